"""How a column is laid out as ``tf.train.Example`` features (shared by the encoder and decoder).

* float16/32/64 columns -> ``float_list`` (float64 is stored as float32);
* bool/int*/uint*, timestamps, dates -> ``int64_list``;
* string/binary -> ``bytes_list``;
* a column with ragged inner dimensions also gets ``"<name>/row_lengths_<d>"`` features holding
  the lengths of its lists at dimension ``d`` (``d >= 1``; dimension 0 is the row's own list).
"""

from __future__ import annotations

__all__ = ["feature_kind", "row_lengths_key", "ragged_dims"]


def feature_kind(dtype: str) -> str:
    """The ``tf.train.Feature`` list a column dtype is stored in: ``bytes``, ``float``, ``int64``."""
    if dtype == "string":
        return "bytes"
    if dtype.startswith("float"):
        return "float"
    return "int64"


def row_lengths_key(name: str, dim: int) -> str:
    """Name of the feature holding the list lengths of ragged dimension ``dim`` of ``name``."""
    return f"{name}/row_lengths_{dim}"


def ragged_dims(shape: tuple[int | None, ...]) -> list[int]:
    """Dimensions (>= 1) of a per-row shape that need a row-lengths feature."""
    return [d for d in range(1, len(shape)) if shape[d] is None]
