"""Driver side of ``cluster.train`` and ``cluster.inference``.

The driver never touches the data: it announces an epoch to the workers, runs a ``mapInArrow``
job whose tasks push straight to the nodes, then reads back what each node accepted and tells
every worker how many rows to yield (the minimum, so all yield the same number of batches).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import pyarrow as pa

from dataplane.errors import FeedError, SchemaError
from dataplane.sparkjobs import SparkJob, arrow_schema_of, is_connect, sample_arrow

if TYPE_CHECKING:  # pragma: no cover
    from dataplane.cluster import Cluster

__all__ = ["FeedReport", "train", "inference"]

logger = logging.getLogger(__name__)


@dataclass
class FeedReport:
    """What ``cluster.train`` pushed.

    Attributes:
        rows: rows pushed in all epochs (``df.count() * num_epochs`` when nothing failed).
        bytes: Arrow payload bytes pushed.
        seconds: wall time of the feed.
        rows_per_node: node id -> rows that node received (after dedupe of retried tasks).
        dropped_for_balance: rows received but not yielded, so every worker yields the same
            number of rows (and batches) per epoch.
        rows_unconsumed: rows not delivered because a node's ``main`` had already returned.
        epochs: epoch ids used for this feed.
        messages: notes for the user (e.g. a node that stopped consuming early).
    """

    rows: int
    bytes: int
    seconds: float
    rows_per_node: dict[int, int]
    dropped_for_balance: int
    rows_unconsumed: int = 0
    epochs: list[int] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def _array_shapes(df: Any, schema: pa.Schema) -> dict[str, tuple[int, ...]]:
    """Per-row lengths of top-level array columns whose length is the same in every row.

    One aggregate query over ``df``; such columns are fed as dense ``[batch, n]`` tensors, the
    others as ragged tensors.
    """
    from pyspark.sql import functions as F

    lists = [
        f.name
        for f in schema
        if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
        if not (pa.types.is_list(f.type.value_type) or pa.types.is_large_list(f.type.value_type))
    ]
    if not lists:
        return {}
    aggs = []
    for i, name in enumerate(lists):
        size = F.size(F.col(f"`{name}`"))
        aggs += [F.min(size).alias(f"mn{i}"), F.max(size).alias(f"mx{i}")]
    row = df.agg(*aggs).collect()[0]
    out = {}
    for i, name in enumerate(lists):
        mn, mx = row[f"mn{i}"], row[f"mx{i}"]
        if mn is not None and mn == mx and mn > 0:
            out[name] = (int(mn),)
    return out


def _each(cluster: "Cluster", nodes: Sequence[Any], name: str, body: Callable[[Any], dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Send one control action to every node at once; replies by node id (first error raised).

    A node busy converting its tail of an epoch answers in a few ms; asked one after another,
    those waits added up at every epoch boundary.
    """
    if len(nodes) <= 1:
        return {n.node_id: cluster._node_action(n, name, body(n)) for n in nodes}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="dataplane-action") as pool:
        futures = [(n, pool.submit(cluster._node_action, n, name, body(n))) for n in nodes]
        return {n.node_id: f.result() for n, f in futures}


def _push_frame(cluster: "Cluster", df: Any, workers: Sequence[Any], schema_ipc: bytes, epoch: int) -> tuple[Any, dict[str, str]]:
    """The push job's DataFrame for ``epoch`` and the job-local properties to run it with.

    On classic Spark the epoch travels as a job-local property, so one ``mapInArrow``
    DataFrame serves every epoch of the same ``df`` and workers: building it costs tens of
    py4j calls (about 60 ms), every epoch otherwise. Spark Connect has no job-local
    properties: the epoch is baked into a new DataFrame each time.
    """
    from feeders.push import EPOCH_PROPERTY, PUSH_RESULT_SCHEMA, PartitionPusher

    locations = [(n.node_id, n.flight_location) for n in workers]
    connect = is_connect(cluster.spark)

    def frame(fixed_epoch: int | None) -> Any:
        pusher = PartitionPusher(
            secret=cluster._secret,
            epoch=fixed_epoch,
            locations=locations,
            schema_ipc=schema_ipc,
            max_chunk_bytes=cluster._max_chunk_bytes,
            tls_root_certs=cluster._tls_root,
        )
        return df.mapInArrow(pusher, PUSH_RESULT_SCHEMA)

    if connect:
        return frame(epoch), {}
    key = (id(df), tuple(locations), schema_ipc)
    cached = cluster._push_frame
    if cached is None or cached[0] != key or cached[1]() is not df:
        import weakref

        try:
            ref = weakref.ref(df)
        except TypeError:  # not weak-referenceable: no reuse
            return frame(None), {EPOCH_PROPERTY: str(epoch)}
        cluster._push_frame = (key, ref, frame(None))
    return cluster._push_frame[2], {EPOCH_PROPERTY: str(epoch)}


