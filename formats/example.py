"""tf.train.Example coding driven by the schema, one Arrow batch at a time.

Encoding writes the protobuf wire format directly: every column of a batch is turned into one
Arrow binary array holding, per row, that column's ``Features.feature`` map entry, built from
numpy arrays (varints, length prefixes) and ``pyarrow.compute`` joins; a record is the join of
its row across columns. Consecutive columns whose entry has the same size in every row of the
batch (non-null float scalars, short fixed-length float lists, ints whose varints all have one
size) are written side by side into one (rows x width) byte matrix by column slices instead,
which gives the same bytes with one join input instead of two per column. No Python object is
built per row or per value, so the cost per row is a few numpy passes over the batch.

Feature layout (what :func:`parse_features` asks ``tf.io.parse_example`` for):

* float16/32/64 columns -> ``float_list`` (float64 is stored as float32: ``tf.train.Example``
  has no double; values read back are the float32-rounded values, typed as double again);
* bool/int*/uint*, timestamps and dates -> ``int64_list`` (timestamps as int64 microseconds
  since the UTC epoch whatever their Arrow unit, as Spark holds them; dates as days; uint64 as
  the int64 with the same bits);
* string/binary -> ``bytes_list``;
* a column's values are flattened row-major; a column with ragged inner dimensions (``list<list
  <T>>``) also writes ``"<name>/row_lengths_<d>"``, the lengths of the lists at dimension ``d``,
  which :func:`parse_features` turns into ``tf.io.RaggedFeature`` partitions.

Null rule (``tf.train.Example`` has no nulls): a null row value (a null scalar or a null list)
is written as an **absent feature**; an empty list is a present feature with no values, so the two
stay apart. Readers here (:func:`decode_examples`, ``formats.read_tfrecords``) turn an absent
feature back into a null. Plain ``tf.io.parse_example`` with :func:`parse_features` needs a value:
a dense column absent from a record fails to parse unless the spec has a ``fill`` (used as
``default_value``); a ragged column absent from a record parses as an empty row. Nulls *inside*
a list (a null element or a null inner list) cannot be written: they are a SchemaError naming the
column unless the spec has a ``fill`` for elements.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import SchemaError
from formats.example_decode import decode_examples, infer_specs
from formats.features import feature_kind, ragged_dims, row_lengths_key
from formats.schema import ColumnSpec, column_array, is_list_type, list_offsets, timestamps_as_micros
from formats.wire import binary, binary_parts, header, join, varint_bytes, varint_sizes, varints

__all__ = [
    "feature_kind",
    "row_lengths_key",
    "encode_examples",
    "encode_example_array",
    "parse_features",
    "decode_examples",
    "infer_specs",
]

_TAG_BYTES, _TAG_FLOAT, _TAG_INT64 = 0x0A, 0x12, 0x1A


# ---------------------------------------------------------------------------------------------
# column flattening


class _Flat:
    """A column as leaf values plus row splits per list level (all rebased to start at 0)."""

    def __init__(self, leaves: pa.Array, splits: list[np.ndarray], valid: np.ndarray) -> None:
        self.leaves = leaves
        self.splits = splits  # splits[d]: offsets of level-d lists into level d+1 elements
        self.valid = valid  # per row: is the row non-null

    def row_splits(self, depth: int) -> np.ndarray:
        """Offsets of each row into the elements at list depth ``depth`` (0 = rows)."""
        n = len(self.valid)
        s = np.arange(n + 1, dtype=np.int64)
        for d in range(depth):
            s = self.splits[d][s]
        return s


def _list_level(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    if pa.types.is_fixed_size_list(arr.type):
        k = arr.type.list_size
        values = arr.values.slice(arr.offset * k, len(arr) * k)
        return values, np.arange(len(arr) + 1, dtype=np.int64) * k
    offsets = list_offsets(arr)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    return values, offsets - offsets[0]


def _flatten(name: str, arr: pa.Array, spec: ColumnSpec) -> _Flat:
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    n = len(arr)
    valid = np.ones(n, dtype=bool) if not arr.null_count else np.asarray(arr.is_valid())
    splits: list[np.ndarray] = []
    cur = arr
    depth = 0
    while is_list_type(cur.type):
        if depth > 0 and cur.null_count:
            raise SchemaError(
                f"column {name!r} has {cur.null_count} null inner list(s); a TFRecord feature "
                f"cannot hold a null inside a list. Replace them with empty lists first."
            )
        cur, s = _list_level(cur)
        splits.append(s)
        depth += 1
    if pa.types.is_dictionary(cur.type):
        cur = cur.dictionary_decode()
    if cur.null_count:
        if depth == 0:
            # scalar column: a null row is an absent feature unless a fill is given
            if spec.fill is not None:
                cur = cur.fill_null(pa.scalar(spec.fill, type=cur.type))
                valid = np.ones(n, dtype=bool)
            else:
                cur = cur.fill_null(pa.scalar(_zero(cur.type), type=cur.type))
        else:
            flat = _Flat(cur, splits, valid)
            leaf_valid = np.asarray(cur.is_valid())
            rows_of_leaf = np.repeat(np.arange(n), np.diff(flat.row_splits(depth)))
            bad = ~leaf_valid & valid[rows_of_leaf]
            if bad.any() and spec.fill is None:
                row = int(rows_of_leaf[np.argmax(bad)])
                raise SchemaError(
                    f"column {name!r} has {int(bad.sum())} null element(s) inside its lists (the "
                    f"first in row {row} of this batch); a TFRecord feature cannot hold nulls "
                    f"inside a list. Replace them before exporting, e.g. df.withColumn("
                    f"{name!r}, expr('transform({name}, x -> coalesce(x, 0))')), or drop those rows."
                )
            cur = cur.fill_null(
                pa.scalar(spec.fill if spec.fill is not None else _zero(cur.type), type=cur.type)
            )
    return _Flat(cur, splits, valid)


def _zero(t: pa.DataType) -> Any:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return b""
    if pa.types.is_boolean(t):
        return False
    if pa.types.is_floating(t):
        return 0.0
    return 0


def _int64_values(leaves: pa.Array, name: str = "") -> np.ndarray:
    if pa.types.is_timestamp(leaves.type):
        leaves = timestamps_as_micros(name, leaves)  # the unit TensorFlow gets from every path
    t = leaves.type
    if pa.types.is_timestamp(t) or pa.types.is_date64(t) or pa.types.is_duration(t):
        return np.frombuffer(leaves.buffers()[1], dtype=np.int64)[leaves.offset : leaves.offset + len(leaves)]
    if pa.types.is_date32(t):
        leaves = leaves.cast(pa.int32())
    vals = np.asarray(leaves.to_numpy(zero_copy_only=False))
    if vals.dtype == np.uint64:
        return vals.view(np.int64)
    return vals.astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------
# encoding


def _entry(key: str, kind: str, payload: pa.Array, valid: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """(head, payload): per-row map entry for ``key`` is head + payload (null where absent)."""
    n = len(payload)
    _, poff = binary_parts(payload)
    plen = np.diff(poff).astype(np.uint64)
    kb = key.encode("utf-8")
    key_part = bytes([0x0A]) + varint_bytes(len(kb)) + kb + bytes([0x12])
    if kind == "bytes":
        list_len = plen
        tag_segments: list[Any] = []
    else:
        list_len = np.uint64(1) + varint_sizes(plen).astype(np.uint64) + plen
        tag_segments = [b"\x0a", plen]
    tag = {"bytes": _TAG_BYTES, "float": _TAG_FLOAT, "int64": _TAG_INT64}[kind]
    feat_len = np.uint64(1) + varint_sizes(list_len).astype(np.uint64) + list_len
    entry_len = (
        np.uint64(len(key_part)) + varint_sizes(feat_len).astype(np.uint64) + feat_len
    )
    data, offs = header(
        n, [b"\x0a", entry_len, key_part, feat_len, bytes([tag]), list_len, *tag_segments]
    )
    return binary(data, offs, valid), payload


def _float32(name: str, arr: pa.Array) -> np.ndarray:
    """A float column's values as float32, the only float an Example holds. A finite double
    beyond float32's range would silently become inf, and a non-zero one too small for it 0:
    both are errors naming the column."""
    vals = np.asarray(arr.to_numpy(zero_copy_only=False))
    with np.errstate(over="ignore", under="ignore"):
        out = vals.astype("<f4", copy=False)
    if vals.dtype != np.float64:
        return out
    too_small = (out == 0) & (vals != 0) & ~np.isnan(vals)
    too_big = np.isinf(out) & np.isfinite(vals)
    for bad, what, fix in (
        (too_small, "too small for float32 (below about 1.4e-45)", "0. Scale the column before "
         f"the export, cast it to float yourself to accept the zeros (col({name!r}).cast('float'))"),
        (too_big, "beyond float32's range (about ±3.4e38)", "inf. Scale the column (or clip it) "
         "before the export"),
    ):
        if bad.any():
            value, more = float(vals[np.argmax(bad)]), int(bad.sum()) - 1
            also = f" and {more} more value(s)" if more else ""
            raise SchemaError(
                f"column {name!r} holds {value!r}{also}, {what}: a tf.train.Example stores "
                f"floats as float32, so it would be written as {fix}, or export to Parquet, "
                f"which keeps doubles."
            )
    return out


def _payload(kind: str, leaves: pa.Array, row_leaf_splits: np.ndarray, valid: np.ndarray,
             name: str = "") -> pa.Array:
    """Per-row payload bytes: packed float32 / packed varints / repeated length-prefixed bytes."""
    if kind == "float":
        vals = _float32(name, leaves)
        return binary(vals.view(np.uint8), row_leaf_splits * 4, valid)
    if kind == "int64":
        data, sizes = varints(_int64_values(leaves, name).view(np.uint64))
        voff = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=voff[1:])
        return binary(data, voff[row_leaf_splits], valid)
    vals = leaves.cast(pa.large_binary())
    _, off = binary_parts(vals)
    lens = np.diff(off).astype(np.uint64)
    hdata, hoff = header(len(vals), [b"\x0a", lens])
    elems = join(binary(hdata, hoff), vals)
    edata, eoff = binary_parts(elems)
    return binary(edata, eoff[row_leaf_splits], valid)


def _encode_column(data: pa.RecordBatch | pa.Table, spec: ColumnSpec) -> list[pa.Array]:
    """The column's map entries as [head, payload, head, payload...] arrays (null: absent)."""
    arr = column_array(data, spec.name)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    flat = _flatten(spec.name, arr, spec)
    depth = len(flat.splits)
    if (spec.is_ragged and depth < len(spec.shape)) or (depth == 0 and spec.shape):
        raise SchemaError(
            f"column {spec.name!r} has Arrow type {arr.type}, which does not fit the spec's "
            f"shape {spec.shape}; build the specs from this data's schema (column_specs)."
        )
    row_leaf = flat.row_splits(depth)
    counts = np.diff(row_leaf)
    if spec.shape and not spec.is_ragged:
        per_row = math.prod(spec.shape)  # type: ignore[arg-type]
        bad = flat.valid & (counts != per_row)
        if bad.any():
            row = int(np.argmax(bad))
            raise SchemaError(
                f"column {spec.name!r} is written as dense shape {spec.shape} ({per_row} values "
                f"a row), but row {row} of this batch has {int(counts[row])} values. Leave its "
                f"shape undeclared (ragged) or fix the data."
            )
    kind = feature_kind(spec.dtype)
    out = list(_entry(spec.name, kind, _payload(kind, flat.leaves, row_leaf, flat.valid, spec.name), flat.valid))
    if spec.is_ragged:
        for d in ragged_dims(spec.shape):
            lengths = np.diff(flat.splits[d]).astype(np.int64)
            payload = _payload("int64", pa.array(lengths), flat.row_splits(d), flat.valid)
            out.extend(_entry(row_lengths_key(spec.name, d), "int64", payload, flat.valid))
    return out


