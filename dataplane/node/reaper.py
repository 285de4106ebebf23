"""Start one node process, wait for it, then remove its work directory, however it ended.

A node removes its own work directory when it exits, but a node killed outright (SIGKILL, the
kernel's OOM killer) cannot: its ``config.json`` (holding the cluster's secret), its payload and
its cache's spill files (possibly gigabytes) would stay behind. So the launch step starts this
script, which starts the node, waits for it and removes the directory after it (all but
``node.log`` when the node died before telling the launcher how its start went: the launcher
shows that log's tail in the start error, then removes the rest).

``reaper.py --detach CONFIG FD`` is the launch step's intermediate process: it starts the reaper
in a session of its own and exits at once, so that neither the reaper nor the node is a child
of the long-lived Spark worker (whose zombie they would become).

Run by path with ``python -S`` (see :func:`dataplane.node.process.spawn_detached`): it imports
only the standard library, so it costs a few MB per node, and its command line does not name
the node module (tools that look for node processes find only the node).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

# Made in the work directory by the node just before it tells the launcher how its start went
# (dataplane.node.process); without it, the node died first and its log is the only word.
TOLD_LAUNCHER = "told-launcher"


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
    if code != 0 and os.path.exists(config_path) and os.path.exists(os.path.join(workdir, TOLD_LAUNCHER)):
        _report_exit(config_path, code)
    _end_left_behind()
    # DATAPLANE_KEEP_NODE_DIR=1 keeps config, payload and node.log for debugging.
    if os.environ.get("DATAPLANE_KEEP_NODE_DIR") == "1":
        return code
    if os.path.exists(os.path.join(workdir, TOLD_LAUNCHER)):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        # The node died before a word to the launcher (an import that failed as the
        # interpreter started, a crash): the launcher, which saw the pipe close, shows
        # node.log's tail and then removes the directory. Everything else goes now (the
        # config holds the cluster's secret).
        for name in os.listdir(workdir) if os.path.isdir(workdir) else []:
            if name != "node.log":
                path = os.path.join(workdir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.remove(path)
                    except OSError:
                        pass
    return code


def _report_exit(config_path: str, code: int) -> None:
    """Tell the driver how a registered node ended when it could not say so itself (killed by
    a signal, a native crash, ``os._exit``): a node that exits on its own removes its config
    first, so only such an end leaves it here. A short process of the node's own Python sends
    it (this script imports only the standard library); the driver then names the signal and
    shows the log's last lines at once, instead of waiting for the heartbeats to lapse."""
    try:
        subprocess.run(
            [sys.executable, "-m", "dataplane.node.exitreport", config_path, str(code)],
            stdin=subprocess.DEVNULL, close_fds=True, timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        pass  # the driver falls back on the heartbeats


def detach(config_path: str, ready_fd: int) -> None:
    """Start ``reaper.py CONFIG FD`` in a new session, its output in the node's log; return."""
    workdir = os.path.dirname(config_path)
    with open(os.path.join(workdir, "node.log"), "ab", buffering=0) as log:
        subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), config_path, str(ready_fd)],
            pass_fds=(ready_fd,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )


def _end_left_behind(grace: float = 2.0) -> None:
    """End the processes main started and left running (a ``subprocess.Popen`` of its own):
    they share this reaper's process group (it leads a session of its own), so they would
    outlive the node, the cluster and the driver. SIGTERM first, then SIGKILL after ``grace``
    seconds. A process that started a session of its own is out of reach, as intended."""
    me, group = os.getpid(), os.getpgrp()

    def others() -> list[int]:
        pids = []
        for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            # fields after the command: state, ppid, pgrp; a zombie is already gone
            if int(fields[2]) == group and fields[0] != b"Z":
                pids.append(int(name))
        return pids

    left = others()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = others()
        if not left:
            return


if __name__ == "__main__":
    if sys.argv[1] == "--detach":
        detach(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    sys.exit(reap(sys.argv[1], int(sys.argv[2])))
