"""shard= for the pull readers: parsing, and that the shards partition the rows exactly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import feeders
from feeders.shard import balanced_shards, normalize_shard
from formats.errors import StorageError
from tests.builders import numeric_table, row_checksum, write_parquet_files, write_tfrecord_files


def test_normalize_shard_forms():
    assert normalize_shard(None) is None
    assert normalize_shard((1, 3)) == (1, 3)
    assert normalize_shard([0, 1]) == (0, 1)
    assert normalize_shard((np.int64(2), np.int32(4))) == (2, 4)
    ctx = SimpleNamespace(role="worker", index=2, worker_index=1, num_workers=3)
    assert normalize_shard(ctx) == (1, 3)  # worker_index wins over index
    assert normalize_shard(SimpleNamespace(index=2, num_workers=3)) == (2, 3)


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ((3, 3), r"shard index must be in \[0, 3\), got 3"),
        ((-1, 3), r"shard index must be in \[0, 3\), got -1"),
        ((0, 0), "shard count must be >= 1, got 0"),
        ((0, 1, 2), r"shard must be \(index, count\), got \(0, 1, 2\) with 3 item"),
        ((True, 2), "shard index must be an integer, got True"),
        ((0.5, 2), "shard index must be an integer, got 0.5"),
        ("0/2", "shard must be None, \\(index, count\\) or a node ctx"),
        (SimpleNamespace(index=0), "shard must be None"),
        (SimpleNamespace(index=4, num_workers=2), r"got 4 .*ps, evaluator"),
    ],
)
def test_normalize_shard_errors(shard, message):
    with pytest.raises(ValueError, match=message):
        normalize_shard(shard)


def _ids(ds) -> np.ndarray:
    return np.concatenate([b["id"].numpy() for b in ds] + [np.array([], np.int64)])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    table = numeric_table(240).select(["id", "f0"])
    write_parquet_files(table, root / "pq3", files=3)  # enough files: shard by file
    write_parquet_files(table, root / "pq1", files=1, row_group_size=50)  # 5 row groups
    write_tfrecord_files(table, root / "tf3", files=3)
    write_tfrecord_files(table, root / "tf1", files=1)
    return root


@pytest.mark.parametrize(
    ("reader", "name"),
    [
        (feeders.parquet_dataset, "pq3"),
        (feeders.parquet_dataset, "pq1"),
        (feeders.tfrecord_dataset, "tf3"),
        (feeders.tfrecord_dataset, "tf1"),
    ],
)
def test_shards_partition_the_rows(reader, name, sharded):
    parts = [_ids(reader(sharded / name, batch_size=32, shard=(i, 2))) for i in range(2)]
    assert all(len(p) for p in parts)
    both = np.concatenate(parts)
    assert row_checksum(both) == row_checksum(np.arange(240))  # no row lost or read twice
    if name in ("pq3", "pq1"):  # by rows, whatever the files and row groups
        assert parts[1].tolist() == list(range(120, 240))
    if name == "tf1":  # by record
        assert parts[0].tolist() == list(range(0, 240, 2))


def test_a_node_ctx_selects_its_shard(sharded):
    ctx = SimpleNamespace(role="worker", index=2, worker_index=1, num_workers=3)
    got = _ids(feeders.parquet_dataset(sharded / "pq3", batch_size=1000, shard=ctx))
    assert got.tolist() == list(range(80, 160))


def test_balanced_shards_are_contiguous_runs_of_about_equal_size():
    assert balanced_shards([1000, 10, 517], 2) == [0, 1, 1]
    assert balanced_shards([50] * 5, 2) == [0, 0, 1, 1, 1]
    assert balanced_shards([0, 10, 0, 10], 2) == [0, 0, 1, 1]
    assert balanced_shards([0, 0], 3) == [0, 1]
    assert balanced_shards([1000, 1, 1], 3) == [0, 1, 2]  # every shard a file, none empty
    assert balanced_shards([1, 1, 1000], 3) == [0, 1, 2]
    assert balanced_shards([5, 5, 5, 5, 1000], 2) == [0, 0, 0, 0, 1]
    assert balanced_shards([10] * 6, 3) == [0, 0, 1, 1, 2, 2]


def test_tfrecord_shards_hold_even_bytes_and_say_when_they_cannot(tmp_path, caplog):
    # three files of 1000, 10 and 517 records: every other file gave 1517 and 10 records;
    # by bytes it is 1000 / 527 (a file is never split), which the warning reports
    import logging

    table = numeric_table(1527).select(["id", "f0"])
    for k, (a, b) in enumerate([(0, 1000), (1000, 1010), (1010, 1527)]):
        write_tfrecord_files(table.slice(a, b - a), tmp_path, suffix=f"-{k}.tfrecord")
    with caplog.at_level(logging.WARNING, logger="feeders.tfrecord.plan"):
        parts = [_ids(feeders.tfrecord_dataset(tmp_path, batch_size=64, shard=(i, 2))) for i in range(2)]
    assert [p.tolist() for p in parts] == [list(range(1000)), list(range(1000, 1527))]
    said = [r.getMessage() for r in caplog.records if "shards hold" in r.getMessage()]
    assert len(said) == 2 and "(a file is never split; this shard: " in said[0], said
    assert "a loop that runs a collective every step over the dataset itself hangs" in said[0]


def test_tensorflow_io_shards_split_the_rows_as_the_native_reader_does(tmp_path):
    # files of 1000, 10 and 517 rows, row groups of 64: tensorflow-io took every other file
    # (1517 and 10 rows for two shards); now each shard reads the same rows as
    # feeders.parquet_dataset's, also starting inside a file's middle row group
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dataplane.errors import StackError

    table = numeric_table(1527).select(["id", "f0"])
    for k, (a, b) in enumerate([(0, 1000), (1000, 1010), (1010, 1527)]):
        pq.write_table(table.slice(a, b - a), tmp_path / f"part-{k}.parquet", row_group_size=64)
    if int(pa.__version__.split(".")[0]) >= 16:  # the current stack has no tensorflow-io
        with pytest.raises(StackError, match="compat stack"):
            feeders.tfio_parquet_dataset(tmp_path, shard=(0, 2))
        return
    for count in (2, 3, 5):
        parts = [_ids(feeders.tfio_parquet_dataset(tmp_path, batch_size=100, shard=(i, count)))
                 for i in range(count)]
        native = [_ids(feeders.parquet_dataset(tmp_path, batch_size=100, shard=(i, count)))
                  for i in range(count)]
        assert [p.tolist() for p in parts] == [n.tolist() for n in native], count
        assert np.concatenate(parts).tolist() == list(range(1527))
    # more shards than rows: a shard without rows is an empty dataset of the same structure
    write_parquet_files(table.slice(0, 2), tmp_path / "two")
    got = [feeders.tfio_parquet_dataset(tmp_path / "two", batch_size=4, shard=(i, 3)) for i in range(3)]
    assert [_ids(d).tolist() for d in got] == [[], [0], [1]]
    assert got[0].element_spec == got[1].element_spec


class _Driver:
    """The driver's side of ``ctx.agree``: the first node's value of every (key, n-th call),
    through JSON as on the wire."""

    def __init__(self) -> None:
        self.agreed: dict = {}
        self.ctxs: dict = {}

    def ctx(self, worker_index: int, num_workers: int = 2):  # type: ignore[no-untyped-def]
        if worker_index in self.ctxs:
            return self.ctxs[worker_index]
        calls: dict = {}

        def agree(key, value):  # type: ignore[no-untyped-def]
            n = calls[key] = calls.get(key, -1) + 1
            first = self.agreed.setdefault((key, n), (worker_index, json.loads(json.dumps(value))))
            return first

        ctx = self.ctxs[worker_index] = SimpleNamespace(
            role="worker", index=worker_index, worker_index=worker_index, num_workers=num_workers,
            agree=agree)
        return ctx


@pytest.mark.parametrize("fmt", ["parquet", "tfrecord"])
def test_a_file_written_between_two_nodes_listings_is_read_by_neither(fmt, tmp_path, caplog):
    """Node 0 plans, a file arrives, node 1 plans. Each node used to shard its own listing:
    node 1 then cut its rows from 300 where node 0 cut from 200, and rows 100-149 were read by
    no one (TFRecord: by bytes, files moved between shards). Now both shard node 0's listing."""
    import logging

    read = feeders.parquet_dataset if fmt == "parquet" else feeders.tfrecord_dataset
    write = write_parquet_files if fmt == "parquet" else write_tfrecord_files
    table = numeric_table(300).select(["id", "f0"])
    driver = _Driver()
    if fmt == "parquet":
        write(table.slice(0, 200), tmp_path, files=2)
    else:
        for k in range(4):
            write(table.slice(50 * k, 50), tmp_path, suffix=f"-{k}.tfrecord")
    first = read(tmp_path, batch_size=32, shard=driver.ctx(0))
    late = tmp_path / "late"
    write(table.slice(200, 100), late, **({"files": 1} if fmt == "parquet" else {"suffix": "-9.tfrecord"}))
    for f in late.iterdir():
        f.rename(tmp_path / ("part-99999.parquet" if fmt == "parquet" else f.name))
    late.rmdir()
    logger = "feeders.parquet.plan" if fmt == "parquet" else "feeders.tfrecord.plan"
    with caplog.at_level(logging.WARNING, logger=logger):
        second = read(tmp_path, batch_size=32, shard=driver.ctx(1))
    parts = [_ids(first), _ids(second)]
    both = np.concatenate(parts)
    assert len(both) == 200 and row_checksum(both) == row_checksum(np.arange(200)), [len(p) for p in parts]
    said = [r.getMessage() for r in caplog.records if "the first to plan this dataset" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "node 0, the first to plan this dataset" in said[0] and "build it again to read them" in said[0], said
    assert ("part-99999.parquet" if fmt == "parquet" else "-9.tfrecord") in said[0], said
    # the next build of each node agrees again, on the listing of now
    again = [_ids(read(tmp_path, batch_size=32, shard=driver.ctx(i))) for i in (1, 0)]
    assert sorted(np.concatenate(again).tolist()) == list(range(300))


def test_a_parquet_file_rewritten_or_deleted_while_the_nodes_list_fails_the_late_node(tmp_path):
    import pyarrow.parquet as pq

    table = numeric_table(200).select(["id", "f0"])
    paths = write_parquet_files(table, tmp_path, files=2)
    driver = _Driver()
    feeders.parquet_dataset(tmp_path, batch_size=32, shard=driver.ctx(0))
    pq.write_table(table.slice(100, 10), paths[1])  # rewritten with 10 rows of 100
    with pytest.raises(StorageError, match=r"part-00001.parquet holds 10 rows here, but 100 when node 0 planned"):
        feeders.parquet_dataset(tmp_path, batch_size=32, shard=driver.ctx(1))
    driver = _Driver()
    feeders.parquet_dataset(tmp_path, batch_size=32, shard=driver.ctx(0))
    paths[1].unlink()
    with pytest.raises(StorageError, match=r"node 0, the first to plan this dataset, listed .*part-00001.parquet, but this node cannot read it"):
        feeders.parquet_dataset(tmp_path, batch_size=32, shard=driver.ctx(1))
