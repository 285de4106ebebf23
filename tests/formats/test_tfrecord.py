"""TFRecord framing: our reader and writer against TensorFlow's, and every way a file breaks."""

from __future__ import annotations

import io
import pickle
import struct

import pyarrow as pa
import pytest

from dataplane.errors import RecordError
from formats import tfrecord
from formats.tfrecord import (
    iter_records,
    masked_crc32c,
    open_compressed,
    write_record_array,
    write_records,
)

RECORDS = [b"", b"hello", bytes(range(256)) * 40, b"x"]


def _write(path, records, compression=None):
    with open(path, "wb") as raw:
        stream = open_compressed(raw, compression, mode="wb")
        n = write_records(stream, records)
        if stream is not raw:
            stream.close()
    return n


def _read(path, compression=None):
    with open(path, "rb") as raw:
        return list(iter_records(open_compressed(raw, compression), name=str(path)))


def test_crc32c_known_values_and_fallback_agree():
    assert tfrecord.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    data = bytes(range(256)) * 3
    assert tfrecord.crc._crc32c_python(data) == tfrecord.crc32c(data)
    crc = 0xE3069283
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_round_trip_with_tensorflow_both_ways(tmp_path, compression):
    tf = pytest.importorskip("tensorflow")
    ours = tmp_path / "ours.tfrecord"
    n = _write(ours, RECORDS, compression)
    assert n == sum(len(r) + 16 for r in RECORDS)
    got = [r.numpy() for r in tf.data.TFRecordDataset(str(ours), compression_type=compression or "")]
    assert got == RECORDS
    theirs = tmp_path / "theirs.tfrecord"
    with tf.io.TFRecordWriter(str(theirs), options=compression or "") as w:
        for r in RECORDS:
            w.write(r)
    assert _read(theirs, compression) == RECORDS


def test_vectorised_framing_matches_per_record_framing():
    arr = pa.array(RECORDS, pa.binary()).slice(1)  # a sliced array: offsets must be honoured
    a, b = io.BytesIO(), io.BytesIO()
    assert write_record_array(a, arr) == write_records(b, RECORDS[1:])
    assert a.getvalue() == b.getvalue()
    assert write_record_array(io.BytesIO(), pa.array([], pa.binary())) == 0


def test_empty_file_yields_nothing(tmp_path):
    p = tmp_path / "empty.tfrecord"
    p.write_bytes(b"")
    assert _read(p) == []


def test_corrupt_data_crc_names_file_and_offset(tmp_path):
    p = tmp_path / "bad.tfrecord"
    _write(p, RECORDS)
    raw = bytearray(p.read_bytes())
    second = 16 + len(RECORDS[0])  # byte offset of the second record
    raw[second + 12] ^= 0xFF  # flip a data byte of "hello"
    p.write_bytes(bytes(raw))
    with pytest.raises(RecordError) as info:
        _read(p)
    msg = str(info.value)
    assert str(p) in msg and f"byte offset {second}" in msg and "CRC of its 5 data bytes" in msg
    assert (info.value.offset, info.value.maybe_compressed) == (second, False)
    # the attributes survive the pickling that carries an error out of a Spark task
    again = pickle.loads(pickle.dumps(info.value))
    assert (str(again), again.offset, again.maybe_compressed) == (msg, second, False)


def test_corrupt_length_crc(tmp_path):
    p = tmp_path / "bad.tfrecord"
    _write(p, RECORDS)
    raw = bytearray(p.read_bytes())
    raw[0:8] = struct.pack("<Q", 7)  # length changed, its CRC not
    p.write_bytes(bytes(raw))
    with pytest.raises(RecordError, match=r"byte offset 0: the CRC of the length field") as info:
        _read(p)
    assert (info.value.offset, info.value.maybe_compressed) == (0, True)


@pytest.mark.parametrize("cut, what", [(5, "truncated record header"), (30, "truncated record at")])
def test_truncated_file(tmp_path, cut, what):
    p = tmp_path / "cut.tfrecord"
    _write(p, [b"a" * 40])
    p.write_bytes(p.read_bytes()[:cut])
    with pytest.raises(RecordError, match=what) as info:
        _read(p)
    assert "byte offset 0" in str(info.value) and info.value.offset == 0


