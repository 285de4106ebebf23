"""Starting a TensorFlowOnSpark (TFoS) cluster for the benchmark peers, on loopback only.

The push scenario's ``tfos`` path (:mod:`benchmarks.push`) and the train scenario's
(:mod:`benchmarks.train_peers`) start TFoS the same way: ``TFCluster.run`` in
``InputMode.SPARK`` with one executor, its driver-side reservation server bound to 127.0.0.1
instead of every interface. They differ only in the ``map_fun`` and its arguments.

Nothing here runs at import time: tensorflowonspark is imported by :func:`start_tfos_cluster`,
so importing this module works on stacks where TFoS cannot be imported.
"""

from __future__ import annotations

import atexit
import os
import shutil
from pathlib import Path
from typing import Any, Callable

__all__ = ["start_tfos_cluster", "stop_tfos_cluster"]


def _loopback_socket(server: Any) -> Any:
    """Stands in for ``reservation.Server.start_listening_socket``: a listening socket on
    127.0.0.1 at a free port (TFoS's own binds every interface)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(10)
    return sock


def start_tfos_cluster(sc: Any, map_fun: Callable[[dict[str, Any], Any], None],
                       args: dict[str, Any], *, num_executors: int = 1, num_ps: int = 0,
                       reservation_timeout: int = 180) -> Any:
    """``TFCluster.run(sc, map_fun, args, num_executors, num_ps, InputMode.SPARK)`` on loopback.

    Sets ``TFOS_SERVER_HOST=127.0.0.1`` and, while the cluster starts, replaces the reservation
    server's ``start_listening_socket`` with one that binds 127.0.0.1 (restored afterwards,
    however the start ends). Local mode needs ``num_executors=1``: TFoS keys its per-executor
    manager by (host, executor id), and every task of ``local[N]`` runs in the one executor.
    Returns the ``TFCluster``.
    """
    from tensorflowonspark import TFCluster, reservation

    os.environ["TFOS_SERVER_HOST"] = "127.0.0.1"
    original = reservation.Server.start_listening_socket
    reservation.Server.start_listening_socket = _loopback_socket
    try:
        return TFCluster.run(
            sc, map_fun, args, num_executors, num_ps,
            input_mode=TFCluster.InputMode.SPARK, reservation_timeout=reservation_timeout,
        )
    finally:
        reservation.Server.start_listening_socket = original


_LEFT: set[Path] = set()  # TFoS managers' socket folders, removed when this process exits


def _remove_left() -> None:
    for folder in _LEFT:
        shutil.rmtree(folder, ignore_errors=True)


def stop_tfos_cluster(cluster: Any) -> None:
    """``cluster.shutdown(timeout=-1)``; what TFoS leaves in the temp folder goes at exit.

    In local mode each TFoS node's manager listens on a Unix socket in a ``pymp-*`` folder that
    ``multiprocessing`` removes only at a clean interpreter exit; Spark's Python workers end with
    ``os._exit``, so every run used to leave one such folder in ``/tmp``. The socket's path is
    the node's ``addr`` in ``cluster.cluster_info``. It is removed when this (the driver's)
    process exits, not now: the Python worker keeps its manager for the next TFoS cluster of
    the same application.
    """
    try:
        cluster.shutdown(timeout=-1)
    finally:
        for node in getattr(cluster, "cluster_info", None) or []:
            addr = node.get("addr")
            if isinstance(addr, (str, bytes)):
                folder = Path(os.fsdecode(addr)).parent
                if folder.name.startswith("pymp-"):
                    if not _LEFT:
                        atexit.register(_remove_left)
                    _LEFT.add(folder)
