"""Export scenario: a cached Spark DataFrame to TFRecord files, ours against the per-row way.

Paths (same cached DataFrame, same machine, alternating repetitions by the harness):

* ``export`` (ours): ``formats.write_tfrecords(df, dir)``: one ``mapInArrow`` job encoding each
  Arrow batch into ``tf.train.Example`` wire format with numpy/pyarrow, attempt-keyed staging,
  driver commit and schema file included.
* ``export-per-row`` (baseline): what people write by hand: ``df.rdd.mapPartitionsWithIndex``
  building one ``tf.train.Example`` per row in Python and writing it with
  ``tf.io.TFRecordWriter``, one file per partition. It is slow, so it runs on the first
  :data:`PER_ROW_MAX_ROWS` rows only; its result carries its own row count (rates compare).

Each repetition writes to a fresh directory under ``env.workdir`` and removes the previous one.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any, Iterator

from benchmarks.paths import BenchPath

__all__ = ["TABLES", "PER_ROW_MAX_ROWS", "build"]

TABLES = ("numeric", "mnist")
PER_ROW_MAX_ROWS = 50_000


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
    """The export scenario's two paths on ``env.table_name``."""
    import formats

    rows = env.rows_of()
    row_bytes = env.row_bytes()
    df = env.dataframe()
    ours_dirs = _Fresh(env.workdir / "export")

    def ours() -> int:
        return formats.write_tfrecords(df, str(ours_dirs.next())).rows

    paths = [BenchPath("export", ours, kind="ours", nbytes=rows * row_bytes, close=ours_dirs.close)]
    try:
        env.spark.sparkContext  # noqa: B018 - Spark Connect has no RDDs
    except Exception as exc:  # noqa: BLE001
        paths.append(BenchPath("export-per-row", lambda: 0, kind="peer",
                               unavailable=f"needs df.rdd (classic Spark): {exc}"))
        return paths
    base_rows = min(rows, PER_ROW_MAX_ROWS)
    base_df = env.dataframe(rows=base_rows)
    base_dirs = _Fresh(env.workdir / "export-per-row")

    def per_row() -> int:
        writer = _PerRowWriter(str(base_dirs.next()))
        return sum(base_df.rdd.mapPartitionsWithIndex(writer).collect())

    paths.append(BenchPath("export-per-row", per_row, kind="peer", nbytes=base_rows * row_bytes,
                           close=base_dirs.close))
    return paths
