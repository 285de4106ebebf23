"""Decoding ``tf.train.Example`` records that share one byte layout: numpy, no work per record.

Records written from one schema by one writer mostly share a layout: the same features in the
same order, each with the same number of values, so that only the values' own bytes differ from
record to record (MNIST-shaped rows: every record of one length, the image's 784 floats at one
offset). ``tf.io.parse_example`` finds every feature in every record again; this module finds
them once per layout, from one record (:func:`layout_of`), and then decodes a whole run of
records read in place (a ``(records, length)`` byte matrix over the read buffer, one row per
record, see :class:`LayoutDecoder`) column by column:

* every byte that is not a value byte (tags, lengths, keys, and the length prefixes of features
  not asked for) must equal the layout record's byte, checked for all records in one comparison;
* int64 values are varints: the continuation bit of each of their bytes must equal the layout
  record's, so that every value starts and ends where it does there;
* float values are copied as they are (little-endian float32); varints are decoded vectorised.

A record that passes has the same parse tree as the layout record, so it decodes to exactly what
``tf.io.parse_example`` returns for it (floats bit for bit, int64 as protobuf reads a varint).
Anything else is left to ``tf.io.parse_example``: :meth:`LayoutDecoder.decode` returns ``False``
and the caller parses those records with TensorFlow, which also raises TensorFlow's errors for
bad ones. That covers records of another layout and layouts this decoder does not take: a
missing or repeated feature, a list kind other than the column's, a value count other than the
column's shape, values not in one packed run, string columns, ragged columns, and records that
are not one ``features`` field.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from formats.features import feature_kind
from formats.schema import ColumnSpec
from formats.wire import read_varint

__all__ = ["ExampleLayout", "LayoutDecoder", "VALUE_DTYPES", "layout_of", "layout_columns"]

_LIST_TAGS = {"float": 0x12, "int64": 0x1A}  # Feature.float_list / Feature.int64_list
# What each kind's values decode to (then cast to the column's own dtype, as parse_example's are).
VALUE_DTYPES = {"float": np.dtype("<f4"), "int64": np.dtype("<i8")}
_MAX_VARINT = 10


@dataclasses.dataclass(frozen=True)
class _Values:
    """Where one column's values lie in a record of the layout."""

    name: str
    kind: str  # "float" or "int64"
    shape: tuple[int, ...]
    start: int  # first value byte (floats: 4 bytes a value from here)
    starts: np.ndarray | None = None  # int64: each varint's first byte
    widths: np.ndarray | None = None  # int64: each varint's byte count


