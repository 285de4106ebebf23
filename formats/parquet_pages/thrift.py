"""The Thrift compact protocol, just enough to read a Parquet ``PageHeader`` and skip what the
page reader does not need."""

from __future__ import annotations

from typing import Any

from formats.parquet_pages.layout import PagesRefused
from formats.wire import read_varint

__all__ = ["HEADER_FIELDS", "read_struct"]


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
        return read_struct(buf, pos, None)[1]
    raise PagesRefused(f"unknown Thrift type {ftype}")


def read_struct(buf: Any, pos: int, wanted: dict[int, Any] | None) -> tuple[dict[int, Any], int]:
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
                out[fid], pos = read_struct(buf, pos, wanted[fid])
                continue
        pos = _skip(buf, pos, ftype)


# PageHeader: 1 type, 2 uncompressed size, 3 compressed size, 5 data page, 7 dictionary page,
# 8 data page v2 (their own fields as listed below).
HEADER_FIELDS = {1: None, 2: None, 3: None, 5: {1: None, 2: None, 3: None, 4: None}, 7: {1: None, 2: None},
                  8: {1: None, 2: None, 3: None, 4: None, 5: None, 6: None, 7: None}}
