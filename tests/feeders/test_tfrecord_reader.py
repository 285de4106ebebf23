"""The TFRecord reader's own framing: batch cutting across files and chunks, sharding, closing.

Files are written with TensorFlow's own writer (``tests.builders``); the reader frames them
itself, so these pin what it must keep from ``tf.data``'s: every record once, in file order,
exact batches, and nothing left open.
"""

from __future__ import annotations

import numpy as np
import pytest

import feeders
from feeders import tfrecord as reader
from tests.builders import numeric_table, row_checksum, write_tfrecord_files


@pytest.fixture(scope="module")
def three_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfr-reader") / "data"
    table = numeric_table(300).select(["id", "f0", "i0"])
    write_tfrecord_files(table, root, files=3)  # 100 rows a file
    return root, table


def test_batches_are_exact_across_files_and_in_file_order(three_files):
    root, table = three_files
    batches = list(feeders.tfrecord_dataset(root, schema=table.schema, batch_size=64))
    assert [int(b["id"].shape[0]) for b in batches] == [64, 64, 64, 64, 44]
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert ids.tolist() == list(range(300))
    f0 = np.concatenate([b["f0"].numpy() for b in batches])
    np.testing.assert_array_equal(f0, table.column("f0").to_numpy())
    assert batches[0]["i0"].dtype.name == "int32"


def test_chunks_of_many_batches_are_recut_exactly(three_files, monkeypatch):
    root, table = three_files
    # Chunks of 4 batches (48 records) that never line up with the 100-record files.
    per_record = sum(f.stat().st_size for f in root.iterdir()) / 300  # framing included
    monkeypatch.setattr(reader, "_CHUNK_BYTES", int(4.5 * 12 * per_record))
    seen: list[int] = []
    original = reader._RecordBatches.__call__

    def spy(self):
        for chunk in original(self):
            seen.append(len(chunk))
            yield chunk

    monkeypatch.setattr(reader._RecordBatches, "__call__", spy)
    batches = list(feeders.tfrecord_dataset(root, schema=table.schema, batch_size=12))
    assert seen[:-1] == [48] * (len(seen) - 1) and seen[-1] == 300 - 48 * (len(seen) - 1)
    assert [int(b["id"].shape[0]) for b in batches] == [12] * 25
    assert np.concatenate([b["id"].numpy() for b in batches]).tolist() == list(range(300))


def test_record_shards_count_records_across_files(three_files):
    root, table = three_files
    # 3 files, 4 shards: fewer files than shards, so every 4th record, counted across files.
    parts = [
        np.concatenate(
            [b["id"].numpy() for b in feeders.tfrecord_dataset(
                root, schema=table.schema, batch_size=10, shard=(i, 4))]
        )
        for i in range(4)
    ]
    for i, part in enumerate(parts):
        assert part.tolist() == list(range(i, 300, 4))
    assert row_checksum(np.concatenate(parts)) == row_checksum(np.arange(300))


def test_an_abandoned_pass_closes_its_files(three_files):
    from feeders.generator import live_iterators

    root, table = three_files
    ds = feeders.tfrecord_dataset(root, schema=table.schema, batch_size=8)
    before = live_iterators()
    first = next(iter(ds))
    assert first["id"].numpy().tolist() == list(range(8))
    del first
    import gc

    gc.collect()
    assert live_iterators() == before
