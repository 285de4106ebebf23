"""Export scenario: the same data to TFRecord files, ours against the per-row way people write.

Two pairs of paths, each pair on the same source, all alternating repetitions in one run:

From a cached, materialised Spark DataFrame (the table in Spark's memory):

* ``export`` (ours): ``formats.write_tfrecords(df, dir)``: one ``mapInArrow`` job encoding each
  Arrow batch into ``tf.train.Example`` wire format with numpy/pyarrow, attempt-keyed staging,
  driver commit and schema file included. Spark converts its rows to Arrow for the tasks.
* ``export-per-row`` (its baseline): what people write by hand: ``df.rdd.mapPartitionsWithIndex``
  building one ``tf.train.Example`` per row in Python and writing it with
  ``tf.io.TFRecordWriter``, one file per partition.

From Parquet files on local disk (the same table written once, untimed, by Spark with
``df.write.parquet``: one snappy file per cached partition):

* ``export-parquet`` (ours): ``formats.parquet_to_tfrecords(spark, parquet_dir, dir)``: one
  ``spark.range(tasks).mapInArrow`` job whose tasks read their row groups with pyarrow, then
  encode, stage and commit exactly like ``export`` (same records, same schema file).
* ``export-parquet-per-row`` (its baseline): the per-row job above on
  ``spark.read.parquet(parquet_dir).rdd``.

Each timing covers the whole job (Spark job, reading, encoding, writing, commit). The per-row
baselines are slow, so they run on the first :data:`PER_ROW_MAX_ROWS` rows only (the Parquet
one on a Parquet copy of those rows, written the same way); their results carry their own row
counts, and rates compare. The scenario's ``pairs`` object gives each ``ours`` path's ratio to
its own baseline (``ratio_vs`` also holds the cross ratios).

Each repetition writes to a fresh directory under ``env.workdir`` and removes the previous one.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any, Iterator

from benchmarks.paths import BenchPath

__all__ = ["TABLES", "PER_ROW_MAX_ROWS", "PAIRS", "build", "extra"]

TABLES = ("numeric", "mnist")
PER_ROW_MAX_ROWS = 50_000
PAIRS = {"export": "export-per-row", "export-parquet": "export-parquet-per-row"}
"""Each ``ours`` path and the baseline that reads the same source."""


class _Fresh:
    """A new output directory per repetition (the previous one removed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.counter = itertools.count()
        self.last: Path | None = None

    def next(self) -> Path:
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = self.root / f"rep-{next(self.counter)}"
        return self.last

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class _PerRowWriter:
    """Executor side of the baseline: one tf.train.Example object per row (picklable)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def __call__(self, index: int, rows: Iterator[Any]) -> Iterator[int]:
        import os

        import tensorflow as tf

        def feature(v: Any) -> Any:
            if isinstance(v, (list, tuple)):
                vals = list(v)
            else:
                vals = [v]
            if vals and isinstance(vals[0], float):
                return tf.train.Feature(float_list=tf.train.FloatList(value=vals))
            if vals and isinstance(vals[0], (bytes, str)):
                return tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[x.encode() if isinstance(x, str) else x for x in vals]))
            return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x) for x in vals]))

        os.makedirs(self.out_dir, exist_ok=True)
        n = 0
        with tf.io.TFRecordWriter(os.path.join(self.out_dir, f"part-{index:05d}.tfrecord")) as w:
            for row in rows:
                ex = tf.train.Example(features=tf.train.Features(
                    feature={k: feature(v) for k, v in row.asDict().items()}))
                w.write(ex.SerializeToString())
                n += 1
        yield n


def build(env: Any) -> list[BenchPath]:
    """The export scenario's four paths on ``env.table_name``."""
    import formats

    rows = env.rows_of()
    row_bytes = env.row_bytes()
    df = env.dataframe()
    base_rows = min(rows, PER_ROW_MAX_ROWS)
    base_df = env.dataframe(rows=base_rows)
    parquet_dir = str(env.workdir / "source.parquet")
    base_parquet_dir = str(env.workdir / "source-per-row.parquet")
    df.write.parquet(parquet_dir)
    base_df.write.parquet(base_parquet_dir)
    ours_dirs = _Fresh(env.workdir / "export")
    parquet_dirs = _Fresh(env.workdir / "export-parquet")

    def ours() -> int:
        return formats.write_tfrecords(df, str(ours_dirs.next())).rows

    def ours_parquet() -> int:
        return formats.parquet_to_tfrecords(env.spark, parquet_dir, str(parquet_dirs.next())).rows

    paths = [
        BenchPath("export", ours, kind="ours", nbytes=rows * row_bytes, close=ours_dirs.close),
        BenchPath("export-parquet", ours_parquet, kind="ours", nbytes=rows * row_bytes,
                  close=parquet_dirs.close),
    ]
    try:
        env.spark.sparkContext  # noqa: B018 - Spark Connect has no RDDs
    except Exception as exc:  # noqa: BLE001
        for name in PAIRS.values():
            paths.append(BenchPath(name, lambda: 0, kind="peer",
                                   unavailable=f"needs df.rdd (classic Spark): {exc}"))
        return paths
    base_dirs = _Fresh(env.workdir / "export-per-row")
    base_parquet_dirs = _Fresh(env.workdir / "export-parquet-per-row")

    def per_row() -> int:
        writer = _PerRowWriter(str(base_dirs.next()))
        return sum(base_df.rdd.mapPartitionsWithIndex(writer).collect())

    def per_row_parquet() -> int:
        writer = _PerRowWriter(str(base_parquet_dirs.next()))
        return sum(env.spark.read.parquet(base_parquet_dir).rdd.mapPartitionsWithIndex(writer).collect())

    paths.append(BenchPath("export-per-row", per_row, kind="peer", nbytes=base_rows * row_bytes,
                           close=base_dirs.close))
    paths.append(BenchPath("export-parquet-per-row", per_row_parquet, kind="peer",
                           nbytes=base_rows * row_bytes, close=base_parquet_dirs.close))
    return paths


def extra(env: Any, results: list[dict[str, Any]], *, progress: Any = None) -> dict[str, Any]:
    """``pairs``: each ``ours`` path's median rows/s over its own baseline's (same source)."""
    del env, progress
    by_name = {r["path"]: r for r in results}
    pairs: dict[str, Any] = {}
    for ours, base in PAIRS.items():
        a, b = by_name.get(ours), by_name.get(base)
        ok = bool(a and b and a["ok"] and b["ok"] and b["rows_per_s"] > 0)
        pairs[ours] = {
            "baseline": base,
            "ratio": a["rows_per_s"] / b["rows_per_s"] if ok else None,  # type: ignore[index]
        }
    return {"pairs": pairs}
