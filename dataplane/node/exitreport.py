"""``python -m dataplane.node.exitreport CONFIG CODE``: tell the driver how a node ended when it
could not say so itself.

A node that exits on its own reports to the driver first and removes its work directory, config
included. One killed by a signal (the kernel's out-of-memory killer sends SIGKILL), crashing in
native code, or leaving through ``os._exit`` says nothing, and a driver on another machine would
only notice its silence once ``node_timeout`` passed, with no cause to give. Its reaper
(:mod:`dataplane.node.reaper`, standard library only) finds the config still there and runs this
short process, which sends the exit code and the last lines of ``node.log`` as the control
action ``exited``: for a crash, the stack of the crashing thread that ``faulthandler`` wrote.
It is its own module, not the node's, so that tools looking for node processes do not count it.
"""

from __future__ import annotations

import os
import sys

from dataplane.node.config import NodeConfig
from dataplane.node.logtail import file_tail

__all__ = ["report_exit", "crash_stack"]

#: lines of node.log the report carries (twice as many for a crash's stack)
EXIT_LINES = 25
_SCAN_BYTES = 64 << 10  # how far back node.log is read
_LINE_CHARS = 400  # a longer line (a printed array, a progress bar's carriage returns) is cut


def crash_stack(log: str) -> list[str]:
    """From faulthandler's dump at the end of ``log``, its "Fatal Python error" line and the
    stack of the thread that crashed; ``[]`` when ``log`` holds no such dump."""
    at = log.rfind("Fatal Python error:")
    if at < 0:
        return []
    lines = log[at:].split("\n")
    out = [lines[0]]
    for i, line in enumerate(lines):
        if line.startswith("Current thread "):
            for more in lines[i:]:
                if not more.strip():
                    break
                out.append(more)
            break
    return out[: EXIT_LINES * 2]


def report_exit(config_path: str, code: int) -> int:
    """Tell the driver that the node of ``config_path`` ended with exit code ``code``
    (negative: the signal that killed it), with its log's last lines; 0 once it was told."""
    from dataplane.errors import drop_tf_noise
    from dataplane.rpc import connect_driver, do_json_action

    cfg = NodeConfig.load(config_path)
    tail = file_tail(os.path.join(os.path.dirname(config_path), "node.log"), _SCAN_BYTES)
    lines = crash_stack(tail) or drop_tf_noise(tail.rstrip("\n").split("\n"))[-EXIT_LINES:]
    lines = [ln if len(ln) <= _LINE_CHARS else ln[:_LINE_CHARS] + " [...]" for ln in lines]
    client = connect_driver(cfg.driver, cfg.tls)
    try:
        do_json_action(client, cfg.secret, "exited",
                       {"node_id": cfg.node_id, "code": code, "log": "\n".join(lines)}, timeout=10.0)
    except Exception as e:  # noqa: BLE001 - the driver may be gone: its heartbeats decide then
        print(f"could not tell the driver that node {cfg.node_id} exited with {code}: {e}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    # os._exit: an interpreter's normal exit may linger on gRPC's threads, and this process
    # must be gone as soon as it has spoken
    os._exit(report_exit(sys.argv[1], int(sys.argv[2])))
