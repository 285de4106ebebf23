"""Decoding serialized ``tf.train.Example`` records into Arrow, without TensorFlow.

Each record is walked once in Python to find where each feature's values lie (a handful of
varint reads per feature); the values themselves are gathered per column and converted with
numpy (packed floats are a ``frombuffer``, packed varints are decoded for the whole column at
once). Absent features become nulls (the null rule in :mod:`formats.example`).

Schema inference (:func:`infer_specs`), used when there is no schema file, looks at every record
it is given (``read_tfrecords`` hands it the first ``sample`` records, 1000 by default, across
files in order), never only the first one:

* the Example kind gives the dtype: ``float_list`` -> float32, ``int64_list`` -> int64,
  ``bytes_list`` -> string when every sampled value is valid UTF-8, else binary;
* a feature holding exactly one value in every sampled record where it appears is a scalar;
  any other count (0, 2, varying) makes it a variable-length list. Fixed shapes are never
  guessed from data: a reader that needs ``[batch, 784]`` passes the schema (file) instead;
* ``"<name>/row_lengths_<d>"`` features turn ``name`` into a nested list with ragged dimension
  ``d``;
* a feature missing from some sampled records is nullable (absent -> null);
* columns come in sorted name order.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import RecordError, SchemaError
from formats.features import feature_kind, ragged_dims, row_lengths_key
from formats.schema import ColumnSpec, is_list_type
from formats.wire import read_varint as _varint

__all__ = ["decode_examples", "infer_specs", "parse_record", "NotTextError"]


class NotTextError(SchemaError):
    """A ``bytes_list`` feature's values do not convert to the column's text type (not UTF-8).

    The fix depends on who asked for that type, so callers with another way to ask for binary
    (``loadTFRecords(binary_features=)``) re-raise with :meth:`with_fix`.

    Attributes:
        column: the column.
    """

    def __init__(self, column: str, target: pa.DataType, detail: str,
                 fix: str = "pass a schema with a binary type") -> None:
        self.column, self.target, self.detail, self.fix = column, target, detail, fix
        super().__init__(
            f"column {column!r}: bytes_list values cannot be read as {target}: {detail}. Read it "
            f"as binary ({fix}) or fix the writer."
        )

    def with_fix(self, fix: str) -> "NotTextError":
        """The same error, naming ``fix`` as the way to read the column as binary."""
        return NotTextError(self.column, self.target, self.detail, fix)

    def __reduce__(self) -> Any:  # pickled with its parts, not its message
        return NotTextError, (self.column, self.target, self.detail, self.fix)

_KINDS = {0x0A: "bytes", 0x12: "float", 0x1A: "int64"}
_ROW_LENGTHS = re.compile(r"^(.*)/row_lengths_(\d+)$")


def _skip(buf: bytes, pos: int, wire: int) -> int:
    if wire == 0:
        return _varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        ln, pos = _varint(buf, pos)
        return pos + ln
    if wire == 5:
        return pos + 4
    raise ValueError(f"unsupported protobuf wire type {wire}")


def parse_record(rec: bytes) -> dict[str, tuple[str | None, int, int]]:
    """``{feature name: (kind, start, end)}`` of one serialized Example; values lie in [start, end).

    ``kind`` is ``"bytes"``, ``"float"``, ``"int64"`` or ``None`` for a feature with no list set.

    Raises:
        ValueError / IndexError: the bytes are not a valid Example.
    """
    out: dict[str, tuple[str | None, int, int]] = {}
    pos, n = 0, len(rec)
    while pos < n:
        tag, pos = _varint(rec, pos)
        if tag != 0x0A:  # not Example.features
            pos = _skip(rec, pos, tag & 7)
            continue
        ln, pos = _varint(rec, pos)
        fend = pos + ln
        while pos < fend:
            tag, pos = _varint(rec, pos)
            ln, pos = _varint(rec, pos)
            if tag != 0x0A:  # not a map entry
                pos += ln if tag & 7 == 2 else 0
                continue
            eend = pos + ln
            key = None
            kind: str | None = None
            vs = ve = pos
            while pos < eend:
                tag, pos = _varint(rec, pos)
                if tag == 0x0A:
                    ln, pos = _varint(rec, pos)
                    key = rec[pos : pos + ln].decode("utf-8")
                    pos += ln
                elif tag == 0x12:
                    ln, pos = _varint(rec, pos)
                    fe = pos + ln
                    kind, vs, ve = None, pos, pos
                    while pos < fe:  # Feature: the last list set wins
                        tag, pos = _varint(rec, pos)
                        ln, pos = _varint(rec, pos)
                        if tag in _KINDS:
                            kind, vs, ve = _KINDS[tag], pos, pos + ln
                        pos += ln
                else:
                    pos = _skip(rec, pos, tag & 7)
            if pos != eend or key is None:
                raise ValueError("malformed feature map entry")
            out[key] = (kind, vs, ve)
        if pos != fend:
            raise ValueError("malformed Features message")
    if pos != n:
        raise ValueError("record ends inside a field")
    return out


def _list_values(rec: bytes, kind: str, s: int, e: int) -> tuple[str, Any]:
    """The values of one list: ("packed", bytes) for numbers, ("items", list) otherwise."""
    if s == e:
        return ("packed", b"")
    if kind != "bytes" and rec[s] == 0x0A:
        ln, p = _varint(rec, s + 1)
        if p + ln == e:  # the usual single packed run
            return ("packed", rec[p:e])
    items: list[Any] = []
    pos = s
    while pos < e:
        tag, pos = _varint(rec, pos)
        wire = tag & 7
        if tag >> 3 != 1:
            pos = _skip(rec, pos, wire)
            continue
        if kind == "bytes":
            ln, pos = _varint(rec, pos)
            items.append(rec[pos : pos + ln])
            pos += ln
        elif wire == 2:  # a packed run among others
            ln, pos = _varint(rec, pos)
            seg = rec[pos : pos + ln]
            pos += ln
            if kind == "float":
                items.extend(np.frombuffer(seg, dtype="<f4").tolist())
            else:
                items.extend(_decode_varints(np.frombuffer(seg, dtype=np.uint8))[0].tolist())
        elif wire == 5:
            items.append(float(np.frombuffer(rec[pos : pos + 4], dtype="<f4")[0]))
            pos += 4
        elif wire == 0:
            v, pos = _varint(rec, pos)
            items.append(v - (1 << 64) if v >= 1 << 63 else v)
        else:
            pos = _skip(rec, pos, wire)
    if kind == "bytes":
        return ("items", items)
    arr = np.asarray(items, dtype=np.float32 if kind == "float" else np.int64)
    if kind == "float":
        return ("packed", arr.astype("<f4").tobytes())
    return ("ints", arr)


def _decode_varints(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All varints in a byte array (as int64) and the cumulative count of values ending by each byte."""
    if len(buf) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    ends = buf < 0x80
    if not ends[-1]:
        raise ValueError("packed varints end inside a value")
    end_pos = np.flatnonzero(ends)
    starts = np.concatenate([[0], end_pos[:-1] + 1])
    vid = np.concatenate([[0], np.cumsum(ends)[:-1]])
    j = np.arange(len(buf)) - starts[vid]
    contrib = (buf & 0x7F).astype(np.uint64) << (7 * j).astype(np.uint64)
    values = np.bitwise_or.reduceat(contrib, starts).view(np.int64)
    cum = np.concatenate([[0], np.cumsum(ends)])
    return values, cum


