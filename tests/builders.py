"""Synthetic data shared by the tests: deterministic, small, with checksums to compare."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

__all__ = [
    "all_types_table",
    "numeric_table",
    "mnist_like_table",
    "row_checksum",
    "conformance_table",
    "write_parquet_files",
    "write_tfrecord_files",
    "digits_table",
]


def numeric_table(rows: int, *, seed: int = 0) -> pa.Table:
    """An ``id`` column plus 16 numeric columns of mixed dtypes (17 columns in all)."""
    rng = np.random.default_rng(seed)
    cols = {"id": np.arange(rows, dtype=np.int64)}
    for i in range(8):
        cols[f"f{i}"] = rng.standard_normal(rows).astype(np.float32)
    for i in range(4):
        cols[f"d{i}"] = rng.standard_normal(rows)
    for i in range(3):
        cols[f"i{i}"] = rng.integers(-1000, 1000, rows, dtype=np.int32)
    cols["label"] = rng.integers(0, 10, rows, dtype=np.int64)
    return pa.table(cols)


def mnist_like_table(rows: int, *, seed: int = 0) -> pa.Table:
    """``id``, a 784-float ``image`` list column and an int ``label``."""
    rng = np.random.default_rng(seed)
    img = rng.random((rows, 784), dtype=np.float32)
    return pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "image": pa.FixedSizeListArray.from_arrays(pa.array(img.ravel()), 784).cast(
                pa.list_(pa.float32())
            ),
            "label": rng.integers(0, 10, rows, dtype=np.int64),
        }
    )


def row_checksum(ids: np.ndarray) -> tuple[int, int]:
    """(count, sum of squares) of row ids: catches lost and duplicated rows alike."""
    ids = np.asarray(ids, dtype=np.int64)
    return int(ids.size), int(np.sum(ids.astype(object) ** 2)) if ids.size else 0


def conformance_table(rows: int = 300, *, seed: int = 0) -> pa.Table:
    """One column per kind a pull reader must carry, with values every format keeps exactly.

    ``id`` int64, ``i32`` int32, ``f32`` float32, ``f64`` float64 (multiples of 1/8, so the
    float32 that ``tf.train.Example`` stores is exact), ``flag`` bool, ``name`` string (non-ASCII
    too), ``blob`` binary (not UTF-8), ``vec`` fixed_size_list<float32>[3], ``seq``
    list<int64> of 0..4 values (empty lists included).
    """
    rng = np.random.default_rng(seed)
    ids = np.arange(rows, dtype=np.int64)
    lengths = rng.integers(0, 5, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.table(
        {
            "id": ids,
            "i32": rng.integers(-(2**31), 2**31 - 1, rows, dtype=np.int32),
            "f32": rng.standard_normal(rows).astype(np.float32),
            "f64": rng.integers(-8000, 8000, rows) / 8.0,
            "flag": rng.random(rows) < 0.5,
            "name": pa.array([f"row-{i}-\u00e9\u4e2d" for i in range(rows)], pa.string()),
            "blob": pa.array([bytes([0xFF, i % 256, 0x00, 0x80]) for i in range(rows)], pa.binary()),
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(rows * 3).astype(np.float32)), 3
            ),
            "seq": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(rng.integers(-50, 50, int(offsets[-1]), dtype=np.int64))
            ),
        }
    )


def write_parquet_files(
    table: pa.Table, directory: str | Path, *, files: int = 1, row_group_size: int | None = None
) -> list[Path]:
    """Split ``table`` into ``files`` consecutive parts written as ``part-NNNNN.parquet``."""
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    out = []
    for i in range(files):
        path = directory / f"part-{i:05d}.parquet"
        pq.write_table(
            table.slice(bounds[i], bounds[i + 1] - bounds[i]), path, row_group_size=row_group_size
        )
        out.append(path)
    return out


def _example_feature(tf, value, t: pa.DataType):
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        values, t = list(value), t.value_type
    else:
        values = [value]
    if pa.types.is_floating(t):
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode() for v in values]))
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    raise TypeError(f"no tf.train.Feature for Arrow type {t}")


def write_tfrecord_files(
    table: pa.Table,
    directory: str | Path,
    *,
    files: int = 1,
    compression: str | None = None,
    suffix: str | None = None,
) -> list[Path]:
    """Write ``table`` as ``tf.train.Example`` TFRecords with TensorFlow's own writer.

    The independent reference for the readers: one Example per row, built with the protobuf
    classes and ``tf.io.TFRecordWriter`` (not ``formats``), using the same feature layout
    (scalars as one-value lists, lists flattened; only one list level). A null is an absent
    feature.
    """
    import tensorflow as tf

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if suffix is None:
        suffix = {None: ".tfrecord", "GZIP": ".tfrecord.gz", "ZLIB": ".tfrecord.zlib"}[compression]
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    rows = table.to_pylist()
    types = {f.name: f.type for f in table.schema}
    out = []
    for i in range(files):
        path = directory / f"part-{i:05d}{suffix}"
        with tf.io.TFRecordWriter(str(path), options=compression or "") as writer:
            for row in rows[bounds[i] : bounds[i + 1]]:
                feats = {
                    k: _example_feature(tf, v, types[k]) for k, v in row.items() if v is not None
                }
                ex = tf.train.Example(features=tf.train.Features(feature=feats))
                writer.write(ex.SerializeToString())
        out.append(path)
    return out


def digits_table(rows: int | None = None) -> pa.Table:
    """scikit-learn's 8x8 digits: ``id``, 64-float ``pixels`` (0..16) list column, int ``label``.

    Real data with a known attainable accuracy (a small MLP reaches > 0.9), 1797 rows at most.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    n = len(d.target) if rows is None else min(rows, len(d.target))
    pixels = d.data[:n].astype(np.float32)
    return pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 64).cast(
                pa.list_(pa.float32())
            ),
            "label": d.target[:n].astype(np.int64),
        }
    )


