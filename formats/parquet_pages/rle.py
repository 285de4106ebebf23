"""The RLE / bit-packed hybrid encoding of Parquet levels and dictionary indices: repetition
and definition levels checked against "every row is a full list" run by run (not decoded value
by value), and dictionary indices looked up a block at a time."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from formats.parquet_pages.layout import PagesRefused
from formats.wire import read_varint

__all__ = ["unpack_bits", "unpack_groups", "check_def_levels", "RowWalk", "dictionary_values"]

_BLOCK = 65536  # dictionary-encoded values decoded at a time (256 KB of float32)


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
    return unpack_groups(raw[: groups * width].reshape(groups, width)).reshape(-1)[:count]


def unpack_groups(matrix: np.ndarray) -> np.ndarray:
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


def check_def_levels(buf: Any, pos: int, end: int, width: int, count: int, want: int) -> None:
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


class RowWalk:
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



def dictionary_values(buf: Any, count: int, dictionary: np.ndarray | None) -> Iterator[np.ndarray]:
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
            yield looked_up(unpack_groups(runs).reshape(-1))
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
