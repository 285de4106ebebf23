"""Synthetic data shared by the tests: deterministic, small, with checksums to compare."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["numeric_table", "mnist_like_table", "row_checksum"]


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
