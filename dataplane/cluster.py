"""``dataplane.run`` and the driver-side ``Cluster``."""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import pyarrow as pa

from dataplane.control import ControlServer
from dataplane.errors import ClusterStateError, NodeError, ReservationError
from dataplane.feed import FeedReport
from dataplane.sparkjobs import SparkJob, is_connect
from dataplane.topology import NodeInfo, Topology

__all__ = ["run", "Cluster"]

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


def run(
    spark: Any,
    main: Callable[[Any, Any], Any],
    args: Any = None,
    *,
    num_nodes: int = 2,
    num_ps: int = 0,
    evaluator: bool = False,
    tensorboard: bool = False,
    reservation_timeout: float = 120.0,
    buffer_bytes: int = 64 * _MiB,
    port_range: tuple[int, int] | None = None,
    bind_host: str | None = None,
    log_dir: str | None = None,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 15.0,
    node_timeout: float = 10.0,
    stop_grace: float = 10.0,
    max_chunk_bytes: int = _MiB,
    tls: tuple[bytes, bytes] | None = None,
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
        tls: ``(cert_pem, key_pem)``: serve the nodes' Flight servers over ``grpc+tls``.

    Raises:
        ValueError / TypeError: bad arguments.
        ReservationError: not every node registered within ``reservation_timeout``.
        NodeError: a node failed to start (the message carries its error).
    """
    _validate(spark, main, num_nodes, num_ps, evaluator, reservation_timeout, buffer_bytes, port_range)
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
    node_config = {
        "cluster_id": cluster_id,
        "buffer_bytes": int(buffer_bytes),
        "port_range": list(port_range) if port_range else None,
        "bind_host": bind_host,
        "heartbeat_interval": heartbeat_interval,
        "heartbeat_timeout": heartbeat_timeout,
        "reservation_timeout": reservation_timeout,
        "stop_grace": stop_grace,
        "tensorboard": bool(tensorboard),
        "log_dir": log_dir,
        "default_fs": _default_fs(spark),
        "tls": {"cert": tls[0].decode(), "key": tls[1].decode()} if tls else None,
    }
    control = ControlServer(
        host, secret, num_nodes=num_nodes, num_ps=num_ps, evaluator=evaluator,
        node_config=node_config,
    )
    from dataplane.launcher import LAUNCH_SCHEMA, NodeLauncher

    launcher = NodeLauncher(
        driver=control.location,
        secret=secret,
        cluster_id=cluster_id,
        payload=payload,
        node_config=node_config,
        start_timeout=reservation_timeout,
    )
    launch_df = spark.range(0, num_nodes, 1, num_nodes).mapInArrow(
        launcher, LAUNCH_SCHEMA, barrier=True
    )
    job = SparkJob(spark, f"dataplane: start {num_nodes} TF nodes", launch_df.collect)
    cluster = Cluster(
        spark, control, secret=secret, cluster_id=cluster_id, node_timeout=node_timeout,
        max_chunk_bytes=max_chunk_bytes, tls_root=tls[0] if tls else None, launch_job=job,
        log_dir=log_dir,
    )
    try:
        cluster._await_reservation(job, num_nodes, reservation_timeout)
    except BaseException:
        cluster._abort()
        raise
    return cluster


def _validate(spark, main, num_nodes, num_ps, evaluator, reservation_timeout, buffer_bytes, port_range) -> None:  # type: ignore[no-untyped-def]
    if not hasattr(spark, "range") or not hasattr(spark, "createDataFrame"):
        raise TypeError(f"spark must be a SparkSession, got {type(spark).__name__}")
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
    if not (isinstance(reservation_timeout, (int, float)) and reservation_timeout > 0):
        raise ValueError(f"reservation_timeout must be > 0 seconds, got {reservation_timeout!r}")
    if not isinstance(buffer_bytes, int) or buffer_bytes < 64 * 1024:
        raise ValueError(f"buffer_bytes must be an int >= 65536, got {buffer_bytes!r}")
    if port_range is not None:
        lo, hi = port_range
        if not (0 < lo <= hi < 65536):
            raise ValueError(f"port_range must be (low, high) with 0 < low <= high < 65536, got {port_range!r}")


class Cluster:
    """A running set of TF nodes (returned by :func:`run`); use as a context manager."""

    def __init__(
        self,
        spark: Any,
        control: ControlServer,
        *,
        secret: str,
        cluster_id: str,
        node_timeout: float,
        max_chunk_bytes: int,
        tls_root: bytes | None,
        launch_job: SparkJob,
        log_dir: str | None,
    ) -> None:
        self.spark = spark
        self._control = control
        self._secret = secret
        self.cluster_id = cluster_id
        self._node_timeout = node_timeout
        self._max_chunk_bytes = max_chunk_bytes
        self._tls_root = tls_root
        self._launch_job = launch_job
        self.log_dir = log_dir
        self._epoch = 0
        self._state = "starting"
        self._lock = threading.Lock()
        self._clients: dict[int, Any] = {}
        self._shapes: dict[int, tuple[Any, dict[str, tuple[int, ...]]]] = {}
        self._push_frame: tuple[Any, ...] | None = None  # feed.train's reusable push job
        self.topology: Topology | None = None

    # -- public -------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[NodeInfo]:
        """Every node, ordered by node id."""
        return sorted(self.topology.nodes, key=lambda n: n.node_id) if self.topology else []

    @property
    def tensorboard_url(self) -> str | None:
        """``http://host:port`` of the chief's TensorBoard, or None when not started."""
        if self.topology is None:
            return None
        for n in self.topology.nodes:
            if n.role == "chief":
                port = self._control.status[n.node_id].registration.get("tensorboard_port")
                return f"http://{n.host}:{port}" if port else None
        return None

    def train(
        self,
        df: Any,
        num_epochs: int = 1,
        feed_timeout: float = 600.0,
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> FeedReport:
        """Push every row of ``df`` into the workers, ``num_epochs`` times.

        Each epoch is one Spark job whose tasks stream their partition straight to the workers'
        Flight servers; the driver only coordinates. Returns when every row is in a node's
        buffer (the nodes may still be training on the last of it).

        ``df`` should be deterministic per partition (cached, or read from files): a retried
        task must produce the same rows for exactly-once delivery.

        Raises:
            NodeError: a node's main raised or its process died during the feed.
            FeedError: the feeding job failed or did not finish within ``feed_timeout``.
        """
        from dataplane import feed

        self._check_running("train")
        return feed.train(self, df, num_epochs=num_epochs, feed_timeout=feed_timeout, progress=progress)

    def inference(
        self,
        df: Any,
        passthrough: Sequence[str] = ("id",),
        *,
        columns: Sequence[str] | None = None,
        output_schema: pa.Schema | None = None,
        feed_timeout: float = 600.0,
        max_rows: int = 4096,
    ) -> Any:
        """Run every row of ``df`` through the nodes' ``ctx.serve(predict)``.

        Returns a (lazy) DataFrame with the ``passthrough`` columns and predict's outputs, one
        output row per input row. Each partition goes to one serving node over ``do_exchange``;
        answers come back on the same stream, matched by sequence number.

        Args:
            df: input rows.
            passthrough: input columns copied to the output (keys to join on).
            columns: input columns sent to predict (default: all).
            output_schema: predict's output columns; default: learned from a 4-row probe.
            feed_timeout: per-call deadline for the node's answers.
            max_rows: rows per request batch.
        """
        from dataplane import feed

        self._check_running("inference")
        return feed.inference(
            self, df, passthrough=passthrough, columns=columns, output_schema=output_schema,
            feed_timeout=feed_timeout, max_rows=max_rows,
        )

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per node id: rows_in, bytes_in, batches_in, buffer_bytes, buffer_peak_bytes,
        stall_seconds (producers waiting on a full buffer), rows_out, rows_duplicate, main."""
        self._check_running("metrics")
        out = {}
        for n in self.nodes:
            try:
                out[n.node_id] = self._node_action(n, "metrics", {})
            except NodeError as e:
                out[n.node_id] = {"error": str(e)}
        return out

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop every node and wait (up to ``timeout`` s) until each process has exited.

        The chief and workers first get to finish what they are doing (training on the epochs
        already pushed, or reading files in pull mode) until their main returns or only waits
        for the driver; then every node is told to stop: datasets waiting for more data end,
        ``ctx.serve`` returns, and a main that still runs after ``stop_grace`` seconds is ended
        with its process (a parameter server's ``server.join()``, say).

        Calling it again is a no-op.

        Raises:
            NodeError: some node's main raised (the first such node; ``remote_traceback`` has
                its traceback) or a node was lost.
        """
        with self._lock:
            if self._state in ("stopped", "stopping"):
                return
            self._state = "stopping"
        failure = self._node_failure()
        deadline = time.monotonic() + timeout
        if failure is None:
            self._drain(deadline)
            failure = self._node_failure()
        self._stop_nodes(max(deadline - time.monotonic(), 10.0))
        self._state = "stopped"
        if failure is None:
            failure = self._node_failure(include_lost=False)
        if failure is not None:
            raise failure

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        try:
            self.shutdown()
        except NodeError:
            if exc_type is None:
                raise
            logger.exception("a node failed while the with-block was already raising")

    def __repr__(self) -> str:
        return f"Cluster({self.cluster_id}, {len(self.nodes)} nodes, {self._state})"

    # -- internals --------------------------------------------------------------------------
    def _check_running(self, what: str) -> None:
        if self._state != "running":
            raise ClusterStateError(f"cannot {what}: the cluster is {self._state}.")

    def _next_epoch(self) -> int:
        e = self._epoch
        self._epoch += 1
        return e

    def _shapes_of(self, df: Any, compute: Callable[[], dict[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
        """Array lengths of ``df`` (a Spark pass over it), remembered while ``df`` is alive, so
        repeated ``train(df)`` calls on the same DataFrame do not scan it again."""
        import weakref

        hit = self._shapes.get(id(df))
        if hit is not None and hit[0]() is df:
            return hit[1]
        shapes = compute()
        try:
            self._shapes[id(df)] = (weakref.ref(df), shapes)
        except TypeError:  # not weak-referenceable: just do not cache
            pass
        if len(self._shapes) > 64:
            self._shapes = {k: v for k, v in self._shapes.items() if v[0]() is not None}
        return shapes

    def _live_workers(self) -> list[NodeInfo]:
        snap = self._control.snapshot()
        return [n for n in self.topology.workers if not snap[n.node_id].done]  # type: ignore[union-attr]

    def _client(self, node: NodeInfo):  # type: ignore[no-untyped-def]
        from dataplane.rpc import connect

        c = self._clients.get(node.node_id)
        if c is None:
            scheme = "grpc+tls" if self._tls_root else "grpc"
            c = connect(f"{scheme}://{node.host}:{node.flight_port}", tls_root_certs=self._tls_root)
            self._clients[node.node_id] = c
        return c

    def _node_action(self, node: NodeInfo, name: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        import pyarrow.flight as flight

        from dataplane.rpc import do_json_action

        try:
            return do_json_action(self._client(node), self._secret, name, body, timeout=timeout)
        except flight.FlightError as e:
            err = self._node_failure(grace=2.0)
            if err is not None:
                raise err from e
            raise NodeError(
                f"{node.describe()} did not answer {name!r}: {e}", node=node,
                remote_traceback="",
            ) from e

    def _node_failure(self, *, grace: float = 0.0, include_lost: bool = True) -> NodeError | None:
        """A NodeError for the first failed or lost node, or None when all are healthy."""
        deadline = time.monotonic() + grace
        while True:
            snap = self._control.snapshot()
            now = time.monotonic()
            for nid in sorted(snap):
                st = snap[nid]
                info = self.topology.node(nid) if self.topology else None
                name = info.describe() if info else f"node {nid}"
                if st.done and not st.ok:
                    return NodeError(
                        f"{name}: main raised:\n{_last_line(st.traceback)}",
                        node=info, remote_traceback=st.traceback,
                    )
                if include_lost and not st.exited and now - st.last_seen > self._node_timeout:
                    return NodeError(
                        f"{name} stopped responding {now - st.last_seen:.0f} s ago (no heartbeat): "
                        f"its process died or was killed, or its executor was lost.",
                        node=info, remote_traceback="(no traceback: the process was lost)",
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.25)

    def _await_reservation(self, job: SparkJob, num_nodes: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._control.wait_registered(0.25):
            fails = dict(self._control.launch_failures)
            if fails:
                nid, f = sorted(fails.items())[0]
                raise NodeError(f["error"], node=None, remote_traceback=f.get("log", ""))
            if job.done() and job.future.exception() is not None:
                e = job.future.exception()
                raise NodeError(
                    f"the job starting the TF nodes failed: {type(e).__name__}: {_last_line(str(e))}",
                    node=None, remote_traceback=str(e),
                ) from e
            if time.monotonic() > deadline:
                got = self._control.registered_ids()
                missing = [i for i in range(num_nodes) if i not in got]
                slots = _slots(self.spark)
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
        self.topology = self._control.topology
        self._state = "running"
        try:
            job.future.result(timeout=30.0)
        except Exception as e:  # noqa: BLE001 - all nodes registered; a late job error is only logged
            logger.warning("the launch job ended with %s after every node registered", e)

    def _drain(self, deadline: float) -> None:
        """Let every chief and worker finish what it is doing before it is told to stop.

        A main is left alone while it is busy (training on pushed epochs, reading files in
        pull mode, saving a model); it is stopped once it only waits for the driver (blocked on
        the next epoch, or serving inference) or has returned. ``train`` then ``shutdown``
        therefore never drops pushed rows, and pull-mode training is not cut short.
        """
        busy: list[int] = []
        while time.monotonic() < deadline:
            busy = []
            for n in self._live_workers():
                try:
                    m = self._node_action(n, "metrics", {}, timeout=5.0)
                except NodeError:
                    return
                if m.get("main") == "running" and not m.get("idle"):
                    busy.append(n.node_id)
            if not busy or self._node_failure() is not None:
                return
            time.sleep(0.25)
        logger.warning(
            "shutdown: node(s) %s were still running main when the timeout ran out; stopping "
            "them anyway", busy,
        )

    def _stop_nodes(self, timeout: float) -> None:
        self._control.request_stop()
        for n in self.nodes:
            try:
                from dataplane.rpc import do_json_action

                do_json_action(self._client(n), self._secret, "shutdown", {}, timeout=5.0)
            except Exception:  # noqa: BLE001 - it may be dead already; heartbeat tells it too
                pass
        ids = set(self._control.registered_ids())
        ok = self._control.wait_for(
            lambda st: all(st[i].exited or time.monotonic() - st[i].last_seen > self._node_timeout for i in ids if i in st),
            timeout,
        )
        if not ok:
            logger.warning("some nodes did not confirm their exit within %.0f s", timeout)
        self._reap_local(deadline=time.monotonic() + 10.0)
        for c in self._clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        self._clients.clear()
        self._control.shutdown()
        if self._launch_job is not None and not self._launch_job.done():
            self._launch_job.cancel()

    def _reap_local(self, deadline: float) -> None:
        """Make sure node processes on this machine are gone (kill what lingers)."""
        local = {"127.0.0.1", "localhost", socket.gethostname()}
        for nid, st in self._control.snapshot().items():
            r = st.registration
            pid = int(r.get("pid", 0))
            if not pid or (r.get("host") not in local and r.get("hostname") != socket.gethostname()):
                continue
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                logger.warning("node %d (pid %d) still running after shutdown; killing it", nid, pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _abort(self) -> None:
        """Failed start: stop whatever did start, quietly."""
        self._state = "stopping"
        try:
            self._launch_job.cancel()
            self._stop_nodes(timeout=15.0)
        finally:
            self._state = "stopped"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


_EXC_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Stopped|Shutdown))\b:?\s")


def _last_line(text: str) -> str:
    """The most telling line of a traceback: the last 'SomeError: message' line (TF wraps the
    Python error of a tf.data generator inside its own error text), else the last line."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _EXC_LINE.match(ln) and not ln.startswith(("tensorflow.python.framework.errors_impl",)):
            return ln
    for ln in reversed(lines):
        if _EXC_LINE.match(ln):
            return ln
    return lines[-1] if lines else ""