class _Collector:
    """Values of one feature across records."""

    def __init__(self, key: str, kind: str) -> None:
        self.key = key
        self.kind = kind
        self.present: list[int] = []  # record indices where the feature is present
        self.packed: list[bytes] = []
        self.items: list[Any] = []
        self.counts: list[int] = []  # bytes: values per record; numbers filled at finish()
        self.extra_ints: dict[int, np.ndarray] = {}

    def add(self, i: int, rec: bytes, kind: str | None, s: int, e: int, name: str) -> None:
        if kind is not None and kind != self.kind:
            raise SchemaError(
                f"{name}: record {i}: feature {self.key!r} is a {kind}_list, but the schema says "
                f"{self.kind}_list. The schema (file) does not match the data; pass the right "
                f"schema or let it be inferred."
            )
        self.present.append(i)
        form, vals = _list_values(rec, self.kind, s, e) if kind else ("packed", b"")
        if self.kind == "bytes":
            vals = vals if form == "items" else []
            self.items.extend(vals)
            self.counts.append(len(vals))
        elif form == "ints":
            self.extra_ints[len(self.packed)] = vals
            self.packed.append(b"")
        else:
            self.packed.append(vals)

    def finish(self) -> tuple[np.ndarray, Any, np.ndarray]:
        """(present record indices, flat values, per-present-record counts)."""
        present = np.asarray(self.present, dtype=np.int64)
        if self.kind == "bytes":
            return present, pa.array(self.items, pa.large_binary()), np.asarray(self.counts, np.int64)
        if self.extra_ints:  # rare: unpacked ints from another writer; go value by value
            parts, counts = [], []
            for k, seg in enumerate(self.packed):
                v = self.extra_ints.get(k)
                if v is None:
                    v, _ = _decode_varints(np.frombuffer(seg, dtype=np.uint8))
                parts.append(v)
                counts.append(len(v))
            values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            return present, values, np.asarray(counts, np.int64)
        lens = np.fromiter((len(p) for p in self.packed), dtype=np.int64, count=len(self.packed))
        buf = np.frombuffer(b"".join(self.packed), dtype=np.uint8)
        if self.kind == "float":
            if (lens % 4).any():
                raise ValueError(f"feature {self.key!r}: packed floats not a multiple of 4 bytes")
            return present, buf.view("<f4"), lens // 4
        values, cum = _decode_varints(buf)
        off = np.concatenate([[0], np.cumsum(lens)])
        return present, values, cum[off[1:]] - cum[off[:-1]]


