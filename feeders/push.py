"""Executor side of the push data plane: Spark partitions into the nodes' Flight servers.

Both classes are the functions given to ``DataFrame.mapInArrow`` (so they also run under Spark
Connect). They are small picklable objects; each task opens its own Flight clients. What the
streams carry, and why the interleaved sending cannot deadlock, is in :mod:`feeders.protocol`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from formats.errors import FeedError, SchemaError, StorageError
from formats.schema import list_levels
from feeders.flight import flight_message
from feeders.protocol import (
    EPOCH_PROPERTY,
    PUSH_RESULT_FIELDS,
    PUSH_RESULT_SCHEMA,
    ChunkTag,
    FeedCommand,
    InferCommand,
    PutReply,
    Refusal,
    split_counts,
)

__all__ = [
    "PartitionPusher",
    "PartitionInferrer",
    "PUSH_RESULT_SCHEMA",
    "EPOCH_PROPERTY",
    "split_counts",
    "push_partition",
]

logger = logging.getLogger(__name__)

_NODE_HINT = (
    "If the node died, cluster.metrics() and cluster.shutdown() on the driver report its error "
    "(a NodeError with its traceback); otherwise check that executors can reach it."
)
# An action on inference()'s output after the cluster is gone ends up here too.
_INFER_HINT = (
    "If the cluster was shut down: the DataFrame that cluster.inference() returns is lazy, and "
    "every action on it (count, collect, write) sends its rows to the nodes again, so write it "
    "(or cache() and count() it) before leaving the `with dataplane.run(...)` block. "
    + _NODE_HINT
)


def _chunks(batch: pa.RecordBatch, max_bytes: int) -> list[pa.RecordBatch]:
    n = batch.num_rows
    if n == 0:
        return []
    per_row = max(1, batch.nbytes // n)
    step = max(1, max_bytes // per_row)
    return [batch.slice(start, step) for start in range(0, n, step)]


@dataclass
class _Stream:
    """One task's ``do_put`` stream to one worker node."""

    node: int
    loc: str
    writer: object = None
    meta: object = None
    client: object = None
    sent: int = 0
    bytes: int = 0
    refused: int = 0
    accepted: int = 0
    open: bool = True
    was_refused: bool = False  # the node refused the stream (see _refused_or_raise)
    pending: deque = field(default_factory=deque)  # chunks of the current batch not yet written


@dataclass
class _Push:
    """What one task's push needs besides its rows (see :func:`push_partition`)."""

    secret: str
    epoch: int
    partition: int
    attempt: int
    locations: Sequence[tuple[int, str]]
    schema: pa.Schema
    chunk_bytes: int
    timeout: float | None
    tls_root_certs: bytes | None
    held: tuple[int, ...] | None = None  # see PartitionPusher


