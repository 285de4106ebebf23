"""The Spark task that starts one TF node on an executor.

Shipped to executors inside a barrier ``mapInArrow`` job (one partition per node), so Spark
starts every node at the same time, each in its own task slot, or not at all. The task spawns the
detached node process, waits until the node has registered with the driver (or failed), and
returns, freeing its slot for the feeding jobs.

The node's configuration, what the driver tells every node, lives in :mod:`dataplane.node.config`
(:class:`NodeConfig`, re-exported here, the driver's one door into the node's room).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import pyarrow as pa

from dataplane.node.config import NodeConfig
from dataplane.node.logtail import file_tail

__all__ = ["NodeLauncher", "NodeConfig", "LAUNCH_SCHEMA", "resolve_bind_host"]

LAUNCH_SCHEMA = "node_id long, host string, flight_port long, pid long, hostname string"


def node_malloc_env() -> dict[str, str]:
    """glibc malloc settings for the node process: one arena per core.

    The node frees every received chunk and batch soon after allocating it, from many threads
    (gRPC's, TensorFlow's). With glibc's default of up to 8 arenas per core the freed memory
    went back to the kernel and was faulted in and zeroed again, about 20% of the node's CPU
    on a push (docs/design.md).
    """
    return {"MALLOC_ARENA_MAX": str(max(2, os.cpu_count() or 2))}


def node_environment(env: dict[str, str], path: list[str], tmpdir: str | None = None) -> dict[str, str]:
    """The node process's environment: this task's, with the task's own import path added,
    :func:`node_malloc_env` where the task sets none of it, and ``TMPDIR`` = ``tmpdir``.

    ``tmpdir`` is inside the node's work directory, which is removed however the node ends. A
    node leaves with ``os._exit`` (a normal exit could wait forever on Flight handler threads),
    so libraries' exit-time cleanup never runs: TensorFlow's autograph writes a module file per
    function it converts to the temp directory and removes it only at exit, so every node left
    a few in the executor's /tmp, every run, and so did anything ``main`` put in ``tempfile``.

    Spark puts ``--py-files`` / ``spark.submit.pyFiles`` / ``sc.addPyFile`` files, and the
    driver script's modules it ships, on the Python worker's ``sys.path`` at run time, not in
    ``PYTHONPATH``; the node is a new interpreter, so it would not see them and could not
    unpickle a ``main`` defined in one. Entries inside the interpreter's own prefix come back
    by themselves and are left out.
    """
    env = {**env, **{k: v for k, v in node_malloc_env().items() if not env.get(k)}}
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    own = tuple(p for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} if p)
    have = env.get("PYTHONPATH", "")
    known = set(have.split(os.pathsep)) if have else set()
    extra: list[str] = []
    for p in path:
        if p and not p.startswith(own) and p not in known and p not in extra:
            extra.append(p)
    if not extra:
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(extra + ([have] if have else []))}


def resolve_bind_host(configured: str | None) -> str:
    """The address a server on this machine should bind: configured, SPARK_LOCAL_IP, or the
    host's resolved address."""
    if configured:
        return configured
    env = os.environ.get("SPARK_LOCAL_IP")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def work_root(env: Mapping[str, str], node_id: int) -> str | None:
    """Where a node's work directory (its log, and its cache's spill files) goes: beside the
    executor's Spark local directories, i.e. in ``spark.local.dir``, the disks Spark is given
    for scratch (on YARN the application's own directory, removed when it ends); spread over
    them by node id when there are several. None (the system temp directory) outside Spark."""
    roots = []
    for d in str(env.get("SPARK_LOCAL_DIRS", "")).split(","):
        root = os.path.dirname(d.strip().rstrip("/"))  # SPARK_LOCAL_DIRS names blockmgr-* in it
        if root and os.path.isdir(root) and os.access(root, os.W_OK) and root not in roots:
            roots.append(root)
    return roots[node_id % len(roots)] if roots else None