@dataclasses.dataclass(frozen=True)
class ExampleLayout:
    """One record layout: what must match, and where each wanted column's values are.

    Attributes:
        length: the records' byte length.
        check_pos, check_val: byte positions that must hold exactly these values.
        cont_pos, cont_val: positions of varint value bytes, and their continuation bits.
        columns: the wanted columns' value positions.
    """

    length: int
    check_pos: np.ndarray
    check_val: np.ndarray
    cont_pos: np.ndarray
    cont_val: np.ndarray
    columns: tuple[_Values, ...]

    def matches(self, rows: np.ndarray) -> bool:
        """Whether every row (a record of ``length`` bytes) has this layout."""
        if not (rows[:, self.check_pos] == self.check_val).all():
            return False
        return bool(((rows[:, self.cont_pos] & 0x80) == self.cont_val).all())

    def decode_into(self, rows: np.ndarray, out: Mapping[str, np.ndarray], at: int) -> None:
        """Write each column's values of ``rows`` (checked with :meth:`matches`) into
        ``out[name][at : at + len(rows)]`` (float32 for floats, int64 for int64)."""
        k = rows.shape[0]
        for col in self.columns:
            target = out[col.name][at : at + k]
            if col.kind == "float":
                n = 4 * int(np.prod(col.shape, dtype=np.int64))
                target[...] = rows[:, col.start : col.start + n].view("<f4").reshape(target.shape)
                continue
            assert col.starts is not None and col.widths is not None
            value = np.zeros((k, len(col.starts)), dtype=np.uint64)
            for j in range(int(col.widths.max())):
                sel = col.widths > j
                part = (rows[:, col.starts[sel] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
                if sel.all():
                    value |= part
                else:
                    value[:, sel] |= part
            target[...] = value.view(np.int64).reshape(target.shape)


def layout_columns(specs: Sequence[ColumnSpec]) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """``{name: (kind, shape)}`` for columns this decoder can take, or None if one cannot be
    taken (a string or ragged column: those are always parsed by TensorFlow)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for spec in specs:
        kind = feature_kind(spec.dtype)
        if kind not in _LIST_TAGS or spec.is_ragged or any(d is None for d in spec.shape):
            return None
        out[spec.name] = (kind, tuple(int(d) for d in spec.shape))
    return out


def layout_of(record: bytes, wanted: Mapping[str, tuple[str, tuple[int, ...]]]) -> ExampleLayout | None:
    """The layout of ``record`` for the ``wanted`` columns (from :func:`layout_columns`), or
    None when the record does not have one this decoder takes (see the module doc)."""
    try:
        return _layout_of(record, wanted)
    except (IndexError, UnicodeDecodeError):  # not a well-formed Example: TF will say why
        return None


def _layout_of(rec: bytes, wanted: Mapping[str, tuple[str, tuple[int, ...]]]) -> ExampleLayout | None:
    n = len(rec)
    structural = np.ones(n, dtype=bool)
    cont: list[np.ndarray] = []
    found: dict[str, _Values] = {}
    tag, pos = read_varint(rec, 0)
    if tag != 0x0A:  # Example.features
        return None
    length, pos = read_varint(rec, pos)
    if pos + length != n:  # one features field, the whole record
        return None
    while pos < n:
        tag, pos = read_varint(rec, pos)
        length, pos = read_varint(rec, pos)
        end = pos + length
        if tag != 0x0A or end > n:  # Features.feature map entry
            return None
        tag, pos = read_varint(rec, pos)
        if tag != 0x0A:  # the entry's key first
            return None
        length, pos = read_varint(rec, pos)
        key = rec[pos : pos + length].decode("utf-8")
        pos += length
        tag, pos = read_varint(rec, pos)
        length, pos = read_varint(rec, pos)
        if tag != 0x12 or pos + length != end:  # then its Feature, ending the entry
            return None
        if key not in wanted:
            structural[pos:end] = False  # TF skips features it was not asked for
            pos = end
            continue
        if key in found:
            return None
        kind, shape = wanted[key]
        count = int(np.prod(shape, dtype=np.int64))
        tag, pos = read_varint(rec, pos)
        length, pos = read_varint(rec, pos)
        if tag != _LIST_TAGS[kind] or pos + length != end or count == 0:
            return None
        tag, pos = read_varint(rec, pos)
        length, pos = read_varint(rec, pos)
        if tag != 0x0A or pos + length != end:  # one packed run of values
            return None
        if kind == "float":
            if length != 4 * count:
                return None
            structural[pos:end] = False
            found[key] = _Values(key, kind, shape, pos)
        else:
            payload = np.frombuffer(rec, dtype=np.uint8, count=length, offset=pos)
            last = np.flatnonzero(payload < 0x80)
            if len(last) != count or (length and payload[-1] >= 0x80):
                return None
            starts = np.concatenate([[0], last[:-1] + 1]).astype(np.int64)
            widths = last - starts + 1
            if widths.max() > _MAX_VARINT:
                return None
            structural[pos:end] = False
            cont.append(np.arange(pos, end))
            found[key] = _Values(key, kind, shape, pos, starts + pos, widths)
        pos = end
    if set(found) != set(wanted):
        return None
    data = np.frombuffer(rec, dtype=np.uint8)
    check_pos = np.flatnonzero(structural)
    cont_pos = np.concatenate(cont) if cont else np.zeros(0, dtype=np.int64)
    return ExampleLayout(
        length=n,
        check_pos=check_pos,
        check_val=data[check_pos].copy(),
        cont_pos=cont_pos,
        cont_val=data[cont_pos] & 0x80,
        columns=tuple(found[name] for name in wanted),
    )


class LayoutDecoder:
    """Decodes runs of records that share a layout into per-column arrays (see the module doc).

    Layouts are found from the first record of each record length seen and kept (at most
    :data:`MAX_LAYOUTS` lengths). Not thread-safe: one decoder per reading pass.
    """

    MAX_LAYOUTS = 64

    def __init__(self, wanted: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        self.wanted = dict(wanted)
        self._layouts: dict[int, ExampleLayout | None] = {}

    def decode(
        self, buf: bytes | memoryview, begins: np.ndarray, lengths: np.ndarray, out: Mapping[str, np.ndarray], at: int
    ) -> bool:
        """Decode the records ``buf[begins[i] : begins[i] + lengths[i]]`` into
        ``out[name][at : at + len(begins)]``.

        Returns:
            True when every record was decoded; False when one does not have a layout this
            decoder takes (``out`` may then be partly written: parse those records with
            TensorFlow instead). Also False, without looking at layouts, when the records change
            length or spacing more often than once every 16 records on average (such data has
            varying layouts, and trying each would cost more than it saves).
        """
        n = len(begins)
        if n == 0:
            return True
        # Runs of records with one length and a constant step between them: each run is one
        # strided (records x length) view of buf.
        breaks = lengths[1:] != lengths[:-1]
        if n > 2:
            step = np.diff(begins)
            same = (lengths[2:] == lengths[1:-1]) & (lengths[1:-1] == lengths[:-2])
            breaks[1:] |= same & (step[1:] != step[:-1])
        firsts = [0, *(np.flatnonzero(breaks) + 1).tolist()]
        if len(firsts) > max(4, n // 16):
            return False
        data = np.frombuffer(buf, dtype=np.uint8)
        for a, b in zip(firsts, [*firsts[1:], n]):
            length, begin = int(lengths[a]), int(begins[a])
            layout = self._layout(length, buf, begin)
            if layout is None:
                return False
            stride = int(begins[a + 1]) - begin if b - a > 1 else length
            rows = np.ndarray((b - a, length), dtype=np.uint8, buffer=data, offset=begin, strides=(stride, 1))
            if not layout.matches(rows):
                return False
            layout.decode_into(rows, out, at + a)
        return True

    def _layout(self, length: int, buf: bytes | memoryview, begin: int) -> ExampleLayout | None:
        if length in self._layouts:
            return self._layouts[length]
        if len(self._layouts) >= self.MAX_LAYOUTS:
            return None
        layout = layout_of(bytes(buf[begin : begin + length]), self.wanted)
        self._layouts[length] = layout
        return layout