def test_truncated_gzip_is_a_record_error(tmp_path):
    p = tmp_path / "cut.tfrecord.gz"
    _write(p, [bytes(range(256)) * 100] * 5, "GZIP")
    p.write_bytes(p.read_bytes()[:-200])
    with pytest.raises(RecordError, match=str(p)):
        _read(p, "GZIP")


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_plain_file_read_as_compressed_is_told_so(tmp_path, compression):
    # "cannot read past byte offset 0 (uncompressed): Not a gzipped file" read like damage
    p = tmp_path / "plain.tfrecord"
    _write(p, RECORDS)
    with pytest.raises(RecordError, match=rf"^{p}: not {compression}-compressed \(.*\), but it is being "
                                          r"read as such; pass compression=None \(or the compression it has\)\.$"):
        _read(p, compression)


def test_compression_names():
    assert tfrecord.normalize_compression("gzip") == "GZIP"
    assert tfrecord.normalize_compression("") is None
    assert tfrecord.compression_suffix("zlib") == ".zlib"
    with pytest.raises(ValueError, match="unknown TFRecord compression 'lz4'"):
        tfrecord.normalize_compression("lz4")


# ---------------------------------------------------------------- batches, chunks and sources

MANY = [bytes([i % 251]) * ((i * 37) % 301) for i in range(200)]  # 0..300 bytes, some empty


def _offsets(records) -> list[int]:
    out, pos = [], 0
    for r in records:
        out.append(pos)
        pos += 16 + len(r)
    return out


def _write_with_bad_data(path, records, index) -> tuple[int, int]:
    """Write ``records`` with one data byte of record ``index`` flipped (its CRC kept);
    return that record's byte offset and length."""
    _write(path, records)
    at = _offsets(records)[index]
    raw = bytearray(path.read_bytes())
    raw[at + 12 + 100] ^= 0x01
    path.write_bytes(bytes(raw))
    return at, len(records[index])


def _batches(source, *, batch_records=1024):
    return list(tfrecord.iter_record_batches(source, name="f", batch_records=batch_records))


@pytest.mark.parametrize("read_chunk", [1, 7, 100, 1 << 20])
@pytest.mark.parametrize("batch_records", [1, 3, 1024])
def test_records_cross_read_chunks_and_batches_intact(tmp_path, monkeypatch, read_chunk, batch_records):
    p = tmp_path / "many.tfrecord"
    _write(p, MANY)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", read_chunk)
    with open(p, "rb") as f:
        batches = _batches(f, batch_records=batch_records)
    assert [r for b in batches for r in b] == MANY
    assert all(0 < len(b) <= batch_records for b in batches)


def test_a_file_in_memory_reads_as_the_stream_does(tmp_path):
    p = tmp_path / "many.tfrecord"
    _write(p, MANY)
    batches = _batches(p.read_bytes(), batch_records=64)
    assert [len(b) for b in batches] == [64, 64, 64, 8]
    assert [r for b in batches for r in b] == MANY


@pytest.mark.parametrize("walk", [1, 13, 700])
@pytest.mark.parametrize("source", ["stream", "bytes"])
def test_a_short_walk_still_hands_out_every_record_once(tmp_path, monkeypatch, walk, source):
    """Headers are walked a few MB at a time (a whole file in memory is not walked at once);
    any walk length, even shorter than one record, gives every record once, in order."""
    p = tmp_path / "many.tfrecord"
    _write(p, MANY)
    monkeypatch.setattr(tfrecord.reader, "_WALK_BYTES", walk)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", 1000)
    with open(p, "rb", buffering=0) as f:
        batches = _batches(f if source == "stream" else f.read(), batch_records=64)
    assert [r for b in batches for r in b] == MANY


@pytest.mark.parametrize("source", ["stream", "bytes"])
def test_a_bad_record_deep_in_the_file_has_its_own_offset(tmp_path, monkeypatch, source):
    p = tmp_path / "bad.tfrecord"
    at, size = _write_with_bad_data(p, MANY, 151)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", 1000)  # the record starts in a later chunk
    seen = []
    with pytest.raises(RecordError, match=rf"^f: corrupt record at byte offset {at}: "
                                          rf"the CRC of its {size} data bytes does not match"):
        with open(p, "rb", buffering=0) as f:
            src = f if source == "stream" else f.read()
            for batch in tfrecord.iter_record_batches(src, name="f", batch_records=50):
                seen.extend(batch)
    # Only checked lists were yielded: a prefix of the good records, never the bad one.
    assert seen == MANY[: len(seen)] and len(seen) <= 151


