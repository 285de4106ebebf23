"""One epoch as a node sees it: what the driver announced, and what has become of its rows.

:class:`EpochInfo` is the driver's announcement (``begin_epoch``); :class:`NodeEpoch` is the
node's record of it, kept by :class:`feeders.buffer.FeedBuffer` under its lock. The exceptions
are what producers and consumers of the buffer are told when they must give up.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa

from feeders.cache import EpochCache, spill_failed
from feeders.protocol import BeginEpoch

__all__ = ["FeedStopped", "ConsumerFinished", "EpochClosed", "EpochWithdrawn", "EpochInfo", "NodeEpoch",
           "ParkedRows"]


class FeedStopped(Exception):
    """The node is shutting down; producers and consumers give up."""


class ConsumerFinished(Exception):
    """The node's ``main`` has returned (or serves inference): it will consume no more data."""


class EpochClosed(Exception):
    """The node's pass over this epoch has ended; the rest of the epoch is not wanted."""


class EpochWithdrawn(Exception):
    """A failed ``train()`` call took this epoch back before the pass over it yielded a row:
    the pass reads the next epoch instead (see ``FeedBuffer.hold_epochs``)."""

    def __init__(self, epoch: int) -> None:
        super().__init__(f"epoch {epoch} was taken back by a failed train() call")
        self.epoch = epoch


@dataclass
class EpochInfo:
    """What the driver announced for one epoch (``begin_epoch``).

    ``split``: which dataset reads it (``ctx.dataset(split=...)``). ``shuffle`` / ``seed``: the
    rows come out in a seeded random order. ``record``: keep the rows in the node's cache under
    this id. ``replay``: the epoch's rows come from that cache, not from Spark. ``carry``: a
    complete pass holds back the rows past its limit for the next carry epoch of its split,
    which begins with them if its ``carry_from`` is this epoch (streaming micro-batches: see
    ``FeedBuffer.take_carry``). ``ends_call``: the last epoch of its split in its
    ``cluster.train`` call, where a ``repeat=True`` stream ends.
    """

    epoch: int
    schema: pa.Schema
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    split: str = "train"
    shuffle: bool = False
    seed: int | None = None
    record: str | None = None
    replay: str | None = None
    carry: bool = False
    carry_from: int | None = None
    ends_call: bool = False

    @classmethod
    def announced(cls, begin: BeginEpoch) -> "EpochInfo":
        """The node's view of a ``begin_epoch`` command: the same fields, the schema read back
        from its IPC bytes (a field added to one and not the other fails here, loudly)."""
        values = {f.name: getattr(begin, f.name) for f in fields(begin) if f.name != "schema_ipc"}
        values["shapes"] = dict(begin.shapes)
        return cls(schema=pa.ipc.read_schema(pa.py_buffer(begin.schema_ipc)), **values)

    def shuffle_seed(self, *salt: int) -> list[int]:
        """The seed of this epoch's shuffles: the user's seed, the epoch id, then ``salt``."""
        return [self.seed if self.seed is not None else 0, self.epoch, *salt]


