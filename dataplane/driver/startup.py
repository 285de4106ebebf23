"""Starting a cluster: ``dataplane.run`` places the TF nodes and waits for their reservation.

The driver starts its control server, then one barrier Spark stage whose tasks each spawn a
node process (:mod:`dataplane.node.launcher`). Every node binds its Flight server, then
registers; once all have, the driver has the cluster spec and returns a
:class:`dataplane.driver.cluster.Cluster`.
A node that fails to start, a launch job that fails, or a reservation that times out is a
typed error, and whatever did start is stopped again.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
import time
from typing import Any, Callable

from dataplane.driver.cluster import Cluster
from dataplane.driver.control import ControlServer
from dataplane.errors import JVM_EXITED, ClusterStateError, NodeError, ReservationError, jvm_gone, spark_job_error
from dataplane.driver.sparkjobs import SparkJob, is_connect, spark_stopped
from dataplane.node.launcher import LAUNCH_SCHEMA, NodeConfig, NodeLauncher

__all__ = ["run"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20


def _driver_host(spark: Any, configured: str | None) -> str:
    if configured:
        return configured
    env = os.environ.get("SPARK_LOCAL_IP")
    if env:
        return env
    if not is_connect(spark):
        host = spark.sparkContext.getConf().get("spark.driver.host", None)
        if host:
            return host
    return socket.gethostbyname(socket.gethostname())


def _default_fs(spark: Any) -> str:
    try:
        if not is_connect(spark):
            return spark.sparkContext._jsc.hadoopConfiguration().get("fs.defaultFS") or "file:///"
        return spark.conf.get("spark.hadoop.fs.defaultFS", "file:///") or "file:///"
    except Exception:  # noqa: BLE001 - best effort; local is the safe default
        return "file:///"


def _slots(spark: Any) -> int | None:
    try:
        return None if is_connect(spark) else int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001
        return None


def _fixed_slots(spark: Any) -> tuple[str, int] | None:
    """(master, task slots) for a master whose slots never grow: ``local[N]`` and
    ``local-cluster[E,C,M]``; None for a cluster manager, where executors may still join."""
    import re

    try:
        if is_connect(spark):
            return None
        conf = spark.sparkContext.getConf()
        master = str(spark.sparkContext.master)
        cpus = max(1, int(conf.get("spark.task.cpus", "1")))
    except Exception:  # noqa: BLE001 - nothing to check against
        return None
    local = re.fullmatch(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?", master)
    if local:
        cores = (os.cpu_count() or 1) if local.group(1) == "*" else int(local.group(1) or 1)
        return master, cores // cpus
    many = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if many:
        return master, int(many.group(1)) * (int(many.group(2)) // cpus)
    return None


def dynamic_allocation_refuses(master: str, enabled: str, testing: str = "false") -> bool:
    """Whether Spark refuses a barrier stage under these settings, by Spark's own rule: dynamic
    allocation is on (``spark.dynamicAllocation.enabled``) and the master is not local
    (``local``, ``local[...]``: Spark ignores the setting there, unless
    ``spark.dynamicAllocation.testing``)."""
    on = str(enabled).strip().lower() == "true"
    local = master == "local" or master.startswith("local[")
    return on and (not local or str(testing).strip().lower() == "true")


def _dynamic_allocation(spark: Any) -> str | None:
    """The master, if the session has dynamic allocation on where Spark applies it."""
    try:
        get = spark.conf.get  # classic and Spark Connect alike
        master = str(get("spark.master", ""))
        if dynamic_allocation_refuses(master, get("spark.dynamicAllocation.enabled", "false"),
                                      get("spark.dynamicAllocation.testing", "false")):
            return master
    except Exception:  # noqa: BLE001 - nothing to check against: Spark says so if it refuses
        pass
    return None


def run(
    spark: Any,
    main: Callable[[Any, Any], Any],
    args: Any = None,
    *,
    num_nodes: int = 2,
    num_ps: int = 0,
    evaluator: bool = False,
    tensorboard: bool = False,
    reservation_timeout: float = NodeConfig.reservation_timeout,
    buffer_bytes: int = NodeConfig.buffer_bytes,
    port_range: tuple[int, int] | None = None,
    bind_host: str | None = None,
    log_dir: str | None = None,
    heartbeat_interval: float = NodeConfig.heartbeat_interval,
    heartbeat_timeout: float = NodeConfig.heartbeat_timeout,
    node_timeout: float = 10.0,
    stop_grace: float = NodeConfig.stop_grace,
    max_chunk_bytes: int = _MiB,
    cache_bytes: int = NodeConfig.cache_bytes,
    tls: tuple[bytes, bytes] | None = None,
    log_to_driver: bool = NodeConfig.log_to_driver,
) -> "Cluster":
    """Start ``num_nodes`` TF nodes on the executors and return once all have registered.

    Every node runs ``main(args, ctx)`` in its own spawned process, with ``TF_CONFIG`` set.

    Args:
        spark: a classic ``SparkSession`` or a Spark Connect session.
        main: the program of every node; must be picklable (a module-level function).
        args: handed to ``main`` unchanged; must be picklable.
        num_nodes: all TF nodes, ps and evaluator included (needs that many free task slots at
            once: nodes are started as one barrier stage).
        num_ps: parameter servers (ParameterServerStrategy roles); 0 for all-reduce clusters.
        evaluator: make the last node an evaluator (kept out of the cluster spec).
        tensorboard: start TensorBoard on the chief; see ``cluster.tensorboard_url``.
        reservation_timeout: seconds to wait for every node to register.
        buffer_bytes: each node's feed buffer (default 64 MiB): producers wait when it is full.
        port_range: ``(low, high)`` inclusive range for the nodes' ports (default: any free port).
        bind_host: address nodes and driver bind (default: ``SPARK_LOCAL_IP`` or the host's).
        log_dir: TensorBoard log directory on the chief (default: a temporary directory).
        heartbeat_interval: seconds between a node's heartbeats to the driver.
        heartbeat_timeout: a node exits by itself when the driver is unreachable this long.
        node_timeout: the driver declares a node lost after this long without a heartbeat.
        stop_grace: seconds a node's main gets to return after shutdown before it is ended.
        max_chunk_bytes: largest Arrow batch a pushing task sends in one message.
        cache_bytes: memory each worker may hold for ``train(cache=True)`` (default 1 GiB);
            the rest of its share is spilled to Arrow IPC files in the node's work directory.
        tls: ``(cert_pem, key_pem)``: serve the nodes' Flight servers and the driver's control
            server over ``grpc+tls`` with this certificate, which every client trusts as its
            root (it must name the driver's and the executors' addresses). Default: plaintext
            gRPC, every call still authenticated by the cluster's secret.
        log_to_driver: print what every node writes to its stdout and stderr (``main``'s
            prints, Keras' progress, TensorFlow's log) on the driver's stderr, each line
            prefixed with its node, e.g. ``[node 1 worker]``, about once a second (up to
            256 KiB each time: a chattier node lags, and when it ends only its last MiB goes,
            after a line saying how many bytes were skipped). False: it stays in the node's
            ``node.log``, removed when the node exits.

    Raises:
        ValueError / TypeError: bad arguments, or a session with dynamic allocation on
            (Spark refuses barrier stages then).
        ReservationError: not every node registered within ``reservation_timeout``.
        NodeError: a node failed to start (the message carries its error).
    """
    _validate(spark, main, num_nodes, num_ps, evaluator, reservation_timeout, buffer_bytes, port_range)
    dynamic = _dynamic_allocation(spark)
    if dynamic is not None:
        raise ValueError(
            f"dataplane.run starts its {num_nodes} nodes as one barrier stage, which Spark "
            f"refuses while dynamic allocation is on (spark.dynamicAllocation.enabled=true, "
            f"master {dynamic!r}): a TF cluster has a fixed size, and an executor Spark "
            f"removed when idle would take a node with it. Start the session with "
            f".config('spark.dynamicAllocation.enabled', 'false') (spark-submit: --conf "
            f"spark.dynamicAllocation.enabled=false) and at least {num_nodes} executor task "
            f"slots (spark.executor.instances x spark.executor.cores)."
        )
    fixed = _fixed_slots(spark)
    if fixed is not None and fixed[1] < num_nodes:
        master, slots = fixed
        wider = (f".master('local-cluster[{num_nodes},1,1024]'): executors times cores each, "
                 f"at least {num_nodes}" if master.startswith("local-cluster")
                 else f".master('local[{num_nodes}]')")
        raise ReservationError(
            f"num_nodes={num_nodes} needs {num_nodes} task slots at once (the nodes start "
            f"together as one barrier stage), but master {master!r} has {slots}, so they could "
            f"never all start. Start Spark with enough slots ({wider}) or "
            f"lower num_nodes.",
            missing=list(range(num_nodes)), registered=[],
        )
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ValueError(
            f"cache_bytes must be an int >= 0 (bytes of memory per worker for train(cache=True); "
            f"0 spills everything to disk), got {cache_bytes!r}"
        )
    _validate_tls(tls)
    from pyspark import cloudpickle

    try:
        payload = cloudpickle.dumps((main, args))
    except Exception as e:
        raise TypeError(
            f"main and args must be picklable to reach the nodes ({type(e).__name__}: {e}); "
            f"define main at module level and pass plain data as args."
        ) from e
    secret = secrets.token_hex(16)
    cluster_id = secrets.token_hex(4)
    host = _driver_host(spark, bind_host)
    if tensorboard and log_dir is None:
        log_dir = tempfile.mkdtemp(prefix=f"dataplane-{cluster_id}-tb-")
    control = ControlServer(
        host, secret, num_nodes=num_nodes, num_ps=num_ps, evaluator=evaluator, tls=tls,
    )
    node_config = NodeConfig(
        cluster_id=cluster_id,
        driver=control.location,
        secret=secret,
        buffer_bytes=int(buffer_bytes),
        cache_bytes=int(cache_bytes),
        port_range=tuple(port_range) if port_range else None,
        bind_host=bind_host,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        reservation_timeout=reservation_timeout,
        stop_grace=stop_grace,
        tensorboard=bool(tensorboard),
        log_to_driver=bool(log_to_driver),
        log_dir=log_dir,
        default_fs=_default_fs(spark),
        tls_cert=tls[0].decode() if tls else None,
        tls_key=tls[1].decode() if tls else None,
    )
    launcher = NodeLauncher(node_config, payload)
    launch_df = spark.range(0, num_nodes, 1, num_nodes).mapInArrow(
        launcher, LAUNCH_SCHEMA, barrier=True
    )
    job = SparkJob(spark, f"dataplane: start {num_nodes} TF nodes", launch_df.collect)
    cluster = Cluster(
        spark, control, secret=secret, cluster_id=cluster_id, node_timeout=node_timeout,
        max_chunk_bytes=max_chunk_bytes, buffer_bytes=int(buffer_bytes),
        tls_root=tls[0] if tls else None, launch_job=job,
        log_dir=log_dir,
    )
    try:
        _await_reservation(cluster, control, job, num_nodes, reservation_timeout)
    except BaseException:
        cluster._abort()
        raise
    return cluster


def _validate_tls(tls: Any) -> None:
    if tls is None:
        return
    ok = (
        isinstance(tls, tuple)
        and len(tls) == 2
        and all(isinstance(x, bytes) for x in tls)
        and b"-----BEGIN CERTIFICATE-----" in tls[0]
        and b"PRIVATE KEY-----" in tls[1]
    )
    if not ok:
        seen = type(tls).__name__ if not isinstance(tls, tuple) else f"tuple of {[type(x).__name__ for x in tls]}"
        raise TypeError(
            f"tls must be (cert_pem, key_pem): two bytes objects holding a PEM certificate and "
            f"its PEM private key, got {seen}. Read them with open(path, 'rb').read()."
        )


def _validate(spark, main, num_nodes, num_ps, evaluator, reservation_timeout, buffer_bytes, port_range) -> None:  # type: ignore[no-untyped-def]
    if not hasattr(spark, "range") or not hasattr(spark, "createDataFrame"):
        raise TypeError(f"spark must be a SparkSession, got {type(spark).__name__}")
    if spark_stopped(spark):
        raise ClusterStateError(
            "cannot start TF nodes: the SparkSession given has been stopped (spark.stop()). "
            "Start a new one (SparkSession.builder...getOrCreate()) and pass that."
        )
    if jvm_gone(spark):
        raise ClusterStateError(f"cannot start TF nodes: the SparkSession's JVM has exited: {JVM_EXITED}")
    if not callable(main):
        raise TypeError(f"main must be callable as main(args, ctx), got {type(main).__name__}")
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    if not isinstance(num_ps, int) or num_ps < 0:
        raise ValueError(f"num_ps must be an int >= 0, got {num_ps!r}")
    need = num_ps + 1 + int(bool(evaluator))
    if num_nodes < need:
        raise ValueError(
            f"num_nodes={num_nodes} cannot hold {num_ps} ps + 1 chief"
            f"{' + 1 evaluator' if evaluator else ''}: it needs at least {need}."
        )
    if num_ps and num_nodes == need:
        # not refused: a program of its own may use a ps without workers (TensorFlowOnSpark's
        # TF1 programs did), but TensorFlow's ParameterServerStrategy fails on it
        logger.warning(
            "num_nodes=%d with num_ps=%d%s leaves no worker: the nodes are %d ps + 1 chief%s. "
            "TensorFlow's ParameterServerStrategy needs at least one worker besides the chief "
            "(it raises 'There must be at least one worker'); use num_nodes=%d for one.",
            num_nodes, num_ps, " and evaluator=True" if evaluator else "", num_ps,
            " + 1 evaluator" if evaluator else "", need + 1,
        )
    if not (isinstance(reservation_timeout, (int, float)) and reservation_timeout > 0):
        raise ValueError(f"reservation_timeout must be > 0 seconds, got {reservation_timeout!r}")
    if not isinstance(buffer_bytes, int) or buffer_bytes < 64 * 1024:
        raise ValueError(f"buffer_bytes must be an int >= 65536, got {buffer_bytes!r}")
    if port_range is not None:
        lo, hi = port_range
        if not (0 < lo <= hi < 65536):
            raise ValueError(f"port_range must be (low, high) with 0 < low <= high < 65536, got {port_range!r}")


def _executor_import_hint(summary: str) -> str:
    """What to do when the launch task's Python could not import a module it needs."""
    import re

    m = re.search(r"No module named '([^']+)'", summary)
    if m is None:
        return ""
    return (
        f". The executors' Python cannot import {m.group(1)!r}: the launch task runs "
        f"spark-tf-dataplane's code on the executors, so install spark-tf-dataplane with its "
        f"dependencies in the Python they run (spark.pyspark.python / PYSPARK_PYTHON, here "
        f"{os.environ.get('PYSPARK_PYTHON') or 'python3 on the executors'}), or ship a packed "
        f"environment with spark.archives."
    )


def _await_reservation(cluster: Cluster, control: ControlServer, job: SparkJob, num_nodes: int, timeout: float) -> None:
    """Wait until every node registered; raise the first launch failure or a ReservationError."""
    deadline = time.monotonic() + timeout
    while not control.wait_registered(0.25):
        fails = dict(control.launch_failures)
        if fails:
            nid, f = sorted(fails.items())[0]
            raise NodeError(f["error"], node=None, remote_traceback=f.get("log", ""))
        if job.done() and job.future.exception() is not None:
            e = job.future.exception()
            summary = spark_job_error(e, max_lines=1)  # the hint follows on the same line
            raise NodeError(
                f"the job starting the TF nodes failed: {type(e).__name__}: {summary}"
                f"{_executor_import_hint(summary)}",
                node=None, remote_traceback=str(e),
            ) from e
        if time.monotonic() > deadline:
            got = control.registered_ids()
            missing = [i for i in range(num_nodes) if i not in got]
            slots = _slots(cluster.spark)
            slot_text = (
                f"this application has {slots} task slot(s)" if slots is not None
                else "the number of task slots is not visible over Spark Connect"
            )
            raise ReservationError(
                f"node(s) {missing} of {num_nodes} did not register within {timeout:.0f} s "
                f"(registered: {got}). All {num_nodes} nodes start together as one barrier "
                f"stage, so Spark needs {num_nodes} free task slots at once; {slot_text}. "
                f"Likely causes: too few executor slots (add executors or cores, or lower "
                f"num_nodes), or the node process crashed on start (see the executors' stderr).",
                missing=missing, registered=got,
            )
    cluster._mark_running(control.topology)
    try:
        job.future.result(timeout=30.0)
    except Exception as e:  # noqa: BLE001 - all nodes registered; a late job error is only logged
        logger.warning("the launch job ended with %s after every node registered", e)