@pytest.mark.parametrize("grow", [3, 1 << 40])
def test_a_bad_length_deep_in_the_file_is_caught_where_it_is(tmp_path, grow):
    """The walk trusts lengths until the run is checked: a wrong length that still fits the
    buffer (3) leads it astray for the rest of the run, one past the buffer (2**40) stops it.
    Either way the error is the bad record's, and only good records before it are yielded."""
    p = tmp_path / "bad.tfrecord"
    _write(p, MANY)
    at, size = _offsets(MANY)[151], len(MANY[151])
    raw = bytearray(p.read_bytes())
    raw[at : at + 8] = struct.pack("<Q", size + grow)  # its CRC left as it was
    p.write_bytes(bytes(raw))
    seen = []
    with pytest.raises(RecordError, match=rf"^f: corrupt record at byte offset {at}: the CRC of "
                                          rf"the length field does not match \(length read: "
                                          rf"{size + grow}\)"):
        with open(p, "rb", buffering=0) as f:
            for batch in tfrecord.iter_record_batches(f, name="f", batch_records=50):
                seen.extend(batch)
    # Astray: record 151's run (150..199) is held back whole. Stopped: the run ends before it.
    assert seen == MANY[: 150 if grow == 3 else 151]


def test_batch_records_must_be_positive():
    with pytest.raises(ValueError, match="batch_records must be >= 1, got 0"):
        _batches(b"", batch_records=0)


def _span_records(spans) -> list[bytes]:
    return [r for s in spans for r in s.records()]


@pytest.mark.parametrize("read_chunk", [1, 7, 1000, 1 << 20])
@pytest.mark.parametrize("pooled", [False, True])
def test_spans_hand_out_what_record_lists_do(tmp_path, monkeypatch, read_chunk, pooled):
    """iter_record_spans leaves records in the read buffers (the pool's, with ``pool``): the
    same records as iter_record_batches copies out (in the same runs, unless the pool's reads,
    whole multiples of the read chunk, cut them elsewhere)."""
    from formats.pool import BufferPool

    p = tmp_path / "many.tfrecord"
    _write(p, MANY)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", read_chunk)
    with open(p, "rb", buffering=0) as f:
        lists = _batches(f, batch_records=64)
    with open(p, "rb", buffering=0) as f:
        spans = list(tfrecord.iter_record_spans(
            f, name="f", batch_records=64, pool=BufferPool() if pooled else None))
    assert _span_records(spans) == MANY
    assert all(0 < len(s) <= 64 for s in spans)
    if not pooled:
        assert [s.records() for s in spans] == lists
    # Slicing a run keeps the right records (the reader cuts runs into chunks and shards).
    assert _span_records(s[1::3] for s in spans) == [r for s in spans for r in s.records()[1::3]]


def test_pooled_spans_keep_their_bytes_while_alive_and_free_them_after(tmp_path, monkeypatch):
    from formats.pool import BufferPool

    p = tmp_path / "many.tfrecord"
    _write(p, MANY * 5)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", 4096)
    pool = BufferPool()
    with open(p, "rb", buffering=0) as f:
        held = list(tfrecord.iter_record_spans(f, name="f", batch_records=50, pool=pool))
    # Every span still alive: no buffer was handed out twice, so none was overwritten.
    assert _span_records(held) == MANY * 5
    while_held = pool.kept()
    assert while_held > 2
    del held
    for _ in range(3):
        with open(p, "rb", buffering=0) as f:
            for span in tfrecord.iter_record_spans(f, name="f", batch_records=50, pool=pool):
                span.records()
    # Dropped spans give their buffers back: later passes reuse them instead of growing.
    assert pool.kept() <= while_held


