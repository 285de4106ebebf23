"""Executor side of the push data plane: Spark partitions into the nodes' Flight servers.

Both classes are the functions given to ``DataFrame.mapInArrow`` (so they also run under Spark
Connect). They are small picklable objects; each task opens its own Flight clients.

Balancing: every partition is split over the W workers row by row in contiguous slices, so that
after every batch each worker's share of the partition is ``T // W`` or ``T // W + 1`` of the
``T`` rows seen so far. Which workers get the extra rows rotates with the partition id.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from dataplane.errors import FeedError

__all__ = [
    "PartitionPusher",
    "PartitionInferrer",
    "PUSH_RESULT_SCHEMA",
    "EPOCH_PROPERTY",
    "split_counts",
]

logger = logging.getLogger(__name__)

PUSH_RESULT_SCHEMA = (
    "partition long, attempt long, node_id long, rows_sent long, rows_accepted long, "
    "rows_unconsumed long, bytes_sent long"
)
_CONSUMER_FINISHED = "[dataplane:consumer-finished]"
_NODE_HINT = (
    "If the node died, cluster.metrics() and cluster.shutdown() on the driver report its error "
    "(a NodeError with its traceback); otherwise check that executors can reach it."
)
# Spark job-local property carrying the epoch, so one push DataFrame serves every epoch.
EPOCH_PROPERTY = "dataplane.push.epoch"


def split_counts(total: int, workers: int, rotation: int) -> list[int]:
    """Each worker's share of the first ``total`` rows of a partition (differ by at most 1)."""
    base, extra = divmod(total, workers)
    return [base + (1 if (k - rotation) % workers < extra else 0) for k in range(workers)]