@dataclass
class NodeLauncher:
    """Picklable launch function: ``mapInArrow(NodeLauncher(...), LAUNCH_SCHEMA, barrier=True)``."""

    config: NodeConfig  # the cluster's; each task adds its node id and bind address
    payload: bytes = field(repr=False)  # cloudpickle of (main, args), made once on the driver

    @property
    def start_timeout(self) -> float:
        """How long the task waits for its node to register."""
        return self.config.reservation_timeout

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from dataplane import rpc
        from dataplane.node.process import NodeLaunchError, shadowing_hint, spawn_detached

        for _ in batches:
            pass
        node_id = TaskContext.get().partitionId()
        config = self.config
        client = rpc.connect_driver(config.driver, config.tls)
        state = rpc.do_json_action(client, config.secret, "launch", {"node_id": node_id})
        if state.get("registered"):
            # A retried launch task: the node from the first attempt is alive; do not start
            # a second one.
            r = state["registration"]
            yield self._row(node_id, r)
            return
        workdir = tempfile.mkdtemp(
            prefix=f"dataplane-{config.cluster_id}-node{node_id}-", dir=work_root(os.environ, node_id)
        )
        with open(os.path.join(workdir, "payload.pkl"), "wb") as f:
            f.write(self.payload)
        config_path = os.path.join(workdir, "config.json")
        config.for_node(node_id, resolve_bind_host(config.bind_host)).save(config_path)
        tmpdir = os.path.join(workdir, "tmp")
        os.mkdir(tmpdir)
        env = node_environment(dict(os.environ), list(sys.path), tmpdir)
        r_fd, w_fd = os.pipe()
        launched: NodeLaunchError | None = None
        try:
            spawn_detached(config_path, w_fd, env)
        except NodeLaunchError as e:
            launched = e
        finally:
            os.close(w_fd)  # only the node may hold it open: its end-of-file says it died
        if launched is None:
            msg = self._read_ready(r_fd, workdir, node_id)
        else:
            os.close(r_fd)
            msg = {"ok": False, "error": str(launched), "traceback": launched.output or "(it wrote nothing)"}
            if os.environ.get("DATAPLANE_KEEP_NODE_DIR") != "1":
                shutil.rmtree(workdir, ignore_errors=True)  # no reaper was started to do it
        if not msg.get("ok"):
            error = msg.get("error", "the node process exited before registering")
            tail = msg.get("traceback") or file_tail(os.path.join(workdir, "node.log"))
            if msg.get("died"):
                error += shadowing_hint(env, tail)
                if os.environ.get("DATAPLANE_KEEP_NODE_DIR") != "1":
                    # the reaper left node.log for this read (see reaper.reap)
                    shutil.rmtree(workdir, ignore_errors=True)
            text = f"node {node_id} failed to start on {socket.gethostname()}: {error}"
            try:
                rpc.do_json_action(
                    client, config.secret, "launch_failed", {"node_id": node_id, "error": text, "log": tail}
                )
            except Exception:  # noqa: BLE001 - the job failure below carries the message too
                pass
            raise RuntimeError(f"{text}\n--- node log (tail) ---\n{tail}")
        yield self._row(node_id, msg)

    def _read_ready(self, r_fd: int, workdir: str, node_id: int) -> dict[str, Any]:
        deadline = time.monotonic() + self.start_timeout
        data = b""
        try:
            while b"\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": False, "error": f"no word from the node in {self.start_timeout:.0f} s"}
                ready, _, _ = select.select([r_fd], [], [], min(left, 1.0))
                if ready:
                    chunk = os.read(r_fd, 65536)
                    if not chunk:
                        break  # EOF: the node died before writing
                    data += chunk
        finally:
            os.close(r_fd)
        if not data.strip():
            return {"ok": False, "error": "the node process exited before registering", "died": True}
        return json.loads(data.split(b"\n")[0])

    @staticmethod
    def _row(node_id: int, r: dict[str, Any]) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {
                "node_id": [node_id],
                "host": [str(r.get("host", ""))],
                "flight_port": [int(r.get("flight_port", 0))],
                "pid": [int(r.get("pid", 0))],
                "hostname": [str(r.get("hostname", ""))],
            }
        )