@pytest.mark.parametrize("pooled", [False, True])
def test_spans_raise_the_same_errors(tmp_path, monkeypatch, pooled):
    from formats.pool import BufferPool

    p = tmp_path / "bad.tfrecord"
    at, size = _write_with_bad_data(p, MANY, 151)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", 1000)
    seen = []
    with pytest.raises(RecordError, match=rf"^f: corrupt record at byte offset {at}: "
                                          rf"the CRC of its {size} data bytes does not match"):
        with open(p, "rb", buffering=0) as f:
            for span in tfrecord.iter_record_spans(
                f, name="f", batch_records=50, pool=BufferPool() if pooled else None
            ):
                seen.extend(span.records())
    assert seen == MANY[: len(seen)] and len(seen) <= 151
    # Truncated in the middle of a record's data.
    p.write_bytes(_write_bytes(MANY)[: _offsets(MANY)[20] + 30])
    with pytest.raises(RecordError, match=rf"^f: truncated record at byte offset "
                                          rf"{_offsets(MANY)[20]}"):
        with open(p, "rb", buffering=0) as f:
            list(tfrecord.iter_record_spans(
                f, name="f", batch_records=50, pool=BufferPool() if pooled else None))


def _write_bytes(records) -> bytes:
    buf = io.BytesIO()
    write_records(buf, records)
    return buf.getvalue()


# Runs of equal-length records (the walk takes those in numpy steps), a length change between
# them, and a last record cut off by the read chunk in most of the chunk sizes below.
UNIFORM = [bytes([i % 251]) * 100 for i in range(300)] + [b"b" * 101] * 50 + [b"c" * 100] * 100


@pytest.mark.parametrize("read_chunk", [7, 1000, 4096, 1 << 20])
@pytest.mark.parametrize("walk", [1, 1000, 4 << 20])
def test_runs_of_one_length_are_walked_like_any_records(tmp_path, monkeypatch, read_chunk, walk):
    p = tmp_path / "uniform.tfrecord"
    _write(p, UNIFORM)
    monkeypatch.setattr(tfrecord.reader, "_READ_CHUNK", read_chunk)
    monkeypatch.setattr(tfrecord.reader, "_WALK_BYTES", walk)
    with open(p, "rb", buffering=0) as f:
        batches = _batches(f, batch_records=64)
    assert [r for b in batches for r in b] == UNIFORM
    assert all(0 < len(b) <= 64 for b in batches)
    batches = _batches(p.read_bytes(), batch_records=64)
    assert [r for b in batches for r in b] == UNIFORM


@pytest.mark.parametrize("damage", ["data", "length+3", "length-1"])
def test_damage_inside_a_run_of_one_length_is_caught_where_it_is(tmp_path, damage):
    p = tmp_path / "uniform.tfrecord"
    _write(p, UNIFORM)
    at = _offsets(UNIFORM)[151]
    raw = bytearray(p.read_bytes())
    if damage == "data":
        raw[at + 12 + 50] ^= 0x01
        message = rf"the CRC of its 100 data bytes does not match"
    else:
        length = 100 + int(damage[6:])
        raw[at : at + 8] = struct.pack("<Q", length)  # its CRC left as it was
        message = rf"the CRC of the length field does not match \(length read: {length}\)"
    p.write_bytes(bytes(raw))
    seen = []
    with pytest.raises(RecordError, match=rf"^f: corrupt record at byte offset {at}: {message}"):
        with open(p, "rb", buffering=0) as f:
            for batch in tfrecord.iter_record_batches(f, name="f", batch_records=50):
                seen.extend(batch)
    assert seen == UNIFORM[:150]  # record 151's run (150..199) is held back whole


@pytest.mark.parametrize("source", ["stream", "bytes"])
def test_a_gzip_file_read_as_uncompressed_is_told_it_is_gzip(tmp_path, source):
    # a GZIP TFRecord without a .gz suffix (tf.io.TFRecordWriter's options) read as plain: the
    # message named damage first; the magic bytes say what it is
    import gzip
    import io

    raw = io.BytesIO()
    tfrecord.write_records(raw, MANY[:10])
    p = tmp_path / "part-0.tfrecord"
    p.write_bytes(gzip.compress(raw.getvalue()))
    with pytest.raises(RecordError, match=r"^f: not an uncompressed TFRecord file: it starts with GZIP's "
                                          r"magic bytes \(1f 8b\), so it is GZIP-compressed without a "
                                          r"\.gz suffix; pass compression='GZIP'\.$"):
        with open(p, "rb", buffering=0) as f:
            list(_batches(f if source == "stream" else f.read(), batch_records=4))
    with open(p, "rb") as f, pytest.raises(RecordError, match="GZIP-compressed without a .gz suffix") as info:
        list(tfrecord.iter_records(f, name="f"))
    assert (info.value.offset, info.value.maybe_compressed) == (None, True)
