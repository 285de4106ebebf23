"""ReadAheadStream: in-order bytes from ranged reads issued ahead, on real files and real S3."""

from __future__ import annotations

import threading

import pytest
from pyarrow import fs as pafs

from dataplane.errors import RecordError, StorageError
from feeders import readahead
from feeders.fs import resolve
from feeders.readahead import OpenAhead, ReadAheadStream
from feeders.tfrecord.files import open_record_batches
from formats.tfrecord import iter_record_batches, write_records

DATA = bytes(range(256)) * 1000 + b"tail"  # 256,004 bytes: blocks never divide it evenly


class _Counted:
    """A real pyarrow file that records which ranges were requested (instrumentation only)."""

    def __init__(self, file):
        self.file = file
        self.requested: list[int] = []
        self.closed = False

    def size(self):
        return self.file.size()

    def read_at(self, n, offset):
        self.requested.append(offset)
        return self.file.read_at(n, offset)

    def close(self):
        self.closed = True
        self.file.close()


def _open(tmp_path, data=DATA):
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    return _Counted(pafs.LocalFileSystem().open_input_file(str(p)))


def _readahead_threads() -> int:
    return sum(t.name.startswith("dataplane-readahead") for t in threading.enumerate())


@pytest.mark.parametrize(
    "block, depth, ask",
    [(1000, 1, 1), (1000, 3, 777), (1000, 3, 100_000), (65536, 16, 1),
     (65536, 16, 777), (65536, 16, 100_000), (1 << 20, 2, 777), (1 << 20, 2, 1 << 20)],
)
def test_reads_back_every_byte_in_order(tmp_path, block, depth, ask):
    s = ReadAheadStream(_open(tmp_path), name="f", block=block, depth=depth)
    parts = []
    while True:
        chunk = s.read(ask)
        assert len(chunk) <= ask
        if not chunk:
            break
        parts.append(chunk)
    assert b"".join(parts) == DATA
    assert s.read(10) == b""
    s.close()


@pytest.mark.parametrize("block, depth, ask", [(1, 1, 777), (1, 4, 1), (3, 2, 5)])
def test_tiny_blocks(tmp_path, block, depth, ask):
    data = DATA[:2000]
    s = ReadAheadStream(_open(tmp_path, data), name="f", block=block, depth=depth)
    parts = iter(lambda: s.read(ask), b"")
    assert b"".join(parts) == data
    s.close()


def test_readall_readinto_and_an_empty_file(tmp_path):
    s = ReadAheadStream(_open(tmp_path), name="f", block=4096, depth=4)
    buf = bytearray(10)
    assert s.readinto(buf) == 10 and bytes(buf) == DATA[:10]
    assert s.read() == DATA[10:]
    s.close()
    empty = ReadAheadStream(_open(tmp_path, b""), name="f")
    assert empty.read(5) == b"" and empty.read() == b""
    empty.close()


def test_reads_ahead_only_as_far_as_the_reader_has_come(tmp_path):
    f = _open(tmp_path)
    s = ReadAheadStream(f, name="f", block=1000, depth=16)
    assert s.read(1000) == DATA[:1000]
    # two blocks asked for at open; consuming one doubles the depth to 4: at most 1 + 4 asked
    assert 2 <= len(f.requested) <= 5
    s.read(1000), s.read(1000)
    assert len(f.requested) <= 3 + 16
    assert f.requested == sorted(f.requested) and len(set(f.requested)) == len(f.requested)
    s.close()
    assert f.closed and _readahead_threads() == 0


def test_closing_mid_file_stops_the_threads_and_closes_the_file(tmp_path):
    f = _open(tmp_path)
    s = ReadAheadStream(f, name="f", block=100, depth=8)
    s.read(50)
    s.close()
    assert f.closed and s.closed and _readahead_threads() == 0
    with pytest.raises(ValueError, match="closed"):
        s.read(1)
    s.close()  # twice is fine


