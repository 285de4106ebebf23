"""The Python source of a TFRecord ``tf.data`` pipeline: the files' records in chunks, as
serialized records for ``tf.io.parse_example`` or, when they share a byte layout, decoded in
place (:class:`formats.example_layout.LayoutDecoder`)."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, Mapping

import numpy as np

from feeders.readahead import OpenAhead
from feeders.tfrecord.files import framed, open_raw
from formats.errors import RecordError, StorageError
from formats.example_layout import VALUE_DTYPES, LayoutDecoder
from formats.fs import Location
from formats.pool import BufferPool
from formats.tfrecord import RecordSpans

__all__ = ["RecordBatches", "layout_holds"]

# Serialized records per generator call, when the batches are dense: a multiple of the batch
# size holding about this many bytes. Fewer, bigger calls make the Python source cheap; the
# parsed chunk is then re-cut into exact batches by ``Dataset.rebatch`` in C++.
_CHUNK_BYTES = 1 << 20
_MAX_CHUNK_BATCHES = 16


class RecordBatches:
    """Reads the files' records in order, in chunks of serialized records (picklable).

    Each chunk but the last holds exactly ``batch_size`` records, or with ``chunked`` a
    multiple of it sized to about :data:`_CHUNK_BYTES` (from the first records' size). Chunks
    run across file boundaries. With ``record_shard`` ``(index, count)``, every ``count``-th
    record from ``index`` is kept (counted across files).

    With ``layout`` (``{name: (kind, shape)}`` from :func:`formats.example_layout.layout_columns`,
    chunked only), each chunk is a pair ``(serialized, decoded)``: the chunk's records decoded
    in place by :class:`~formats.example_layout.LayoutDecoder` (``decoded``, one array per
    column, ``serialized`` empty) when they all share a layout it takes, else the serialized
    records (``decoded`` empty) for ``tf.io.parse_example``.
    """

    def __init__(
        self,
        loc: Location,
        files: list[str],
        compression: str | None,
        batch_size: int,
        record_shard: tuple[int, int] | None,
        chunked: bool = False,
        layout: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    ) -> None:
        if layout is not None and not chunked:
            raise ValueError("RecordBatches: layout decoding needs chunked=True")
        self.loc = loc
        self.files = files
        self.compression = compression
        self.batch_size = batch_size
        self.record_shard = record_shard
        self.chunked = chunked
        self.layout = dict(layout) if layout is not None else None
        self._pool = BufferPool()
        # Whether the last chunk tried could be layout-decoded (None: none tried yet), kept
        # across passes: data that cannot be (varying layouts) is then framed as bytes.
        self._decodes: bool | None = None
        self._files_since_failure = 0

    def _chunk_size(self, mean_length: float) -> int:
        if not self.chunked:
            return self.batch_size
        batches = int(_CHUNK_BYTES / ((16 + mean_length) * self.batch_size))
        return self.batch_size * max(1, min(batches, _MAX_CHUNK_BATCHES))

    def __call__(self) -> Iterator[Any]:
        index, count = self.record_shard or (0, 1)
        # Remote files: the next one is opened (and its first blocks requested) while this one
        # is read, so a file's first round trips overlap the previous file's data.
        opener = OpenAhead(lambda p: open_raw(self.loc, p, self.compression),
                           self.files if self.loc.scheme != "file" else [])
        try:
            if self.layout is None:
                yield from self._chunks(opener, index, count)
            else:
                yield from self._decoded_chunks(opener, index, count)
        finally:
            opener.close()

    def _chunks(self, opener: "OpenAhead", index: int, count: int) -> Iterator[np.ndarray]:
        size = 0  # decided from the first records
        seen = 0  # records read so far, across files (for the record shard)
        pending: list[bytes] = []
        for path in self.files:
            raw = opener.take(path)
            for recs in framed(self.loc, path, raw, self.compression, self.batch_size):
                if count > 1:
                    first = (index - seen) % count
                    seen += len(recs)
                    recs = recs[first::count]
                if not recs:
                    continue
                if not size:
                    size = self._chunk_size(sum(map(len, recs)) / len(recs))
                if not pending and len(recs) == size:
                    yield np.array(recs, dtype=object)
                    continue
                pending.extend(recs)
                while len(pending) >= size:
                    yield np.array(pending[:size], dtype=object)
                    del pending[:size]
        if pending:
            yield np.array(pending, dtype=object)

    def _decoded_chunks(self, opener: "OpenAhead", index: int, count: int) -> Iterator[tuple]:
        assert self.layout is not None
        decoder = LayoutDecoder(self.layout)
        size = 0
        seen = 0
        parts: list[Any] = []  # RecordSpans, or lists of bytes from files read without spans
        have = 0
        for path in self.files:
            raw = opener.take(path)
            spans = self._spans_for_next_file()
            for part in framed(self.loc, path, raw, self.compression, self.batch_size,
                                spans=spans, pool=self._pool):
                if count > 1:
                    first = (index - seen) % count
                    seen += len(part)
                    part = part[first::count]
                if not size and len(part):
                    mean = part.lengths.mean() if spans else sum(map(len, part)) / len(part)
                    size = self._chunk_size(float(mean))
                while len(part):
                    take = min(size - have, len(part))
                    parts.append(part[:take])
                    have += take
                    part = part[take:]
                    if have == size:
                        yield self._decode(decoder, parts, have, size)
                        parts, have = [], 0
        if have:
            yield self._decode(decoder, parts, have, size)

    def _spans_for_next_file(self) -> bool:
        """Whether to read the next file for layout decoding: yes unless the last chunk tried
        could not be decoded, and then again every :data:`_RETRY_LAYOUT_FILES` files."""
        if self._decodes is not False:
            return True
        self._files_since_failure += 1
        return self._files_since_failure % _RETRY_LAYOUT_FILES == 0

    def _decode(self, decoder: LayoutDecoder, parts: list[Any], n: int, size: int) -> tuple:
        """One chunk of ``n`` records as ``(serialized, decoded)`` (see the class doc)."""
        assert self.layout is not None
        if all(isinstance(p, RecordSpans) for p in parts):
            full = _value_arrays(self.layout, size, self._pool.take_array)
            out = {name: array[:n] for name, array in full.items()}
            del full
            at = 0
            for part in parts:
                if not decoder.decode(part.buf, part.begins, part.lengths, out, at):
                    break
                at += len(part)
            else:
                self._decodes = True
                return _NO_RECORDS, out
            del out  # back to the pool
            self._decodes, self._files_since_failure = False, 0
        records = list(itertools.chain.from_iterable(
            p.records() if isinstance(p, RecordSpans) else p for p in parts
        ))
        return np.array(records, dtype=object), _value_arrays(self.layout, 0, np.zeros)


def layout_holds(
    loc: Location, path: str, compression: str | None, layout: Mapping[str, tuple[str, tuple[int, ...]]]
) -> bool:
    """Whether the first records of ``path`` (at most :data:`_PROBE_RECORDS`, from its first
    read) decode in place with ``layout``; also ``True`` when that cannot be told (an empty or
    unreadable file: the pass itself reports what is wrong).

    Decides the pipeline's shape: chunks that may come decoded cost a ``tf.cond`` per chunk in
    the parsing map, which made a pass over records that never decode (narrow rows whose
    varints vary in length, 200k numeric rows) about 8% slower.
    """
    try:
        records = framed(loc, path, open_raw(loc, path, compression), compression,
                          _PROBE_RECORDS, spans=True)
        with contextlib.closing(records):
            first = next(records, None)
    except (RecordError, StorageError, OSError):
        return True
    if first is None:
        return True
    out = _value_arrays(layout, len(first), np.empty)
    return LayoutDecoder(layout).decode(first.buf, first.begins, first.lengths, out, 0)


def _value_arrays(
    layout: Mapping[str, tuple[str, tuple[int, ...]]], rows: int, alloc: Any
) -> dict[str, np.ndarray]:
    """One array of ``rows`` per column for decoded values, from ``alloc(shape, dtype)``."""
    return {
        name: alloc((rows, *shape), VALUE_DTYPES[kind]) for name, (kind, shape) in layout.items()
    }


_PROBE_RECORDS = 256
# Files read without layout decoding after a chunk failed it, before trying again.
_RETRY_LAYOUT_FILES = 16
_NO_RECORDS = np.zeros(0, dtype=object)