def push_partition(batches: Iterator[pa.RecordBatch], p: _Push) -> list[tuple[int, ...]]:
    """Push one partition's rows to every worker; returns one result row per worker
    (:data:`feeders.protocol.PUSH_RESULT_FIELDS`).

    Each Arrow batch is split over the workers (:func:`split_counts`) and the slices are sent
    as chunks interleaved across workers, each chunk tagged with the rows split so far. A node
    that refuses the stream (its pass over the epoch ended, or its main returned) gets nothing
    more; its remaining rows are counted in ``rows_refused``.
    """
    from feeders.flight import call_options, task_client

    w = len(p.locations)
    opts = call_options(p.secret, p.timeout)
    streams: list[_Stream] = []
    cmd = FeedCommand(p.epoch, p.partition, p.attempt).encode()
    for node_id, loc in p.locations:
        s = _Stream(node_id, loc)
        try:
            s.client = task_client(loc, tls_root_certs=p.tls_root_certs)
            s.writer, s.meta = s.client.do_put(
                flight.FlightDescriptor.for_command(cmd), p.schema, options=opts
            )
        except flight.FlightError as e:
            raise _error(p, s, e) from e
        streams.append(s)
    try:
        total = 0
        counts = [0] * w
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if not batch.schema.equals(p.schema, check_metadata=False):
                # same columns, different nullability flags: relabel so the stream is uniform
                batch = pa.RecordBatch.from_arrays(batch.columns, schema=p.schema)
            total += batch.num_rows
            targets = split_counts(total, w, p.partition, p.held)
            offset = 0
            for k, s in enumerate(streams):
                size = targets[k] - counts[k]
                counts[k] = targets[k]
                if size:
                    if s.open:
                        s.pending = deque(_chunks(batch.slice(offset, size), p.chunk_bytes))
                    else:
                        s.refused += size
                offset += size
            seen = ChunkTag(total, _batch_nulls(batch)).encode()
            # one chunk per worker in turn: no worker gets ahead of another by more than a chunk
            while True:
                wrote = False
                for s in streams:
                    if not s.pending:
                        continue
                    chunk = s.pending.popleft()
                    wrote = True
                    if not s.open:
                        s.refused += chunk.num_rows
                        continue
                    try:
                        s.writer.write_with_metadata(chunk, pa.py_buffer(seen))
                    except flight.FlightError as e:
                        _refused_or_raise(p, s, e)
                        s.refused += chunk.num_rows + sum(c.num_rows for c in s.pending)
                        s.pending.clear()
                        continue
                    s.sent += chunk.num_rows
                    s.bytes += chunk.nbytes
                if not wrote:
                    break
        # End every stream before waiting for any reply: a node still taking the last chunks into
        # a full buffer must not hold back the end of the other workers' streams.
        final = pa.py_buffer(ChunkTag(total).encode())
        for s in streams:
            if not s.open:
                continue
            try:
                s.writer.write_metadata(final)
                s.writer.done_writing()
            except flight.FlightError as e:
                _refused_or_raise(p, s, e)
        for s in streams:
            if not s.open:
                continue
            try:
                buf = s.meta.read()
                if buf is not None:
                    s.accepted = PutReply.decode(buf.to_pybytes()).accepted
                s.writer.close()
            except flight.FlightError as e:
                _refused_or_raise(p, s, e)
    except BaseException:
        # the task failed or was cancelled (a failed or interrupted train() call): close the
        # streams here, or Arrow prints "Close() failed: IOError: <the node's refusal>" on
        # the task's stderr for each one when they are collected
        for s in streams:
            if s.open:
                _close_quietly(s.writer)
        raise
    return [(p.partition, p.attempt, s.node, s.sent, s.accepted, s.refused, s.bytes, int(s.was_refused))
            for s in streams]


def _batch_nulls(batch: pa.RecordBatch) -> tuple[tuple[int, int, int], ...]:
    """The columns of ``batch`` that hold nulls, as :class:`ChunkTag` has them (a null count
    Arrow already knows for a clean column, so nothing is scanned for one)."""
    out = []
    for i, col in enumerate(batch.columns):
        inner = sum(level.null_count for level in list_levels(col))
        if col.null_count or inner:
            out.append((i, col.null_count, inner))
    return tuple(out)


def _refused_or_raise(p: _Push, s: _Stream, e: flight.FlightError) -> None:
    """A write or close failed: if the node refused the stream, close it here; else raise."""
    text = str(e)
    why = Refusal.find(text)
    if why is None:
        # the server's status may only show once the stream is closed
        try:
            s.writer.close()
        except flight.FlightError as e2:
            text = str(e2)
            why = Refusal.find(text)
    if why is not None and why.ends_stream_only:
        s.open = False
        s.was_refused = True
        _close_quietly(s.writer)
        return
    if why in (Refusal.SCHEMA, Refusal.STORAGE):
        detail = text[text.index(why.value) + len(why.value):].strip().splitlines()[0]
        # (without gRPC's debug context, which repeats the message)
        if why is Refusal.SCHEMA:
            raise SchemaError(f"{flight_message(detail)} (pushed to node {s.node})") from None
        raise StorageError(f"pushing partition {p.partition} of epoch {p.epoch}: {flight_message(detail)}") from None
    raise _error(p, s, e) from e