def test_a_file_that_shrank_ends_where_its_data_ends(tmp_path):
    p = tmp_path / "data.bin"
    p.write_bytes(DATA)
    f = pafs.LocalFileSystem().open_input_file(str(p))
    s = ReadAheadStream(f, name="f", block=100_000, depth=1)  # only block 0 asked for yet
    with open(p, "r+b") as w:
        w.truncate(150_000)
    assert s.read() == DATA[:150_000]  # block 1 comes back short: nothing after it is asked for
    assert s.read(1) == b""
    s.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="block and depth must be >= 1, got 0 and 4"):
        ReadAheadStream(_open(tmp_path), name="f", block=0, depth=4)


def test_an_s3_object_removed_while_read_is_a_storage_error_naming_it(tmp_path, s3_env, monkeypatch):
    """Records read from S3 go through ReadAheadStream; a failing ranged read is reported as the
    storage failure it is (URL and offset), not as a damaged TFRecord file."""
    local = tmp_path / "src"
    local.mkdir()
    with open(local / "part-0.tfrecord", "wb") as f:
        write_records(f, [bytes([i % 256]) * 1000 for i in range(300)])  # 304,800 bytes
    bucket = s3_env.make_bucket()
    url = s3_env.upload_dir(local, bucket, "vanishing")
    loc = resolve(url)
    path = f"{bucket}/vanishing/part-0.tfrecord"
    monkeypatch.setattr(readahead, "BLOCK_BYTES", 16 * 1024)
    monkeypatch.setattr(readahead, "MAX_DEPTH", 2)
    batches = open_record_batches(loc, path, None, batch_records=10)
    first = next(batches)
    assert first == [bytes([i]) * 1000 for i in range(10)]
    s3_env.filesystem().delete_file(path)
    with pytest.raises(StorageError) as info:
        for _ in batches:
            pass
    msg = str(info.value)
    assert f"s3://{path}" in msg and "byte offset" in msg and "removed or rewritten" in msg
    assert not isinstance(info.value, RecordError)


def test_records_framed_from_a_read_ahead_stream_match_the_file(tmp_path):
    records = [bytes([i % 251]) * (i % 700) for i in range(500)]
    p = tmp_path / "r.tfrecord"
    with open(p, "wb") as f:
        write_records(f, records)
    f = pafs.LocalFileSystem().open_input_file(str(p))
    with ReadAheadStream(f, name=str(p), block=3000, depth=4) as s:
        got = [r for b in iter_record_batches(s, name=str(p), batch_records=64) for r in b]
    assert got == records


# ---------------------------------------------------------------- OpenAhead


def _files(tmp_path, n=3):
    paths = []
    for i in range(n):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * 10)
        paths.append(str(p))
    return paths


def _openahead_threads() -> int:
    return sum(t.name.startswith("dataplane-openahead") for t in threading.enumerate())


def test_open_ahead_opens_the_next_file_while_one_is_read(tmp_path):
    paths = _files(tmp_path)
    opened, second_open = [], threading.Event()

    def open_file(p):
        opened.append(p)
        if p == paths[1]:
            second_open.set()
        return open(p, "rb")

    ahead = OpenAhead(open_file, paths)
    f0 = ahead.take(paths[0])
    assert second_open.wait(10), "the second file was not opened ahead"
    assert f0.read() == bytes([0]) * 10
    f1 = ahead.take(paths[1])  # the one opened ahead, not opened again
    assert f1.read() == bytes([1]) * 10 and opened[:2] == paths[:2]
    f2 = ahead.take(paths[2])
    assert f2.read() == bytes([2]) * 10 and opened == paths  # each opened exactly once
    for f in (f0, f1, f2):
        f.close()
    ahead.close()
    assert _openahead_threads() == 0


