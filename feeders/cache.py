"""A node's epoch cache: the rows pushed to it once, kept to replay later epochs itself.

``cluster.train(df, cache=True)`` pushes ``df`` in one Spark job; every worker records the
rows it accepts (after dedupe of retried tasks, in arrival order) into an :class:`EpochCache`
and replays them for the later epochs without any traffic from Spark.

Memory is bounded: batches are kept in memory up to ``memory_bytes`` (``dataplane.run``'s
``cache_bytes``), one :class:`MemoryBudget` shared by all of a node's caches (the training
split's and the validation split's), so that they hold no more than that between them; the
rest is spilled to Arrow IPC files in the node's work directory, read back a batch at a
time into memory freed once the batch is used (a memory map would leave every page a replay
touched in the node's resident set). The files go when the cache is dropped, and the work
directory with them when the node exits.

Replay order: :meth:`EpochCache.batches` yields the stored batches in order, or in a seeded
random order of batches (``shuffle``); rows are shuffled further within a window by the
consumer (see :mod:`feeders.source`).
"""

from __future__ import annotations

import os
import threading
from typing import Iterator

import numpy as np
import pyarrow as pa

from formats.errors import StorageError

__all__ = ["EpochCache", "MemoryBudget", "spill_failed"]

_SPILL_FILE_BYTES = 256 << 20  # one spill file holds up to this many bytes of batches


def spill_failed(path: str, e: OSError, what: str, fix: str) -> StorageError:
    """A node could not write ``what`` to ``path`` (a full disk, most often): the error names
    the file, the free space left there and ``fix``."""
    try:
        st = os.statvfs(os.path.dirname(path))
        free = f"; {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free there"
    except OSError:
        free = ""
    # (Arrow's own text, "Error writing bytes to file. Detail: [errno 28] ...", would read as
    # gRPC's detail, which feeders.flight.flight_message cuts off)
    reason = os.strerror(e.errno) if e.errno else (e.strerror or str(e))
    return StorageError(f"could not write {what} to {path}: {reason}{free}. {fix}")


class MemoryBudget:
    """Bytes of memory that several caches may hold between them."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes``; False (nothing reserved) if that would pass the limit."""
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class EpochCache:
    """Rows of one DataFrame as this node received them; memory up to a bound, then disk."""

    def __init__(self, cache_id: str, schema: pa.Schema, *, directory: str, memory_bytes: int = 0,
                 budget: MemoryBudget | None = None) -> None:
        """``budget``: the memory this cache shares with the node's other caches; without one,
        a budget of its own of ``memory_bytes``."""
        self.cache_id = cache_id
        self.schema = schema
        self.directory = directory
        self._budget = budget if budget is not None else MemoryBudget(memory_bytes)
        self._lock = threading.Lock()
        self._memory: list[pa.RecordBatch] = []
        self._where: list[tuple[int, int]] = []  # per stored batch: (file index or -1, index)
        self._keys: list[tuple[int, int]] = []  # per stored batch: (partition, first row)
        self._files: list[str] = []
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._writer_bytes = 0
        self._writer_batches = 0
        self._readers: dict[int, tuple[pa.ipc.RecordBatchFileReader, pa.OSFile]] = {}
        self.rows = 0
        self.bytes = 0
        self.memory_used = 0
        self.spilled_bytes = 0
        self.sealed = False

    def add(self, batch: pa.RecordBatch, key: tuple[int, int] = (0, 0)) -> None:
        """Store one accepted batch (called as rows arrive, before the epoch is sealed);
        ``key``: (partition, its first row's offset in the partition), which orders a shuffled
        replay's batches before they are permuted, so that the seed alone decides the order
        (not the order in which Spark's tasks happened to deliver them)."""
        if batch.num_rows == 0:
            return
        nbytes = batch.nbytes
        with self._lock:
            if self.sealed:
                raise RuntimeError(f"cache {self.cache_id} is sealed")
            if self._budget.take(nbytes):
                self._where.append((-1, len(self._memory)))
                self._memory.append(batch)
                self.memory_used += nbytes
            else:
                self._spill(batch)
            self._keys.append(key)  # (after the spill, which may fail: one entry per batch)
            self.rows += batch.num_rows
            self.bytes += nbytes

    def _spill(self, batch: pa.RecordBatch) -> None:
        try:
            if self._writer is None or self._writer_bytes >= _SPILL_FILE_BYTES:
                self._close_writer()
                os.makedirs(self.directory, exist_ok=True)
                path = os.path.join(self.directory, f"cache-{self.cache_id}-{len(self._files)}.arrow")
                self._files.append(path)
                self._writer = pa.ipc.new_file(path, self.schema)
                self._writer_bytes = 0
                self._writer_batches = 0
            self._writer.write_batch(batch)
        except OSError as e:  # Arrow's IOError is one too
            self._writer = None  # (its file is removed with the others when the cache is dropped)
            raise spill_failed(
                self._files[-1] if self._files else self.directory, e,
                "the cached rows beyond its memory bound",
                f"The cache keeps {self.memory_used / 2**20:.0f} MiB in memory "
                f"(dataplane.run(cache_bytes=...)) and the rest in the node's work directory, "
                f"under spark.local.dir: free space there, point spark.local.dir at a larger "
                f"disk, raise cache_bytes, or train without cache=True.",
            ) from None
        self._where.append((len(self._files) - 1, self._writer_batches))
        self._writer_batches += 1
        self._writer_bytes += batch.nbytes
        self.spilled_bytes += batch.nbytes

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def seal(self) -> None:
        """No more rows: the pushed epoch is over. Spill files are closed for reading."""
        with self._lock:
            self._close_writer()
            self.sealed = True

    def batches(self, *, shuffle: bool = False, seed: int | None = None) -> Iterator[pa.RecordBatch]:
        """The stored batches, in arrival order or a seeded random order of batches (the
        same for the same seed and rows, whatever order they arrived in)."""
        if shuffle:
            order = np.array(sorted(range(len(self._where)), key=self._keys.__getitem__), dtype=np.int64)
            np.random.default_rng(seed).shuffle(order)
        else:
            order = np.arange(len(self._where))
        for i in order:
            f, k = self._where[int(i)]
            if f < 0:
                yield self._memory[k]
            else:
                yield self._reader(f).get_batch(k)

    def _reader(self, f: int) -> pa.ipc.RecordBatchFileReader:
        got = self._readers.get(f)
        if got is None:
            # plain reads, not a memory map: a mapped page a replay touched stays in the
            # node's RSS until the cache is dropped, which an RSS limit (YARN, Kubernetes)
            # counts as if the whole share were held in memory
            source = pa.OSFile(self._files[f], "rb")
            got = self._readers[f] = (pa.ipc.open_file(source), source)
        return got[0]

    @property
    def files(self) -> list[str]:
        return list(self._files)

    def drop(self) -> None:
        """Free the memory and remove the spill files."""
        with self._lock:
            self._close_writer()
            self._readers.clear()  # (their files close with them; a replay still running
            # at shutdown keeps its own until it ends)
            self._memory.clear()
            self._where.clear()
            for path in self._files:
                try:
                    os.remove(path)
                except OSError:
                    pass
            self._files.clear()
            self._budget.give_back(self.memory_used)
            self.memory_used = 0
