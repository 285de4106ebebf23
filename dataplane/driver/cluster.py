"""The driver-side ``Cluster``: what ``dataplane.run`` returns.

It holds the running nodes' topology and the driver's control server, offers ``train``,
``inference``, ``metrics`` and ``shutdown``, and tears the nodes down (draining first, then
stopping, then reaping what lingers on this machine). Starting the nodes is
:mod:`dataplane.driver.startup`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa

from dataplane.driver.control import ControlServer
from dataplane.errors import (
    JVM_EXITED, ClusterStateError, NodeError, NodeSchemaError, error_summary, jvm_gone, known_fix,
)
from dataplane.driver.feed import Feeder, FeedReport
from dataplane.driver.sparkjobs import SparkJob, on_jvm_exit, plain_ctrl_c, spark_stopped
from dataplane.topology import NodeInfo, Topology

__all__ = ["Cluster"]

logger = logging.getLogger(__name__)

MWMS_HINT_AFTER = 15.0  # seconds a busy main may run beside returned ones before the save hint
POLLING_NOTE_AFTER = 5.0  # seconds shutdown waits on mains polling ctx.should_stop before it says why
EXIT_REPORT_WAIT = 3.0  # seconds to wait, once a node is seen gone, for its reaper to say how it ended


class Cluster:
    """A running set of TF nodes (returned by :func:`dataplane.run`); use as a context manager."""

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
        buffer_bytes: int = 64 << 20,
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
        self._state = "starting"
        self._lock = threading.Lock()
        self._clients: dict[int, Any] = {}
        self.topology: Topology | None = None
        self._feeder = Feeder(
            spark, secret=secret, tls_root=tls_root, max_chunk_bytes=max_chunk_bytes,
            buffer_bytes=buffer_bytes, node_timeout=node_timeout, action=self._node_action,
            live_workers=self._live_workers, failure=self._node_failure,
            stopping=lambda: self._state in ("stopping", "stopped"),
        )
        # a cluster dropped without shutdown() (a notebook cell that ran dataplane.run again)
        # stops its nodes when collected; at exit the nodes go with the driver anyway
        self._finalizer = weakref.finalize(self, _stop_dropped, control, launch_job, cluster_id)
        self._finalizer.atexit = False

    # -- public -------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[NodeInfo]:
        """Every node, ordered by node id."""
        return sorted(self.topology.nodes, key=lambda n: n.node_id) if self.topology else []

    @property
    def state(self) -> str:
        """``"starting"``, ``"running"`` (train and inference accepted), ``"stopping"`` or
        ``"stopped"``."""
        return self._state

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
        cache: bool = False,
        shuffle: bool = False,
        seed: int | None = None,
        validation: Any = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> FeedReport:
        """Push every row of ``df`` into the workers, ``num_epochs`` times.

        Each epoch is one Spark job whose tasks stream their partition straight to the workers'
        Flight servers; the driver only coordinates. Returns once every worker's pass over the
        last epoch has ended (read to its end, left early, or its main returned), so the report
        accounts for every row: consumed + ``rows_unconsumed`` + ``dropped_for_balance`` =
        ``rows``. A worker that leaves an epoch early (``break``, ``take``,
        ``steps_per_epoch``) is sent no more of it; the next epoch proceeds.

        ``df`` should be deterministic per partition (cached, or read from files): a retried
        task must produce the same rows for exactly-once delivery.

        Args:
            df: the training rows; read on the nodes with ``ctx.dataset(...)``.
            num_epochs: passes over ``df``.
            feed_timeout: seconds the call may stand still: it fails once no row has moved
                into or out of any worker's buffer for that long (a node that stops reading, a
                stuck job, a main still setting up before its first ``ctx.dataset()``: the
                error says which). Training that keeps reading is never cut short, however long,
                nor is Spark computing an expensive DataFrame as long as it finishes tasks
                (a long shuffle before the push); one task slower than this before its first
                row is.
            cache: push ``df`` once (one Spark job) and let every worker replay its share for
                the later epochs itself, from memory up to ``run(cache_bytes=...)`` and from
                Arrow IPC files in its work directory beyond that (removed at shutdown).
                Training ``df`` again with ``cache=True`` replays it with no Spark job.
            shuffle: every epoch yields each worker's rows in a different order, seeded by
                ``seed``: a cached epoch is replayed in a random order of the batches the node
                received, and on every epoch, cached or not, rows are permuted within windows
                of about one feed buffer (``run(buffer_bytes=...)``) as they stream. So rows
                move across the whole epoch in batch-sized groups and freely within a window;
                ``dataplane bench train`` reports how far rows move between epochs.
            seed: the shuffle's seed (with ``shuffle=False`` it changes nothing, and the
                report's messages say so). The same seed gives the same orders for cached
                replays, and for a pushed epoch whose rows arrive in the same order (one
                partition per worker); Spark's tasks deliver several partitions in whatever
                order they run, which a pushed epoch's order follows within its windows.
                Epochs differ from each other (the epoch id is part of the seed).
            validation: a second DataFrame, pushed alongside (after each training epoch, one
                pass) and read with ``ctx.dataset(split="validation")``, so
                ``fit(train_ds, validation_data=val_ds)`` works, under MWMS too (every worker
                yields the same number of validation batches). Cached with ``cache=True``.

        Returns:
            A :class:`FeedReport`: rows, bytes, seconds, rows per node and per split, rows
            dropped for balance, rows unconsumed per node, and the Spark jobs that pushed.

        A cluster takes one call at a time: a call from another thread while one runs (a
        stream's micro-batch among them) waits for it, then pushes its epochs after it.

        Raises:
            NodeError: a node's main raised or its process died during the feed.
            ClusterStateError: ``cluster.shutdown()`` began (from another thread) while the
                call ran, or while it waited for another call: no later epoch is pushed; or the
                SparkSession was stopped, or its JVM has exited.
            SchemaError: ``df`` has no columns, or a column no tensor can hold.
            FeedError: the feeding job failed (Spark's JVM exiting under it included), or
                nothing moved for ``feed_timeout`` seconds.
        """
        self._check_running("train")
        with plain_ctrl_c(self.spark), on_jvm_exit(self.spark, "train"):
            report = self._feeder.train(
                df, num_epochs=num_epochs, feed_timeout=feed_timeout, progress=progress,
                cache=cache, shuffle=shuffle, seed=seed, validation=validation,
            )
        ps = [n for n in self.topology.nodes if n.role == "ps"] if self.topology else []
        if ps and report.rows and sum(report.rows_unconsumed.values()) + report.dropped_for_balance == report.rows:
            msg = (
                f"no worker read any pushed row, and this cluster has {len(ps)} parameter "
                f"server(s): under ParameterServerStrategy the workers' input comes from the "
                f"chief's dataset_fn, which ctx.dataset() cannot be (README, Known limits). Give "
                f"that strategy a dataset_fn over TensorFlow's own readers, or train with "
                f"MultiWorkerMirroredStrategy (num_ps=0) to use train(df)."
            )
            report.messages.append(msg)
            logger.warning("%s", msg)
        return report

    def _train_micro_batch(self, df: Any, feed_timeout: float) -> FeedReport:
        """``train(df)`` for a stream's micro-batch (:mod:`dataplane.workloads.streaming`): the
        rows past the balanced count are held back on the workers for the next micro-batch
        instead of dropped (``FeedReport.carried_out``)."""
        self._check_running("train")
        with on_jvm_exit(self.spark, "train"):
            return self._feeder.train(df, num_epochs=1, feed_timeout=feed_timeout, carry=True)

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
        output row per input row. Every action on it runs the inference again, so write it (or
        cache and count it) before the cluster shuts down; after that its tasks fail. Each
        partition goes to one serving node over ``do_exchange``; answers come back on the same
        stream, matched by sequence number.

        Args:
            df: input rows.
            passthrough: input columns copied to the output (keys to join on): a name, a
                list of names, or None for none.
            columns: input columns sent to predict, a name or a list (default: all).
            output_schema: predict's output columns, a ``pyarrow.Schema``; default: learned
                from a 4-row probe. Required for a streaming ``df``, whose result is then a
                stream too. A float answer beyond a float32 output's range is an error, not
                infinity.
            feed_timeout: seconds to wait for each answer (one request of up to ``max_rows``
                rows, and the probe); a node that is not serving, or a predict slower than
                that, fails the job with a FeedError naming the node. Requests go to the nodes
                serving when this is called (to every chief and worker if none is yet).
            max_rows: rows per request batch (a positive int).

        Raises:
            ValueError / TypeError: an argument above that is not what it says (checked here,
                not in the Spark tasks).
            SchemaError: a named column is not in ``df``.
        """
        self._check_running("inference")
        with on_jvm_exit(self.spark, "inference"):
            return self._feeder.inference(
                df, passthrough=passthrough, columns=columns, output_schema=output_schema,
                feed_timeout=feed_timeout, max_rows=max_rows,
            )

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per node id: rows_in, bytes_in, batches_in, buffer_bytes, buffer_peak_bytes,
        stall_seconds (producers waiting on a full buffer), rows_out, rows_duplicate, main,
        serving (the node's ``ctx.serve`` is answering ``inference``)."""
        self._check_running("metrics")
        out = {}
        for n in self.nodes:
            try:
                out[n.node_id] = self._node_action(n, "metrics", {})
            except NodeError as e:
                out[n.node_id] = {"error": str(e)}
        return out

    def shutdown(self, timeout: float = 60.0, *, drain: bool = True, _stop_busy: bool = False) -> None:
        """Stop every node and wait (up to ``timeout`` s) until each process has exited.

        The chief and workers first get to finish what they are doing (training on the epochs
        already pushed, or reading files in pull mode) until their main returns or only waits
        for the driver; a ``train`` running in another thread pushes no further epoch and
        raises :class:`ClusterStateError`. A busy main that never checks ``ctx.should_stop``
        is waited for however long it runs (a pull-mode training run goes to its end; the log
        says every minute what shutdown waits for, and Ctrl-C stops the nodes at once); one
        that polls the flag is told to stop once ``timeout`` runs out. Then every node is told
        to stop: datasets waiting for more data end, ``ctx.serve`` returns, and a main that
        still runs after ``stop_grace`` seconds is ended with its process; a parameter
        server's (its ``server.join()`` never returns) after one second.

        Under MultiWorkerMirroredStrategy two busy mains cannot finish and are not waited for:
        one inside ``ctx.save_model`` beside a worker whose main returned without that save
        (a collective it can never join) is stopped at once; and once a failed ``train`` call
        left the workers' passes of different lengths (a node says so), busy mains are stopped
        when ``timeout`` runs out, since one may wait in a collective for steps the others
        never take. Either raises :class:`NodeError` saying so.

        ``drain=False`` skips the first step: the nodes are told to stop at once, and a main
        still running gets one second instead of ``stop_grace``. Leaving a
        ``with dataplane.run(...)`` block on an exception (Ctrl-C included) does that, since
        the program is ending anyway; a second Ctrl-C meanwhile is held until the nodes have
        stopped (a few seconds at most), then raised.

        Calling it again is a no-op. (``_stop_busy``, for ``TFCluster.shutdown``, whose timeout
        bounds the whole shutdown as in TensorFlowOnSpark: busy mains are stopped once
        ``timeout`` runs out, whether or not they poll the flag.)

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
        stuck: NodeError | None = None  # a main the drain stopped because it cannot finish
        if failure is None and drain:
            try:
                stuck = self._drain(deadline, timeout=timeout, stop_busy=_stop_busy)
            except BaseException:  # Ctrl-C while waiting for busy mains: stop them now
                self._stop_now()
                raise
            failure = self._node_failure()
        if not drain:  # (leaving a with-block on Ctrl-C: a second one must not cut it short)
            with _ctrl_c_held("stopping the nodes"):
                unreachable = self._stop_nodes(max(deadline - time.monotonic(), 10.0), now=True)
                self._state = "stopped"
                self._feeder.close()
        else:
            try:
                unreachable = self._stop_nodes(max(deadline - time.monotonic(), 10.0))
            except BaseException:  # Ctrl-C while the nodes finish: stop them now
                self._stop_now()
                raise
            self._state = "stopped"
            self._feeder.close()
        if failure is None:
            failure = self._node_failure(include_lost=False)
            if stuck is not None:
                # what the stopped main then raised (its collective aborted by the stop) is a
                # symptom; the drain's reason is the error, with that traceback
                if failure is not None and failure.node == stuck.node:
                    stuck.remote_traceback = failure.remote_traceback
                failure = stuck
        if failure is None:
            # A node killed shortly before shutdown (within node_timeout) is not yet lost by
            # heartbeat, but it could not be told to stop and never confirmed its exit.
            snap = self._control.snapshot()
            now = time.monotonic()
            for nid in sorted(unreachable):
                st = snap.get(nid)
                if st is not None and not st.exited:
                    info = self.topology.node(nid) if self.topology else None
                    failure = _lost(info.describe() if info else f"node {nid}", info, now - st.last_seen,
                                    st.registration)
                    break
        if failure is not None:
            self._feeder.notes.add_to(failure)
            raise failure

    def __enter__(self) -> "Cluster":
        if self._state in ("stopped", "stopping"):
            # its nodes are gone: every call in the block would fail, one by one
            raise ClusterStateError(
                f"cannot enter a with-block: the cluster is {self._state}. Start a new one "
                "with `with dataplane.run(spark, main, ...) as cluster:`.")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        try:
            self.shutdown(drain=exc_type is None)
        except NodeError as failure:
            if exc_type is None:
                raise
            same = isinstance(exc, NodeError) and (
                str(exc).split("\n")[0] == str(failure).split("\n")[0])
            if same:
                return  # the block is raising this node's failure already (train raised it)
            logger.error("a node failed while the with-block was already raising: %s", failure)

    def __repr__(self) -> str:
        return f"Cluster({self.cluster_id}, {len(self.nodes)} nodes, {self._state})"

    # -- internals --------------------------------------------------------------------------
    def _mark_running(self, topology: Topology) -> None:
        """Every node registered (called by :func:`dataplane.driver.startup.run`)."""
        self.topology = topology
        self._state = "running"

    def _check_running(self, what: str) -> None:
        doing = {"inference": "run inference", "metrics": "read metrics"}.get(what, what)
        if self._state != "running":
            raise ClusterStateError(f"cannot {doing}: the cluster is {self._state}.")
        if what in ("train", "inference"):
            # a node whose main failed makes every later call fail at once, with its error
            err = self._node_failure()
            if err is not None:
                self._feeder.notes.add_to(err)
                raise err
            if spark_stopped(self.spark):
                raise ClusterStateError(
                    f"cannot {doing}: the SparkSession this cluster was started with has been "
                    f"stopped (spark.stop()), and {what} runs Spark jobs on it. Stop Spark after "
                    f"the cluster: leave the `with dataplane.run(...)` block (or call "
                    f"cluster.shutdown()) first."
                )
            if jvm_gone(self.spark):
                raise ClusterStateError(
                    f"cannot {doing}: the JVM of the SparkSession this cluster was started with "
                    f"has exited, and {what} runs Spark jobs: {JVM_EXITED} Shut this cluster "
                    f"down (leave its `with` block) before the program ends."
                )

    def _live_workers(self) -> list[NodeInfo]:
        snap = self._control.snapshot()
        return [n for n in self.topology.workers if not snap[n.node_id].done]  # type: ignore[union-attr]

    def _client(self, node: NodeInfo):  # type: ignore[no-untyped-def]
        from dataplane.rpc import connect

        c = self._clients.get(node.node_id)
        if c is None:
            c = connect(node.flight_location, tls_root_certs=self._tls_root)
            self._clients[node.node_id] = c
        return c

    def _answer(self, node: NodeInfo, call: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
        """``call()``, but a node that stops heartbeating meanwhile (its main holds Python's lock
        in native code, or the process is stopped) fails the wait once it is lost, after
        ``node_timeout``, rather than after the action's own ``timeout``."""
        if timeout <= self._node_timeout:
            return call()
        done = threading.Event()
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["reply"] = call()
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                out["error"] = e
            done.set()

        threading.Thread(target=run, name="dataplane-action", daemon=True).start()
        while not done.wait(0.5):
            st = self._control.snapshot().get(node.node_id)
            if st is not None and not (st.done or st.exited) and (
                    time.monotonic() - st.last_seen > self._node_timeout):
                err = self._node_failure()
                if err is not None:
                    raise err
        if "error" in out:
            raise out["error"]
        return out["reply"]

    def _node_action(self, node: NodeInfo, name: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        import pyarrow.flight as flight

        from dataplane.rpc import do_json_action
        from feeders.flight import flight_message

        try:
            return self._answer(node, lambda: do_json_action(
                self._client(node), self._secret, name, body, timeout=timeout), timeout)
        except flight.FlightError as e:
            err = self._node_failure(grace=2.0)
            if err is not None:
                raise err from e
            if self._state in ("stopping", "stopped"):
                # (a train or inference in another thread while shutdown stops the nodes):
                # no node failed, the user's own shutdown ended the call
                raise ClusterStateError(
                    f"{node.describe()} did not answer {name!r}: cluster.shutdown() stopped the "
                    f"nodes while the call ran ({flight_message(e)})."
                ) from e
            st = self._control.snapshot().get(node.node_id)
            silent = time.monotonic() - st.last_seen if st is not None else 0.0
            raise NodeError(
                f"{node.describe()} did not answer {name!r}: {flight_message(e)} (its last "
                f"heartbeat came {silent:.0f} s ago; if its process died, the executor's log "
                f"says why).", node=node, remote_traceback="",
            ) from e

    def _node_failure(self, *, grace: float = 0.0, include_lost: bool = True) -> NodeError | None:
        """A NodeError for the first failed or lost node, or None when all are healthy."""
        deadline = time.monotonic() + grace
        while True:
            snap = self._control.snapshot()
            now = time.monotonic()
            failed: list[NodeError] = []
            for nid in sorted(snap):
                st = snap[nid]
                info = self.topology.node(nid) if self.topology else None
                name = info.describe() if info else f"node {nid}"
                if st.done and not st.ok:
                    fix = known_fix(st.traceback, st.note)
                    summary = error_summary(st.traceback)
                    # a SchemaError on the node is one for the caller too (a null, a shape)
                    cls = NodeSchemaError if summary.split(":", 1)[0].endswith("SchemaError") else NodeError
                    failed.append(cls(
                        f"{name}: main raised:\n{summary}" + (f"\n{fix}" if fix else ""),
                        node=info, remote_traceback=st.traceback,
                    ))
                elif include_lost and not st.done and not st.exited and (
                        st.exit_code is not None or _gone_here(st.registration)):
                    # died without a word (killed, out of memory): its peers' collectives then
                    # fail too, and their errors would name them instead of the cause. Its
                    # reaper's word on how it ended follows within a second or so.
                    self._control.wait_for(lambda now_st: now_st[nid].exit_code is not None, EXIT_REPORT_WAIT)
                    st = self._control.snapshot()[nid]
                    return _died(name, info, self._peer_errors(snap, nid), st.exit_code, st.exit_log)
                elif include_lost and not st.exited and now - st.last_seen > self._node_timeout:
                    return _lost(name, info, now - st.last_seen, st.registration)
            if failed:
                # a node whose own code failed before the ones whose collectives it broke
                return next((e for e in failed if not _peer_symptom(e.remote_traceback)), failed[0])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.25)

    def _peer_errors(self, snap: dict[int, Any], dead: int) -> list[NodeError]:
        """The nodes other than ``dead`` that reported a failure, as short NodeErrors."""
        out = []
        for nid in sorted(snap):
            st = snap[nid]
            if nid != dead and st.done and not st.ok:
                info = self.topology.node(nid) if self.topology else None
                out.append(NodeError(error_summary(st.traceback), node=info, remote_traceback=st.traceback))
        return out

    def _drain(self, deadline: float, *, timeout: float, stop_busy: bool = False) -> NodeError | None:
        """Let every chief and worker finish what it is doing before it is told to stop.

        A main is left alone while it is busy (training on pushed epochs, reading files in
        pull mode, saving a model); it is stopped once it only waits for the driver (blocked on
        the next epoch, serving inference, ``ctx.wait_stop``) or has returned. ``train`` then
        ``shutdown`` therefore never drops pushed rows, and pull-mode training is not cut
        short. Only mains that poll ``ctx.should_stop`` (they expect to be told) are stopped
        busy, once ``deadline`` has passed.

        Two busy mains under MultiWorkerMirroredStrategy cannot finish, and are not waited for:
        one in ``ctx.save_model`` (a collective) beside a worker whose main returned having
        begun fewer saves is stopped at once; once a failed push left the workers' passes of
        different lengths (a node reported ``overran_cut``), busy mains are stopped when
        ``deadline`` has passed, since one may wait in a collective for steps the others never
        take. Either comes back as the NodeError to raise.
        """
        next_note = deadline
        polling_note = time.monotonic() + POLLING_NOTE_AFTER  # (then never again)
        hint_due = False  # some workers' mains returned while others run: the MWMS hint is timed
        ended: dict[int, dict[str, Any]] = {}  # metrics of workers whose main returned (final)
        while True:
            busy: list[int] = []
            polling: list[int] = []
            snap = self._control.snapshot()
            workers = self.topology.workers  # type: ignore[union-attr]
            returned = [n.node_id for n in workers if snap[n.node_id].done]
            metrics: dict[int, dict[str, Any]] = {}
            for n in workers:
                if n.node_id in ended:
                    metrics[n.node_id] = ended[n.node_id]
                    continue
                try:
                    m = self._node_action(n, "metrics", {}, timeout=5.0)
                except (NodeError, ClusterStateError):
                    if n.node_id in returned:
                        continue  # (its process may be gone already: nothing to wait for)
                    return None
                metrics[n.node_id] = m
                if n.node_id in returned:
                    ended[n.node_id] = m
                elif m.get("main") == "running" and not m.get("idle"):
                    busy.append(n.node_id)
                    if m.get("checks_should_stop"):
                        polling.append(n.node_id)
            if not busy or self._node_failure() is not None:
                return None
            saving = _stuck_saving(busy, returned, metrics, self.topology)
            if saving is not None:
                logger.warning("shutdown: %s", saving)
                return saving
            overran = {nid: m["overran_cut"] for nid, m in metrics.items() if m.get("overran_cut")}
            now = time.monotonic()
            if returned and not hint_due:
                hint_due = True
                next_note = min(next_note, now + MWMS_HINT_AFTER)
            if now >= deadline and overran and len(workers) > 1:
                stuck = _stuck_after_cut(busy, returned, overran, self.topology, timeout)
                logger.warning("shutdown: %s", stuck)
                return stuck
            if polling and now >= polling_note and deadline - now > 1.0:
                polling_note = float("inf")
                logger.warning(
                    "shutdown: node(s) %s still run main, which polls ctx.should_stop: it may be "
                    "training, so it is left to return by itself or told to stop once shutdown's "
                    "timeout runs out (%.0f s from now). A main that only waits for the end "
                    "should call ctx.wait_stop(), which shutdown ends at once.",
                    polling, deadline - now,
                )
            if now >= deadline and (stop_busy or len(polling) == len(busy)):
                logger.warning(
                    "shutdown: node(s) %s were still running main when the timeout ran out; "
                    "stopping them (%s)", busy,
                    "TFCluster.shutdown's timeout" if stop_busy and len(polling) < len(busy) else
                    "their main polls ctx.should_stop; ctx.wait_stop() tells the driver a main "
                    "only waits",
                )
                return None
            if now >= next_note:
                alone = ""
                if overran and len(workers) > 1:
                    alone = (
                        f" A failed push cut an epoch after node(s) {sorted(overran)} had yielded "
                        f"more of it, so the workers' passes differ in length: under "
                        f"MultiWorkerMirroredStrategy a worker may wait in a collective for "
                        f"steps the others never take. It is stopped once shutdown's timeout "
                        f"({timeout:.0f} s) runs out."
                    )
                elif returned:
                    # MWMS: a collective step taken by some workers only never completes
                    alone = (
                        f" The main of node(s) {returned} has returned: under "
                        f"MultiWorkerMirroredStrategy a step every worker must take (model.save "
                        f"to .keras or a SavedModel, evaluate, predict) waits forever when only "
                        f"some take it. Save with ctx.save_model(model, path) on every worker "
                        f"(the chief writes path) instead of model.save on the chief alone. "
                        f"Likewise a loop running a collective for every batch of a dataset "
                        f"whose workers hold different batch counts (pull shards of different "
                        f"sizes) waits once one worker runs out: iterate "
                        f"strategy.experimental_distribute_dataset(ds), or Keras fit, which "
                        f"cope with that."
                    )
                logger.warning(
                    "shutdown: waiting for node(s) %s, whose main is still running (training in "
                    "pull mode, saving a model...); it is left to finish.%s Ctrl-C stops the "
                    "nodes now.", sorted(set(busy) - set(polling)), alone,
                )
                next_note = now + 60.0
            time.sleep(0.25)

    def _stop_nodes(self, timeout: float, *, now: bool = False) -> set[int]:
        """Tell every node to stop and wait for them; returns the ids that could not be told.
        ``now``: a main still running gets one second, not ``stop_grace``."""
        self._control.request_stop()
        unreachable: set[int] = set()
        for n in self.nodes:
            try:
                from dataplane.rpc import do_json_action
                from feeders.protocol import Action

                do_json_action(self._client(n), self._secret, Action.SHUTDOWN.value, {"now": now}, timeout=5.0)
            except Exception:  # noqa: BLE001 - it may be dead already; heartbeat tells it too
                unreachable.add(n.node_id)
        ids = set(self._control.registered_ids())
        def gone(st: Any) -> bool:  # told us it exited, went silent, or its process is gone
            return (st.exited or st.exit_code is not None
                    or time.monotonic() - st.last_seen > self._node_timeout or _gone_here(st.registration))

        # a node killed outright never confirms: without the pid check shutdown waited the
        # whole timeout for it
        ok = self._control.wait_for(lambda st: all(gone(st[i]) for i in ids if i in st), timeout)
        if not ok:
            logger.warning("some nodes did not confirm their exit within %.0f s", timeout)
        for c in self._clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        self._clients.clear()
        _finish_stop(self._control, self._launch_job)
        self._finalizer.detach()
        return unreachable

    def _stop_now(self) -> None:
        """Stop the nodes at once after a Ctrl-C, holding a further Ctrl-C until they are
        (an interrupted stop left the cluster "stopping" for good, with the driver's control
        server, its port and threads still open, and shutdown() a no-op)."""
        with _ctrl_c_held("stopping the nodes"):
            self._stop_nodes(10.0, now=True)
            self._state = "stopped"
            self._feeder.close()

    def _abort(self) -> None:
        """Failed start: stop whatever did start, quietly."""
        self._state = "stopping"
        try:
            self._launch_job.cancel()
            self._stop_nodes(timeout=15.0, now=True)
        finally:
            self._state = "stopped"


def _stop_dropped(control: ControlServer, launch_job: SparkJob | None, cluster_id: str) -> None:
    """A Cluster was garbage-collected while running: tell its nodes to stop (through their
    heartbeats), then close its control server and its Spark job, in a thread of its own
    (finalizers must not block). It used to keep its nodes, ports and work directories until
    the driver exited, even past spark.stop()."""
    logger.warning(
        "cluster %s was dropped without shutdown() (for example a notebook cell that ran "
        "dataplane.run again): stopping its nodes. Call cluster.shutdown(), or use `with "
        "dataplane.run(...) as cluster:`.", cluster_id)

    def stop() -> None:
        control.request_stop()
        control.wait_for(lambda st: all(s.exited or s.exit_code is not None or _gone_here(s.registration)
                                        for s in st.values()), 30.0)
        _finish_stop(control, launch_job)

    threading.Thread(target=stop, name="dataplane-dropped-cluster", daemon=True).start()


def _finish_stop(control: ControlServer, launch_job: SparkJob | None) -> None:
    """The end of every stop, once the nodes were told and waited for: kill what lingers of
    them on this machine, close the control server, cancel the launch job."""
    _reap_local(control, deadline=time.monotonic() + 10.0)
    control.shutdown()
    if launch_job is not None and not launch_job.done():
        launch_job.cancel()


def _reap_local(control: ControlServer, deadline: float) -> None:
    """Make sure node processes on this machine are gone (kill what lingers)."""
    for nid, st in control.snapshot().items():
        pid = _local_pid(st.registration)
        if not pid:
            continue
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            logger.warning("node %d (pid %d) still running after shutdown; killing it", nid, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@contextlib.contextmanager
def _ctrl_c_held(what: str) -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) while a stop bounded in time runs, then raise KeyboardInterrupt
    if one came: notebook users press it twice, and the second cut the stop short. Only the
    main thread can take signals; elsewhere, or where SIGINT's handler was set outside Python,
    this does nothing."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is None):
        # (None: a handler set outside Python, which signal.signal could not put back)
        yield
        return
    pressed: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if not pressed:
            logger.warning("Ctrl-C: %s first (a few seconds at most)", what)
        pressed.append(signum)

    try:
        before = signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if pressed:
        raise KeyboardInterrupt


def _lost(name: str, info: NodeInfo | None, silent_for: float, registration: dict[str, Any]) -> NodeError:
    pid = _local_pid(registration)
    if pid and _alive(pid):
        # its heartbeat thread got no turn: native code holding Python's lock
        return NodeError(
            f"{name} stopped responding {silent_for:.0f} s ago (no heartbeat), though its "
            f"process (pid {pid}) still runs: its main is likely stuck in native code that holds "
            f"Python's lock, so no other thread of the node runs. TensorFlow does this when a "
            f"strategy waits for peers that never join (MultiWorkerMirroredStrategy in a "
            f"cluster started with num_ps > 0, whose ps nodes take no part in it; a collective "
            f"a worker never reaches). Use ParameterServerStrategy with ps nodes, "
            f"MultiWorkerMirroredStrategy without.",
            node=info, remote_traceback="(no traceback: the node did not answer)",
        )
    return NodeError(
        f"{name} stopped responding {silent_for:.0f} s ago (no heartbeat): its process died or "
        f"was killed, or its executor was lost.",
        node=info, remote_traceback="(no traceback: the process was lost)",
    )


def _stuck_saving(busy: list[int], returned: list[int], metrics: dict[int, dict[str, Any]],
                  topology: Any) -> NodeError | None:
    """A busy worker inside a collective ``ctx.save_model`` that a returned worker can no
    longer join (it began fewer saves before its main returned): that save never finishes."""
    if len(topology.workers) < 2:
        return None
    for nid in busy:
        m = metrics.get(nid, {})
        if not m.get("saving"):
            continue
        begun = int(m.get("saves_begun", 0))
        absent = sorted(r for r in returned if int(metrics.get(r, {}).get("saves_begun", begun)) < begun)
        if absent:
            return NodeError(
                f"node {nid}'s main was stopped inside ctx.save_model: under "
                f"MultiWorkerMirroredStrategy saving is a collective every worker takes part in, "
                f"and the main of node(s) {absent} had returned without this save (save "
                f"{begun} of node {nid}), so it could never finish. The model was not saved "
                f"(the path holds what it held before). Call ctx.save_model(model, path) on "
                f"every chief and worker, not on the chief alone (the chief writes path, the "
                f"others a throwaway copy).",
                node=topology.node(nid),
                remote_traceback="(no traceback: main was stopped while it waited in ctx.save_model)",
            )
    return None


def _stuck_after_cut(busy: list[int], returned: list[int], overran: dict[int, dict[str, Any]],
                     topology: Any, timeout: float) -> NodeError:
    """The error for busy mains that shutdown stopped after a failed push had left the
    workers' passes of different lengths (the nodes in ``overran`` had yielded past its cut)."""
    nid, cut = next(iter(sorted(overran.items())))
    info = topology.node(busy[0]) if topology is not None else None
    beside = f", beside node(s) {returned} whose main had returned" if returned else ""
    return NodeError(
        f"node(s) {busy} were still running main when shutdown's timeout ({timeout:.0f} s) ran "
        f"out{beside}, and were stopped: the rest of their main did not run. A failed push had "
        f"cut epoch {cut['epoch']} ({cut['split']}) at {cut['cut']} row(s) per worker after "
        f"node {nid}'s pass had yielded {cut['yielded']}, so the workers' passes differ in "
        f"length, and under MultiWorkerMirroredStrategy a worker then waits in a collective "
        f"for steps the others never take. After a train() call fails under that strategy, "
        f"start a new cluster for the next one, or clean the DataFrame first so that no call "
        f"fails mid-epoch (df.na.drop(), ctx.dataset(fill_values=...)).",
        node=info, remote_traceback="(no traceback: main was stopped while it ran)",
    )


def _peer_symptom(traceback_text: str) -> bool:
    """Whether a node's error is what another node's failure does to its peers under a
    multi-worker strategy (its collectives aborted or cut off), not a failure of its own."""
    last = error_summary(traceback_text)
    return any(s in last for s in (
        "Collective ops is aborted", "CollectiveReduce", "CollectiveGather", "CollectiveBcast",
        "failed to connect to all addresses",
    ))


def _died(name: str, info: NodeInfo | None, symptoms: list[NodeError], code: int | None = None,
          log: str = "") -> NodeError:
    """The error for a node whose process ended without reporting why; ``code`` is its exit
    code when its reaper told the driver (negative: the signal), ``log`` its last lines."""
    also = ""
    if symptoms:
        others = ", ".join(e.node.describe() if e.node else "a node" for e in symptoms)
        also = f" {others} then failed as a result (their collectives lost this node)."
    last = f"\nIts last output:\n{log}" if log.strip() else ""
    return NodeError(f"{name}: {_how_it_ended(code)}{also}{last}", node=info,
                     remote_traceback=log or "(no traceback: the process was lost)")


def _how_it_ended(code: int | None) -> str:
    """Why a node's process ended without reporting an error, from its exit code."""
    if code is None:
        return ("its process exited without reporting an error (killed, e.g. by the kernel's "
                "out-of-memory killer, or it called os._exit or crashed in native code; the "
                "executor's stderr may say which).")
    if code > 0:
        return (f"its process exited with code {code} without reporting an error: main or a "
                f"library it calls ended the process with os._exit({code}), which skips "
                f"Python's error handling (sys.exit or an exception in main is reported).")
    try:
        sig = signal.Signals(-code).name
    except ValueError:
        sig = f"signal {-code}"
    else:
        sig = f"{sig} (signal {-code})"
    if -code == signal.SIGKILL:
        return (f"its process was killed by {sig}, which gives no chance to report: most often "
                f"the kernel's out-of-memory killer (the machine's `dmesg` then shows 'Out of "
                f"memory: Killed process' with its pid), or a container limit or a `kill -9`. "
                f"If memory: smaller batches or model, a smaller run(buffer_bytes=..., "
                f"cache_bytes=...), or fewer nodes or Spark tasks per machine.")
    if -code in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT):
        return (f"its process crashed in native code with {sig}: a fault in TensorFlow or "
                f"another compiled library (or one built for another CPU or library version). "
                f"Python's stack of the crashing thread, when it printed one, is below.")
    return f"its process was ended by {sig} from outside, before it could report anything."


def _local_pid(registration: dict[str, Any]) -> int:
    """The node's pid when it runs on this machine (local mode, or an executor beside the
    driver), else 0."""
    pid = int(registration.get("pid", 0) or 0)
    here = registration.get("host") in {"127.0.0.1", "localhost", socket.gethostname()} or (
        registration.get("hostname") == socket.gethostname())
    return pid if here else 0


def _gone_here(registration: dict[str, Any]) -> bool:
    """Whether the node ran on this machine and its process is gone (killed, crashed)."""
    pid = _local_pid(registration)
    return bool(pid) and not _alive(pid)


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
