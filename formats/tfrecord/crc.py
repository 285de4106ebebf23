"""CRC32C as TFRecord framing uses it: plain, masked, and vectorised over many records.

CRC32C comes from the ``crc32c`` package (hardware accelerated) when it is installed, which both
stacks do; otherwise a table-driven pure Python/numpy fallback is used, which is correct but slow.
The lengths' CRCs (8 bytes each) are always computed with numpy, all lengths at once.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

__all__ = [
    "crc32c",
    "masked_crc32c",
    "masked_crc_of_lengths",
    "masked_crcs",
    "masked_crcs_of_slices",
]

_MASK_DELTA = 0xA282EAD8


def _make_table() -> np.ndarray:
    poly = np.uint32(0x82F63B78)
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ poly, table >> 1).astype(np.uint32)
    return table


_TABLE = _make_table()
_TABLE_LIST = [int(v) for v in _TABLE]


def _crc32c_python(data: bytes | memoryview) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE_LIST
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


try:  # the C implementation (SSE4.2 / ARMv8 CRC instructions where the CPU has them)
    from crc32c import crc32c as _crc32c_c  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - both stacks install crc32c
    _crc32c_c = None


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """Plain (unmasked) CRC32C (Castagnoli) of ``data``."""
    if _crc32c_c is not None:
        return _crc32c_c(data)
    return _crc32c_python(data)  # pragma: no cover


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    """The masked CRC32C that TFRecord framing stores: ``rotr(crc, 15) + 0xa282ead8``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc_of_lengths(lengths: np.ndarray) -> np.ndarray:
    """Masked CRC32C of each length's 8 little-endian bytes, for all lengths at once (numpy)."""
    raw = lengths.astype("<u8").view(np.uint8).reshape(-1, 8)
    crc = np.full(len(lengths), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(8):
        crc = _TABLE[(crc ^ raw[:, j]) & 0xFF] ^ (crc >> np.uint32(8))
    crc ^= np.uint32(0xFFFFFFFF)
    return (((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)).astype(
        np.uint32
    )


def _mask(crcs: np.ndarray) -> np.ndarray:
    """TFRecord's mask (``rotr(crc, 15) + 0xa282ead8``) of plain CRC32Cs held as uint64."""
    return (
        (((crcs >> np.uint64(15)) | (crcs << np.uint64(17))) + np.uint64(_MASK_DELTA))
        & np.uint64(0xFFFFFFFF)
    ).astype(np.uint32)


def masked_crcs(pieces: Iterable[bytes | memoryview], count: int) -> np.ndarray:
    """Masked CRC32C of each of ``count`` ``pieces`` (uint32): one C call per piece."""
    crc = _crc32c_c if _crc32c_c is not None else _crc32c_python
    return _mask(np.fromiter(map(crc, pieces), dtype=np.uint64, count=count))


def masked_crcs_of_slices(data: bytes | memoryview, begins: list[int], ends: list[int]) -> np.ndarray:
    """Masked CRC32C of each ``data[begins[i]:ends[i]]`` (uint32), without copying the slices."""
    view = memoryview(data)
    return masked_crcs(map(view.__getitem__, map(slice, begins, ends)), len(begins))
