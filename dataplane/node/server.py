"""The Arrow Flight server every TF node runs.

``do_put``       training data: one stream per (epoch, partition, task attempt), described by a
                 :class:`feeders.protocol.FeedCommand`; batches go into the node's
                 :class:`~feeders.buffer.FeedBuffer`.
``do_exchange``  inference: request batches in, answers out on the same stream, one answer per
                 request, tagged with the request's sequence number in ``app_metadata``.
``do_action``    JSON control from the driver (:class:`feeders.protocol.Action`).

A refused stream's error carries a :class:`feeders.protocol.Refusal` marker in its message.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable

import pyarrow as pa
import pyarrow.flight as flight

from dataplane.errors import FeedError, NotServing, SchemaError, StorageError
from dataplane.rpc import AuthMiddlewareFactory, json_result
from feeders.buffer import ConsumerFinished, EpochClosed, EpochInfo, FeedBuffer, FeedStopped
from feeders.protocol import Action, BeginEpoch, ChunkTag, FeedCommand, PutReply, Refusal

__all__ = ["NodeServer", "InferenceBroker", "CONSUMER_FINISHED", "NODE_STOPPING"]

logger = logging.getLogger(__name__)

CONSUMER_FINISHED = Refusal.CONSUMER_FINISHED.value
NODE_STOPPING = Refusal.NODE_STOPPING.value


# How long an inference request waits for ctx.serve on a node whose main is in ctx.wait_stop().
WAIT_STOP_GRACE = 3.0
# ... and on a node whose main waits in ctx.dataset() for the driver's next train() call (longer:
# another driver thread may be about to push it)
WAIT_DATA_GRACE = 10.0
# Calls of ctx.wait_stop(timeout) less than this far apart (a polling loop) are one wait.
WAIT_STOP_GAP = 1.0


class InferenceBroker:
    """Hands inference requests from Flight handler threads to ``ctx.serve`` in main's thread."""

    def __init__(self) -> None:
        self.requests: queue.Queue[tuple[pa.RecordBatch, Future]] = queue.Queue()
        self.stopped = threading.Event()
        self.serving = False  # ctx.serve is running: main waits for the driver's requests
        self.closed: str | None = None  # why no answer will ever come (main ended unserving)
        self.waiting_since: float | None = None  # main blocks in ctx.wait_stop() (monotonic)
        # seconds main has waited in ctx.dataset() for a pushed epoch (FeedBuffer.waits_for_data)
        self.waits_for_data: Callable[[], float | None] = lambda: None
        self._left_wait: float | None = None  # when main's last ctx.wait_stop() returned
        self._wait_start: float | None = None  # when the current run of wait_stop calls began
        self.rows = 0
        self.batches = 0

    def submit(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        fut: Future = Future()
        self.requests.put((batch, fut))
        while True:
            if self.stopped.is_set():
                raise FeedStopped("the node is shutting down")
            if self.closed is not None and not self.serving and not fut.done():
                raise NotServing(self.closed)
            since = self.waiting_since
            if since is not None and not self.serving and time.monotonic() - since > WAIT_STOP_GRACE:
                # (the grace: a thread of main's may be about to start ctx.serve)
                raise NotServing(
                    "main waits in ctx.wait_stop() without serving inference, so nothing will "
                    "answer; call ctx.serve(predict) in main on every chief and worker (it "
                    "returns when the driver shuts down, as wait_stop does) before "
                    "cluster.inference"
                )
            waited = None if self.serving else self.waits_for_data()
            if waited is not None and waited > WAIT_DATA_GRACE:
                raise NotServing(
                    f"main has waited {waited:.0f} s in ctx.dataset() for the driver's next "
                    f"cluster.train() call (it read every epoch pushed so far) instead of "
                    f"serving inference, so nothing will answer; call ctx.serve(predict) in main "
                    f"on every chief and worker once it has read the passes train() pushes (or "
                    f"from a thread of its own) before cluster.inference"
                )
            try:
                return fut.result(timeout=0.2)
            except TimeoutError:
                continue

    def enter_wait(self) -> None:
        """Main calls ``ctx.wait_stop()``. A call soon after the last one returned continues
        that wait, so a loop of short ``wait_stop(timeout)`` calls counts as one long wait."""
        now = time.monotonic()
        if self._left_wait is None or now - self._left_wait > WAIT_STOP_GAP:
            self._wait_start = now
        self.waiting_since = self._wait_start

    def leave_wait(self) -> None:
        self.waiting_since = None
        self._left_wait = time.monotonic()

    def close(self, reason: str) -> None:
        """Main has ended without ``ctx.serve`` running: fail waiting and later requests."""
        self.closed = reason
        while True:
            try:
                _, fut = self.requests.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(NotServing(reason))

    def stop(self) -> None:
        self.stopped.set()


class SaveTally:
    """Main's ``ctx.save_model`` calls: how many began, and how many are running now. Under
    MultiWorkerMirroredStrategy a save is a collective, so a chief saving while a worker's
    main has returned having begun fewer saves waits for ever (``cluster.shutdown`` tells)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.begun = 0
        self.active = 0  # collective saves running now (a model of a multi-worker strategy)

    def enter(self, collective: bool) -> None:
        with self._lock:
            self.begun += 1
            self.active += collective

    def leave(self, collective: bool) -> None:
        with self._lock:
            self.active -= collective


class NodeServer(flight.FlightServerBase):
    """One node's Flight server; lives until the node process exits."""

    def __init__(
        self,
        location: str,
        secret: str,
        *,
        buffer: FeedBuffer,
        broker: InferenceBroker,
        on_shutdown: Callable[[bool], None],
        node_id: int,
        tls_certificates: list[Any] | None = None,
    ) -> None:
        kw: dict[str, Any] = {"middleware": {"auth": AuthMiddlewareFactory(secret)}}
        if tls_certificates:
            kw["tls_certificates"] = tls_certificates
        super().__init__(location, **kw)
        self.buffer = buffer
        self.broker = broker
        self._on_shutdown = on_shutdown
        self.node_id = node_id
        self.main_state = "running"
        self.main_polls_stop = threading.Event()  # main read ctx.should_stop (NodeContext)
        self.saves = SaveTally()  # main's ctx.save_model calls (NodeContext)

    # -- data -------------------------------------------------------------------------------
    def do_put(self, context, descriptor, reader, writer):  # type: ignore[override]
        cmd = FeedCommand.decode(descriptor.command)
        epoch, partition = cmd.epoch, cmd.partition

        def chunks():
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    return
                tag = ChunkTag.decode(chunk.app_metadata)
                yield (chunk.data, None) if tag is None else (chunk.data, tag.seen, tag.nulls)

        try:
            rows = self.buffer.put_stream(epoch, partition, chunks())
        except ConsumerFinished:
            raise flight.FlightServerError(
                f"{Refusal.CONSUMER_FINISHED.value} node {self.node_id}'s main has returned and "
                f"consumes no more data (epoch {epoch}, partition {partition})"
            ) from None
        except EpochClosed:
            raise flight.FlightServerError(
                f"{Refusal.EPOCH_CLOSED.value} node {self.node_id} has ended its pass over epoch "
                f"{epoch} (partition {partition})"
            ) from None
        except FeedStopped:
            raise flight.FlightServerError(
                f"{Refusal.NODE_STOPPING.value} node {self.node_id} is shutting down"
            ) from None
        except SchemaError as e:
            raise flight.FlightServerError(f"{Refusal.SCHEMA.value} {e}") from None
        except StorageError as e:  # its cache or set-aside rows met a full disk
            raise flight.FlightServerError(f"{Refusal.STORAGE.value} node {self.node_id} {e}") from None
        except FeedError as e:
            raise flight.FlightServerError(f"node {self.node_id}: {e}") from None
        writer.write(pa.py_buffer(PutReply(rows).encode()))

    def do_exchange(self, context, descriptor, reader, writer):  # type: ignore[override]
        started = False
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            if chunk.data is None:
                continue
            seq = chunk.app_metadata
            try:
                out = self.broker.submit(chunk.data)
            except FeedStopped:
                raise flight.FlightServerError(
                    f"{NODE_STOPPING} node {self.node_id} is shutting down"
                ) from None
            except NotServing as e:
                raise flight.FlightServerError(f"node {self.node_id}: {e}") from None
            except SchemaError as e:  # the rows or predict's answer do not fit (not predict's error)
                raise flight.FlightServerError(f"node {self.node_id}: {e}") from None
            except Exception as e:  # the user's predict raised: report it to the caller
                where = "".join(traceback.format_tb(e.__traceback__)[-3:]).rstrip()
                raise flight.FlightServerError(
                    f"node {self.node_id}: predict raised {type(e).__name__}: {e}\n"
                    f"Traceback on node {self.node_id} (innermost calls):\n{where}"
                ) from None
            if not started:
                writer.begin(out.schema)
                started = True
            writer.write_with_metadata(out, seq)

    # -- control ----------------------------------------------------------------------------
    def do_action(self, context, action):  # type: ignore[override]
        body = json.loads(action.body.to_pybytes() or b"{}")
        try:
            name = Action(action.type)
        except ValueError:
            raise flight.FlightServerError(f"node {self.node_id}: unknown action {action.type!r}") from None
        if name is Action.PING:
            return json_result({"node_id": self.node_id, "main": self.main_state})
        if name is Action.BEGIN_EPOCH:  # one epoch, or a train call's epochs in order
            reply: dict[str, Any] = {}
            for one in body.get("epochs", [body]):
                begin = BeginEpoch.from_json(one)
                try:
                    reply = self.buffer.begin_epoch(EpochInfo.announced(begin))
                except FeedError as e:
                    raise flight.FlightServerError(f"node {self.node_id}: {e}") from None
            return json_result({"ok": True, "main": self.main_state, **reply})
        if name is Action.DROP_CACHE:
            self.buffer.drop_cache(str(body["cache"]))
            return json_result({"ok": True})
        if name is Action.HOLD_EPOCHS:
            return json_result({"held": self.buffer.hold_epochs([int(e) for e in body["epochs"]])})
        if name is Action.RELEASE_EPOCHS:
            self.buffer.release_epochs(withdraw=[int(e) for e in body["withdraw"]],
                                       keep=[int(e) for e in body["keep"]])
            return json_result({"ok": True})
        if name is Action.END_EPOCH:
            self.buffer.end_epoch(int(body["epoch"]), int(body["limit"]), cut=bool(body.get("cut", False)))
            return json_result({"ok": True})
        if name is Action.EPOCH_STATE:
            wait = float(body.get("wait", 0.0))
            if wait > 0:  # long poll: answer as soon as the pass over the epoch has ended
                self.buffer.wait_closed(int(body["epoch"]), min(wait, 2.0))
            return json_result(dict(self.buffer.epoch_state(int(body["epoch"])), main=self.main_state))
        if name is Action.METRICS:
            m = self.buffer.snapshot()
            m["inference_rows"] = self.broker.rows
            m["inference_batches"] = self.broker.batches
            m["main"] = self.main_state
            m["serving"] = self.broker.serving  # ctx.serve is answering cluster.inference
            # main only waits for the driver (next epoch, or inference requests): safe to stop
            m["idle"] = self.buffer.idle_waiters > 0 or self.broker.serving
            m["checks_should_stop"] = self.main_polls_stop.is_set()
            m["saves_begun"], m["saving"] = self.saves.begun, self.saves.active > 0
            m["time"] = time.time()
            return json_result(m)
        if name is Action.SHUTDOWN:
            now = bool(body.get("now", False))
            threading.Thread(target=self._on_shutdown, args=(now,), daemon=True).start()
            return json_result({"ok": True})
        raise flight.FlightServerError(f"node {self.node_id}: unhandled action {name.value!r}")