def _wait(cluster: "Cluster", job: SparkJob, timeout: float, what: str) -> Any:
    """Wait for ``job`` while watching the nodes; cancel it if a node fails or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return job.future.result(timeout=0.25)
        except TimeoutError:
            pass
        except Exception as e:
            # The job failed: if a node is behind it, say so. A node that cannot be reached may
            # be dead: give the heartbeat monitor long enough to decide.
            text = str(e)
            unreachable = any(
                k in text for k in ("Unavailable", "unreachable", "Connection refused", "failed to connect")
            )
            err = cluster._node_failure(grace=cluster._node_timeout + 2.0 if unreachable else 3.0)
            if err is not None:
                raise err from e
            raise FeedError(f"{what} failed: {type(e).__name__}: {_first_line(e)}") from e
        err = cluster._node_failure()
        if err is not None:
            job.cancel()
            raise err
        if time.monotonic() > deadline:
            job.cancel()
            raise FeedError(
                f"{what} did not finish within feed_timeout={timeout:.0f} s; the job was "
                f"cancelled. Raise feed_timeout for bigger data, or check that the nodes consume "
                f"their dataset (cluster.metrics() shows each node's buffer and stall time)."
            )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "FeedError" in line or "failed to start" in line:
            return line.strip()
    return text.splitlines()[0][:2000] if text else repr(e)


def train(
    cluster: "Cluster",
    df: Any,
    *,
    num_epochs: int,
    feed_timeout: float,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> FeedReport:
    from pyspark.sql.types import StructType

    if not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be an int >= 1, got {num_epochs!r}")
    if not hasattr(df, "mapInArrow") or not isinstance(getattr(df, "schema", None), StructType):
        raise TypeError(f"train() needs a Spark DataFrame, got {type(df).__name__}")
    schema = arrow_schema_of(df)
    from formats.schema import column_specs

    column_specs(schema)  # unsupported column types fail here, naming the column
    shapes = cluster._shapes_of(df, lambda: _array_shapes(df, schema))
    schema_ipc = schema.serialize().to_pybytes()
    t0 = time.monotonic()
    report = FeedReport(0, 0, 0.0, {}, 0)
    for _ in range(num_epochs):
        workers = cluster._live_workers()
        if not workers:
            report.messages.append(
                "every worker's main has returned; the remaining epochs were not pushed"
            )
            logger.warning(report.messages[-1])
            break
        epoch = cluster._next_epoch()
        report.epochs.append(epoch)
        begin = {"epoch": epoch, "schema": schema_ipc.hex(),
                 "shapes": {k: list(v) for k, v in shapes.items()}}
        _each(cluster, workers, "begin_epoch", lambda n: begin)
        pushed, properties = _push_frame(cluster, df, workers, schema_ipc, epoch)
        job = SparkJob(cluster.spark, f"dataplane: push epoch {epoch}", pushed.collect, properties)
        rows = _wait(cluster, job, feed_timeout, f"pushing epoch {epoch}")
        sent: dict[int, int] = {}
        unconsumed = 0
        for r in rows:
            sent[r["node_id"]] = sent.get(r["node_id"], 0) + r["rows_sent"]
            unconsumed += r["rows_unconsumed"]
            report.bytes += r["bytes_sent"]
        replies = _each(cluster, workers, "epoch_rows", lambda n: {"epoch": epoch})
        received = {nid: int(r["rows"]) for nid, r in replies.items()}
        # asked of the nodes themselves: their "done" report may still be on its way
        failed = sorted(nid for nid, r in replies.items() if r.get("main") == "failed")
        if failed:
            err = cluster._node_failure(grace=10.0)
            raise err if err is not None else FeedError(
                f"epoch {epoch}: the main of node(s) {failed} raised while data was being pushed "
                f"(its traceback has not reached the driver yet; cluster.shutdown() reports it)."
            )
        finished = {nid for nid, r in replies.items() if r.get("main") != "running"}
        consuming = [n for n in workers if n.node_id not in finished]
        for n in workers:
            got, pushed = received[n.node_id], sent.get(n.node_id, 0)
            if n.node_id in finished:
                # written into a stream the node had stopped reading: never consumed
                unconsumed += max(pushed - got, 0)
            elif got < pushed:
                raise FeedError(
                    f"epoch {epoch}: node {n.node_id} acknowledged {got} rows but the pushing "
                    f"tasks sent it {pushed}; rows were lost."
                )
        report.rows += sum(sent.values()) + sum(r["rows_unconsumed"] for r in rows)
        report.rows_unconsumed += unconsumed
        limit = min((received[n.node_id] for n in consuming), default=0)
        _each(cluster, consuming, "end_epoch", lambda n: {"epoch": epoch, "limit": limit})
        for n in consuming:
            report.dropped_for_balance += received[n.node_id] - limit
        for nid, r in received.items():
            report.rows_per_node[nid] = report.rows_per_node.get(nid, 0) + r
        if unconsumed:
            gone = sorted(set(n.node_id for n in workers) - set(n.node_id for n in consuming))
            msg = (
                f"epoch {epoch}: node(s) {gone} returned from main while data was still being "
                f"pushed; {unconsumed} row(s) were not consumed."
            )
            report.messages.append(msg)
            logger.warning(msg)
        if progress is not None:
            progress({"epoch": epoch, "rows": report.rows, "seconds": time.monotonic() - t0})
    report.seconds = time.monotonic() - t0
    return report


def inference(
    cluster: "Cluster",
    df: Any,
    *,
    passthrough: Sequence[str],
    columns: Sequence[str] | None,
    output_schema: pa.Schema | None,
    feed_timeout: float,
    max_rows: int,
) -> Any:
    """Build the lazily evaluated output DataFrame of ``cluster.inference``."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from feeders.push import PartitionInferrer

    in_schema = arrow_schema_of(df)
    passthrough = list(passthrough)
    for c in passthrough:
        if c not in in_schema.names:
            raise SchemaError(
                f"passthrough column {c!r} is not in the DataFrame; its columns are {in_schema.names}."
            )
    send = list(columns) if columns is not None else list(in_schema.names)
    for c in send:
        if c not in in_schema.names:
            raise SchemaError(f"column {c!r} is not in the DataFrame; its columns are {in_schema.names}.")
    servers = cluster._live_workers()
    if not servers:
        raise FeedError("no chief or worker node is running main, so nothing can answer inference.")
    if output_schema is None:
        output_schema = _probe_output_schema(cluster, df, servers[0], send, feed_timeout)
    clash = [f.name for f in output_schema if f.name in passthrough]
    if clash:
        raise SchemaError(
            f"predict returns column(s) {clash}, which are also passthrough columns; rename the "
            f"outputs or drop them from passthrough."
        )
    fields = [in_schema.field(c) for c in passthrough] + list(output_schema)
    out_schema = pa.schema(fields)
    inferrer = PartitionInferrer(
        secret=cluster._secret,
        locations=[(n.node_id, n.flight_location) for n in servers],
        send_columns=send,
        passthrough=passthrough,
        output_schema_ipc=out_schema.serialize().to_pybytes(),
        max_rows=max_rows,
        tls_root_certs=cluster._tls_root,
    )
    return df.mapInArrow(inferrer, from_arrow_schema(out_schema))


