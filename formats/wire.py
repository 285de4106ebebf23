"""Vectorised protobuf wire-format pieces for the ``tf.train.Example`` encoder.

Varints of whole numpy arrays (and one varint read back), per-row byte strings built from
constant and varint segments, and ``large_binary`` Arrow arrays over numpy buffers (zero copy
where possible). Used by the Example coders in :mod:`formats`; nothing here knows about Examples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["varint_sizes", "varints", "varint_bytes", "read_varint", "binary", "binary_parts", "header", "join"]

_EMPTY = pa.scalar(b"", pa.large_binary())
_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def varint_sizes(u: np.ndarray) -> np.ndarray:
    """Bytes each value takes as a protobuf varint (1..10)."""
    u = u.astype(np.uint64, copy=False)
    if len(u) and u.max() < 128:
        return np.ones(len(u), dtype=np.int64)
    return np.searchsorted(_VARINT_LIMITS, u, side="right").astype(np.int64) + 1


def varints(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated varint bytes of every value, and each value's byte size."""
    u = u.astype(np.uint64, copy=False)
    sizes = varint_sizes(u)
    width = int(sizes.max()) if len(u) else 1
    mat = np.empty((len(u), width), dtype=np.uint8)
    for j in range(width):
        byte = ((u >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        mat[:, j] = np.where(j < sizes - 1, byte | 0x80, byte)
    if width == 1:
        return mat.ravel(), sizes
    return mat[np.arange(width) < sizes[:, None]], sizes


def binary(data: np.ndarray | pa.Buffer, offsets: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A large_binary array over ``data`` with int64 ``offsets`` (zero copy where possible)."""
    n = len(offsets) - 1
    vbuf = None
    if valid is not None and not valid.all():
        vbuf = pa.py_buffer(np.packbits(valid, bitorder="little"))
    dbuf = data if isinstance(data, pa.Buffer) else pa.py_buffer(np.ascontiguousarray(data))
    return pa.Array.from_buffers(
        pa.large_binary(), n, [vbuf, pa.py_buffer(np.ascontiguousarray(offsets, dtype=np.int64)), dbuf]
    )


def binary_parts(arr: pa.Array) -> tuple[pa.Buffer, np.ndarray]:
    """(data buffer, int64 offsets) of a large_binary array, honouring its slice offset."""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = arr.buffers()[2] or pa.py_buffer(b"")
    return data, offsets


def header(n: int, segments: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Build per-row byte strings from segments: ``bytes`` constants or uint64 varint arrays.

    Returns (concatenated bytes, per-row offsets).
    """
    parts = []
    sizes = np.zeros(n, dtype=np.int64)
    for seg in segments:
        if isinstance(seg, (bytes, bytearray)):
            parts.append(("c", seg))
            sizes += len(seg)
        else:
            s = varint_sizes(seg)
            parts.append(("v", seg, s))
            sizes += s
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    width = int(sizes.max()) if n else 0
    mat = np.zeros((n, width), dtype=np.uint8)
    pos = np.zeros(n, dtype=np.int64)
    rows = np.arange(n)
    uniform = True  # while every row's position is the same, use plain column slices
    for part in parts:
        if part[0] == "c":
            c = np.frombuffer(part[1], dtype=np.uint8)
            if uniform:
                p0 = int(pos[0]) if n else 0
                mat[:, p0 : p0 + len(c)] = c
            else:
                for j, b in enumerate(c):
                    mat[rows, pos + j] = b
            pos += len(c)
        else:
            u = part[1].astype(np.uint64, copy=False)
            s = part[2]
            for j in range(int(s.max()) if n else 0):
                byte = ((u >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
                byte = np.where(j < s - 1, byte | 0x80, byte)
                sel = j < s
                if uniform and sel.all():
                    mat[:, int(pos[0]) + j] = byte
                else:
                    mat[rows[sel], pos[sel] + j] = byte[sel]
            pos += s
            uniform = uniform and bool(n == 0 or (s == s[0]).all())
    if n and width and (sizes == width).all():
        return mat.ravel(), offsets
    return mat[np.arange(width) < sizes[:, None]], offsets


def join(*arrays: Any, null_handling: str = "emit_null") -> pa.Array:
    return pc.binary_join_element_wise(*arrays, _EMPTY, null_handling=null_handling)



def varint_bytes(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint starting at ``buf[pos]`` and the position after it (IndexError past the end)."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result = b & 0x7F
    shift = 7
    pos += 1
    while True:
        b = buf[pos]
        result |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return result, pos
        shift += 7
