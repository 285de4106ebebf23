"""TFRecord framing: reading and writing length-delimited records with masked CRC32C checks.

A TFRecord file is a sequence of records, each framed as::

    uint64 length          (little endian)
    uint32 masked_crc32c(length bytes)
    bytes  data[length]
    uint32 masked_crc32c(data)

optionally inside one GZIP or ZLIB stream covering the whole file. :func:`iter_records` checks
both CRCs of every record and raises :class:`~dataplane.errors.RecordError` naming the file and
the byte offset of the bad record (an offset in the *uncompressed* stream for compressed files).

The pieces, one module each:

* :mod:`formats.tfrecord.crc`: CRC32C, plain, masked and vectorised (hardware accelerated by
  the ``crc32c`` package, which both stacks install; a slow table-driven fallback otherwise);
* :mod:`formats.tfrecord.compression`: the compression names and GZIP / ZLIB streams;
* :mod:`formats.tfrecord.reader`: framing and checking records as they are read;
* :mod:`formats.tfrecord.writer`: framing records to write them.
"""

from __future__ import annotations

from formats.tfrecord.compression import (
    COMPRESSIONS,
    compression_suffix,
    normalize_compression,
    open_compressed,
)
from formats.tfrecord.crc import crc32c, masked_crc32c
from formats.tfrecord.reader import RecordSpans, iter_record_batches, iter_record_spans, iter_records
from formats.tfrecord.writer import write_record_array, write_records

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