def _close_quietly(writer: Any) -> None:
    """Close a stream the node has refused or failed: left to the garbage collector, Arrow
    prints "Close() failed: IOError: <the node's message>" on the task's stderr."""
    try:
        writer.close()
    except (flight.FlightError, pa.ArrowException):
        pass


def _error(p: _Push, s: _Stream, e: Exception) -> FeedError:
    return FeedError(
        f"pushing partition {p.partition} (attempt {p.attempt}) of epoch {p.epoch} to node "
        f"{s.node} at {s.loc} failed: {type(e).__name__}: {flight_message(e)}. If the node "
        f"died, the driver reports its error; otherwise check that executors can reach {s.loc}."
    )


@dataclass
class PartitionPusher:
    """Pushes one partition of one epoch to every worker (``mapInArrow`` function).

    ``epoch=None`` reads the epoch from the job's :data:`EPOCH_PROPERTY` local property (set by
    the driver for each epoch's job), so the same function, and the same DataFrame, can push
    every epoch. ``chunk_bytes`` is the largest message a task sends
    (:func:`feeders.protocol.chunk_bytes`). ``held``: rows each worker (in ``locations``
    order) holds back from a stream's last micro-batch; a partition's extra rows then go to
    those holding back fewest first (:func:`feeders.protocol.split_counts`).
    """

    secret: str
    epoch: int | None
    locations: Sequence[tuple[int, str]]  # (node_id, flight location) of the workers, in order
    schema_ipc: bytes  # the DataFrame's Arrow schema (empty partitions still open streams)
    max_chunk_bytes: int = 1 << 20
    timeout: float | None = None
    tls_root_certs: bytes | None = None
    held: tuple[int, ...] | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from formats.sparktask import prepare_task

        prepare_task()
        tc = TaskContext.get()
        part, attempt = tc.partitionId(), tc.attemptNumber()
        epoch = self.epoch
        if epoch is None:
            prop = tc.getLocalProperty(EPOCH_PROPERTY)
            if prop is None:
                raise FeedError(
                    f"partition {part}: this push job carries no {EPOCH_PROPERTY!r} property; "
                    f"push jobs are started by cluster.train, not run directly."
                )
            epoch = int(prop)
        job = _Push(
            secret=self.secret, epoch=epoch, partition=part, attempt=attempt,
            locations=self.locations, schema=pa.ipc.read_schema(pa.py_buffer(self.schema_ipc)),
            chunk_bytes=self.max_chunk_bytes, timeout=self.timeout,
            tls_root_certs=self.tls_root_certs, held=self.held,
        )
        rows = push_partition(batches, job)
        yield pa.RecordBatch.from_arrays(
            [pa.array([r[i] for r in rows], pa.int64()) for i in range(len(PUSH_RESULT_FIELDS))],
            names=list(PUSH_RESULT_FIELDS),
        )