# Longer fixed lists keep their zero-copy payload (one copy less than the fixed-entry matrix).
_FIXED_LIST_BYTES = 256


def _fixed_prefix(key: str, kind: str, m: int) -> bytes:
    """The bytes before a packed ``kind`` payload of ``m`` bytes in ``key``'s map entry."""
    kb = key.encode("utf-8")
    key_part = b"\x0a" + varint_bytes(len(kb)) + kb + b"\x12"
    list_len = 1 + len(varint_bytes(m)) + m
    tag = _TAG_FLOAT if kind == "float" else _TAG_INT64
    feat_len = 1 + len(varint_bytes(list_len)) + list_len
    entry_len = len(key_part) + len(varint_bytes(feat_len)) + feat_len
    return (
        b"\x0a" + varint_bytes(entry_len) + key_part + varint_bytes(feat_len)
        + bytes([tag]) + varint_bytes(list_len) + b"\x0a" + varint_bytes(m)
    )


def _fixed_entry(data: pa.RecordBatch | pa.Table, spec: ColumnSpec) -> tuple[bytes, np.ndarray] | None:
    """(constant prefix, per-row payload matrix) when the column's map entry has the same size
    in every row, else None (the general path then encodes it, and raises its errors).

    That is: no nulls, and either a float scalar, an integer-kind scalar whose varints all have
    one size (bools, small labels), or a one-level float list of at most
    :data:`_FIXED_LIST_BYTES` with one length in every row.
    """
    kind = feature_kind(spec.dtype)
    if kind == "bytes":
        return None
    arr = column_array(data, spec.name)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count or pa.types.is_dictionary(arr.type):
        return None
    n = len(arr)
    if not is_list_type(arr.type):
        if spec.shape:
            return None
        if kind == "float":
            vals = _float32(spec.name, arr)
            return _fixed_prefix(spec.name, kind, 4), vals.view(np.uint8).reshape(n, 4)
        u = _int64_values(arr, spec.name).view(np.uint64)
        sizes = varint_sizes(u)
        if n and (sizes != sizes[0]).any():
            return None
        raw, _ = varints(u)
        width = int(sizes[0]) if n else 1
        return _fixed_prefix(spec.name, kind, width), raw.reshape(n, width)
    if kind != "float" or len(spec.shape) != 1:
        return None
    values, offsets = _list_level(arr)
    if is_list_type(values.type) or pa.types.is_dictionary(values.type) or values.null_count:
        return None
    k = int(offsets[1] - offsets[0]) if n else 0
    if 4 * k > _FIXED_LIST_BYTES or (n and (np.diff(offsets) != k).any()):
        return None
    if spec.shape[0] is not None and spec.shape[0] != k:
        return None
    vals = _float32(spec.name, values)
    return _fixed_prefix(spec.name, kind, 4 * k), vals.view(np.uint8).reshape(n, 4 * k)


