"""TFRecord writing: records framed with their lengths and masked CRC32Cs, one record at a time
or a whole Arrow array in vectorised steps."""

from __future__ import annotations

import struct
from typing import BinaryIO, Iterable

import numpy as np
import pyarrow as pa

from formats.tfrecord.crc import masked_crc32c, masked_crc_of_lengths, masked_crcs_of_slices

__all__ = ["write_records", "write_record_array"]

_WRITE_CHUNK = 1 << 20  # framed bytes gathered before one write


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
        if pending_size >= _WRITE_CHUNK:
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
    headers["crc"] = masked_crc_of_lengths(lengths)
    offs = offsets.tolist()
    footers = masked_crcs_of_slices(data, offs[:-1], offs[1:]).astype("<u4")
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