@dataclass
class PartitionInferrer:
    """Sends one partition to a serving node over ``do_exchange`` and yields its answers."""

    secret: str
    locations: Sequence[tuple[int, str]]
    send_columns: Sequence[str]
    passthrough: Sequence[str]
    output_schema_ipc: bytes
    max_rows: int = 4096
    timeout: float | None = None
    tls_root_certs: bytes | None = None
    # where the output columns and types came from, for errors: "output_schema" (the caller
    # declared them) or "probe" (predict's answer to a 4-row probe batch)
    schema_from: str = "probe"

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from formats.sparktask import prepare_task
        from feeders.flight import call_options, task_client

        prepare_task()
        part = TaskContext.get().partitionId()
        node_id, loc = self.locations[part % len(self.locations)]
        out_schema = pa.ipc.read_schema(pa.py_buffer(self.output_schema_ipc))
        out_names = [f.name for f in out_schema if f.name not in self.passthrough]
        client = task_client(loc, tls_root_certs=self.tls_root_certs)
        desc = flight.FlightDescriptor.for_command(InferCommand(partition=part).encode())
        try:
            # no deadline on the call: a partition may take longer than one answer may
            writer, reader = client.do_exchange(desc, options=call_options(self.secret, None))
        except flight.FlightError as e:
            raise FeedError(
                f"inference: cannot reach node {node_id} at {loc}: {flight_message(e)}. "
                f"{_INFER_HINT}"
            ) from e
        begun = False
        seq = 0
        watch = _AnswerDeadline(reader, self.timeout)
        try:
            for batch in batches:
                for start in range(0, batch.num_rows, self.max_rows):
                    chunk = batch.slice(start, self.max_rows)
                    request = pa.RecordBatch.from_arrays(
                        [chunk.column(c) for c in self.send_columns], names=list(self.send_columns)
                    )
                    watch.waiting()
                    if not begun:
                        writer.begin(request.schema)
                        begun = True
                    writer.write_with_metadata(request, pa.py_buffer(str(seq).encode()))
                    reply = reader.read_chunk()
                    watch.answered()
                    got = reply.app_metadata.to_pybytes().decode() if reply.app_metadata else ""
                    if got != str(seq) or reply.data is None or reply.data.num_rows != chunk.num_rows:
                        raise FeedError(
                            f"inference: node {node_id} answered request {seq} of partition "
                            f"{part} with {got!r} / "
                            f"{None if reply.data is None else reply.data.num_rows} rows; "
                            f"expected request {seq} with {chunk.num_rows} rows."
                        )
                    seq += 1
                    yield _assemble(chunk, reply.data, self.passthrough, out_names, out_schema, node_id,
                                    self.schema_from)
            if begun:
                writer.done_writing()
            writer.close()
            writer = None
        except Exception as e:
            if watch.expired:  # however the cancelled call surfaced (read or write)
                raise FeedError(
                    f"inference: node {node_id} did not answer request {seq} of partition {part} "
                    f"(up to max_rows={self.max_rows} rows) within feed_timeout={self.timeout:g} s. "
                    f"Its main is not in ctx.serve (still busy, or it never calls it), or predict "
                    f"takes longer than that for one request: lower max_rows or raise "
                    f"feed_timeout. cluster.metrics() says which nodes are serving."
                ) from e
            if not isinstance(e, flight.FlightError):
                raise
            # a node that answered with predict's error (or a misfit answer) needs no guess
            # about dead nodes or lazy DataFrames; one that is gone or stopping does
            answered = isinstance(e, flight.FlightServerError) and Refusal.NODE_STOPPING.value not in str(e)
            found = _null_row(chunk, self.send_columns, self.passthrough) if answered and begun else ""
            raise FeedError(
                f"inference of partition {part} on node {node_id} at {loc} failed: "
                f"{flight_message(e)}" + ("" if answered else f". {_INFER_HINT}") + found
            ) from e
        finally:
            watch.close()
            if writer is not None:  # a failure or an early stop (a limit()): once per retry
                _close_quietly(writer)


class _AnswerDeadline:
    """Cancels an inference exchange once one answer has been awaited ``timeout`` seconds
    (None: never). A deadline on the whole call would also end a long partition that is
    answered steadily; this bounds each request instead."""

    def __init__(self, reader: Any, timeout: float | None) -> None:
        import threading

        self._reader = reader
        self._timeout = timeout
        self._since: float | None = None
        self.expired = False
        self._done = threading.Event()
        if timeout is not None:
            threading.Thread(target=self._watch, name="dataplane-answer-deadline", daemon=True).start()

    def waiting(self) -> None:
        import time

        self._since = time.monotonic()

    def answered(self) -> None:
        self._since = None

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        import time

        assert self._timeout is not None
        tick = min(0.5, self._timeout / 4)
        while not self._done.wait(tick):
            since = self._since
            if since is not None and time.monotonic() - since > self._timeout:
                self.expired = True
                try:
                    self._reader.cancel()
                except Exception:  # noqa: BLE001 - the call may have ended meanwhile
                    pass
                return


