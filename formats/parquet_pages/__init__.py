"""Parquet pages of a fixed-length list column, decoded without Arrow's level decoding.

A ``list<float>`` column whose rows all hold the same number of values (an MNIST image, an
embedding) is stored as one leaf column with repetition and definition levels for every value.
Arrow decodes those levels value by value to build list offsets and validity bitmaps that a
dense tensor does not need: for 20,000 MNIST rows that is about 60 ms of a 85 ms read, against
28 ms for a flat float column of the same bytes (pyarrow 14, 2026-11-25).

This module reads such a column chunk page by page and proves, instead of decoding, that the
levels say "every row is a non-null list of exactly ``list_size`` non-null values":

* definition levels must all be the maximum (no null list, no empty list, no null value);
* repetition levels must start a row (level 0) every ``list_size`` values. They are walked run
  by run (RLE / bit-packed hybrid), and once a stretch of whole runs is seen to hold whole
  rows, the stretches that follow byte for byte the same are taken without decoding: a writer
  encodes every row of a fixed-length column the same way, so a page's levels are a few
  distinct runs and then one byte comparison.

The values are then the page's PLAIN bytes, or dictionary indices looked up in the chunk's
dictionary page. Anything else (another encoding, a codec whose output length cannot be checked, a
level that breaks the pattern, deeper nesting) raises :class:`PagesRefused`, and the caller
reads the column with pyarrow instead: this module never guesses.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from formats.wire import read_varint

__all__ = ["PagesRefused", "ChunkLayout", "chunk_layout", "iter_page_values", "unpack_bits"]

# parquet.thrift enums
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_PHYSICAL = {"FLOAT": np.dtype("<f4"), "DOUBLE": np.dtype("<f8"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8")}
_WINDOW = 4 << 20  # bytes of a column chunk read at a time
_BLOCK = 65536  # dictionary-encoded values decoded at a time (256 KB of float32)
# Codecs whose output length can be proven: pyarrow's ``decompress`` returns a buffer of the
# size asked for even when the data decompress to fewer bytes (the rest uninitialised), except
# for zstd, which fails. Snappy streams start with their length and a gzip member ends with it,
# and both decoders fail unless they produce exactly that. Brotli and LZ4_RAW say nothing, so
# pages compressed with them are left to Arrow.
_CODECS = {"SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd"}


class PagesRefused(Exception):
    """This column chunk is not one this module decodes; read it with pyarrow instead."""


@dataclass(frozen=True)
class ChunkLayout:
    """Where one column chunk lies and how it is stored (from the file's footer)."""

    start: int
    length: int
    codec: str | None  # pyarrow Codec name; None for UNCOMPRESSED
    num_values: int
    dtype: np.dtype
    max_def: int  # the repetition level's maximum is 1: checked by chunk_layout


def chunk_layout(metadata: Any, row_group: int, column: str, dtype: Any) -> ChunkLayout:
    """The layout of ``column``'s chunk in ``row_group``, if it is a one-level list of ``dtype``.

    Raises:
        PagesRefused: the column is nested deeper, has another physical type or codec.
    """
    schema = metadata.schema
    leaf = None
    for i in range(metadata.num_columns):
        path = schema.column(i).path
        if path.split(".")[0] == column:
            if leaf is not None:
                raise PagesRefused(f"column {column!r} has several leaf columns")
            leaf = i
    if leaf is None:
        raise PagesRefused(f"no leaf column for {column!r}")
    desc = schema.column(leaf)
    if desc.max_repetition_level != 1:
        raise PagesRefused(f"{desc.path} has repetition level {desc.max_repetition_level}, not 1")
    physical = _PHYSICAL.get(desc.physical_type)
    if physical is None or physical != np.dtype(dtype).newbyteorder("<"):
        raise PagesRefused(f"{desc.path} is stored as {desc.physical_type}, not as {np.dtype(dtype)}")
    logical = desc.logical_type
    if logical.type != "NONE":
        info = json.loads(logical.to_json())
        if logical.type != "INT" or not info.get("isSigned") or info.get("bitWidth") != 8 * physical.itemsize:
            raise PagesRefused(f"{desc.path} has logical type {logical}")
    col = metadata.row_group(row_group).column(leaf)
    compression = col.compression.upper()
    if compression == "UNCOMPRESSED":
        codec = None
    elif compression in _CODECS:
        codec = _CODECS[compression]
    else:
        raise PagesRefused(f"{desc.path} is compressed with {compression}")
    start = col.data_page_offset
    if col.has_dictionary_page and 0 < col.dictionary_page_offset < start:
        start = col.dictionary_page_offset
    return ChunkLayout(
        start=int(start),
        length=int(col.total_compressed_size),
        codec=codec,
        num_values=int(col.num_values),
        dtype=physical,
        max_def=int(desc.max_definition_level),
    )


# ---------------------------------------------------------------------------------------------
# Thrift compact protocol: just enough to read a PageHeader and skip what it does not need.


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _skip(buf: Any, pos: int, ftype: int) -> int:
    if ftype in (1, 2):  # bool in a field header
        return pos
    if ftype == 3:
        return pos + 1
    if ftype in (4, 5, 6):
        return read_varint(buf, pos)[1]
    if ftype == 7:
        return pos + 8
    if ftype == 8:
        n, pos = read_varint(buf, pos)
        return pos + n
    if ftype in (9, 10):
        head = buf[pos]
        pos += 1
        size, etype = head >> 4, head & 0x0F
        if size == 15:
            size, pos = read_varint(buf, pos)
        for _ in range(size):
            pos = pos + 1 if etype in (1, 2) else _skip(buf, pos, etype)
        return pos
    if ftype == 11:
        size, pos = read_varint(buf, pos)
        if size:
            kv = buf[pos]
            pos += 1
            for _ in range(size):
                for etype in (kv >> 4, kv & 0x0F):
                    pos = pos + 1 if etype in (1, 2) else _skip(buf, pos, etype)
        return pos
    if ftype == 12:
        return _struct(buf, pos, None)[1]
    raise PagesRefused(f"unknown Thrift type {ftype}")


def _struct(buf: Any, pos: int, wanted: dict[int, Any] | None) -> tuple[dict[int, Any], int]:
    """Read a compact-protocol struct: ints and bools of the top level, nested structs whose
    field id maps to a ``wanted`` dict of their own; everything else skipped."""
    out: dict[int, Any] = {}
    fid = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return out, pos
        ftype = head & 0x0F
        delta = head >> 4
        if delta:
            fid += delta
        else:
            raw, pos = read_varint(buf, pos)
            fid = _zigzag(raw)
        if wanted is not None and fid in wanted:
            if ftype in (5, 6, 4):
                raw, pos = read_varint(buf, pos)
                out[fid] = _zigzag(raw)
                continue
            if ftype in (1, 2):
                out[fid] = ftype == 1
                continue
            if ftype == 12:
                out[fid], pos = _struct(buf, pos, wanted[fid])
                continue
        pos = _skip(buf, pos, ftype)


# PageHeader: 1 type, 2 uncompressed size, 3 compressed size, 5 data page, 7 dictionary page,
# 8 data page v2 (their own fields as listed below).
_HEADER_FIELDS = {1: None, 2: None, 3: None, 5: {1: None, 2: None, 3: None, 4: None}, 7: {1: None, 2: None},
                  8: {1: None, 2: None, 3: None, 4: None, 5: None, 6: None, 7: None}}


# ---------------------------------------------------------------------------------------------
# RLE / bit-packed hybrid


def unpack_bits(data: Any, width: int, count: int) -> np.ndarray:
    """``count`` little-endian bit-packed values of ``width`` bits (1-32) as uint32."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if width == 8:
        return raw[:count].astype(np.uint32)
    if width == 16:
        return raw[: 2 * count].view("<u2").astype(np.uint32)
    if width == 32:
        return raw[: 4 * count].view("<u4").astype(np.uint32)
    if width == 1:
        return np.unpackbits(raw, count=count, bitorder="little").astype(np.uint32)
    groups = -(-count // 8)
    if len(raw) < groups * width:
        raise PagesRefused("bit-packed values end early")
    return _unpack_groups(raw[: groups * width].reshape(groups, width)).reshape(-1)[:count]


def _unpack_groups(matrix: np.ndarray) -> np.ndarray:
    """Bit-packed groups of 8 values, one group per last-axis row of ``width`` bytes (any view).

    Eight values take exactly ``width`` bytes, so value j of every group starts at the same byte
    and bit: the values are unpacked column by column. Returns shape ``(*leading, 8)``.
    """
    width = matrix.shape[-1]
    wide = np.uint64 if width > 25 else np.uint32
    out = np.empty((*matrix.shape[:-1], 8), dtype=np.uint32)
    mask = wide((1 << width) - 1)
    for j in range(8):
        first, shift = divmod(j * width, 8)
        word = matrix[..., first].astype(wide)
        for k in range(1, (shift + width + 7) // 8):
            word |= matrix[..., first + k].astype(wide) << wide(8 * k)
        out[..., j] = (word >> wide(shift)) & mask
    return out


def _check_def_levels(buf: Any, pos: int, end: int, width: int, count: int, want: int) -> None:
    """Every one of ``count`` levels in ``buf[pos:end]`` equals ``want``."""
    seen = 0
    nbytes = (width + 7) // 8
    while seen < count:
        if pos >= end:
            raise PagesRefused("definition levels end early")
        header, pos = read_varint(buf, pos)
        if header & 1:
            n = (header >> 1) * 8
            size = (header >> 1) * width
            take = min(n, count - seen)
            if pos + size > end:
                raise PagesRefused("definition levels run past their stream")
            values = unpack_bits(buf[pos : pos + size], width, take)
            if len(values) != take or not np.all(values == want):
                raise PagesRefused("a null or an empty list (definition level below the maximum)")
            pos += size
            seen += take
        else:
            n = header >> 1
            value = int.from_bytes(buf[pos : pos + nbytes], "little")
            pos += nbytes
            if pos > end:
                raise PagesRefused("definition levels run past their stream")
            if value != want or n == 0:
                raise PagesRefused("a null or an empty list (definition level below the maximum)")
            seen += min(n, count - seen)


class _RowWalk:
    """Checks repetition levels (max 1) row by row across the pages of one column chunk.

    ``filled`` is how many values the current row holds so far (0 before the chunk's first).
    """

    def __init__(self, list_size: int) -> None:
        self.size = list_size
        self.filled = 0

    def _zeros(self, rel: np.ndarray, n: int) -> None:
        """A run of ``n`` levels whose row starts (level 0) are at offsets ``rel``, ascending."""
        size = self.size
        if len(rel) == 0:
            if self.filled == 0:
                raise PagesRefused("the column chunk does not start with a row")
            self.filled += n
        else:
            first = int(rel[0])
            if self.filled == 0:
                if first != 0:
                    raise PagesRefused("the column chunk does not start with a row")
            elif self.filled + first != size:
                raise PagesRefused("a row with another number of values")
            if len(rel) > 1 and not np.all(np.diff(rel) == size):
                raise PagesRefused("a row with another number of values")
            self.filled = n - int(rel[-1])
        if self.filled > size:
            raise PagesRefused("a row with another number of values")

    def walk(self, buf: Any, pos: int, end: int, count: int) -> None:
        """Check ``count`` repetition levels (bit width 1) in ``buf[pos:end]``."""
        size = self.size
        seen = 0
        # filled -> (byte offset, levels seen) at a run boundary: a stretch between two
        # boundaries with the same ``filled`` holds whole rows, and repeats of its bytes do too.
        marks: dict[int, tuple[int, int]] = {}
        view = memoryview(buf)
        while seen < count:
            mark = marks.get(self.filled)
            if mark is not None and mark[0] < pos:
                seg = view[mark[0] : pos]
                levels = seen - mark[1]
                plen = len(seg)
                if levels and view[pos : pos + plen] == seg:
                    most = min((end - pos) // plen, (count - seen) // levels)
                    if most > 0:
                        pattern = bytes(seg) * most
                        got = view[pos : pos + plen * most]
                        if got != pattern:
                            diff = np.frombuffer(got, np.uint8) != np.frombuffer(pattern, np.uint8)
                            most = int(np.argmax(diff)) // plen
                        pos += plen * most
                        seen += levels * most
                        if seen >= count:
                            break
            marks[self.filled] = (pos, seen)
            if pos >= end:
                raise PagesRefused("repetition levels end early")
            header, pos = read_varint(buf, pos)
            if header & 1:
                groups = header >> 1
                take = min(groups * 8, count - seen)
                if pos + groups > end:
                    raise PagesRefused("repetition levels run past their stream")
                bits = np.unpackbits(np.frombuffer(view[pos : pos + groups], np.uint8), count=take, bitorder="little")
                if len(bits) != take:
                    raise PagesRefused("repetition levels end early")
                self._zeros(np.flatnonzero(bits == 0), take)
                pos += groups
                seen += take
            else:
                n = min(header >> 1, count - seen)
                if n == 0 or pos >= end:
                    raise PagesRefused("an empty or cut repetition run")
                value = buf[pos]
                pos += 1
                if value == 1:
                    self._zeros(np.empty(0, np.int64), n)
                elif value == 0 and (n == 1 or size == 1):
                    self._zeros(np.arange(n, dtype=np.int64), n)
                else:
                    raise PagesRefused(f"repetition level {value} repeated {n} times")
                seen += n
        if seen != count:
            raise PagesRefused("repetition levels do not match the page's value count")

    def finish(self) -> None:
        if self.filled != self.size:
            raise PagesRefused("the column chunk ends inside a row")


def _levels_v1(buf: Any, pos: int) -> tuple[int, int]:
    """(start, end) of one 4-byte-length-prefixed level stream."""
    if pos + 4 > len(buf):
        raise PagesRefused("a level stream runs past its page")
    (n,) = struct.unpack_from("<i", buf, pos)
    if n < 0 or pos + 4 + n > len(buf):
        raise PagesRefused("a level stream runs past its page")
    return pos + 4, pos + 4 + n


def _dictionary_values(buf: Any, count: int, dictionary: np.ndarray | None) -> Iterator[np.ndarray]:
    """``count`` values given as dictionary indices (bit width byte, then RLE / bit-packed).

    Yields them :data:`_BLOCK` values or so at a time, so that no temporary is large: whole
    pages' temporaries (1 MB each) were mapped and unmapped every time in the decoding thread,
    about 11,000 page faults and 20 ms per MNIST epoch on numpy 2 (64k-value blocks: about
    1,600; fewer still at 16k, which cost more calls on numpy 1). Each block's indices are
    checked before its values are yielded.
    """
    if dictionary is None:
        raise PagesRefused("dictionary indices without a dictionary page")
    if len(buf) < 1:
        raise PagesRefused("dictionary indices missing")
    width = buf[0]
    pos = 1
    if width > 32:
        raise PagesRefused(f"dictionary index width {width}")
    size = len(dictionary)

    def looked_up(indices: np.ndarray) -> np.ndarray:
        if len(indices) and int(indices.max()) >= size:
            raise PagesRefused("a dictionary index past the dictionary")
        return dictionary[indices]

    if width == 0:
        for at in range(0, count, _BLOCK):
            yield looked_up(np.zeros(min(_BLOCK, count - at), dtype=np.uint32))
        return
    seen = 0
    # Writers cut long bit-packed stretches into runs of 63 groups (header 0x7F, Arrow's
    # longest): the leading ones are unpacked straight from the page, a block of runs at a time.
    stride = 1 + 63 * width
    full = min((len(buf) - pos) // stride, count // 504)
    if full:
        frame = np.frombuffer(buf, np.uint8, count=full * stride, offset=pos).reshape(full, stride)
        marked = frame[:, 0] == 0x7F
        full = full if marked.all() else int(np.argmin(marked))
        per = max(1, _BLOCK // 504)
        for r in range(0, full, per):
            runs = frame[r : min(full, r + per), 1:].reshape(-1, 63, width)
            yield looked_up(_unpack_groups(runs).reshape(-1))
        seen = full * 504
        pos += full * stride
    # The rest run by run, gathered into blocks.
    pending: list[np.ndarray] = []
    held = 0
    nbytes = (width + 7) // 8
    while seen < count:
        if pos >= len(buf):
            raise PagesRefused("dictionary indices end early")
        header, pos = read_varint(buf, pos)
        if header & 1:
            groups = header >> 1
            if pos + groups * width > len(buf):
                raise PagesRefused("dictionary indices run past their page")
            take = min(groups * 8, count - seen)
            pending.append(unpack_bits(buf[pos : pos + groups * width], width, take))
            pos += groups * width
        else:
            take = min(header >> 1, count - seen)
            if take == 0:
                raise PagesRefused("an empty dictionary run")
            value = int.from_bytes(buf[pos : pos + nbytes], "little")
            pos += nbytes
            if pos > len(buf):
                raise PagesRefused("dictionary indices run past their page")
            pending.append(np.full(take, value, dtype=np.uint32))
        seen += take
        held += take
        if held >= _BLOCK or seen >= count:
            yield looked_up(np.concatenate(pending) if len(pending) > 1 else pending[0])
            pending, held = [], 0


class _ChunkBytes:
    """A column chunk's bytes, read in windows of at least :data:`_WINDOW` bytes."""

    def __init__(self, read: Callable[[int, int], Any], start: int, length: int) -> None:
        self._read = read
        self._start = start
        self.length = length
        self._base = 0
        self._buf = memoryview(b"")

    def view(self, pos: int, n: int) -> memoryview:
        """Bytes ``[pos, pos + n)`` of the chunk (``n`` must not run past it)."""
        if pos < self._base or pos + n > self._base + len(self._buf):
            want = min(max(n, _WINDOW), self.length - pos)
            data = memoryview(self._read(self._start + pos, want)).cast("B")
            if len(data) != want:
                raise PagesRefused("the file is shorter than its footer says")
            self._buf, self._base = data, pos
        at = pos - self._base
        return self._buf[at : at + n]

    def header(self, pos: int) -> tuple[dict[int, Any], int]:
        """The page header at ``pos`` and the position after it."""
        n = 1024
        while True:
            n = min(n, self.length - pos)
            if n <= 0:
                raise PagesRefused("a page header runs past the column chunk")
            try:
                fields, used = _struct(self.view(pos, n), 0, _HEADER_FIELDS)
                return fields, pos + used
            except IndexError:
                if pos + n >= self.length:
                    raise PagesRefused("a page header runs past the column chunk") from None
                n *= 16


def iter_page_values(
    read: Callable[[int, int], Any], layout: ChunkLayout, list_size: int
) -> Iterator[np.ndarray]:
    """The values of one column chunk as flat arrays, page by page (see :func:`_page_values`).

    Raises:
        PagesRefused: anything this module does not decode, including data too damaged to
            parse (a varint or header running off its page, nesting past Python's limit).
    """
    try:
        yield from _page_values(read, layout, list_size)
    except (IndexError, ValueError, struct.error, RecursionError) as exc:
        raise PagesRefused(f"unreadable page data ({type(exc).__name__}: {exc})") from None


def _page_values(
    read: Callable[[int, int], Any], layout: ChunkLayout, list_size: int
) -> Iterator[np.ndarray]:
    """The values of one column chunk as flat arrays, page by page, checked as described above.

    Args:
        read: ``read(offset, nbytes)`` returns that many bytes of the file (bytes-like).
        layout: from :func:`chunk_layout`.
        list_size: values every row must hold.

    Every array yielded holds values of whole or partial rows in order (a page's values, or
    part of them); the chunk's rows are ``layout.num_values // list_size``. A page's levels are
    checked before any of its values are yielded, and
    :meth:`PagesRefused` may come after some pages were yielded (the last row cut short):
    callers keep only rows they have seen complete.

    Raises:
        PagesRefused: anything this module does not decode (see the module's docstring).
    """
    import pyarrow as pa

    if list_size < 1:
        raise PagesRefused("lists of no values")
    chunk = _ChunkBytes(read, layout.start, layout.length)
    codec = pa.Codec(layout.codec) if layout.codec else None
    rows = _RowWalk(list_size)
    def_width = layout.max_def.bit_length()
    itemsize = layout.dtype.itemsize
    dictionary = None
    pos = 0
    total = 0
    while total < layout.num_values:
        header, pos = chunk.header(pos)
        kind = header.get(1)
        size = header.get(3, -1)
        raw_size = header.get(2, -1)
        if size < 0 or raw_size < 0 or pos + size > layout.length:
            raise PagesRefused("a page runs past the column chunk")
        body = chunk.view(pos, size)
        pos += size
        if kind == _INDEX_PAGE:
            continue
        if kind == _DICTIONARY_PAGE:
            info = header.get(7) or {}
            if info.get(2, _PLAIN) not in (_PLAIN, _PLAIN_DICTIONARY):
                raise PagesRefused("a dictionary page not PLAIN-encoded")
            page = _decompress(codec, body, raw_size)
            n = info.get(1, -1)
            if n < 0 or n * itemsize > len(page):
                raise PagesRefused("a dictionary page shorter than its value count")
            dictionary = np.frombuffer(page, dtype=layout.dtype, count=n)
            continue
        if kind == _DATA_PAGE:
            info = header.get(5) or {}
            count = info.get(1, -1)
            if info.get(3, _RLE) != _RLE or info.get(4, _RLE) != _RLE:
                raise PagesRefused("levels not RLE-encoded")
            page = _decompress(codec, body, raw_size)
            rep_at, rep_end = _levels_v1(page, 0)
            def_at, def_end = _levels_v1(page, rep_end)
            values_at = def_end
        elif kind == _DATA_PAGE_V2:
            info = header.get(8) or {}
            count = info.get(1, -1)
            rep_len, def_len = info.get(6, -1), info.get(5, -1)
            if info.get(2, 0) != 0 or rep_len < 0 or def_len < 0 or rep_len + def_len > len(body):
                raise PagesRefused("a v2 page with nulls or bad level lengths")
            levels = bytes(body[: rep_len + def_len])
            rest = body[rep_len + def_len :]
            if info.get(7, True) and codec is not None:
                rest = _decompress(codec, rest, raw_size - rep_len - def_len)
            page = memoryview(levels + bytes(rest)) if rest else memoryview(levels)
            rep_at, rep_end = 0, rep_len
            def_at, def_end = rep_len, rep_len + def_len
            values_at = def_end
        else:
            raise PagesRefused(f"page type {kind}")
        if count < 0 or total + count > layout.num_values:
            raise PagesRefused("page value counts exceed the column chunk's")
        rows.walk(page, rep_at, rep_end, count)
        _check_def_levels(page, def_at, def_end, def_width, count, layout.max_def)
        encoding = info.get(2 if kind == _DATA_PAGE else 4, -1)
        if encoding == _PLAIN:
            if values_at + count * itemsize > len(page):
                raise PagesRefused("a data page shorter than its value count")
            yield np.frombuffer(page, dtype=layout.dtype, count=count, offset=values_at)
        elif encoding in (_RLE_DICTIONARY, _PLAIN_DICTIONARY):
            yield from _dictionary_values(page[values_at:], count, dictionary)
        else:
            raise PagesRefused(f"value encoding {encoding}")
        total += count
    rows.finish()
    if total != layout.num_values or total % list_size:
        raise PagesRefused("the column chunk's value count is not whole rows")


def _decompress(codec: Any, body: memoryview, raw_size: int) -> memoryview:
    if codec is None:
        if len(body) != raw_size:
            raise PagesRefused("an uncompressed page whose sizes differ")
        return body
    name = codec.name
    if name == "snappy":
        stated = read_varint(body, 0)[0]
    elif name == "gzip":
        stated = int.from_bytes(body[-4:], "little") if len(body) >= 18 else -1
        raw_size &= 0xFFFFFFFF
    else:
        stated = raw_size  # zstd checks the size itself
    if stated != raw_size:
        raise PagesRefused(f"a {name} page that decompresses to {stated} bytes, not {raw_size}")
    try:
        out = codec.decompress(body, decompressed_size=raw_size)
    except Exception as exc:  # pyarrow raises OSError/ArrowInvalid for corrupt input
        raise PagesRefused(f"a page does not decompress ({exc})") from None
    return memoryview(out).cast("B")  # pyarrow buffers are signed chars
