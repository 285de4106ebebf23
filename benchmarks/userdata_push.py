"""The push scenario on the user's data (``--data``): ours against the two ceilings, and stages.

Spark reads the data set from the URL once, untimed, into a cached, materialised DataFrame
(:func:`read_frame`): Parquet with ``spark.read.parquet`` (local, ``file://``, ``hdfs://``) or,
for ``s3://`` (this Spark has no S3A connector), with Spark tasks reading the files through
``pyarrow.fs`` (endpoint and keys from the AWS variables); TFRecords with
``formats.read_tfrecords``. ``--columns`` selects, ``--limit`` takes the first rows (then
repartitioned back to the partitions the read gave, as a user's DataFrame would have).

Paths, as in :mod:`benchmarks.push`: ``flight-push`` (ours: two nodes iterating
``ctx.dataset(shapes=--shapes)``), ``spark-mapinarrow`` and ``flight-raw`` (ceilings). TFoS is
left out: it feeds one Python row at a time and measures nothing about the user's data.

Breakdown (:mod:`benchmarks.breakdown`), each part the extra median time of the next rung:
``spark_to_arrow`` (bare ``mapInArrow``), ``transport`` (``flight-raw``: the same job doing
``do_put`` into a server that drops the data), ``node_buffer`` (the stage ``node-buffer``:
``cluster.train`` into nodes that drain their feed buffer with ``feeders.source.iterate_epoch``
and make no tensors) and ``tensors`` (ours whole: Arrow to tensors and ``tf.data`` on the node).
The nodes' counters (``cluster.metrics()`` after the repetitions: stall seconds, buffer peak)
and the last ``FeedReport`` go with it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from benchmarks.breakdown import Step, ladder
from benchmarks.paths import BenchPath
from benchmarks.paths import COUNT_SCHEMA, count_partition
from benchmarks.push import FlightPushPath, RawFlightPath, _write_json

__all__ = ["build", "breakdown", "read_frame", "drain_main"]

_STAGE_TIMEOUT = 180.0


class _ReadParquetFiles:
    """``mapInArrow`` function: read the Parquet files whose indexes arrive, with pyarrow.

    Carries the driver's ``pyarrow.fs`` filesystem (pyarrow pickles its options, keys
    included): the executors' Python may have started before the AWS variables were set.
    """

    def __init__(self, filesystem: Any, files: list[str], columns: list[str], hive: Any) -> None:
        self.filesystem = filesystem
        self.files = files
        self.columns = columns
        self.hive = hive  # formats.hive.HiveColumns: columns kept in key=value directory names

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        from formats.hive import add_constant_columns

        fs = self.filesystem
        in_files = self.hive.in_files(self.columns)
        for b in batches:
            for i in b.column(0).to_pylist():
                path = self.files[i]
                with fs.open_input_file(path) as f:
                    for batch in pq.ParquetFile(f).iter_batches(batch_size=8192, columns=in_files):
                        if self.hive:
                            batch = add_constant_columns(batch, self.hive.values[path], self.columns)
                        yield batch


def read_frame(spark: Any, d: Any) -> Any:
    """The data set as a cached, materialised DataFrame of the selected columns (see module doc)."""
    cols = d.columns
    if d.format == "parquet":
        if d.location.scheme in ("file", "hdfs"):
            from formats.sparkframe import read_parquet

            df = read_parquet(spark, d.spec.url)  # the files ours read (no README), as ours
        else:
            from pyspark.sql.pandas.types import from_arrow_schema

            schema = pa.schema([d.plan.schema.field(c) for c in cols])
            ids = spark.range(0, len(d.files), 1, numPartitions=len(d.files))
            df = ids.mapInArrow(_ReadParquetFiles(d.location.filesystem, list(d.files), cols, d.plan.hive), from_arrow_schema(schema))
    else:
        import formats

        df = formats.read_tfrecords(spark, d.spec.url)
    if d.format == "parquet" and d.plan.hive:
        # Spark infers a partition key of small integers as int32; our readers (and the s3://
        # branch above) give int64, as formats.hive documents: one type wherever the files live
        from pyspark.sql.pandas.types import from_arrow_type

        df = df.withColumns({f.name: df[f.name].cast(from_arrow_type(f.type))
                             for f in d.plan.hive.fields if f.name in cols})
    df = df.select(*cols)
    if d.spec.limit is not None and d.spec.limit < d.total_rows:
        parts = df.rdd.getNumPartitions()
        df = df.limit(d.spec.limit).repartition(max(1, parts))
    df = df.cache()
    n = df.count()
    if n != d.rows:
        raise RuntimeError(f"Spark read {n} rows from {d.spec.url}, the files hold {d.rows}")
    return df


def _num_rows(table: pa.Table) -> int:
    return table.num_rows


def drain_main(args: dict[str, Any], ctx: Any) -> None:
    """A node's ``main`` for the ``node-buffer`` stage: drain each pushed epoch, no tensors.

    Reads the node's feed buffer as ``ctx.dataset`` does (``ctx.next_pushed_epoch``: the same
    batch cutting and equal-batch limit) but hands out row counts instead of tensors. Writes
    ``<role><index>-epoch<e>.json`` like :func:`benchmarks.push.count_main`.
    """
    out = Path(args["dir"])
    epoch = 0
    while True:
        asked = time.perf_counter()
        chunks = ctx.next_pushed_epoch(args["batch_size"], _num_rows)
        if chunks is None:  # the node is stopping
            return
        rows = sum(chunks)
        _write_json(out / f"{ctx.role}{ctx.index}-epoch{epoch}.json",
                    {"rows": rows, "seconds": time.perf_counter() - asked})
        epoch += 1


def _drain_unavailable() -> str | None:
    """Why the node-buffer stage cannot run against this checkout's node API, or None."""
    try:
        from dataplane.node.context import NodeContext
    except Exception as exc:  # noqa: BLE001 - any failure: the stage is skipped, with why
        return f"the node's context cannot be imported: {type(exc).__name__}: {exc}"
    if not callable(getattr(NodeContext, "next_pushed_epoch", None)):
        return ("the node's context has no next_pushed_epoch(rows, convert); "
                "benchmarks/userdata_push.drain_main needs updating")
    return None