def _probe_output_schema(cluster, df, node, send, timeout) -> pa.Schema:  # type: ignore[no-untyped-def]
    """Ask one node to answer a few rows, to learn predict's output columns and types."""
    import json

    import pyarrow.flight as flight

    from dataplane.rpc import call_options, connect

    sample = sample_arrow(df.select(*[f"`{c}`" for c in send]), 4)
    if sample.num_rows == 0:
        raise FeedError(
            "inference on an empty DataFrame: there is no row to learn predict's output columns "
            "from; pass output_schema= (a pyarrow.Schema) to cluster.inference."
        )
    client = connect(node.flight_location, tls_root_certs=cluster._tls_root)
    desc = flight.FlightDescriptor.for_command(json.dumps({"kind": "infer", "probe": True}))
    writer, reader = client.do_exchange(desc, options=call_options(cluster._secret, timeout))
    batch = sample.combine_chunks().to_batches()[0]
    writer.begin(batch.schema)
    writer.write_with_metadata(batch, pa.py_buffer(b"0"))
    try:
        reply = reader.read_chunk()
    except flight.FlightError as e:
        raise FeedError(f"inference: node {node.node_id} could not answer a probe batch: {e}") from e
    writer.done_writing()
    writer.close()
    client.close()
    schema = reply.data.schema
    # Spark has no unsigned or half types: widen them so the output DataFrame can hold them.
    fields = []
    for f in schema:
        t = f.type
        if pa.types.is_unsigned_integer(t):
            t = pa.int64()
        elif pa.types.is_float16(t):
            t = pa.float32()
        elif pa.types.is_list(t) and pa.types.is_float16(t.value_type):
            t = pa.list_(pa.float32())
        fields.append(pa.field(f.name, t))
    return pa.schema(fields)