def _chunks(batch: pa.RecordBatch, max_bytes: int) -> Iterator[pa.RecordBatch]:
    n = batch.num_rows
    if n == 0:
        return
    per_row = max(1, batch.nbytes // n)
    step = max(1, max_bytes // per_row)
    for start in range(0, n, step):
        yield batch.slice(start, step)


@dataclass
class PartitionPusher:
    """Pushes one partition of one epoch to every worker (``mapInArrow`` function).

    ``epoch=None`` reads the epoch from the job's :data:`EPOCH_PROPERTY` local property (set by
    the driver for each epoch's job), so the same function, and the same DataFrame, can push
    every epoch.
    """

    secret: str
    epoch: int | None
    locations: Sequence[tuple[int, str]]  # (node_id, flight location) of the workers, in order
    schema_ipc: bytes  # the DataFrame's Arrow schema (empty partitions still open streams)
    max_chunk_bytes: int = 1 << 20
    timeout: float | None = None
    tls_root_certs: bytes | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from dataplane.executor import prepare_task
        from dataplane.rpc import call_options, task_client

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
        schema = pa.ipc.read_schema(pa.py_buffer(self.schema_ipc))
        w = len(self.locations)
        opts = call_options(self.secret, self.timeout)
        streams = []
        for node_id, loc in self.locations:
            cmd = {"kind": "feed", "epoch": epoch, "partition": part, "attempt": attempt}
            try:
                client = task_client(loc, tls_root_certs=self.tls_root_certs)
                writer, meta = client.do_put(
                    flight.FlightDescriptor.for_command(json.dumps(cmd)), schema, options=opts
                )
            except flight.FlightError as e:
                raise self._error(node_id, loc, part, attempt, epoch, e) from e
            streams.append({"node": node_id, "loc": loc, "client": client, "writer": writer,
                            "meta": meta, "sent": 0, "bytes": 0, "unconsumed": 0, "open": True})
        total = 0
        counts = [0] * w
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if not batch.schema.equals(schema, check_metadata=False):
                # same columns, different nullability flags: relabel so the stream is uniform
                batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
            total += batch.num_rows
            targets = split_counts(total, w, part)
            offset = 0
            for k, s in enumerate(streams):
                size = targets[k] - counts[k]
                counts[k] = targets[k]
                piece = batch.slice(offset, size)
                offset += size
                if not size:
                    continue
                if not s["open"]:
                    s["unconsumed"] += size
                    continue
                sent_piece = 0
                for chunk in _chunks(piece, self.max_chunk_bytes):
                    try:
                        s["writer"].write_batch(chunk)
                    except flight.FlightError as e:
                        if _CONSUMER_FINISHED in str(e) or self._finished(s):
                            s["open"] = False
                            s["unconsumed"] += size - sent_piece
                            break
                        raise self._error(s["node"], s["loc"], part, attempt, epoch, e) from e
                    sent_piece += chunk.num_rows
                    s["sent"] += chunk.num_rows
                    s["bytes"] += chunk.nbytes
        rows_out = []
        for s in streams:
            accepted = 0
            if s["open"]:
                try:
                    s["writer"].done_writing()
                    buf = s["meta"].read()
                    if buf is not None:
                        accepted = int(json.loads(buf.to_pybytes())["accepted"])
                    s["writer"].close()
                except flight.FlightError as e:
                    if _CONSUMER_FINISHED in str(e):
                        s["open"] = False
                    else:
                        raise self._error(s["node"], s["loc"], part, attempt, epoch, e) from e
            rows_out.append(
                (part, attempt, s["node"], s["sent"], accepted, s["unconsumed"], s["bytes"])
            )
        names = ["partition", "attempt", "node_id", "rows_sent", "rows_accepted",
                 "rows_unconsumed", "bytes_sent"]
        yield pa.RecordBatch.from_arrays(
            [pa.array([r[i] for r in rows_out], pa.int64()) for i in range(len(names))], names=names
        )

    def _finished(self, s) -> bool:  # type: ignore[no-untyped-def]
        """After a write error, ask the stream for the server's status message."""
        try:
            s["writer"].close()
        except flight.FlightError as e:
            return _CONSUMER_FINISHED in str(e)
        return False

    def _error(self, node_id: int, loc: str, part: int, attempt: int, epoch: int, e: Exception) -> FeedError:
        return FeedError(
            f"pushing partition {part} (attempt {attempt}) of epoch {epoch} to node "
            f"{node_id} at {loc} failed: {type(e).__name__}: {e}. If the node died, the driver "
            f"reports its error; otherwise check that executors can reach {loc}."
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

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        from dataplane.executor import prepare_task
        from dataplane.rpc import call_options, task_client

        prepare_task()
        part = TaskContext.get().partitionId()
        node_id, loc = self.locations[part % len(self.locations)]
        out_schema = pa.ipc.read_schema(pa.py_buffer(self.output_schema_ipc))
        out_names = [f.name for f in out_schema if f.name not in self.passthrough]
        client = task_client(loc, tls_root_certs=self.tls_root_certs)
        desc = flight.FlightDescriptor.for_command(json.dumps({"kind": "infer", "partition": part}))
        try:
            writer, reader = client.do_exchange(desc, options=call_options(self.secret, self.timeout))
        except flight.FlightError as e:
            raise FeedError(
                f"inference: cannot reach node {node_id} at {loc}: {e}. {_NODE_HINT}"
            ) from e
        begun = False
        seq = 0
        try:
            for batch in batches:
                for start in range(0, batch.num_rows, self.max_rows):
                    chunk = batch.slice(start, self.max_rows)
                    request = pa.RecordBatch.from_arrays(
                        [chunk.column(c) for c in self.send_columns], names=list(self.send_columns)
                    )
                    if not begun:
                        writer.begin(request.schema)
                        begun = True
                    writer.write_with_metadata(request, pa.py_buffer(str(seq).encode()))
                    reply = reader.read_chunk()
                    got = reply.app_metadata.to_pybytes().decode() if reply.app_metadata else ""
                    if got != str(seq) or reply.data is None or reply.data.num_rows != chunk.num_rows:
                        raise FeedError(
                            f"inference: node {node_id} answered request {seq} of partition "
                            f"{part} with {got!r} / "
                            f"{None if reply.data is None else reply.data.num_rows} rows; "
                            f"expected request {seq} with {chunk.num_rows} rows."
                        )
                    seq += 1
                    yield _assemble(chunk, reply.data, self.passthrough, out_names, out_schema, node_id)
            if begun:
                writer.done_writing()
            writer.close()
        except flight.FlightError as e:
            raise FeedError(
                f"inference of partition {part} on node {node_id} at {loc} failed: {e}. "
                f"{_NODE_HINT}"
            ) from e


def _assemble(chunk, reply, passthrough, out_names, out_schema, node_id) -> pa.RecordBatch:  # type: ignore[no-untyped-def]
    cols = [chunk.column(c) for c in passthrough]
    for name in out_names:
        idx = reply.schema.get_field_index(name)
        if idx < 0:
            raise FeedError(
                f"inference: node {node_id}'s predict did not return output {name!r} for this "
                f"batch (it returned {reply.schema.names}); predict must return the same keys "
                f"for every batch."
            )
        cols.append(reply.column(idx))
    arrays = []
    for col, field in zip(cols, out_schema):
        arrays.append(col if col.type == field.type else col.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=out_schema)