def test_open_ahead_closes_what_nobody_took(tmp_path):
    paths = _files(tmp_path)
    handed = []

    def open_file(p):
        f = open(p, "rb")
        handed.append(f)
        return f

    ahead = OpenAhead(open_file, paths)
    ahead.take(paths[0]).close()
    ahead.close()  # paths[1] was opened ahead and never taken
    assert len(handed) == 2 and all(f.closed for f in handed)
    assert _openahead_threads() == 0
    # taking out of order: the file opened ahead is closed, the one asked for is opened
    handed.clear()
    ahead = OpenAhead(open_file, paths)
    ahead.take(paths[0]).close()
    f2 = ahead.take(paths[2])
    assert f2.read() == bytes([2]) * 10
    assert [f.name for f in handed if f.closed] == [paths[0], paths[1]]
    f2.close()
    ahead.close()


def test_open_ahead_raises_a_files_error_when_that_file_is_taken(tmp_path):
    paths = _files(tmp_path)
    (tmp_path / "f1").unlink()
    ahead = OpenAhead(lambda p: open(p, "rb"), paths)
    ahead.take(paths[0]).close()  # f1's failure to open is not raised here...
    with pytest.raises(FileNotFoundError, match="f1"):
        ahead.take(paths[1])  # ...but here
    ahead.close()
    # without paths to look ahead at, take is a plain open
    plain = OpenAhead(lambda p: open(p, "rb"), [])
    f = plain.take(paths[2])
    assert f.read() == bytes([2]) * 10 and _openahead_threads() == 0
    f.close()


def test_an_abandoned_s3_pass_leaves_no_reader_threads(tmp_path, s3_env):
    local = tmp_path / "src"
    local.mkdir()
    for i in range(3):
        with open(local / f"part-{i}.tfrecord", "wb") as f:
            write_records(f, [bytes([i]) * 500] * 50)
    bucket = s3_env.make_bucket()
    url = s3_env.upload_dir(local, bucket, "abandoned")
    from feeders.tfrecord.stream import RecordBatches  # the records are raw bytes: read them framed

    passes = RecordBatches(resolve(url), [f"{bucket}/abandoned/part-{i}.tfrecord" for i in range(3)],
                           None, 10, None)
    it = passes()
    first = next(it)
    assert list(first) == [bytes([0]) * 500] * 10
    assert _openahead_threads() == 1  # part-1 is being (or was) opened ahead
    it.close()
    assert _openahead_threads() == 0 and _readahead_threads() == 0
    full = [r for chunk in passes() for r in chunk]
    assert full == [bytes([i]) * 500 for i in range(3) for _ in range(50)]
    assert _openahead_threads() == 0 and _readahead_threads() == 0


# --- IterAhead ---------------------------------------------------------------------------


def test_iter_ahead_keeps_order_and_stays_within_its_depth():
    from feeders.readahead import IterAhead

    produced: list[int] = []

    def items():
        for i in range(50):
            produced.append(i)
            yield i

    ahead = IterAhead(items(), depth=3, name="test-ahead")
    got = []
    for item in ahead:
        # the thread is at most depth items ahead, plus the one it holds waiting for room
        assert len(produced) - len(got) <= 3 + 1 + 1
        got.append(item)
    assert got == list(range(50))
    ahead.close()


def test_iter_ahead_raises_the_sources_error_after_the_items_before_it():
    from feeders.readahead import IterAhead

    def items():
        yield 1
        yield 2
        raise StorageError("s3://b/k: gone")

    got = []
    with IterAhead(items(), depth=4, name="test-ahead") as ahead:
        with pytest.raises(StorageError, match="gone"):
            for item in ahead:
                got.append(item)
    assert got == [1, 2]


def test_iter_ahead_closed_early_stops_its_thread_and_closes_the_source():
    from feeders.readahead import IterAhead

    closed = threading.Event()

    def items():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    ahead = IterAhead(items(), depth=2, name="test-ahead-early")
    it = iter(ahead)
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    ahead.close()
    assert closed.is_set()
    assert not [t for t in threading.enumerate() if t.name == "test-ahead-early"]
