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
from typing import Any, BinaryIO, Iterable, Iterator

import numpy as np
import pyarrow as pa

from formats.errors import RecordError, StorageError
from formats.pool import BufferPool

__all__ = [
    "COMPRESSIONS",
    "crc32c",
    "masked_crc32c",
    "normalize_compression",
    "compression_suffix",
    "open_compressed",
    "iter_records",
    "iter_record_batches",
    "iter_record_spans",
    "RecordSpans",
    "write_records",
    "write_record_array",
]

COMPRESSIONS = ("GZIP", "ZLIB")
_MASK_DELTA = 0xA282EAD8
_LENGTH = struct.Struct("<Q")
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


def _mask(crcs: np.ndarray) -> np.ndarray:
    """TFRecord's mask (``rotr(crc, 15) + 0xa282ead8``) of plain CRC32Cs held as uint64."""
    return (
        (((crcs >> np.uint64(15)) | (crcs << np.uint64(17))) + np.uint64(_MASK_DELTA))
        & np.uint64(0xFFFFFFFF)
    ).astype(np.uint32)


def _masked_crcs(pieces: Iterable[bytes | memoryview], count: int) -> np.ndarray:
    """Masked CRC32C of each of ``count`` ``pieces`` (uint32): one C call per piece."""
    crc = _crc32c_c if _crc32c_c is not None else _crc32c_python
    return _mask(np.fromiter(map(crc, pieces), dtype=np.uint64, count=count))


def _masked_crcs_of_slices(data: bytes | memoryview, begins: list[int], ends: list[int]) -> np.ndarray:
    """Masked CRC32C of each ``data[begins[i]:ends[i]]`` (uint32), without copying the slices."""
    view = memoryview(data)
    return _masked_crcs(map(view.__getitem__, map(slice, begins, ends)), len(begins))


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


# Records per batch when a caller does not say; also bounds the work done before a check.
_BATCH_RECORDS = 1024
# Bytes of headers walked before their records are checked and handed out (bounds the list of
# record starts when a whole file is given as bytes).
_WALK_BYTES = 4 << 20


