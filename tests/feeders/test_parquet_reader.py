"""feeders.parquet_dataset beyond conformance: row order under read-ahead, a file rewritten
after the dataset was built, prefetch/autotune options."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

import feeders
from feeders import parquet as parquet_mod
from tests.builders import numeric_table, write_parquet_files


def _ids(ds) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.concatenate([b["id"].numpy() for b in ds])


def test_rows_arrive_in_file_and_row_group_order(tmp_path, monkeypatch):
    # Small chunks and many files/row groups, so the scan's read-ahead has several files in
    # flight at once: the batches must still come out in file order, every row once.
    monkeypatch.setattr(parquet_mod, "_CHUNK_BYTES", 4096)
    write_parquet_files(numeric_table(3000), tmp_path, files=7, row_group_size=150)
    ds = feeders.parquet_dataset(tmp_path, batch_size=64)
    for _ in range(2):  # and again on the next epoch
        np.testing.assert_array_equal(_ids(ds), np.arange(3000))


def test_row_group_shards_keep_order_and_partition_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_mod, "_CHUNK_BYTES", 4096)
    write_parquet_files(numeric_table(2000), tmp_path, files=1, row_group_size=100)
    parts = [_ids(feeders.parquet_dataset(tmp_path, batch_size=50, shard=(i, 3))) for i in range(3)]
    for p in parts:
        assert np.all(np.diff(p) > 0)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(2000))


def test_a_file_rewritten_without_a_column_after_planning_is_named(tmp_path):
    files = write_parquet_files(numeric_table(400), tmp_path, files=2)
    ds = feeders.parquet_dataset(tmp_path, batch_size=100)
    pq.write_table(numeric_table(200).drop_columns(["f3"]), files[1])
    with pytest.raises(Exception, match=r"part-00001\.parquet: column 'f3' is no such column.*changed after"):
        _ids(ds)


def test_prefetch_is_fixed_unless_autotune_is_asked_for(tmp_path):
    import tensorflow as tf

    write_parquet_files(numeric_table(100), tmp_path)
    assert feeders.parquet_dataset(tmp_path).options().autotune.enabled is False
    tuned = feeders.parquet_dataset(tmp_path, prefetch=tf.data.AUTOTUNE)
    assert tuned.options().autotune.enabled is True
    np.testing.assert_array_equal(_ids(tuned), np.arange(100))