def _leaf_type(t: pa.DataType) -> pa.DataType:
    while is_list_type(t):
        t = t.value_type
    return t


def _default_type(spec: ColumnSpec) -> pa.DataType:
    if spec.dtype == "string":
        t: pa.DataType = pa.binary()
    else:
        t = pa.from_numpy_dtype(np.dtype(spec.dtype))
    for dim in reversed(spec.shape):
        t = pa.list_(t) if dim is None else pa.list_(t, int(dim))
    return t


def _to_leaf(name: str, kind: str, values: Any, t: pa.DataType) -> pa.Array:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if kind == "bytes":
        try:
            return values.cast(t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise NotTextError(name, t, str(exc)) from exc
    v = np.asarray(values)
    if kind == "float":
        if not pa.types.is_floating(t):
            raise SchemaError(f"column {name!r} holds float_list values but its type is {t}.")
        return pa.array(v.astype(t.to_pandas_dtype(), copy=False), type=t)
    v = v.astype(np.int64, copy=False)
    if pa.types.is_boolean(t):
        return pa.array(v != 0, type=t)
    if pa.types.is_integer(t):
        np_t = np.dtype(t.to_pandas_dtype())
        return pa.array(v.view(np.uint64) if np_t == np.uint64 else v.astype(np_t), type=t)
    if pa.types.is_timestamp(t) and t.unit != "us":  # written as microseconds (example.py)
        micros = pa.Array.from_buffers(pa.timestamp("us", tz=t.tz), len(v),
                                       [None, pa.py_buffer(np.ascontiguousarray(v))])
        return micros.cast(t)
    if pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_date64(t):
        return pa.Array.from_buffers(t, len(v), [None, pa.py_buffer(np.ascontiguousarray(v))])
    if pa.types.is_date32(t):
        return pa.Array.from_buffers(t, len(v), [None, pa.py_buffer(v.astype(np.int32))])
    raise SchemaError(f"column {name!r} holds int64_list values but its type is {t}.")


def _build_column(
    name: str,
    spec: ColumnSpec,
    n: int,
    main: tuple[np.ndarray, Any, np.ndarray],
    lengths: dict[int, tuple[np.ndarray, Any, np.ndarray]],
    src: str,
) -> pa.Array:
    target = spec.arrow_type if spec.arrow_type is not None else _default_type(spec)
    present, values, counts = main
    kind = feature_kind(spec.dtype)
    cur = _to_leaf(name, kind, values, _leaf_type(target))
    shape = spec.shape
    if not shape:
        bad = counts != 1
        if bad.any():
            i = int(present[np.argmax(bad)])
            raise RecordError(
                f"{src}: record {i}: feature {name!r} holds {int(counts[np.argmax(bad)])} values "
                f"but the schema says it is a scalar. Pass a schema that declares it a list."
            )
    else:
        for d in reversed(range(1, len(shape))):
            dim = shape[d]
            if dim is None:
                lp, lv, _ = lengths[d]
                if len(lp) != len(present) or (lp != present).any():
                    raise RecordError(
                        f"{src}: feature {row_lengths_key(name, d)!r} is not present in exactly "
                        f"the records holding {name!r}; the records are damaged."
                    )
                offs = np.concatenate([[0], np.cumsum(np.asarray(lv, dtype=np.int64))])
                if offs[-1] != len(cur):
                    raise RecordError(
                        f"{src}: {row_lengths_key(name, d)!r} sums to {int(offs[-1])} but "
                        f"{name!r} holds {len(cur)} values at that level."
                    )
                cur = pa.ListArray.from_arrays(pa.array(offs, pa.int32()), cur)
            else:
                cur = pa.FixedSizeListArray.from_arrays(cur, int(dim))
        # elements per row at level 1
        rag = ragged_dims(shape)
        if rag:
            first = rag[0]
            elems = lengths[first][2] // max(1, math.prod(int(x) for x in shape[1:first]))
        else:
            elems = counts // max(1, math.prod(int(x) for x in shape[1:]))  # type: ignore[arg-type]
        if shape[0] is None:
            offs = np.concatenate([[0], np.cumsum(elems)])
            cur = pa.ListArray.from_arrays(pa.array(offs, pa.int32()), cur)
        else:
            bad = elems != int(shape[0])
            if bad.any():
                i = int(present[np.argmax(bad)])
                raise RecordError(
                    f"{src}: record {i}: feature {name!r} holds {int(counts[np.argmax(bad)])} "
                    f"values, but its shape {shape} needs {math.prod(int(x) for x in shape if x)}. "
                    f"Declare the shape the records have, or a variable-length list "
                    f"(pa.list_(...)) to read it ragged."
                )
            cur = pa.FixedSizeListArray.from_arrays(cur, int(shape[0]))
    if len(present) != n:
        idx = np.full(n, -1, dtype=np.int64)
        idx[present] = np.arange(len(present))
        cur = cur.take(pa.array(idx, mask=idx < 0))
    if cur.type != target:
        try:
            if pa.types.is_dictionary(target):
                cur = cur.dictionary_encode()
            cur = cur.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # a declared shape that differs from the Arrow nesting: keep the built form
    return cur


def decode_examples(
    records: Sequence[bytes], specs: Sequence[ColumnSpec], *, name: str = "records",
    unknown: str | None = None,
) -> pa.Table:
    """Decode serialized ``tf.train.Example`` records into an Arrow table, one row per record.

    Args:
        records: serialized Examples.
        specs: the columns to read (from the schema file or :func:`infer_specs`); a spec's
            ``arrow_type`` is restored when set.
        name: what to call the records in errors (the file path).
        unknown: None (default: features outside ``specs`` are skipped), or why ``specs`` are
            all there is (e.g. "inferred from the first 1000 records; ..."): a feature outside
            them is then a SchemaError, since skipping it would drop its data unnoticed.

    Raises:
        RecordError: a record is not a valid Example or its values do not fit the spec.
        SchemaError: a feature's kind (bytes/float/int64) differs from the spec's.
    """
    collectors: dict[str, _Collector] = {}
    for spec in specs:
        kind = feature_kind(spec.dtype)
        collectors[spec.name] = _Collector(spec.name, kind)
        if spec.is_ragged:
            for d in ragged_dims(spec.shape):
                key = row_lengths_key(spec.name, d)
                collectors[key] = _Collector(key, "int64")
    for i, rec in enumerate(records):
        try:
            feats = parse_record(rec)
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise RecordError(
                f"{name}: record {i} is not a valid tf.train.Example ({exc}). The file is not "
                f"Example-encoded or is damaged."
            ) from exc
        for key, (kind, s, e) in feats.items():
            col = collectors.get(key)
            if col is not None:
                col.add(i, rec, kind, s, e, name)
            elif unknown is not None:
                raise SchemaError(
                    f"{name}: record {i} of this batch has feature {key!r}, which is not in "
                    f"the schema ({unknown}); its values would be dropped."
                )
    finished = {}
    for key, col in collectors.items():
        try:
            finished[key] = col.finish()
        except ValueError as exc:
            raise RecordError(f"{name}: feature {key!r}: {exc}") from exc
    arrays, fields = [], []
    n = len(records)
    for spec in specs:
        lengths = {d: finished[row_lengths_key(spec.name, d)] for d in ragged_dims(spec.shape)} if spec.is_ragged else {}
        arr = _build_column(spec.name, spec, n, finished[spec.name], lengths, name)
        arrays.append(arr)
        fields.append(pa.field(spec.name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def infer_specs(records: Sequence[bytes], *, name: str = "records") -> list[ColumnSpec]:
    """Column specs for Example records that have no schema file (rule in the module doc).

    Raises:
        SchemaError: no records to look at, or a feature's kind differs between records.
    """
    if len(records) == 0:
        raise SchemaError(
            f"{name}: no records to infer a schema from. Pass schema= (or write the data with "
            f"formats.write_tfrecords, which puts a schema file beside it)."
        )
    kinds: dict[str, str] = {}
    scalar: dict[str, bool] = {}
    utf8: dict[str, bool] = {}
    for i, rec in enumerate(records):
        try:
            feats = parse_record(rec)
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise RecordError(f"{name}: record {i} is not a valid tf.train.Example ({exc}).") from exc
        for key, (kind, s, e) in feats.items():
            if kind is None:
                scalar[key] = False
                continue
            prev = kinds.setdefault(key, kind)
            if prev != kind:
                raise SchemaError(
                    f"{name}: feature {key!r} is a {prev}_list in one record and a {kind}_list in "
                    f"record {i}; pass an explicit schema."
                )
            form, vals = _list_values(rec, kind, s, e)
            if kind == "bytes":
                count = len(vals)
                if utf8.get(key, True):
                    try:
                        for v in vals:
                            v.decode("utf-8")
                        utf8[key] = True
                    except UnicodeDecodeError:
                        utf8[key] = False
            elif form == "ints":
                count = len(vals)
            elif kind == "float":
                count = len(vals) // 4
            else:
                count = int((np.frombuffer(vals, dtype=np.uint8) < 0x80).sum())
            scalar[key] = scalar.get(key, True) and count == 1
    nested: dict[str, set[int]] = {}
    for key in kinds:
        m = _ROW_LENGTHS.match(key)
        if m and m.group(1) in kinds:
            nested.setdefault(m.group(1), set()).add(int(m.group(2)))
    hidden = {row_lengths_key(b, d) for b, ds in nested.items() for d in ds}
    specs = []
    for key in sorted(kinds):
        if key in hidden:
            continue
        kind = kinds[key]
        dtype = {"float": "float32", "int64": "int64", "bytes": "string"}[kind]
        leaf = {"float": pa.float32(), "int64": pa.int64()}.get(kind)
        if leaf is None:
            leaf = pa.string() if utf8.get(key, True) else pa.binary()
        if key in nested:
            dims = nested[key]
            if dims != set(range(1, max(dims) + 1)):
                raise SchemaError(
                    f"{name}: feature {key!r} has row lengths for dimensions {sorted(dims)}, "
                    f"not a contiguous 1..n; pass an explicit schema."
                )
            depth = max(dims) + 1
            t = leaf
            for _ in range(depth):
                t = pa.list_(t)
            specs.append(ColumnSpec(key, dtype, (None,) * depth, depth, None, t))
        elif scalar.get(key, False):
            specs.append(ColumnSpec(key, dtype, (), 0, None, leaf))
        else:
            specs.append(ColumnSpec(key, dtype, (None,), 1, None, pa.list_(leaf)))
    return specs