def _uint_at(data: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
    """The little-endian unsigned int of ``width`` (4 or 8) bytes at each of ``offsets``.

    One gather through an unaligned view of ``data`` that starts an integer at every byte.
    """
    view = np.ndarray((len(data) - width + 1,), dtype=f"<u{width}", buffer=data, strides=(1,))
    return view[offsets]


# Records of one length in a row before the walk takes them in one numpy step (fewer: the walk
# goes on one header at a time until its window ends).
_MIN_RUN = 16


def _same_length_run(data: np.ndarray, p: int, last: int, length: int) -> int:
    """How many records in a row from ``p`` have ``length``, assuming each starts where the one
    before it ends (exactly where the one-at-a-time walk would find it), counting only records
    that start at or before ``last`` and end inside ``data``."""
    stride = 16 + length
    k = min((last - p) // stride + 1, (len(data) - p) // stride)
    if k <= 0:
        return 0
    same = _uint_at(data, np.arange(p, p + k * stride, stride, dtype=np.int64), 8) == length
    return k if same.all() else int(np.argmin(same))


def _check_run(buf: bytes, starts: list[int], materialize: bool) -> "list[bytes] | RecordSpans":
    """Check the CRCs of a run of records walked in ``buf``; return their data.

    Vectorised: the lengths and stored CRCs are gathered with numpy, the length CRCs computed
    with numpy, the data CRCs with one C call per record, over the record's own ``bytes`` when
    they are returned (``materialize``, so nothing is sliced twice), else over views of ``buf``
    (the records are then returned as :class:`RecordSpans`, not copied). No Python bytecode per
    record.

    Raises:
        _BadRecord: the first record in the run whose length or data CRC does not match.
    """
    data = np.frombuffer(buf, dtype=np.uint8)
    st = np.asarray(starts, dtype=np.int64)
    lengths = _uint_at(data, st, 8)
    if len(lengths) > 1 and lengths.min() == lengths.max():  # one length: one CRC
        length_crc = masked_crc32c(struct.pack("<Q", int(lengths[0])))
    else:
        length_crc = _masked_crc_of_lengths(lengths)
    length_ok = length_crc == _uint_at(data, st + 8, 4)
    begins = st + 12
    ends = begins + lengths.astype(np.int64)  # the walk kept every record inside buf
    out: list[bytes] | RecordSpans
    if materialize:
        out = list(map(buf.__getitem__, map(slice, begins.tolist(), ends.tolist())))
        crcs = _masked_crcs(out, len(out))
    else:
        out = RecordSpans(buf, begins, ends - begins)
        crcs = _masked_crcs_of_slices(buf, begins.tolist(), ends.tolist())
    good = length_ok & (crcs == _uint_at(data, ends, 4))
    if not good.all():
        i = int(np.argmin(good))
        raise _BadRecord(i, int(lengths[i]), "length" if not length_ok[i] else "data")
    return out


class RecordSpans:
    """CRC-checked records left where they were read: ``buf[begins[i] : begins[i] + lengths[i]]``.

    What :func:`iter_record_spans` yields, for decoders that read the records' bytes in place
    (``formats.example_layout``) instead of as one Python ``bytes`` each.
    """

    __slots__ = ("buf", "begins", "lengths")

    def __init__(self, buf: bytes | memoryview, begins: np.ndarray, lengths: np.ndarray) -> None:
        self.buf = buf
        self.begins = begins  # int64
        self.lengths = lengths  # int64

    def __len__(self) -> int:
        return len(self.begins)

    def __getitem__(self, index: slice) -> "RecordSpans":
        return RecordSpans(self.buf, self.begins[index], self.lengths[index])

    def records(self) -> list[bytes]:
        """Each record's data as ``bytes`` (copies)."""
        if not len(self.begins):
            return []
        first = int(self.begins[0])
        ends = self.begins + self.lengths
        # One copy of the whole span, then slices of it: as cheap as slicing a bytes buffer.
        whole = self.buf[first : int(ends.max())]
        if not isinstance(whole, bytes):
            whole = whole.tobytes()
        return list(map(whole.__getitem__, map(slice, (self.begins - first).tolist(), (ends - first).tolist())))


class _BadRecord(Exception):
    def __init__(self, index: int, length: int, field: str) -> None:
        self.index = index
        self.length = length
        self.field = field


def _iter_checked(
    stream: BinaryIO | bytes,
    name: str,
    batch_records: int,
    materialize: bool,
    pool: BufferPool | None = None,
) -> Iterator[Any]:
    """The framing loop behind :func:`iter_record_batches` and :func:`iter_record_spans`."""
    if batch_records < 1:
        raise ValueError(f"batch_records must be >= 1, got {batch_records!r}.")
    unpack_length = _LENGTH.unpack_from
    whole = isinstance(stream, bytes)
    buf: bytes = stream if whole else b""  # type: ignore[assignment]
    base = 0  # stream offset of buf[0]
    pos = 0  # first unread byte in buf
    eof = whole

    def unreadable(offset: int, exc: BaseException) -> RecordError:
        return RecordError(
            f"{name}: cannot read past byte offset {offset} (uncompressed): {exc}. The file is "
            f"truncated or not compressed the way it is being read; check the compression "
            f"argument."
        )

    def more(need: int, *, exact: bool = False) -> None:
        """Make ``buf[pos:]`` at least ``need`` bytes long if the stream has them.

        ``exact`` reads no more than that (to finish a record cut by the end of a chunk);
        otherwise at least a chunk is read. Only the few bytes left in ``buf`` are copied, and
        none when it is used up, so the records of a chunk are sliced from the chunk as read.
        """
        nonlocal buf, base, pos, eof
        if eof:
            return
        if pool is not None:
            refill(need)
            return
        parts = [buf[pos:]] if pos < len(buf) else []
        have = len(buf) - pos
        while have < need and not eof:
            try:
                chunk = stream.read(need - have if exact else max(_READ_CHUNK, need - have))
            except StorageError:
                raise  # the storage failed (already names the file), not the file's contents
            except (EOFError, OSError, zlib.error) as exc:
                raise unreadable(base + pos + have, exc) from exc
            if not chunk:
                eof = True
                break
            parts.append(chunk)
            have += len(chunk)
        base += pos
        buf = b"".join(parts) if len(parts) != 1 else parts[0]
        pos = 0

    def refill(need: int) -> None:
        """``more`` with ``pool``: the bytes left and at least a chunk more, read into a buffer
        from the pool (one copy of the few bytes left, no joins, no fresh memory)."""
        nonlocal buf, base, pos, eof
        assert pool is not None
        left = len(buf) - pos
        size = -(-(left + max(_READ_CHUNK, need - left)) // _READ_CHUNK) * _READ_CHUNK
        block = pool.take(size)
        if left:
            block[:left] = np.frombuffer(buf, dtype=np.uint8, count=left, offset=pos)
        view = memoryview(block)
        have = left
        while have < need and not eof:
            try:
                got = stream.readinto(view[have:])  # type: ignore[union-attr]
            except StorageError:
                raise  # as in more()
            except (EOFError, OSError, zlib.error) as exc:
                raise unreadable(base + pos + have, exc) from exc
            if not got:
                eof = True
                break
            have += got
        base += pos
        buf = view[:have]  # type: ignore[assignment]
        pos = 0

    def corrupt_length(start: int, length: int) -> RecordError:
        return RecordError(
            f"{name}: corrupt record at byte offset {start}: the CRC of the length field "
            f"does not match (length read: {length}). The file is damaged or is not a "
            f"TFRecord file (or is compressed: pass compression='GZIP'/'ZLIB')."
        )

    while True:
        # Walk the whole records that start in the next few MB of buf (trusting the lengths for
        # now: the run's check below finds the first bad one, and the walk never leaves buf).
        n = len(buf)
        starts: list[int] = []
        append = starts.append
        p, last = pos, min(n - 12, pos + _WALK_BYTES)
        data = np.frombuffer(buf, dtype=np.uint8) if p <= last else None
        while p <= last:  # runs of records of one length, found with numpy
            length = unpack_length(buf, p)[0]
            same = _same_length_run(data, p, last, length)
            if same < _MIN_RUN:
                break
            stride = 16 + length
            starts.extend(range(p, p + same * stride, stride))
            p += same * stride
        data = None  # no view of buf outlives the walk (a pooled buffer is then free again)
        while p <= last:  # one header at a time
            end = p + 16 + unpack_length(buf, p)[0]
            if end > n:
                break
            append(p)
            p = end
        for i in range(0, len(starts), batch_records):
            run = starts[i : i + batch_records]
            try:
                records = _check_run(buf, run, materialize)
            except _BadRecord as bad:
                start, length = base + run[bad.index], bad.length
                if bad.field == "length":
                    raise corrupt_length(start, length) from None
                raise RecordError(
                    f"{name}: corrupt record at byte offset {start}: the CRC of its {length} "
                    f"data bytes does not match. The file is damaged; rewrite it."
                ) from None
            yield records
        if starts:
            pos = p
            continue
        # Not one whole record left in buf: the next header, or its data, needs more bytes.
        if n - pos < 12:
            more(12, exact=n > pos)  # a cut header: read its rest alone, then a fresh chunk
            if len(buf) - pos < 12:
                if len(buf) == pos:
                    return
                raise RecordError(
                    f"{name}: truncated record header at byte offset {base + pos}: "
                    f"{len(buf) - pos} of 12 header bytes present. The file was cut short "
                    f"(an interrupted write?); rewrite it."
                )
            continue
        (length,) = unpack_length(buf, pos)
        # Trust a length (and read that far) only once its own CRC matches.
        if masked_crc32c(memoryview(buf)[pos : pos + 8]) != _FOOTER.unpack_from(buf, pos + 8)[0]:
            raise corrupt_length(base + pos, length)
        more(16 + length, exact=True)  # the record alone; the next chunk is read whole
        if len(buf) - pos < 16 + length:
            raise RecordError(
                f"{name}: truncated record at byte offset {base + pos}: it declares {length} data "
                f"bytes but the file ends after {max(0, len(buf) - pos - 12)} of them. The file was "
                f"cut short; rewrite it."
            )


def iter_record_batches(
    stream: BinaryIO | bytes, *, name: str, batch_records: int = _BATCH_RECORDS
) -> Iterator[list[bytes]]:
    """Yield the records of a TFRecord stream in lists of up to ``batch_records``, CRC-checked.

    Reads the stream in chunks of about a megabyte (or walks a whole file already in memory),
    walks the length headers (a run of records of one length in one numpy step, others in
    Python, one ``unpack_from`` per record, about 0.1 us) and checks every record's two CRCs in
    one vectorised pass per list (:func:`_check_run`), so the cost per record is a few hundred
    nanoseconds. A list is yielded only after all of its
    records have passed.

    Args:
        stream: binary file-like positioned at the first record (already decompressed; see
            :func:`open_compressed`), or the whole uncompressed file as ``bytes``.
        name: what to call the stream in errors (the file path or URL).
        batch_records: most records per list (lists can be shorter, at the end of each chunk).

    Raises:
        RecordError: a CRC mismatch or a truncated record; the message names ``name`` and the
            byte offset where the bad record starts (in the uncompressed stream). An empty
            stream yields nothing.
    """
    return _iter_checked(stream, name, batch_records, materialize=True)


def iter_record_spans(
    stream: BinaryIO | bytes,
    *,
    name: str,
    batch_records: int = _BATCH_RECORDS,
    pool: BufferPool | None = None,
) -> Iterator[RecordSpans]:
    """As :func:`iter_record_batches`, but each run of records is left in the buffer it was read
    into (:class:`RecordSpans`) instead of being copied out record by record.

    The CRCs are checked the same way before a run is yielded, and errors are the same. With
    ``pool`` (the stream must have ``readinto``), the stream is read into buffers from the pool
    instead of fresh ``bytes``; a buffer is reused once no span (or view) of it is alive.
    """
    return _iter_checked(stream, name, batch_records, materialize=False, pool=pool)


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
    for batch in iter_record_batches(stream, name=name):
        yield from batch


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
    offs = offsets.tolist()
    footers = _masked_crcs_of_slices(data, offs[:-1], offs[1:]).astype("<u4")
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
