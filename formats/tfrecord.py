"""TFRecord framing: reading and writing length-delimited records with masked CRC32C checks.

A TFRecord file is a sequence of records, each framed as::

    uint64 length          (little endian)
    uint32 masked_crc32c(length bytes)
    bytes  data[length]
    uint32 masked_crc32c(data)

optionally inside one GZIP or ZLIB stream covering the whole file. :func:`iter_records` checks
both CRCs of every record and raises :class:`~dataplane.errors.RecordError` naming the file and
the byte offset of the bad record (an offset in the *uncompressed* stream for compressed files).

CRC32C comes from the ``crc32c`` package (hardware accelerated) when it is installed, which both
stacks do; otherwise a table-driven pure Python/numpy fallback is used, which is correct but slow.
"""

from __future__ import annotations

import gzip
import io
import struct
import zlib
from typing import BinaryIO, Iterable, Iterator

import numpy as np
import pyarrow as pa

from dataplane.errors import RecordError

__all__ = [
    "COMPRESSIONS",
    "crc32c",
    "masked_crc32c",
    "normalize_compression",
    "compression_suffix",
    "open_compressed",
    "iter_records",
    "write_records",
    "write_record_array",
]

COMPRESSIONS = ("GZIP", "ZLIB")
_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_READ_CHUNK = 1 << 20


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


