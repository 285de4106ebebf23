"""A fixed-length list column chunk read page by page: headers parsed, levels checked and values
taken from PLAIN or dictionary pages, without Arrow's level decoding (see
:mod:`formats.parquet_pages`)."""

from __future__ import annotations

import struct
from typing import Any, Callable, Iterator

import numpy as np

from formats.parquet_pages.layout import ChunkLayout, PagesRefused
from formats.parquet_pages.rle import RowWalk, check_def_levels, dictionary_values
from formats.parquet_pages.thrift import HEADER_FIELDS, read_struct
from formats.wire import read_varint

__all__ = ["iter_page_values"]

# parquet.thrift enums
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_WINDOW = 4 << 20  # bytes of a column chunk read at a time


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
                fields, used = read_struct(self.view(pos, n), 0, HEADER_FIELDS)
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
        PagesRefused: anything the page reader does not decode, including data too damaged to
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
        PagesRefused: anything the page reader does not decode (see :mod:`formats.parquet_pages`).
    """
    import pyarrow as pa

    if list_size < 1:
        raise PagesRefused("lists of no values")
    chunk = _ChunkBytes(read, layout.start, layout.length)
    codec = pa.Codec(layout.codec) if layout.codec else None
    rows = RowWalk(list_size)
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
        check_def_levels(page, def_at, def_end, def_width, count, layout.max_def)
        encoding = info.get(2 if kind == _DATA_PAGE else 4, -1)
        if encoding == _PLAIN:
            if values_at + count * itemsize > len(page):
                raise PagesRefused("a data page shorter than its value count")
            yield np.frombuffer(page, dtype=layout.dtype, count=count, offset=values_at)
        elif encoding in (_RLE_DICTIONARY, _PLAIN_DICTIONARY):
            yield from dictionary_values(page[values_at:], count, dictionary)
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


def _levels_v1(buf: Any, pos: int) -> tuple[int, int]:
    """(start, end) of one 4-byte-length-prefixed level stream."""
    if pos + 4 > len(buf):
        raise PagesRefused("a level stream runs past its page")
    (n,) = struct.unpack_from("<i", buf, pos)
    if n < 0 or pos + 4 + n > len(buf):
        raise PagesRefused("a level stream runs past its page")
    return pos + 4, pos + 4 + n
