"""How Arrow columns travel through ``tf.data`` as batch elements, shared by the pull readers.

Dense columns are one array each. A ragged column travels as its flat values plus one row-splits
array per ragged dimension (``tf.data.Dataset.from_generator`` converts plain arrays far faster
than ``tf.RaggedTensor`` values) and is reassembled into a ``tf.RaggedTensor`` in a graph ``map``
(:func:`assemble`). The element spec of a finished dataset is ``formats.tf_spec``'s dict, or
``(features, label)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import SchemaError
from formats.schema import ColumnSpec, RaggedColumn, tf_spec

__all__ = [
    "LABELS_HINT",
    "validate_reader_args",
    "ragged_split_count",
    "check_representable",
    "flatten",
    "flat_signature",
    "signature",
    "assemble",
]


def ragged_split_count(spec: ColumnSpec) -> int:
    """How many row-splits arrays a ragged column travels with (its leading list levels)."""
    last_none = max(i for i, d in enumerate(spec.shape) if d is None)
    return last_none + 1


def check_representable(specs: Sequence[ColumnSpec]) -> None:
    """Ragged columns must have their ragged dimensions first (``list<fixed_list>`` is fine,
    ``fixed_list<list>`` is not): that is what ``tf.RaggedTensorSpec`` can describe."""
    for s in specs:
        if s.is_ragged and (
            ragged_split_count(s) != s.ragged_rank or any(d is None for d in s.shape[s.ragged_rank:])
        ):
            raise SchemaError(
                f"column {s.name!r} has per-row shape {s.shape} (a fixed-size list holding "
                f"variable-length lists), which tf.RaggedTensorSpec cannot describe. Declare its "
                f"shape (shapes={{{s.name!r}: ...}}) or restructure the column."
            )


def flatten(arrays: Mapping[str, Any], specs: Sequence[ColumnSpec]) -> tuple[np.ndarray, ...]:
    """Flat tuple of arrays: a dense column is one array; a ragged one is values + splits."""
    out: list[np.ndarray] = []
    for s in specs:
        a = arrays[s.name]
        if isinstance(a, RaggedColumn):
            k = s.ragged_rank
            tail = tuple(d for d in s.shape[k:])
            out.append(a.values.reshape((-1, *tail)) if tail else a.values)
            out.extend(a.row_splits[:k])
        else:
            out.append(a)
    return tuple(out)


def flat_signature(specs: Sequence[ColumnSpec]) -> tuple[Any, ...]:
    """``tf.TensorSpec`` per array of :func:`flatten`'s output."""
    import tensorflow as tf

    sig: list[Any] = []
    for s in specs:
        dtype = tf.string if s.dtype == "string" else tf.as_dtype(s.dtype)
        if s.is_ragged:
            k = s.ragged_rank
            sig.append(tf.TensorSpec((None, *s.shape[k:]), dtype, name=s.name))
            sig.extend(tf.TensorSpec((None,), tf.int64) for _ in range(k))
        else:
            sig.append(tf.TensorSpec((None, *s.shape), dtype, name=s.name))
    return tuple(sig)


def signature(
    schema: pa.Schema,
    wanted: Sequence[str],
    label: str | None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Any:
    """The finished dataset's element spec: ``formats.tf_spec``'s dict, or ``(dict, label)``."""
    out = tf_spec(schema, columns=wanted, shapes=shapes)
    if label is None:
        return out
    y = out.pop(label)
    return out, y


def assemble(flat: Sequence[Any], specs: Sequence[ColumnSpec], label: str | None) -> Any:
    """Inverse of :func:`flatten` inside the graph: dict of tensors (and the label apart)."""
    import tensorflow as tf

    out: dict[str, Any] = {}
    i = 0
    for s in specs:
        if s.is_ragged:
            k = s.ragged_rank
            out[s.name] = tf.RaggedTensor.from_nested_row_splits(
                flat[i], list(flat[i + 1 : i + 1 + k]), validate=False
            )
            i += 1 + k
        else:
            out[s.name] = flat[i]
            i += 1
    if label is None:
        return out
    y = out.pop(label)
    return out, y


LABELS_HINT = (
    "For a model with several outputs, leave label=None and split the batches yourself: "
    "ds.map(lambda b: ({k: b[k] for k in inputs}, {k: b[k] for k in outputs}))."
)


def validate_reader_args(batch_size: Any, label: Any, columns: Any) -> None:
    """Up-front checks shared by the pull readers."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    if label is not None and not isinstance(label, str):
        raise ValueError(f"label must be a column name (str) or None, got {label!r}. {LABELS_HINT}")
    if columns is not None:
        if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"columns must be a list of column names, got {columns!r}.")
        if len(set(columns)) != len(list(columns)):
            raise ValueError(f"columns lists a name twice: {list(columns)!r}.")
        if not list(columns):
            raise ValueError(
                "columns=[] selects no column; list the columns to read, or leave columns=None "
                "for all of them."
            )