def _first_overflow(before: pa.Array, after: pa.Array) -> float | None:
    """A finite float of ``before`` that the cast made infinite (float64 to float32), or None."""
    import pyarrow.compute as pc

    from formats.schema import leaf_values

    src, dst = leaf_values(before), leaf_values(after)
    if not (pa.types.is_floating(src.type) and pa.types.is_floating(dst.type)) or len(src) != len(dst):
        return None
    grew = pc.and_(pc.is_inf(dst), pc.invert(pc.is_inf(src)))
    if not pc.any(grew).as_py():
        return None
    return src.filter(grew)[0].as_py()


def _null_row(chunk: pa.RecordBatch, send: Sequence[str], passthrough: Sequence[str]) -> str:
    """For a request a node refused for its nulls (it sees only the model's inputs, and names
    the row by its place in the request): the first such row's passthrough values, by which
    the user can find it. Empty when there is no passthrough or no null."""
    from formats.schema import first_null_row, null_row_note

    rows = [r for r in (first_null_row(chunk.column(c)) for c in send) if r is not None]
    if not passthrough or not rows:
        return ""
    return null_row_note(chunk, min(rows), passthrough)


def _assemble(chunk, reply, passthrough, out_names, out_schema, node_id, schema_from) -> pa.RecordBatch:  # type: ignore[no-untyped-def]
    cols = [chunk.column(c) for c in passthrough]
    for name in out_names:
        idx = reply.schema.get_field_index(name)
        if idx < 0:
            if schema_from == "output_schema":
                why = (f"output_schema declares {out_names}; declare only the outputs predict "
                       f"returns, or return {name!r} too")
            else:
                why = ("it returned them for the first (probe) batch; predict must return the same "
                       "keys for every batch")
            raise FeedError(
                f"inference: node {node_id}'s predict did not return output {name!r} for this "
                f"batch (it returned {reply.schema.names}); {why}."
            )
        cols.append(reply.column(idx))
    arrays = []
    for col, want in zip(cols, out_schema):
        if col.type != want.type:
            col = _conform_answer(col, want, node_id, schema_from)
        arrays.append(col)
    return pa.RecordBatch.from_arrays(arrays, schema=out_schema)


def _conform_answer(col: pa.Array, want: pa.Field, node_id: int, schema_from: str = "probe") -> pa.Array:
    """``col`` as the output column's type: cast, and an answer with more list levels than
    declared (predict returned ``[rows, 2, 3]`` for a declared ``list<float>``) flattened to
    the declared depth, row by row. A float that the cast would turn into infinity is an
    error, as integer overflow is."""
    from formats.schema import is_list_type, list_depth, list_offsets

    while list_depth(col.type) > max(list_depth(want.type), 1):
        inner = col.values  # whole child arrays: offsets index them unrebased
        col = pa.ListArray.from_arrays(pa.array(list_offsets(inner)[list_offsets(col)]), inner.values)
    source = ("the type output_schema declares" if schema_from == "output_schema"
              else "the type predict returned for the first (probe) batch")
    fix = ("return that type, or declare what predict returns in output_schema"
           if schema_from != "output_schema" else "return that type, or declare another in output_schema")
    try:
        out = col.cast(want.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SchemaError(
            f"inference: node {node_id}'s predict returned output {want.name!r} as {col.type}, "
            f"which does not convert to {want.type}, {source} ({e}); {fix}."
        ) from None
    big = _first_overflow(col, out)
    if big is not None:
        depth = list_depth(want.type)  # the wider type at the output's own depth
        leaf = want.type
        while is_list_type(leaf):
            leaf = leaf.value_type
        wider = "pa.float64()" if pa.types.is_floating(leaf) else "pa.int64()"
        raise SchemaError(
            f"inference: node {node_id}'s predict returned output {want.name!r} as {col.type} "
            f"with the value {big!r}, beyond the range of {want.type}, {source}; {fix} "
            f"(e.g. {'pa.list_(' * depth}{wider}{')' * depth})."
        )
    return out
