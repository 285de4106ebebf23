"""The node's epoch cache on its own: what a replay of spilled batches costs in memory."""

from __future__ import annotations

import gc

import numpy as np
import pyarrow as pa
import pytest

from feeders.cache import EpochCache
from feeders.epoch import ParkedRows
from formats.errors import StorageError


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def test_replaying_spilled_batches_keeps_only_the_batch_in_hand_resident(tmp_path):
    """64 MiB spilled (cache_bytes=0), replayed twice, shuffled, one batch held at a time:
    the process's resident memory grows by a few batches, not by the spill. The spill files
    used to be memory-mapped, so every page a replay touched stayed in the node's RSS (as
    file-backed pages) until the cache was dropped, and an RSS limit (YARN, Kubernetes)
    counted the whole share, whatever cache_bytes said."""
    schema = pa.schema([("id", pa.int64()), ("blob", pa.binary())])
    cache = EpochCache("t", schema, directory=str(tmp_path), memory_bytes=0)
    row = 1 << 20
    for i in range(64):
        blob = np.full(row, i % 251, dtype=np.uint8).tobytes()
        cache.add(pa.record_batch([pa.array([i]), pa.array([blob], pa.binary())], schema=schema), key=(0, i))
    cache.seal()
    assert cache.memory_used == 0 and cache.spilled_bytes >= 64 * row and cache.files
    gc.collect()
    before = _rss_kib("VmRSS")
    peak = 0
    for seed in (1, 2):
        ids = []
        for b in cache.batches(shuffle=True, seed=seed):
            blob = b.column("blob")[0].as_py()
            assert len(blob) == row and blob[0] == b.column("id")[0].as_py() % 251
            ids.append(b.column("id")[0].as_py())
            del b, blob
            peak = max(peak, _rss_kib("VmRSS") - before)
        assert sorted(ids) == list(range(64)) and ids != list(range(64))
    assert peak < 16 * 1024, f"replaying 64 MiB of spilled batches added {peak} KiB of RSS"
    cache.drop()
    assert not any(p.exists() for p in tmp_path.iterdir())


def test_a_nodes_caches_share_one_memory_bound(tmp_path):
    """cache_bytes bounds what a node's caches hold between them: a training split's and a
    validation split's cache each got the whole bound (2x cache_bytes in memory with
    train(cache=True, validation=...)). The first to arrive keeps its batches in memory; the
    other spills what no longer fits, and memory freed by a dropped cache goes to the next."""
    from feeders.cache import MemoryBudget

    schema = pa.schema([("id", pa.int64()), ("blob", pa.binary())])
    budget = MemoryBudget(10 * 4096 + 100)

    def batch(i: int) -> pa.RecordBatch:
        blob = np.full(4000, i % 251, dtype=np.uint8).tobytes()
        return pa.record_batch([pa.array([i]), pa.array([blob], pa.binary())], schema=schema)

    train = EpochCache("train", schema, directory=str(tmp_path), memory_bytes=budget.limit, budget=budget)
    val = EpochCache("val", schema, directory=str(tmp_path), memory_bytes=budget.limit, budget=budget)
    size = batch(0).nbytes
    assert 4000 < size <= 4096
    for i in range(8):
        train.add(batch(i), key=(0, i))
    for i in range(8):
        val.add(batch(100 + i), key=(0, i))
    train.seal()
    val.seal()
    assert train.memory_used == 8 * size and train.spilled_bytes == 0
    assert val.memory_used == 2 * size and val.spilled_bytes == 6 * size and val.files
    assert budget.used == train.memory_used + val.memory_used <= budget.limit
    # every row comes back, from memory or disk
    assert [b.column("id")[0].as_py() for b in val.batches()] == list(range(100, 108))
    train.drop()
    assert budget.used == 2 * size
    again = EpochCache("train2", schema, directory=str(tmp_path), memory_bytes=budget.limit, budget=budget)
    for i in range(8):
        again.add(batch(i), key=(0, i))
    assert again.memory_used == 8 * size and again.spilled_bytes == 0
    for c in (val, again):
        c.drop()
    assert budget.used == 0 and not any(p.exists() for p in tmp_path.iterdir())


def test_a_full_disk_under_the_spill_is_named_with_the_ways_out(tmp_path):
    # the cache's first spill file is /dev/full, which refuses every write with ENOSPC: a
    # node whose spark.local.dir filled up failed its push with Arrow's "Error writing bytes
    # to file", which the pushing task worded as a node it could not reach
    def rows(n: int) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict({"id": np.arange(n), "x": np.zeros(n)})

    os_full = "/dev/full"
    (tmp_path / "cache-c1-0.arrow").symlink_to(os_full)
    cache = EpochCache("c1", rows(1).schema, directory=str(tmp_path), memory_bytes=0)
    with pytest.raises(StorageError) as info:
        cache.add(rows(1000), key=(0, 0))
    text = str(info.value)
    assert text.startswith(f"could not write the cached rows beyond its memory bound to "
                           f"{tmp_path / 'cache-c1-0.arrow'}: No space left on device; "), text
    assert "MiB free there" in text and "spark.local.dir" in text and "cache_bytes" in text, text
    assert (cache.rows, cache.bytes, cache.spilled_bytes) == (0, 0, 0)  # nothing counted
    assert len(cache._keys) == len(cache._where) == 0  # one entry per stored batch, as before

    (tmp_path / "parked-e3-0.arrow").symlink_to(os_full)
    parked = ParkedRows(str(tmp_path), "e3")
    with pytest.raises(StorageError, match=r"could not write rows set aside while another epoch's "
                       r"pass waited for its own to .*parked-e3-0\.arrow: No space left on device"):
        parked.add(rows(1000), spill=True)
    assert parked.rows == 0