def _fixed_block(entries: list[tuple[bytes, np.ndarray]], n: int) -> pa.Array:
    """Consecutive same-size entries side by side in one (rows x width) matrix, filled by column
    slices: the same bytes as encoding them one by one, without a per-column join."""
    width = sum(len(prefix) + payload.shape[1] for prefix, payload in entries)
    mat = np.empty((n, width), dtype=np.uint8)
    pos = 0
    for prefix, payload in entries:
        mat[:, pos : pos + len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        pos += len(prefix)
        mat[:, pos : pos + payload.shape[1]] = payload
        pos += payload.shape[1]
    return binary(mat.reshape(-1), np.arange(n + 1, dtype=np.int64) * width)


def encode_example_array(data: pa.RecordBatch | pa.Table, specs: Sequence[ColumnSpec]) -> pa.Array:
    """Serialized ``tf.train.Example`` per row, as one ``large_binary`` Arrow array.

    This is the fast form of :func:`encode_examples` (no Python object per row); hand it to
    :func:`formats.tfrecord.write_record_array`.

    Raises:
        SchemaError: a column cannot be written (nulls inside lists, wrong dense length...).
    """
    n = data.num_rows
    if n == 0:
        return pa.array([], pa.large_binary())
    chunks: list[pa.Array] = []
    run: list[tuple[bytes, np.ndarray]] = []
    for spec in specs:
        entry = _fixed_entry(data, spec)
        if entry is not None:
            run.append(entry)
            continue
        if run:
            chunks.append(_fixed_block(run, n))
            run = []
        chunks.extend(_encode_column(data, spec))
    if run:
        chunks.append(_fixed_block(run, n))
    lens = np.zeros(n, dtype=np.uint64)
    for c in chunks:
        _, off = binary_parts(c)
        lens += np.where(np.asarray(c.is_valid()), np.diff(off), 0).astype(np.uint64)
    hdata, hoff = header(n, [b"\x0a", lens])
    return join(binary(hdata, hoff), *chunks, null_handling="replace")


def encode_examples(data: pa.RecordBatch | pa.Table, specs: Sequence[ColumnSpec]) -> list[bytes]:
    """Serialized ``tf.train.Example`` bytes, one per row of ``data`` (vectorised per batch).

    Args:
        data: an Arrow batch or table holding every spec'd column (dotted names reach into
            structs, see ``column_specs(flatten_structs=True)``).
        specs: from :func:`formats.schema.column_specs` on ``data.schema``.

    Raises:
        SchemaError: a column cannot be written; the message names it (see the null rule).
    """
    return encode_example_array(data, specs).to_pylist()


# ---------------------------------------------------------------------------------------------
# plain TensorFlow parsing


def parse_features(specs: Sequence[ColumnSpec], *, fill_values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``features`` argument of ``tf.io.parse_example`` for records written with ``specs``.

    Dense columns (scalars, fixed shapes) become ``tf.io.FixedLenFeature`` (with the spec's
    ``fill``, or ``fill_values[name]``, as ``default_value`` for records where the value was
    null); ragged columns become ``tf.io.RaggedFeature`` with row-length partitions. Parsed
    dtypes are the Example kinds: ``tf.int64``, ``tf.float32``, ``tf.string``; cast afterwards
    if you need the column's own dtype.
    """
    import tensorflow as tf  # noqa: PLC0415

    fill_values = dict(fill_values or {})
    tf_dtypes = {"bytes": tf.string, "float": tf.float32, "int64": tf.int64}
    out: dict[str, Any] = {}
    for spec in specs:
        dtype = tf_dtypes[feature_kind(spec.dtype)]
        if spec.is_ragged:
            partitions = []
            for d in range(1, len(spec.shape)):
                dim = spec.shape[d]
                if dim is None:
                    partitions.append(tf.io.RaggedFeature.RowLengths(row_lengths_key(spec.name, d)))
                else:
                    partitions.append(tf.io.RaggedFeature.UniformRowLength(int(dim)))
            out[spec.name] = tf.io.RaggedFeature(
                dtype=dtype, value_key=spec.name, partitions=tuple(partitions), row_splits_dtype=tf.int64
            )
        else:
            fill = fill_values.get(spec.name, spec.fill)
            if fill is not None and spec.shape:
                fill = np.full(spec.shape, fill).tolist()
            out[spec.name] = tf.io.FixedLenFeature(list(spec.shape), dtype, default_value=fill)
    return out

