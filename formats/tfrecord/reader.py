"""TFRecord reading: a stream's records framed, both CRCs of every record checked.

A TFRecord file is a sequence of records, each framed as::

    uint64 length          (little endian)
    uint32 masked_crc32c(length bytes)
    bytes  data[length]
    uint32 masked_crc32c(data)

(inside one GZIP or ZLIB stream for compressed files: see :mod:`formats.tfrecord.compression`).
The stream is read a chunk at a time into a :class:`_Framer`, which walks the length headers and
checks the records of each run in vectorised steps (:func:`_check_run`); the runs are handed out
as lists of ``bytes`` (:func:`iter_record_batches`) or left in the read buffers
(:func:`iter_record_spans`). A bad record is a :class:`~dataplane.errors.RecordError` naming the
stream and the byte offset where the record starts (in the *uncompressed* stream).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, BinaryIO, Iterator

import numpy as np

from formats.errors import RecordError, StorageError
from formats.pool import BufferPool
from formats.tfrecord.crc import masked_crc32c, masked_crc_of_lengths, masked_crcs, masked_crcs_of_slices

__all__ = ["iter_records", "iter_record_batches", "iter_record_spans", "RecordSpans"]

_LENGTH = struct.Struct("<Q")
_FOOTER = struct.Struct("<I")
_READ_CHUNK = 1 << 20  # bytes read from the stream at a time (at least)

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
        length_crc = masked_crc_of_lengths(lengths)
    length_ok = length_crc == _uint_at(data, st + 8, 4)
    begins = st + 12
    ends = begins + lengths.astype(np.int64)  # the walk kept every record inside buf
    out: list[bytes] | RecordSpans
    if materialize:
        out = list(map(buf.__getitem__, map(slice, begins.tolist(), ends.tolist())))
        crcs = masked_crcs(out, len(out))
    else:
        out = RecordSpans(buf, begins, ends - begins)
        crcs = masked_crcs_of_slices(buf, begins.tolist(), ends.tolist())
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



class _Framer:
    """The framing state of one stream: its bytes read but not yet framed, and where they lie.

    ``buf[pos:]`` holds the stream's bytes from offset ``base + pos`` on; ``eof`` says the
    stream has no more. :meth:`walk` finds the whole records in ``buf``, :meth:`checked` checks
    a run of them, and :meth:`read_on` reads what the next record needs when no whole one is
    left. With a ``pool``, chunks are read into its buffers instead of fresh ``bytes``.
    """

    def __init__(self, stream: BinaryIO | bytes, name: str, pool: BufferPool | None) -> None:
        self.stream = stream
        self.name = name
        self.pool = pool
        whole = isinstance(stream, bytes)
        self.buf: bytes = stream if whole else b""  # type: ignore[assignment]
        self.base = 0  # stream offset of buf[0]
        self.pos = 0  # first unread byte in buf
        self.eof = whole

    def walk(self) -> tuple[list[int], int]:
        """The starts of the whole records that start in the next few MB of ``buf``, and where
        the walk stopped (the next record's start, when there are records).

        The lengths are trusted for now: :meth:`checked` finds the first bad one, and the walk
        never leaves ``buf``.
        """
        buf = self.buf
        unpack_length = _LENGTH.unpack_from
        n = len(buf)
        starts: list[int] = []
        append = starts.append
        p, last = self.pos, min(n - 12, self.pos + _WALK_BYTES)
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
        return starts, p

    def checked(self, run: list[int], materialize: bool) -> "list[bytes] | RecordSpans":
        """The records starting at ``run`` (offsets in ``buf``), once both CRCs of each match.

        Raises:
            RecordError: the first record whose length or data CRC does not match.
        """
        try:
            return _check_run(self.buf, run, materialize)
        except _BadRecord as bad:
            start, length = self.base + run[bad.index], bad.length
            if bad.field == "length":
                raise self._corrupt_length(start, length) from None
            raise RecordError(
                f"{self.name}: corrupt record at byte offset {start}: the CRC of its {length} "
                f"data bytes does not match. The file is damaged; rewrite it.", offset=start,
            ) from None

    def read_on(self) -> bool:
        """With not one whole record left in ``buf``: read what the next one needs, its header
        or, once the header's CRC matches, its data. ``False`` at the stream's clean end.

        Raises:
            RecordError: a corrupt length, a record or header cut short, an unreadable stream.
        """
        if len(self.buf) - self.pos < 12:
            # a cut header: read its rest alone, then a fresh chunk
            self._more(12, exact=len(self.buf) > self.pos)
            left = len(self.buf) - self.pos
            if left < 12:
                if left == 0:
                    return False
                raise RecordError(
                    f"{self.name}: truncated record header at byte offset {self.base + self.pos}: "
                    f"{left} of 12 header bytes present. The file was cut short "
                    f"(an interrupted write?); rewrite it.", offset=self.base + self.pos,
                )
            return True
        buf, pos = self.buf, self.pos
        (length,) = _LENGTH.unpack_from(buf, pos)
        # Trust a length (and read that far) only once its own CRC matches.
        if masked_crc32c(memoryview(buf)[pos : pos + 8]) != _FOOTER.unpack_from(buf, pos + 8)[0]:
            raise self._corrupt_length(self.base + pos, length)
        self._more(16 + length, exact=True)  # the record alone; the next chunk is read whole
        if len(self.buf) - self.pos < 16 + length:
            raise RecordError(
                f"{self.name}: truncated record at byte offset {self.base + self.pos}: it declares "
                f"{length} data bytes but the file ends after "
                f"{max(0, len(self.buf) - self.pos - 12)} of them. The file was cut short; "
                f"rewrite it.", offset=self.base + self.pos,
            )
        return True

    def _more(self, need: int, *, exact: bool = False) -> None:
        """Make ``buf[pos:]`` at least ``need`` bytes long if the stream has them.

        ``exact`` reads no more than that (to finish a record cut by the end of a chunk);
        otherwise at least a chunk is read. Only the few bytes left in ``buf`` are copied, and
        none when it is used up, so the records of a chunk are sliced from the chunk as read.
        """
        if self.eof:
            return
        if self.pool is not None:
            self._refill(need)
            return
        buf, pos, stream = self.buf, self.pos, self.stream
        parts = [buf[pos:]] if pos < len(buf) else []
        have = len(buf) - pos
        while have < need and not self.eof:
            try:
                chunk = stream.read(need - have if exact else max(_READ_CHUNK, need - have))  # type: ignore[union-attr]
            except StorageError:
                raise  # the storage failed (already names the file), not the file's contents
            except (EOFError, OSError, zlib.error) as exc:
                raise self._unreadable(self.base + pos + have, exc) from exc
            if not chunk:
                self.eof = True
                break
            parts.append(chunk)
            have += len(chunk)
        self.base += pos
        self.buf = b"".join(parts) if len(parts) != 1 else parts[0]
        self.pos = 0

    def _refill(self, need: int) -> None:
        """``_more`` with ``pool``: the bytes left and at least a chunk more, read into a buffer
        from the pool (one copy of the few bytes left, no joins, no fresh memory)."""
        assert self.pool is not None
        buf, pos = self.buf, self.pos
        left = len(buf) - pos
        size = -(-(left + max(_READ_CHUNK, need - left)) // _READ_CHUNK) * _READ_CHUNK
        block = self.pool.take(size)
        if left:
            block[:left] = np.frombuffer(buf, dtype=np.uint8, count=left, offset=pos)
        view = memoryview(block)
        have = left
        while have < need and not self.eof:
            try:
                got = self.stream.readinto(view[have:])  # type: ignore[union-attr]
            except StorageError:
                raise  # as in _more()
            except (EOFError, OSError, zlib.error) as exc:
                raise self._unreadable(self.base + pos + have, exc) from exc
            if not got:
                self.eof = True
                break
            have += got
        self.base += pos
        self.buf = view[:have]  # type: ignore[assignment]
        self.pos = 0

    def _unreadable(self, offset: int, exc: BaseException) -> RecordError:
        text = str(exc)
        zlib_header = "incorrect header check" in text or "unknown compression method" in text
        if offset == 0 and ("Not a gzipped file" in text or zlib_header):
            # nothing decompressed at all: the file is not compressed this way
            return RecordError(
                f"{self.name}: not {'GZIP' if 'gzip' in text else 'ZLIB'}-compressed ({text}), but "
                f"it is being read as such; pass compression=None (or the compression it has)."
            )
        return RecordError(
            f"{self.name}: cannot read past byte offset {offset} of its decompressed data: {exc}. The file is "
            f"truncated or not compressed the way it is being read; check the compression "
            f"argument."
        )

    def _corrupt_length(self, start: int, length: int) -> RecordError:
        head = bytes(self.buf[:2]) if start == 0 and self.base == 0 else b""
        if head == b"\x1f\x8b":  # GZIP's magic bytes, in a file read as uncompressed
            return RecordError(
                f"{self.name}: not an uncompressed TFRecord file: it starts with GZIP's magic "
                f"bytes (1f 8b), so it is GZIP-compressed without a .gz suffix; pass "
                f"compression='GZIP'.", maybe_compressed=True,
            )
        return RecordError(
            f"{self.name}: corrupt record at byte offset {start}: the CRC of the length field "
            f"does not match (length read: {length}). The file is damaged or is not a "
            f"TFRecord file (or is compressed: pass compression='GZIP'/'ZLIB').",
            offset=start, maybe_compressed=True,
        )


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
    framer = _Framer(stream, name, pool)
    while True:
        starts, end = framer.walk()
        for i in range(0, len(starts), batch_records):
            yield framer.checked(starts[i : i + batch_records], materialize)
        if starts:
            framer.pos = end
        elif not framer.read_on():
            return


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
            :func:`~formats.tfrecord.open_compressed`), or the whole uncompressed file as
            ``bytes``.
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
            :func:`~formats.tfrecord.open_compressed`).
        name: what to call the stream in errors (the file path or URL).

    Raises:
        RecordError: a CRC mismatch or a truncated record; the message names ``name`` and the
            byte offset where the bad record starts. An empty stream yields nothing.
    """
    for batch in iter_record_batches(stream, name=name):
        yield from batch
