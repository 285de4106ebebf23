"""Pull-TFRecord scenario: ``tf.train.Example`` files into TF batches, ours against hand-tuned tf.data.

The table (``env.table()``) is encoded once with ``formats.example`` and written as
:data:`NUM_FILES` uncompressed TFRecord files plus the ``_tf_schema.json`` the export job
writes; both paths read those files into batches of :data:`BATCH_SIZE` rows, materialising
every batch, and return the rows seen. Both datasets are built once and iterated per repetition.

* ``tfrecord`` (ours): ``feeders.tfrecord_dataset(dir)``, schema from the schema file (for
  ``mnist`` the image is declared 784 wide there, so it parses dense), columns cast to their
  own dtypes (int32 stays int32).
* ``tfdata-tuned`` (peer): the pipeline TensorFlow's performance guide recommends, written by
  hand: ``TFRecordDataset(files, num_parallel_reads=AUTOTUNE)`` -> ``batch`` ->
  ``map(parse_example, AUTOTUNE)`` -> ``prefetch(AUTOTUNE)``, with a hand-written feature spec
  (int64 / float32, no casts).
* ``tfdata-sequential`` (peer): the same with one reader (no ``num_parallel_reads``). On these
  2-core machines the parallel reads are the slow choice (numeric: 2.6-5.1 s an epoch against
  0.3 s, 2026-11-23), so a user tuning for the machine ends here; it is the stricter peer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from benchmarks.data import IMAGE_SIZE
from benchmarks.paths import BenchPath

__all__ = ["TABLES", "BATCH_SIZE", "NUM_FILES", "build", "count_rows", "feature_spec", "write_tfrecords"]

TABLES = ("numeric", "mnist")
BATCH_SIZE = 1024
NUM_FILES = 4


def _shapes(table: pa.Table) -> dict[str, tuple[int, ...]]:
    return {"image": (IMAGE_SIZE,)} if "image" in table.column_names else {}


def write_tfrecords(table: pa.Table, directory: Path, *, files: int = NUM_FILES) -> list[Path]:
    """Encode ``table`` as Examples (``formats.example``) into ``files`` TFRecord files + schema."""
    from formats.example import encode_example_array
    from formats.schema import column_specs
    from formats.schemafile import TFRecordSchema, write_schema_file
    from formats.tfrecord import write_record_array

    directory.mkdir(parents=True, exist_ok=True)
    specs = column_specs(table.schema, shapes=_shapes(table))
    per = -(-table.num_rows // files)
    out, entries = [], []
    for i in range(files):
        part = table.slice(i * per, per)
        if part.num_rows == 0:
            break
        path = directory / f"part-{i:05d}.tfrecord"
        with open(path, "wb") as f:
            for batch in part.to_batches(max_chunksize=64 * 1024):
                write_record_array(f, encode_example_array(batch, specs))
        out.append(path)
        entries.append({"path": path.name, "rows": part.num_rows, "bytes": path.stat().st_size})
    write_schema_file(
        directory,
        TFRecordSchema(specs=specs, num_rows=table.num_rows, files=entries),
    )
    return out


def count_rows(ds: Any, key: str = "id") -> Callable[[], int]:
    """A repetition: iterate ``ds`` once, materialising every batch; returns the rows seen."""

    def run() -> int:
        rows = 0
        for batch in ds:
            rows += int(batch[key].shape[0])
        return rows

    return run


def feature_spec(table: pa.Table) -> dict[str, Any]:
    """The peers' hand-written ``parse_example`` features (int64 / float32, no casts)."""
    import tensorflow as tf

    features: dict[str, Any] = {}
    for field in table.schema:
        if field.name == "image":
            features[field.name] = tf.io.FixedLenFeature([IMAGE_SIZE], tf.float32)
        elif pa.types.is_floating(field.type):
            features[field.name] = tf.io.FixedLenFeature([], tf.float32)
        else:
            features[field.name] = tf.io.FixedLenFeature([], tf.int64)
    return features


def _tuned(files: list[Path], table: pa.Table, *, parallel_reads: bool = True) -> Any:
    import tensorflow as tf

    features = feature_spec(table)
    reads = tf.data.AUTOTUNE if parallel_reads else None
    ds = tf.data.TFRecordDataset([str(f) for f in files], num_parallel_reads=reads)
    ds = ds.batch(BATCH_SIZE)
    ds = ds.map(lambda s: tf.io.parse_example(s, features), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def build(env: Any) -> list[BenchPath]:
    """The pull-TFRecord paths on ``env.table()``."""
    import feeders

    table = env.table()
    directory = env.workdir / "tfrecord"
    files = write_tfrecords(table, directory)
    nbytes = table.num_rows * env.row_bytes()
    ours = feeders.tfrecord_dataset(directory, batch_size=BATCH_SIZE)
    return [
        BenchPath("tfrecord", count_rows(ours), kind="ours", nbytes=nbytes),
        BenchPath("tfdata-tuned", count_rows(_tuned(files, table)), kind="peer", nbytes=nbytes),
        BenchPath(
            "tfdata-sequential",
            count_rows(_tuned(files, table, parallel_reads=False)),
            kind="peer",
            nbytes=nbytes,
        ),
    ]
