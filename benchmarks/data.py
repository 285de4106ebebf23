"""The benchmark's data: deterministic tables, the same bytes on every run, stack and machine.

Three shapes, all fixed-width so bytes per row are exact and MB/s means the same for every path:

* ``numeric``: 17 columns, 68 bytes a row: ``id`` (int32), ``f0``..``f11`` (float32),
  ``i0``..``i2`` (int32) and ``label`` (int32). Tabular features, the common case.
* ``mnist``: MNIST-shaped rows, 3,144 bytes a row: ``id`` (int32), ``image`` (784 float32 as a
  ``list<float32>``, Spark's ``array<float>``) and ``label`` (int32). Wide rows, one big column.
* ``image``: image rows, 49,160 bytes a row (48 KiB): ``id``, ``image`` (a 64x64x3 float32 image
  as a flat ``array<float>`` of 12,288) and ``label``. The rows of issue #18: one row is bigger
  than a gRPC message's share of many buffers, so this is where per-row and per-chunk costs of
  the push path differ from the narrow tables'.

Values come from ``numpy.random.default_rng(seed)``, so a given ``rows`` and ``seed`` always give
the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["TABLES", "TableKind", "image_width", "make_table", "row_bytes", "spark_schema_ddl"]

NUMERIC_FLOATS = 12
NUMERIC_INTS = 3
IMAGE_SIZE = 784
PICTURE_SIZE = 64 * 64 * 3  # the ``image`` table's 48 KiB rows


@dataclass(frozen=True)
class TableKind:
    """One benchmark table shape.

    Attributes:
        name: ``numeric`` or ``mnist``.
        row_bytes: payload bytes per row (fixed-width values only, no offsets or validity).
        description: one line for reports.
    """

    name: str
    row_bytes: int
    description: str


TABLES: dict[str, TableKind] = {
    "numeric": TableKind(
        "numeric",
        4 * (1 + NUMERIC_FLOATS + NUMERIC_INTS + 1),
        "17 numeric columns: id, 12 float32, 3 int32, label (68 bytes/row)",
    ),
    "mnist": TableKind(
        "mnist",
        4 * (1 + IMAGE_SIZE + 1),
        "MNIST-shaped: id, 784-float32 image, label (3,144 bytes/row)",
    ),
    "image": TableKind(
        "image",
        4 * (1 + PICTURE_SIZE + 1),
        "image rows: id, 64x64x3 float32 image as a flat array<float>, label (49,160 bytes/row)",
    ),
}


def image_width(kind: str) -> int | None:
    """Floats in ``kind``'s ``image`` column (784, 12,288), or None for ``numeric``."""
    return {"mnist": IMAGE_SIZE, "image": PICTURE_SIZE}.get(_kind(kind).name)


def _kind(kind: str) -> TableKind:
    if kind not in TABLES:
        raise ValueError(f"table kind must be one of {sorted(TABLES)}, got {kind!r}")
    return TABLES[kind]


def row_bytes(kind: str) -> int:
    """Payload bytes one row of ``kind`` carries (68 ``numeric``, 3,144 ``mnist``, 49,160 ``image``)."""
    return _kind(kind).row_bytes


def make_table(kind: str, rows: int, *, seed: int = 0) -> pa.Table:
    """Build the ``kind`` table with ``rows`` rows, deterministically from ``seed``.

    Args:
        kind: ``numeric``, ``mnist`` or ``image``.
        rows: number of rows (>= 1).
        seed: random seed (default 0: every run of the benchmark sees the same values).

    Returns:
        A ``pyarrow.Table`` whose ``id`` column is ``0..rows-1``.
    """
    _kind(kind)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    rng = np.random.default_rng(seed)
    ids = np.arange(rows, dtype=np.int32)
    labels = rng.integers(0, 10, rows, dtype=np.int32)
    if kind == "numeric":
        cols: dict[str, object] = {"id": ids}
        floats = rng.standard_normal((NUMERIC_FLOATS, rows), dtype=np.float32)
        for i in range(NUMERIC_FLOATS):
            cols[f"f{i}"] = floats[i]
        ints = rng.integers(-1000, 1000, (NUMERIC_INTS, rows), dtype=np.int32)
        for i in range(NUMERIC_INTS):
            cols[f"i{i}"] = ints[i]
        cols["label"] = labels
        return pa.table(cols)
    width = image_width(kind)
    image = rng.random((rows, width), dtype=np.float32)
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    images = pa.ListArray.from_arrays(offsets, pa.array(image.ravel()))
    return pa.table({"id": ids, "image": images, "label": labels})


def spark_schema_ddl(kind: str) -> str:
    """The Spark DDL schema that keeps ``kind``'s exact types (int, float, array<float>)."""
    _kind(kind)
    if kind == "numeric":
        fields = ["id INT"]
        fields += [f"f{i} FLOAT" for i in range(NUMERIC_FLOATS)]
        fields += [f"i{i} INT" for i in range(NUMERIC_INTS)]
        fields.append("label INT")
        return ", ".join(fields)
    return "id INT, image ARRAY<FLOAT>, label INT"
