"""Small helpers for tests that run TF clusters."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def wait_json(path: Path, timeout: float = 120.0) -> dict:
    """Wait until a node has written ``path`` (nodes report asynchronously; a file seen while
    it is being written is read again)."""
    deadline = time.monotonic() + timeout
    text = None
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text()
            try:
                return json.loads(text)
            except ValueError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"{path} was not written within {timeout:.0f} s (last seen: {text!r:.200})")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 30.0) -> float:  # type: ignore[no-untyped-def]
    """Seconds until every pid has exited; fails if some are still alive after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(alive(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"processes still alive after {timeout:.0f} s: {[p for p in pids if alive(p)]}")


def node_processes(cluster_id: str) -> list[int]:
    """PIDs of node processes of one cluster still on this machine (by their work dir name)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "dataplane.node.process" in cmd and f"dataplane-{cluster_id}-" in cmd and alive(int(d)):
            out.append(int(d))
    return out


def node_workdirs(cluster_id: str, node: str = "*") -> list[str]:
    """The work directories of a cluster's nodes started by this test session's local Spark:
    in its ``spark.local.dir`` (the JVM's temp directory, /tmp) or the system temp directory."""
    import glob
    import tempfile

    roots = dict.fromkeys([tempfile.gettempdir(), "/tmp"])
    return sorted(p for r in roots for p in glob.glob(os.path.join(r, f"dataplane-{cluster_id}-node{node}-*")))


def epoch_name(report, i: int, splits: tuple[str, ...] = ("train",)) -> str:  # type: ignore[no-untyped-def]
    """How the driver's messages name ``report.epochs[i]``: its id, its split and its place in
    the call (a call's epochs go train, validation, train, ... when ``splits`` has both)."""
    k = len(splits)
    return f"epoch {report.epochs[i]} ({splits[i % k]}, {i // k + 1} of {len(report.epochs) // k})"
