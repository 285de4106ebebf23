"""Start one node process, wait for it, then remove its work directory, however it ended.

A node removes its own work directory when it exits, but a node killed outright (SIGKILL, the
kernel's OOM killer) cannot: its ``config.json`` (holding the cluster's secret), its payload and
its cache's spill files (possibly gigabytes) would stay behind. So the detached launch step
starts this script, which starts the node, waits for it and removes the directory after it.

Run by path with ``python -S`` (see :func:`dataplane.node.process.spawn_detached`): it imports
only the standard library, so it costs a few MB per node, and its command line does not name
the node module (tools that look for node processes find only the node).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def reap(config_path: str, ready_fd: int) -> int:
    """Run the node of ``config_path`` to its end; returns its exit code."""
    workdir = os.path.dirname(config_path)
    with open(os.path.join(workdir, "node.log"), "ab", buffering=0) as log:
        node = subprocess.Popen(
            [sys.executable, "-m", "dataplane.node.process", "--run", config_path, str(ready_fd)],
            pass_fds=(ready_fd,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            close_fds=True,
        )
    # The launcher learns that a node died before it was ready from this pipe's end-of-file:
    # only the node may hold it open.
    os.close(ready_fd)
    code = node.wait()
    # DATAPLANE_KEEP_NODE_DIR=1 keeps config, payload and node.log for debugging.
    if os.environ.get("DATAPLANE_KEEP_NODE_DIR") != "1":
        shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(reap(sys.argv[1], int(sys.argv[2])))