def _masked_crc_of_lengths(lengths: np.ndarray) -> np.ndarray:
    """Masked CRC32C of each length's 8 little-endian bytes, for all lengths at once (numpy)."""
    raw = lengths.astype("<u8").view(np.uint8).reshape(-1, 8)
    crc = np.full(len(lengths), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(8):
        crc = _TABLE[(crc ^ raw[:, j]) & 0xFF] ^ (crc >> np.uint32(8))
    crc ^= np.uint32(0xFFFFFFFF)
    return (((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)).astype(
        np.uint32
    )


def normalize_compression(compression: str | None) -> str | None:
    """``"GZIP"``, ``"ZLIB"`` or ``None`` from any spelling (``"gzip"``, ``""``, ``"NONE"``).

    Raises:
        ValueError: an unknown compression name.
    """
    if compression is None:
        return None
    if not isinstance(compression, str):
        raise ValueError(f"compression must be a string or None, got {compression!r}.")
    name = compression.strip().upper()
    if name in ("", "NONE"):
        return None
    if name in ("GZ", "GZIP"):
        return "GZIP"
    if name == "ZLIB":
        return "ZLIB"
    raise ValueError(
        f"unknown TFRecord compression {compression!r}; use one of None, 'GZIP' or 'ZLIB' "
        f"(the names tf.data.TFRecordDataset accepts)."
    )


def compression_suffix(compression: str | None) -> str:
    """File name suffix for a compression: ``".gz"``, ``".zlib"`` or ``""``."""
    return {None: "", "GZIP": ".gz", "ZLIB": ".zlib"}[normalize_compression(compression)]


class _ZlibReader(io.RawIOBase):
    """Read side of one zlib stream (what TF writes for compression_type="ZLIB")."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._dec = zlib.decompressobj()
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        while not self._pending:
            if self._dec.eof:
                return 0
            chunk = self._raw.read(_READ_CHUNK)
            if not chunk:
                self._pending = self._dec.flush()
                if not self._pending:
                    if not self._dec.eof and self._dec.unused_data == b"":
                        # stream ended before the zlib trailer
                        raise EOFError("ZLIB stream ended before its end-of-stream marker")
                    return 0
                break
            self._pending = self._dec.decompress(chunk)
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


class _ZlibWriter(io.RawIOBase):
    """Write side of one zlib stream; ``close`` writes the trailer but leaves ``raw`` open."""

    def __init__(self, raw: BinaryIO, level: int = 6) -> None:
        self._raw = raw
        self._comp = zlib.compressobj(level)

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self._raw.write(self._comp.compress(b))
        return len(b)

    def close(self) -> None:
        if not self.closed:
            self._raw.write(self._comp.flush())
        super().close()


def open_compressed(raw_stream: BinaryIO, compression: str | None, *, mode: str = "rb") -> BinaryIO:
    """Wrap a binary stream so that reads decompress / writes compress as TF does.

    Args:
        raw_stream: an open binary file-like (local file, ``pyarrow.fs`` stream...).
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None`` (any case).
        mode: ``"rb"`` or ``"wb"``.

    Returns:
        A binary file-like. Closing it finishes the compressed stream but does not close
        ``raw_stream`` (except for ``None``, where ``raw_stream`` itself is returned).
    """
    if mode not in ("rb", "wb"):
        raise ValueError(f"mode must be 'rb' or 'wb', got {mode!r}.")
    comp = normalize_compression(compression)
    if comp is None:
        return raw_stream
    if comp == "GZIP":
        return gzip.GzipFile(fileobj=raw_stream, mode=mode)  # type: ignore[return-value]
    if mode == "rb":
        return io.BufferedReader(_ZlibReader(raw_stream), buffer_size=_READ_CHUNK)  # type: ignore[return-value]
    return io.BufferedWriter(_ZlibWriter(raw_stream), buffer_size=_READ_CHUNK)  # type: ignore[return-value]


def iter_records(stream: BinaryIO, *, name: str) -> Iterator[bytes]:
    """Yield the data of every record in a TFRecord stream, checking both CRCs.

    Args:
        stream: binary file-like positioned at the first record (already decompressed; see
            :func:`open_compressed`).
        name: what to call the stream in errors (the file path or URL).

    Raises:
        RecordError: a CRC mismatch or a truncated record; the message names ``name`` and the
            byte offset where the bad record starts. An empty stream yields nothing.
    """
    buf = b""
    pos = 0  # position in buf
    base = 0  # stream offset of buf[0]
    eof = False

    def fill(need: int) -> bool:
        nonlocal buf, pos, base, eof
        while len(buf) - pos < need and not eof:
            try:
                chunk = stream.read(max(_READ_CHUNK, need))
            except (EOFError, OSError, zlib.error) as exc:
                raise RecordError(
                    f"{name}: cannot read past byte offset {base + len(buf)} "
                    f"(uncompressed): {exc}. The file is truncated or not compressed the way "
                    f"it is being read; check the compression argument."
                ) from exc
            if not chunk:
                eof = True
                break
            buf = buf[pos:] + chunk
            base += pos
            pos = 0
        return len(buf) - pos >= need

    while True:
        if not fill(12):
            if len(buf) - pos == 0:
                return
            raise RecordError(
                f"{name}: truncated record header at byte offset {base + pos}: "
                f"{len(buf) - pos} of 12 header bytes present. The file was cut short "
                f"(an interrupted write?); rewrite it."
            )
        start = base + pos
        length, length_crc = _HEADER.unpack_from(buf, pos)
        if masked_crc32c(memoryview(buf)[pos : pos + 8]) != length_crc:
            raise RecordError(
                f"{name}: corrupt record at byte offset {start}: the CRC of the length field "
                f"does not match (length read: {length}). The file is damaged or is not a "
                f"TFRecord file (or is compressed: pass compression='GZIP'/'ZLIB')."
            )
        if not fill(12 + length + 4):
            raise RecordError(
                f"{name}: truncated record at byte offset {start}: it declares {length} data "
                f"bytes but the file ends after {len(buf) - pos - 12} of them. The file was cut "
                f"short; rewrite it."
            )
        data = buf[pos + 12 : pos + 12 + length]
        (data_crc,) = _FOOTER.unpack_from(buf, pos + 12 + length)
        if masked_crc32c(data) != data_crc:
            raise RecordError(
                f"{name}: corrupt record at byte offset {start}: the CRC of its {length} data "
                f"bytes does not match. The file is damaged; rewrite it."
            )
        pos += 16 + length
        yield data


def write_records(stream: BinaryIO, records: Iterable[bytes]) -> int:
    """Frame and write records; returns the number of (uncompressed) bytes written."""
    total = 0
    pending: list[bytes] = []
    pending_size = 0
    for rec in records:
        n = len(rec)
        head8 = struct.pack("<Q", n)
        pending.append(head8 + struct.pack("<I", masked_crc32c(head8)))
        pending.append(bytes(rec) if not isinstance(rec, bytes) else rec)
        pending.append(struct.pack("<I", masked_crc32c(rec)))
        pending_size += n + 16
        if pending_size >= _READ_CHUNK:
            stream.write(b"".join(pending))
            total += pending_size
            pending, pending_size = [], 0
    if pending:
        stream.write(b"".join(pending))
        total += pending_size
    return total


def write_record_array(stream: BinaryIO, records: pa.Array) -> int:
    """Frame and write every value of a binary Arrow array (vectorised framing).

    The length headers and their CRCs are computed for all records at once; the data CRCs are
    one C call per record. Nulls are not allowed.

    Returns:
        The number of (uncompressed) bytes written.
    """
    if records.null_count:
        raise ValueError("write_record_array: records must not contain nulls.")
    n = len(records)
    if n == 0:
        return 0
    if not pa.types.is_large_binary(records.type):
        records = records.cast(pa.large_binary())
    offsets = np.frombuffer(records.buffers()[1], dtype=np.int64)[
        records.offset : records.offset + n + 1
    ]
    data_buf = records.buffers()[2]
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")
    lengths = np.diff(offsets).astype(np.uint64)
    headers = np.empty(n, dtype=[("len", "<u8"), ("crc", "<u4")])
    headers["len"] = lengths
    headers["crc"] = _masked_crc_of_lengths(lengths)
    crc = _crc32c_c if _crc32c_c is not None else _crc32c_python
    mask = _MASK_DELTA
    offs = offsets.tolist()
    footers = np.empty(n, dtype="<u4")
    c = np.fromiter(map(crc, map(data.__getitem__, map(slice, offs[:-1], offs[1:]))),
                    dtype=np.uint64, count=n)
    footers[:] = (((c >> np.uint64(15)) | (c << np.uint64(17))) + np.uint64(mask)) & np.uint64(
        0xFFFFFFFF
    )
    header_arr = pa.Array.from_buffers(
        pa.large_binary(),
        n,
        [None, pa.py_buffer(np.arange(n + 1, dtype=np.int64) * 12), pa.py_buffer(headers.tobytes())],
    )
    footer_arr = pa.Array.from_buffers(
        pa.large_binary(),
        n,
        [None, pa.py_buffer(np.arange(n + 1, dtype=np.int64) * 4), pa.py_buffer(footers)],
    )
    import pyarrow.compute as pc

    framed = pc.binary_join_element_wise(
        header_arr, records, footer_arr, pa.scalar(b"", pa.large_binary())
    )
    fo = np.frombuffer(framed.buffers()[1], dtype=np.int64)[framed.offset : framed.offset + n + 1]
    out = memoryview(framed.buffers()[2])[int(fo[0]) : int(fo[-1])]
    stream.write(out)
    return len(out)