def build(env: Any) -> list[BenchPath]:
    """The push paths and the node-buffer stage on the user's DataFrame."""
    d = env.described
    nbytes = d.rows * d.row_bytes
    df = env.dataframe()
    shapes = {k: list(v) for k, v in d.spec.shapes.items()} or None
    ours = FlightPushPath(env, batch_size=d.spec.batch_size, shapes=shapes, keep_metrics=True,
                          fill_values=d.spec.fill or None)
    raw = RawFlightPath(env)
    paths = [
        BenchPath("flight-push", ours, kind="ours", nbytes=nbytes, close=ours.close),
        BenchPath("spark-mapinarrow",
                  lambda: sum(r.n for r in df.mapInArrow(count_partition, COUNT_SCHEMA).collect()),
                  kind="ceiling", nbytes=nbytes),
        BenchPath("flight-raw", raw, kind="ceiling", nbytes=nbytes, close=raw.close),
    ]
    reason = _drain_unavailable()
    if reason:
        paths.append(BenchPath("node-buffer", lambda: 0, kind="stage", unavailable=reason))
        stage = None
    else:
        stage = FlightPushPath(env, batch_size=d.spec.batch_size, main=drain_main, name="drain",
                               feed_timeout=_STAGE_TIMEOUT)
        paths.append(BenchPath("node-buffer", stage, kind="stage", close=stage.close))
    env.ours_path = ours
    return paths


def _report_json(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None
    fields = ("rows", "bytes", "seconds", "rows_per_node", "dropped_for_balance", "rows_unconsumed", "spark_jobs")
    out = {f: getattr(report, f) for f in fields if hasattr(report, f)}
    return json.loads(json.dumps(out, default=str))


def breakdown(env: Any, out: dict[str, Any]) -> dict[str, Any] | None:
    """Where flight-push's time went, with the nodes' own counters."""
    ours = getattr(env, "ours_path", None)
    waits = ours.waits[-out["reps"]:] if ours is not None else []
    firsts = ours.firsts[-out["reps"]:] if ours is not None else []
    metrics = None
    if ours is not None and ours.final_metrics is not None:
        metrics = {str(k): v for k, v in ours.final_metrics.items()}
    extra = {
        "node_metrics": json.loads(json.dumps(metrics, default=str)) if metrics is not None else None,
        "node_metrics_note": "cluster.metrics() after the warm-up and every repetition (cumulative)",
        "last_feed_report": _report_json(ours.last_report if ours is not None else None),
        "partitions": env.dataframe().rdd.getNumPartitions(),
    }
    return ladder(out, "flight-push", [
        Step("spark_to_arrow", "Spark's conversion of the cached rows to Arrow (bare mapInArrow)",
             result="spark-mapinarrow"),
        Step("transport", "Flight do_put from the tasks to the nodes (flight-raw: a server that drops the data)",
             result="flight-raw"),
        Step("node_buffer", "the nodes' feed buffers, balancing and batch cutting, drained without tensors",
             stage="node-buffer"),
        Step("tensors", "Arrow to tensors and tf.data on the nodes"),
    ], waits=waits, firsts=firsts, extra=extra)