def all_types_table(rows: int = 200, *, spark_types_only: bool = False) -> pa.Table:
    """One column per Arrow type the TF mapping supports, with nulls where the null rule allows.

    ``id`` is 0..rows-1. Row values are deterministic functions of the id. With
    ``spark_types_only`` the columns Spark cannot read back as the same type (unsigned ints,
    float16, large_*, dictionary, fixed_size_list) are left out.
    """
    ids = np.arange(rows, dtype=np.int64)
    every = lambda k: ids % k == 0  # noqa: E731
    def col(values, t, null_every=None):
        mask = every(null_every) if null_every else None
        return pa.array(values, type=t, mask=mask)
    cols: dict[str, pa.Array] = {
        "id": pa.array(ids),
        "i8": col((ids % 200 - 100).astype(np.int8), pa.int8(), 7),
        "i16": col((ids * 37 % 60000 - 30000).astype(np.int16), pa.int16()),
        "i32": col((ids * 1_000_003 % 2**31).astype(np.int32) - 2**30, pa.int32(), 5),
        "i64": col(ids * -(2**40) + 3, pa.int64()),
        "f32": col((ids / 7).astype(np.float32), pa.float32(), 6),
        "f64": col(ids * 0.125 - 3.0, pa.float64()),  # exact in float32
        "flag": col(ids % 3 == 0, pa.bool_(), 11),
        "text": col([f"row-{i}-é" for i in ids], pa.string(), 4),
        "blob": col([bytes([i % 256, 0, 255]) * (i % 4) for i in ids], pa.binary()),
        "ts": col(ids * 1_000_001 + 1_700_000_000_000_000, pa.timestamp("us", tz="UTC"), 9),
        "day": col((ids + 19_000).astype(np.int32), pa.date32()),
        "vec": pa.array([[float(i), -float(i)][: i % 3] for i in ids], pa.list_(pa.float32()),
                        mask=every(13)),
        "nested": pa.array([[[int(i)] * (i % 2), [int(i), 1]] for i in ids],
                           pa.list_(pa.list_(pa.int64()))),
        "words": pa.array([["a", "bb", "ccc"][: i % 4] for i in ids], pa.list_(pa.string())),
    }
    if not spark_types_only:
        cols.update({
            "u8": pa.array((ids % 256).astype(np.uint8)),
            "u64": pa.array((ids.astype(np.uint64) * np.uint64(2**60))),
            "f16": pa.array((ids % 10).astype(np.float16)),
            "ltext": pa.array([f"L{i}" for i in ids], pa.large_string()),
            "lblob": pa.array([bytes([i % 256]) for i in ids], pa.large_binary()),
            "lvec": pa.array([[int(i)] * (i % 3) for i in ids], pa.large_list(pa.int32())),
            "fixed": pa.array([[float(i)] * 3 for i in ids], pa.list_(pa.float32(), 3)),
            "cat": pa.array([["x", "y", "z"][i % 3] for i in ids]).dictionary_encode(),
        })
    return pa.table(cols)