class ParkedRows:
    """Rows of one epoch set aside, in arrival order, while the buffer is full and another
    epoch's pass starves (see ``FeedBuffer.put_stream``): pushed rows go to Arrow IPC files in
    the node's cache directory, replayed rows (already held by their cache) are kept as they
    are. :meth:`pop` hands them back from the front, a bounded amount at a time."""

    def __init__(self, directory: str, name: str) -> None:
        self.directory = directory
        self.name = name
        self.rows = 0
        self.bytes_on_disk = 0
        # (a RecordBatch, or (file index, batch index) on disk; its rows; its bytes)
        self._items: list[tuple[Any, int, int]] = []
        self._files: dict[int, str] = {}  # file index -> path, while batches in it are parked
        self._left: dict[int, int] = {}  # file index -> its batches not yet popped
        self._made = 0  # files made so far (the next file's index)
        self._writer: Any = None
        self._written = 0

    def add(self, batch: pa.RecordBatch, *, spill: bool) -> None:
        self._items.append(self._store(batch, spill))
        self.rows += batch.num_rows

    def prepend(self, batches: list[pa.RecordBatch], *, spill: bool) -> None:
        """Set aside ``batches`` (queued before anything parked so far) ahead of the rest."""
        self._items[:0] = [self._store(b, spill) for b in batches]
        self.rows += sum(b.num_rows for b in batches)

    def _store(self, batch: pa.RecordBatch, spill: bool) -> tuple[Any, int, int]:
        if not spill:
            return batch, batch.num_rows, batch.nbytes
        try:
            if self._writer is None:
                os.makedirs(self.directory, exist_ok=True)
                index = self._made
                self._made += 1
                self._files[index] = os.path.join(self.directory, f"parked-{self.name}-{index}.arrow")
                self._left[index] = 0
                self._writer = pa.ipc.new_file(self._files[index], batch.schema)
                self._written = 0
            self._writer.write_batch(batch)
        except OSError as e:
            self._writer = None  # (as the cache does: the next rows try a new file)
            raise spill_failed(
                self._files.get(self._made - 1, self.directory), e,
                "rows set aside while another epoch's pass waited for its own",
                "The node sets them aside in its work directory, under spark.local.dir: free "
                "space there or point spark.local.dir at a larger disk.",
            ) from None
        self._written += 1
        index = self._made - 1
        self._left[index] += 1
        self.bytes_on_disk += batch.nbytes
        return (index, self._written - 1), batch.num_rows, batch.nbytes

    def pop(self, max_bytes: int | None = None) -> list[pa.RecordBatch]:
        """The parked batches from the front, in order, up to ``max_bytes`` of them (at least
        one; all when None): a pass that starved while a pile was parked takes it back a
        buffer's worth at a time, not all at once. Spilled batches are memory-mapped; a file
        is removed once every batch in it has been popped."""
        n, total = 0, 0
        for _, _, nbytes in self._items:
            if n and max_bytes is not None and total + nbytes > max_bytes:
                break
            n, total = n + 1, total + nbytes
        taken, self._items = self._items[:n], self._items[n:]
        if self._writer is not None and any(isinstance(it, tuple) and it[0] == self._made - 1
                                            for it, _, _ in taken):
            self._writer.close()  # (a file is readable once closed; later rows go to a new one)
            self._writer = None
        readers: dict[int, Any] = {}
        out = []
        for it, rows, _ in taken:
            self.rows -= rows
            if isinstance(it, pa.RecordBatch):
                out.append(it)
                continue
            index, i = it
            if index not in readers:
                readers[index] = pa.ipc.open_file(pa.memory_map(self._files[index], "r"))
            out.append(readers[index].get_batch(i))
            self._left[index] -= 1
            if self._left[index] == 0:  # a memory-mapped batch stays readable after its file goes
                self._remove(index)
        return out

    def _remove(self, index: int) -> None:
        path = self._files.pop(index)
        self._left.pop(index, None)
        try:
            os.remove(path)
        except OSError:
            pass

    def clear(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for index in list(self._files):
            self._remove(index)
        self._items = []
        self.rows = 0


@dataclass
class NodeEpoch:
    """One announced epoch on a node: its queue, dedupe marks and where its pass stands."""

    info: EpochInfo
    queue: deque = field(default_factory=deque)
    queued_bytes: int = 0
    accepted: dict[int, int] = field(default_factory=dict)  # partition -> rows accepted
    seen: dict[int, int] = field(default_factory=dict)  # partition -> rows its task had split
    rows_in: int = 0
    limit: int | None = None  # rows every worker yields this epoch (set by the driver)
    cut: bool = False  # ... a failed train() call's: only the rows that had arrived
    emitted: int = 0  # rows handed to TensorFlow
    carried_in: int = 0  # rows held back from the previous carry epoch its pass began with
    carried_out: int = 0  # rows past the limit its complete pass held back for the next one
    closed: bool = False  # the consumer's pass has ended
    claimed: bool = False  # a pass over it began (claim_epoch)
    stream: int | None = None  # ... by this reader (FeedBuffer.open_stream)
    in_repeat: bool = False  # ... which is a repeat=True stream
    last_move: float = 0.0  # time.monotonic() of its claim or its pass's last take or yield
    finished: bool = False  # ... and ended: emitted, complete and failure are final
    ended_feed: bool = False  # ... closed because the node reads no more (consumer_finished)
    overtaken: str | None = None  # ... ended because a newer reader began (why)
    complete: bool = False  # ... by reaching the limit
    failure: str | None = None  # ... by an error (a batch that did not convert): main raises it
    feeding: bool = False  # rows are still being replayed from the cache
    held: bool = False  # no pass may claim it, no replay feed it (FeedBuffer.hold_epochs)
    withdrawn: bool = False  # a failed train() call took it back unread (release_epochs)
    cache: EpochCache | None = None  # recording into it
    parked: ParkedRows | None = None  # rows set aside while another pass starved
