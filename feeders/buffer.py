"""The node-side feed buffer: bounded in bytes, exactly once per epoch, epoch by epoch.

Producers are Flight ``do_put`` streams, one per (epoch, Spark partition, task attempt); the
consumer is the node's tf.data generator (``feeders.source``). The wire protocol, and why the
interleaved pushing cannot deadlock, is in :mod:`feeders.protocol`.

Exactly once: every partition's stream to a node is a deterministic sequence of rows (Spark
recomputes a partition identically on retry; cache the DataFrame if its source is not
deterministic). The buffer remembers, per (epoch, partition), how many leading rows it has already
accepted; a retried or speculative attempt's rows below that mark are dropped, the rest accepted.
The epoch is complete when the driver says so (its Spark job has finished).

Backpressure: a producer waits while the buffer holds ``capacity`` bytes (a single batch larger
than the buffer is let in when the buffer is empty, so nothing deadlocks). Waiting producers watch
the stop flag, so shutdown never hangs on a full buffer.

Parking: epochs are pushed in order, one Spark job at a time, but a program may need a later
epoch before it reads an earlier one (a ``repeat=True`` stream reading ahead into the next
training epoch while Keras's validation pass waits for its own). When a producer would wait on
a full buffer while the pass over another epoch has waited with nothing to read for
``PARK_AFTER`` seconds, its rows are set aside instead (:class:`feeders.epoch.ParkedRows`:
pushed rows to Arrow IPC files in the cache directory, replayed ones kept as the cache holds
them), so its push can finish and the starving epoch's rows can come. Memory stays within the
buffer; the parked rows come back, in order, when that epoch's pass reads them.

Closing: when the consumer's pass over an epoch ends (read to its limit, or left early), the
epoch is closed: what is queued is dropped and producers of it, waiting or new, get
:class:`EpochClosed`, so the pushing tasks stop sending it instead of waiting for space that
would never come.

Abandoned passes: a pass left early ends when TensorFlow destroys its iterator, which closes
the Python generator. An iterator caught in a reference cycle (the first ``evaluate(steps=k)``
of a tf_keras model makes one) is destroyed only by Python's cyclic collector, which a node
that then allocates little may not run for minutes, and the driver's ``train`` waited out
``feed_timeout`` for that pass. So a pass over a split that begins while an earlier pass over
the same split is still open ends that one (the program has moved on: passes over a split read
its epochs in order), with exactly the rows it had handed to TensorFlow; and while the driver
waits for a claimed epoch's pass to end, the node runs the collector now and then
(:meth:`FeedBuffer.wait_closed`).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from feeders.cache import EpochCache, MemoryBudget
from feeders.epoch import (ConsumerFinished, EpochClosed, EpochInfo, EpochWithdrawn, FeedStopped, NodeEpoch,
                           ParkedRows)
from formats.errors import FeedError, SchemaError
from formats.schema import fill_example, list_levels, same_columns, schema_text

__all__ = ["FeedBuffer", "EpochInfo", "FeedStopped", "ConsumerFinished", "EpochClosed", "EpochWithdrawn"]


PARK_AFTER = 0.2  # seconds a pass must starve before another epoch's rows are parked
# A further pass that has waited this long for the driver's next train() call says so once in
# the node's log (model.evaluate(ds) after fit reads a pass no train() call pushes).
WAIT_HINT_AFTER = 30.0
# ... and a warning after this long if, meanwhile, a pass over another split stands open and
# still: the next train() call cannot begin before that pass ends, and a main reading both in
# one loop (val_ds.take(k) every few training steps) waits in the one for the other.
STUCK_HINT_AFTER = 5.0
# While the driver waits for a claimed epoch's pass to end and that pass has neither taken nor
# yielded rows for this many seconds, the node runs Python's cyclic collector; each further
# collection for the same pass waits twice as long, up to COLLECT_MAX (see "Abandoned passes").
# A full collection in a node with TensorFlow loaded took 160 ms (336k objects), all of it
# holding the GIL.
COLLECT_AFTER = 2.0
COLLECT_MAX = 60.0

logger = logging.getLogger(__name__)


def _collect(epoch: int) -> None:
    """A full collection, for a pass that may be held by a reference cycle. ``gc.collect()``
    does nothing while another thread is inside a collection (a finalizer there that blocks
    keeps it inside), which no one could see from the node's log."""
    runs = gc.get_stats()[2]["collections"]
    gc.collect()
    if gc.get_stats()[2]["collections"] == runs:
        logger.warning(
            "epoch %d's pass has stood still and may be held by a reference cycle, but Python's "
            "collector could not run: another thread is inside a collection, held there by a "
            "finalizer (__del__ or a weakref callback) that blocks. Until it returns, the pass "
            "ends only when main starts another pass over its split or returns.", epoch,
        )


@dataclass
class _Stream:
    """One reader of a split: a pass, or a ``repeat=True`` stream of passes."""

    split: str
    repeat: bool
    superseded: bool = False


def _inner_nulls(col: pa.Array) -> int:
    """Nulls inside a list column's arrays, at any depth (the rows' own nulls not counted)."""
    return sum(level.null_count for level in list_levels(col))


class FeedBuffer:
    """Bounded, deduplicating, epoch-ordered buffer between Flight and tf.data."""

    def __init__(self, capacity_bytes: int, *, cache_dir: str | None = None, cache_bytes: int = 1 << 30) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"buffer capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.cache_dir = cache_dir
        self.cache_bytes = int(cache_bytes)
        # one bound for all of this node's caches (a training and a validation split's)
        self._cache_budget = MemoryBudget(self.cache_bytes)
        self._caches: dict[str, EpochCache] = {}
        self._replayer: threading.Thread | None = None
        # split -> (columns the dataset converts, columns with a fill value, columns it
        # decodes), once it is built
        self._null_rules: dict[str, tuple[frozenset, frozenset, frozenset]] = {}
        self._announced: dict[str, deque] = {}  # split -> announced epochs no pass has claimed
        self._newest_claim: dict[str, int] = {}  # split -> the newest epoch a pass claimed
        # splits main has a reader for: a ctx.dataset() built over it, or a pass that asked
        # for an epoch of it (the TFoS DataFeed's reader): a node without one that stands
        # still is told so, instead of as having stopped reading
        self._readers: set[str] = set()
        self._cond = threading.Condition()
        self._epochs: dict[int, NodeEpoch] = {}
        self._bytes = 0
        self._stopped = False
        self._consumer_done = False
        # the last note_empty_pass recorded: main's error, if it raises after such a pass, is
        # reported with it (Keras only says its logs were empty)
        self.empty_pass_note: str | None = None
        self.idle_waiters = 0  # consumers blocked until the driver announces another epoch
        self._data_waits: list[float] = []  # when each pass now waiting for an epoch began waiting
        self._claiming: Counter[str] = Counter()  # split -> passes now waiting to claim an epoch
        # (split, skip_older) -> passes over split waiting to claim, which skip skip_older's
        # epochs announced while they wait (see begin_epoch)
        self._skipping: Counter[tuple[str, str]] = Counter()
        self._stalled = 0  # producers waiting on a full buffer right now
        self._starving: dict[int, float] = {}  # epoch -> since when its pass waits with nothing to read
        self._stall_mark = 0.0
        # epoch -> (idle seconds before its next collection, when its last one ran)
        self._collect_after: dict[int, tuple[float, float]] = {}
        self._streams: dict[int, _Stream] = {}  # open readers (open_stream), by id
        # split -> (epoch, batches, rows): rows past the limit a complete pass over a carry
        # epoch held back for the next one (see take_carry)
        self._carry: dict[str, tuple[int, list[pa.RecordBatch], int]] = {}
        self._stream_ids = itertools.count(1)
        self._last_collect = 0.0
        self.metrics: dict[str, Any] = {
            "rows_in": 0,
            "bytes_in": 0,
            "batches_in": 0,
            "rows_duplicate": 0,
            "rows_out": 0,
            "rows_taken": 0,  # rows the consumer took from the buffer, pushed or replayed (progress)
            # rows handed to TensorFlow so far, counted as each generator item goes (progress:
            # a pass takes up to a buffer's worth at once, minutes of training on a slow model)
            "rows_yielded": 0,
            # the last pass that had yielded more than a failed push's cut left every worker
            # ({epoch, split, cut, yielded}, rows): under MWMS the workers' steps may differ
            "overran_cut": None,
            "rows_left": 0,  # received but not handed over: passes left early
            "buffer_bytes": 0,
            "buffer_peak_bytes": 0,
            "buffer_capacity": self.capacity,
            "stall_seconds": 0.0,
            "epochs_begun": 0,
            "epochs_consumed": 0,
            "epochs_left_early": 0,
            "rows_parked": 0,
            "cache_rows": 0,
            "cache_memory_bytes": 0,
            "cache_spilled_bytes": 0,
            "cache_bytes_limit": self.cache_bytes,
        }

    # -- control (driver actions) ---------------------------------------------------------
    def begin_epoch(self, info: EpochInfo) -> dict[str, Any]:
        """Announce an epoch. A replayed one is fed from its cache once the cache is sealed
        and every earlier epoch has all its rows (see ``_replay_loop``)."""
        with self._cond:
            if info.epoch in self._epochs:  # idempotent: the driver may retry the action
                return {}
            ep = NodeEpoch(info)
            if self._consumer_done:
                ep.closed = ep.ended_feed = True
            if info.record is not None:
                cache = self._caches.get(info.record)
                if cache is None:
                    cache = EpochCache(info.record, info.schema, directory=self.cache_dir or ".",
                                       budget=self._cache_budget)
                    self._caches[info.record] = cache
                ep.cache = cache
            if info.replay is not None:
                if info.replay not in self._caches:
                    raise FeedError(
                        f"epoch {info.epoch}: replay of cache {info.replay!r}, which this node "
                        f"does not hold; this is a bug in the driver."
                    )
                ep.feeding = not ep.closed
            self._epochs[info.epoch] = ep
            self._announced.setdefault(info.split, deque()).append(info.epoch)
            self.metrics["epochs_begun"] += 1
            if any(n and older == info.split and not self._announced.get(split)
                   for (split, older), n in self._skipping.items()) and not self._claiming[info.split]:
                # A training pass began before this validation epoch came and waits for a
                # training epoch: main will not come back for it (the rule claim_epoch applies
                # when the pass begins, and again when it claims).
                self.skip_announced(info.split)
            if ep.feeding and self._replayer is None:
                self._replayer = threading.Thread(target=self._replay_loop, daemon=True,
                                                  name="dataplane-replay")
                self._replayer.start()
            self._cond.notify_all()
        return {}

    def _replay_loop(self) -> None:
        """Feed replayed epochs from their caches, one at a time in epoch order, each once
        every earlier epoch has all its rows (so a later epoch never holds the buffer space an
        earlier one still needs) and its own limit is known, under the same capacity as pushed
        rows."""
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    waiting = sorted(e for e, o in self._epochs.items() if o.feeding and not o.held)
                    if waiting:
                        ep = self._epochs[waiting[0]]
                        cache = self._caches.get(ep.info.replay or "")
                        if cache is None:  # dropped: nothing will come
                            ep.feeding = False
                            self._cond.notify_all()
                            continue
                        earlier_done = all(
                            o.closed or (o.limit is not None and not o.feeding)
                            for e, o in self._epochs.items() if e < ep.info.epoch
                        )
                        # and its limit is known (the driver sets it once every worker's
                        # cache is sealed): a pass emits a replay's rows only up to it, so
                        # rows replayed before it came piled up in the pass (and its shuffle)
                        if earlier_done and cache.sealed and (ep.limit is not None or ep.closed):
                            break
                    self._cond.wait(0.2)
            try:
                for batch in cache.batches(shuffle=ep.info.shuffle, seed=ep.info.shuffle_seed()):
                    nbytes = batch.nbytes
                    with self._cond:
                        park = False
                        while not (self._stopped or ep.closed):
                            park = self._parking(ep, nbytes)
                            if park or self._bytes == 0 or self._bytes + nbytes <= self.capacity:
                                break
                            self._cond.wait(0.2)
                        if self._stopped:
                            return
                        if ep.closed:
                            break
                        if park:  # the cache holds the batch: keep a reference, write nothing
                            self._park(ep, batch, spill=False)
                        else:
                            self._queue(ep, batch, nbytes)
            finally:
                with self._cond:
                    ep.feeding = False
                    self._cond.notify_all()

    def _queue(self, ep: NodeEpoch, batch: pa.RecordBatch, nbytes: int) -> None:
        ep.queue.append(batch)
        ep.queued_bytes += nbytes
        ep.rows_in += batch.num_rows
        self._bytes += nbytes
        m = self.metrics
        m["rows_in"] += batch.num_rows
        m["bytes_in"] += nbytes
        m["batches_in"] += 1
        m["buffer_bytes"] = self._bytes
        m["buffer_peak_bytes"] = max(m["buffer_peak_bytes"], self._bytes)
        self._cond.notify_all()

    def _parking(self, ep: NodeEpoch, nbytes: int) -> bool:
        """Set ``ep``'s next batch aside rather than queue it (or wait)?

        Yes once some of it is parked (order is kept). When it would wait on a full buffer
        while some epoch's pass has been starving for ``PARK_AFTER`` seconds, that pass may
        need rows queued behind this one: every other epoch's queued rows are parked to make
        room, and this batch is parked too unless it is the starving epoch's own.
        """
        if ep.parked is not None and ep.parked.rows:
            return True
        if self._bytes == 0 or self._bytes + nbytes <= self.capacity:
            return False
        now = time.monotonic()
        starving = {e for e, t in self._starving.items() if now - t >= PARK_AFTER}
        if not starving:
            return False
        for e, o in self._epochs.items():
            if e in starving or o.closed or not o.queue:
                continue
            # replayed or recorded rows are held by their cache already: keep references
            self._parked_rows(o).prepend(list(o.queue), spill=o.info.replay is None and o.cache is None)
            self.metrics["rows_parked"] += sum(b.num_rows for b in o.queue)
            o.queue.clear()
            self._bytes -= o.queued_bytes
            o.queued_bytes = 0
        self.metrics["buffer_bytes"] = self._bytes
        self._cond.notify_all()
        return ep.info.epoch not in starving

    def _parked_rows(self, ep: NodeEpoch) -> ParkedRows:
        if ep.parked is None:
            ep.parked = ParkedRows(self.cache_dir or tempfile.gettempdir(), f"{os.getpid()}-{ep.info.epoch}")
        return ep.parked

    def _park(self, ep: NodeEpoch, batch: pa.RecordBatch, *, spill: bool) -> None:
        self._parked_rows(ep).add(batch, spill=spill)
        ep.rows_in += batch.num_rows
        m = self.metrics
        m["rows_in"] += batch.num_rows
        m["bytes_in"] += batch.nbytes
        m["batches_in"] += 1
        m["rows_parked"] += batch.num_rows
        self._cond.notify_all()

    def expect_columns(self, split: str, columns: Iterator[str], filled: Iterator[str],
                       decoded: Iterator[str] = ()) -> None:
        """The dataset of ``split`` converts ``columns``, replacing nulls in ``filled`` only:
        from now on a pushed batch with nulls elsewhere in them is refused at once (a
        SchemaError for the pushing task) instead of failing main later. ``decoded``: columns
        the dataset decodes (``decode=``), for which an empty fill value is no way out."""
        with self._cond:
            self._null_rules[split] = (frozenset(columns), frozenset(filled), frozenset(decoded))
            self._readers.add(split)

    def _check_nulls(self, ep: NodeEpoch, partition: int, batch: pa.RecordBatch,
                     batch_nulls: tuple[tuple[int, int, int], ...] | None = None) -> None:
        """Refuse a null the node's dataset cannot take. ``batch_nulls``: the nulls of the
        whole Arrow batch ``batch`` was cut from, as the task found them (``ChunkTag.nulls``),
        so that every worker refuses a batch whichever worker's slice holds the null; None
        (a stream without them): this slice's own."""
        rule = self._null_rules.get(ep.info.split)
        if rule is None:
            return
        wanted, filled, decoded = rule
        names = batch.schema.names
        if batch_nulls is None:
            counts = [(i, None, None) for i, name in enumerate(names) if name in wanted and name not in filled]
        else:
            counts = [(i, rows, inner) for i, rows, inner in batch_nulls
                      if i < len(names) and names[i] in wanted and names[i] not in filled]
        for i, nulls, inner in counts:
            name, col = names[i], batch.column(i)
            if nulls is None:
                nulls = col.null_count
            if nulls and name in decoded:
                raise SchemaError(
                    f"column {name!r} has {nulls} null value(s) in a batch of partition "
                    f"{partition} (epoch {ep.info.epoch}), and the node decodes it "
                    f"(ctx.dataset(decode=...)): a null is no image or array to decode. Drop "
                    f"those rows first (df.na.drop(subset=[{name!r}])), or fill them with "
                    f"valid encoded bytes of the decoded size (fill_values={{{name!r}: ...}})."
                )
            if nulls:
                raise SchemaError(
                    f"column {name!r} has {nulls} null value(s) in a batch of partition "
                    f"{partition} (epoch {ep.info.epoch}); a tensor cannot hold a null. "
                    f"Give a fill value on the node (ctx.dataset(fill_values={{{name!r}: {fill_example(col.type)}}})) "
                    f"or clean the DataFrame first (df.na.fill(...) or "
                    f"df.na.drop(subset=[{name!r}]))."
                )
            if inner is None:
                inner = _inner_nulls(col)
            if inner:
                raise SchemaError(
                    f"column {name!r} has {inner} null element(s) inside its arrays in a "
                    f"batch of partition {partition} (epoch {ep.info.epoch}); a tensor cannot "
                    f"hold a null. Give a fill value on the node "
                    f"(ctx.dataset(fill_values={{{name!r}: {fill_example(col.type)}}})) or clean the DataFrame first: "
                    f"df.where(~F.exists({name!r}, lambda v: v.isNull())) drops such rows."
                )

    def drop_cache(self, cache_id: str) -> None:
        with self._cond:
            cache = self._caches.pop(cache_id, None)
        if cache is not None:
            cache.drop()
            self._cache_metrics()

    def drop_caches(self) -> None:
        for cid in list(self._caches):
            self.drop_cache(cid)

    def _cache_metrics(self) -> None:
        caches = list(self._caches.values())
        self.metrics["cache_rows"] = sum(c.rows for c in caches)
        self.metrics["cache_memory_bytes"] = sum(c.memory_used for c in caches)
        self.metrics["cache_spilled_bytes"] = sum(c.spilled_bytes for c in caches)

    def _await(self, ready: Callable[[], bool], timeout: float | None, *, idle: bool,
               hint: Callable[[float], bool] | None = None) -> bool:
        """Wait (holding ``_cond``) until ``ready()``; False if the node stopped or ``timeout``
        passed first. ``idle``: the caller is a consumer waiting for the driver's next move
        (counted in ``idle_waiters``, which tells the driver main is safe to stop). ``hint``:
        called with the seconds waited, from :data:`STUCK_HINT_AFTER` or
        :data:`WAIT_HINT_AFTER` on, until it returns True (it has logged why the wait may be
        long)."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        self.idle_waiters += idle
        if idle:
            self._data_waits.append(start)
        try:
            while not ready():
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if self._stopped or (left is not None and left <= 0):
                    return False
                if (hint is not None and now - start >= min(STUCK_HINT_AFTER, WAIT_HINT_AFTER)
                        and hint(now - start)):
                    hint = None
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return True
        finally:
            self.idle_waiters -= idle
            if idle:
                self._data_waits.remove(start)

    def waits_for_data(self) -> float | None:
        """Seconds the longest-waiting pass over a ``ctx.dataset()`` has waited for the driver
        to push an epoch (building the dataset, or a pass past the last pushed epoch); None
        if none waits."""
        with self._cond:
            return time.monotonic() - min(self._data_waits) if self._data_waits else None

    def waiting_for_driver(self, wait: Callable[[], Any]) -> Any:
        """Call ``wait()`` counted in ``idle_waiters``: the caller (``ctx.wait_stop``) only
        waits for the driver's next move, so shutdown need not wait for it to finish."""
        with self._cond:
            self.idle_waiters += 1
        try:
            return wait()
        finally:
            with self._cond:
                self.idle_waiters -= 1

    def open_stream(self, split: str, *, repeat: bool) -> int:
        """Register a reader of ``split`` (one pass, or a ``repeat=True`` stream of passes);
        its claims name it. See :meth:`close_stream` and "Abandoned passes"."""
        with self._cond:
            sid = next(self._stream_ids)
            self._streams[sid] = _Stream(split, repeat)
            return sid

    def close_stream(self, stream: int) -> bool:
        """The reader has ended (its generator closed). False if it had already been
        superseded by a newer reader of its split: then it must not skip announced epochs,
        which are the newer reader's."""
        with self._cond:
            s = self._streams.pop(stream, None)
            return s is not None and not s.superseded

    def claim_epoch(self, split: str = "train", timeout: float | None = None, *,
                    skip_older: str | None = None, stream: int | None = None) -> int | None:
        """The epoch the next pass over ``split`` reads: the oldest announced one no pass has
        claimed. Waits for the driver to announce one; ``None`` if the node stops first, or
        if ``stream`` was superseded.

        Passes over a split read its epochs in order, one at a time: a claim first ends every
        other reader of the split that is still open (see :meth:`_supersede`), and every
        older pass over it that is still open (see "Abandoned passes").

        ``skip_older``: another split whose unclaimed epochs announced before the claimed one
        (all of them, if the claim has to wait for the driver) are closed unread (see
        :meth:`skip_announced`). A training pass claims with ``skip_older="validation"``: a
        program that starts its next training pass without a validation pass over the previous
        epoch (Keras ``fit(validation_freq=2)``, or a program that never reads the validation
        split) will not come back for it.
        """
        with self._cond:
            self._readers.add(split)
            me = None if stream is None else self._streams.get(stream)
            if stream is not None and (me is None or me.superseded):
                return None
            self._supersede(split, keep=stream)
            if skip_older is not None and not self._announced.get(split):
                self.skip_announced(skip_older)  # nothing left to train on in this call
            self._claiming[split] += 1
            if skip_older is not None:
                self._skipping[split, skip_older] += 1
            try:
                ready = self._await(lambda: self._claimable(split) or (me is not None and me.superseded),
                                    timeout, idle=True, hint=lambda waited: self._waiting_hint(split, waited))
            finally:
                self._claiming[split] -= 1
                if skip_older is not None:
                    self._skipping[split, skip_older] -= 1
            if not ready:
                return None
            if me is not None and me.superseded:
                return None
            epoch = self._announced[split].popleft()
            ep = self._epochs[epoch]
            ep.claimed, ep.stream, ep.last_move = True, stream, time.monotonic()
            ep.in_repeat = me is not None and me.repeat
            self._newest_claim[split] = max(epoch, self._newest_claim.get(split, -1))
            self._end_abandoned(split, epoch)
            if skip_older is not None:
                self.skip_announced(skip_older, before=epoch)
            return epoch

    def _supersede(self, split: str, *, keep: int | None = None, repeat_only: bool = False) -> None:
        """End the open readers of ``split`` other than ``keep`` (only ``repeat=True`` streams
        if ``repeat_only``): a newer reader has begun, so their iterators were dropped, even
        if not yet destroyed. Their open passes end as left early; a stream's announced epochs
        are skipped, as its own end would have done (a ``repeat=True`` stream is the node's
        whole feed of its split: a new reader waits for the driver's next epochs)."""
        ended = [sid for sid, s in self._streams.items()
                 if s.split == split and sid != keep and not (repeat_only and not s.repeat)]
        for sid in ended:
            # Out of the registry now: a dropped iterator that is never destroyed must not
            # keep its entry for the rest of the run; its reader holds the object and sees
            # ``superseded``, and close_stream of an unknown id skips nothing.
            s = self._streams.pop(sid)
            s.superseded = True
            claimed = [ep for ep in self._epochs.values() if ep.stream == sid]
            for ep in claimed:
                self._end_left(ep, f"another reader of {split!r} began")
            if s.repeat:
                self.skip_announced(split)
                if split == "train" and claimed:
                    self.skip_announced("validation", before=max(ep.info.epoch for ep in claimed))
            self._cond.notify_all()

    def _end_abandoned(self, split: str, before: int) -> None:
        """End, as left early, every claimed pass over ``split`` older than ``before`` that is
        still open: its iterator was dropped but not yet destroyed (see "Abandoned passes")."""
        for ep in self._epochs.values():
            if ep.info.split == split and ep.info.epoch < before and ep.claimed:
                self._end_left(ep, f"a pass over epoch {before} began")

    def _end_left(self, ep: NodeEpoch, why: str) -> None:
        """End ``ep``'s open pass as left early with the rows it has yielded (no-op if ended)."""
        if ep.finished:
            return
        logger.info("epoch %d (%s): its pass was left after %d row(s) and its iterator not yet "
                    "destroyed; %s, so that pass ends here", ep.info.epoch, ep.info.split, ep.emitted, why)
        ep.overtaken = why
        self._finish(ep, ep.emitted, complete=False, failure=None)

    def overtaken(self, epoch: int) -> str | None:
        """Why a newer reader ended the pass over ``epoch`` (None if none did): a pass read
        after that was being read at the same time as the newer one."""
        with self._cond:
            ep = self._epochs.get(epoch)
            return None if ep is None else ep.overtaken

    def _open_elsewhere(self, split: str, still_for: float) -> list[NodeEpoch]:
        """The claimed epochs of other splits whose passes are open and have neither taken nor
        yielded a row for ``still_for`` seconds."""
        now = time.monotonic()
        return [ep for ep in self._epochs.values()
                if ep.info.split != split and ep.claimed and not ep.finished
                and not ep.withdrawn and now - ep.last_move >= still_for]

    def _waits_past_pushed(self) -> list[str]:
        """The splits a pass waits over while no epoch of theirs is announced: it waits for a
        later train() call (``EpochState.waits_past``)."""
        return sorted(s for s, n in self._claiming.items() if n and not self._announced.get(s))

    def _waiting_hint(self, split: str, waited: float) -> bool:
        """Log, once, why a pass may wait for nothing, if earlier passes read every pushed
        epoch (nothing on the first pass: waiting for the first train() call is normal).
        True once said."""
        read = sum(1 for ep in self._epochs.values() if ep.info.split == split and not ep.withdrawn)
        if not read:
            return False
        stuck = [] if self._announced.get(split) else self._open_elsewhere(split, STUCK_HINT_AFTER)
        if stuck:
            ep = min(stuck, key=lambda e: e.info.epoch)
            logger.warning(
                "a pass over ctx.dataset(split=%r) has waited %.0f s for a %s epoch, but all %d "
                "pushed so far were read by earlier passes, while the pass over epoch %d (%s) "
                "stands open: the driver's next train() call, which would push more %s rows, "
                "cannot begin before that pass ends. If main reads the two in one loop, both "
                "wait until feed_timeout: every pass (every for loop or iter() over a "
                "ctx.dataset, val_ds.take(k) inside a training loop too) reads one pushed "
                "epoch. To look at a few %s batches now and then, read one pass per training "
                "epoch: val_it = iter(val_ds) when the epoch begins, next(val_it) each time.",
                split, waited, split, read, ep.info.epoch, ep.info.split, split, split)
            return True
        if waited < WAIT_HINT_AFTER:
            return False
        logger.info("%s", (
            f"a pass over ctx.dataset(split={split!r}) has waited {WAIT_HINT_AFTER:.0f} s for the "
            f"driver's next cluster.train() call: all {read} {split} epoch(s) pushed so far were "
            f"claimed by earlier passes. Expected while the driver works between train() calls; "
            f"if train() has returned and main reads more passes than it pushed (for example "
            f"model.evaluate(ds) or a second fit after fit, or a layer.adapt(ds) or a look at "
            f"a batch, next(iter(ds)), before it), "
            f"this pass gets rows only from a later train() call and ends empty at shutdown: "
            f"read one pass per pushed epoch, or evaluate on a dataset of its own (a pull "
            f"reader, or train(validation=...))."
        ))
        return True

    def note_empty_pass(self, split: str) -> str | None:
        """Records, as :attr:`empty_pass_note`, and returns why a pass over ``split`` that
        found no epoch before the node stopped got nothing, if earlier passes read every epoch
        pushed (None, and nothing recorded, when none was: nothing was pushed)."""
        note = self._why_empty(split)
        if note:
            self.empty_pass_note = note
        return note

    def _why_empty(self, split: str) -> str | None:
        with self._cond:
            mine = [ep for ep in self._epochs.values() if ep.info.split == split]
            read = sum(1 for ep in mine if not ep.withdrawn)
            cut = bool(mine) and max(mine, key=lambda ep: ep.info.epoch).withdrawn
        if not read or not self._stopped:
            return None
        if cut:  # the last train() call was stopped (a shutdown, a failure) and took them back
            return (
                f"a pass over ctx.dataset(split={split!r}) ended without rows: the cluster shut "
                f"down after the last cluster.train call stopped early and took back the "
                f"{split} epoch(s) it had not pushed; the driver's train() error says why."
            )
        return (
            f"a pass over ctx.dataset(split={split!r}) ended without rows: the cluster shut down "
            f"after earlier passes had read all {read} {split} epoch(s) pushed. main read more "
            f"passes than cluster.train pushed (e.g. fit(epochs=3) over train(df, num_epochs=2), "
            f"a layer.adapt(ds) or a look at a batch (next(iter(ds)), ds.take(1)) before fit, "
            f"or an evaluate(ds) or a second fit after it: each reads a pass of "
            f"its own); Keras may report that pass as an epoch, without data. Read one pass "
            f"per pushed epoch. (A main fed by a stream that reads passes until shutdown: read "
            f"ctx.should_stop after every pass, and this note goes away.)"
        )

    def peek_epoch(self, split: str = "train", timeout: float | None = None, *,
                   new_reader: bool = False) -> EpochInfo | None:
        """The info of the epoch the next pass over ``split`` would claim (waits for one).

        ``new_reader``: a dataset over ``split`` is being built, so an open ``repeat=True``
        stream over it was dropped (see :meth:`_supersede`): its epochs are not the new
        dataset's."""
        with self._cond:
            if new_reader:
                self._supersede(split, repeat_only=True)
            if not self._await(lambda: self._claimable(split), timeout, idle=True):
                return None
            return self._epochs[self._announced[split][0]].info

    def _claimable(self, split: str) -> bool:
        """An announced epoch of ``split`` waits for a pass, and is not held."""
        q = self._announced.get(split)
        return bool(q) and not self._epochs[q[0]].held

    def hold_epochs(self, epochs: list[int]) -> list[int]:
        """Hold those of ``epochs`` whose pass, if one has claimed it, has yielded no row yet:
        until :meth:`release_epochs`, none is claimed, taken from or replayed into. Returns
        the epochs held.

        A ``train()`` call that fails (or is interrupted) takes back the epochs it announced
        and has not finished: an epoch no worker has yielded a row of is withdrawn, so main's
        pass reads the next call's data instead of an empty or partial epoch (a Keras ``fit``
        stops on an empty one; a pass that had claimed it goes on with the next epoch). Under
        MultiWorkerMirroredStrategy it may be withdrawn only if no worker has yielded from
        it, hence hold first on every node, then release."""
        with self._cond:
            held = []
            for e in epochs:
                ep = self._epochs.get(e)
                if ep is None or ep.closed or ep.finished:
                    continue
                if ep.claimed:
                    if ep.emitted:
                        continue
                elif e not in (self._announced.get(ep.info.split) or ()):
                    continue
                ep.held = True
                held.append(e)
            return held

    def release_epochs(self, *, withdraw: Iterable[int] = (), keep: Iterable[int] = ()) -> None:
        """Release held epochs, all at once: those in ``withdraw`` are closed unread and
        forgotten (their rows, if any came, count as never pushed); those in ``keep`` are
        claimable again."""
        gone = set(withdraw)
        with self._cond:
            for e in sorted(gone | set(keep)):
                ep = self._epochs.get(e)
                if ep is None or not ep.held:
                    continue
                ep.held = False
                if e in gone:
                    q = self._announced.get(ep.info.split) or deque()
                    self._announced[ep.info.split] = deque(x for x in q if x != e)
                    ep.withdrawn = ep.finished = True  # a pass over it goes on to the next epoch
                    ep.feeding = False
                    self._close(ep)
            self._cond.notify_all()

    def last_epoch_info(self, split: str = "train") -> EpochInfo | None:
        """The info of the newest epoch of ``split`` the driver announced (None if none)."""
        with self._cond:
            infos = [ep.info for ep in self._epochs.values() if ep.info.split == split]
            return max(infos, key=lambda i: i.epoch) if infos else None

    def skip_announced(self, split: str = "train", *, before: int | None = None) -> list[int]:
        """Close the announced epochs of ``split`` that no pass has claimed yet (only those
        numbered below ``before``, if given), so their pushes stop instead of waiting for a
        reader that will not come; their rows count as unconsumed.

        A ``repeat=True`` stream is the node's whole feed of its split: when it is dropped
        (``fit`` with ``steps_per_epoch`` done before the data is), the epochs already pushed
        for it will never be read. Returns the epochs closed.
        """
        with self._cond:
            q = self._announced.get(split) or deque()
            skipped = [e for e in q if before is None or e < before]
            if not skipped:
                return []
            self._announced[split] = deque(e for e in q if e not in skipped)
            for e in skipped:
                self._close(self._epochs[e])
            self.metrics["epochs_left_early"] += len(skipped)
            self._cond.notify_all()
            return skipped

    def end_epoch(self, epoch: int, limit: int, *, cut: bool = False) -> None:
        """Set how many rows this node yields for ``epoch`` (equal on every worker); ``cut``:
        a failed ``train()`` call ended the epoch with the rows that had arrived."""
        with self._cond:
            ep = self._epochs.get(epoch)
            if ep is None:
                raise FeedError(f"end_epoch for epoch {epoch}, which this node never began")
            ep.limit = int(limit)
            ep.cut = cut
            if cut and ep.emitted > ep.limit:
                # said here, as the cut arrives: a pass whose main waits in a collective never
                # takes again (feeders.source.iterate_epoch warns when it does); the drain
                # shutdown reads it (dataplane.driver.cluster)
                self.metrics["overran_cut"] = {"epoch": epoch, "split": ep.info.split, "cut": ep.limit,
                                               "yielded": ep.emitted}
            if not ep.feeding:  # its pass has all it needs now: no producer may park for it
                self._starving.pop(epoch, None)
            if ep.cache is not None and ep.info.record is not None and not ep.cache.sealed:
                ep.cache.seal()
                self._cache_metrics()
            self._cond.notify_all()

    def was_cut(self, epoch: int) -> bool:
        """Whether a failed ``train()`` call ended ``epoch`` early (:meth:`end_epoch`)."""
        with self._cond:
            ep = self._epochs.get(epoch)
            return ep is not None and ep.cut

    def epoch_rows(self, epoch: int) -> int:
        with self._cond:
            ep = self._epochs.get(epoch)
            return ep.rows_in if ep else 0

    def wait_closed(self, epoch: int, timeout: float) -> None:
        """Block until ``epoch``'s pass has ended (or the consumer finished, or the node
        stops), at most ``timeout`` seconds: the driver's long poll at the end of ``train``.

        A pass that began but has neither taken nor yielded rows for :data:`COLLECT_AFTER`
        seconds may have been dropped inside a reference cycle, which only Python's cyclic
        collector ends (see "Abandoned passes"): the node then runs it, in a thread of its own,
        and waits twice as long (up to :data:`COLLECT_MAX`) before doing so again for that
        pass, since a slow consumer looks the same."""
        def ended() -> bool:
            ep = self._epochs.get(epoch)
            return self._consumer_done or (ep is not None and ep.closed)

        with self._cond:
            if self._await(ended, timeout, idle=False):
                return
            ep = self._epochs.get(epoch)
            if ep is None or not ep.claimed:
                return
            now = time.monotonic()
            wait, last = self._collect_after.get(epoch, (COLLECT_AFTER, 0.0))
            if now - max(ep.last_move, last) < wait or now - self._last_collect < COLLECT_AFTER:
                return
            self._collect_after[epoch] = (min(2 * wait, COLLECT_MAX), now)
            self._last_collect = now
        threading.Thread(target=_collect, args=(epoch,), name="dataplane-collect", daemon=True).start()

    def epoch_state(self, epoch: int) -> dict[str, Any]:
        """rows received, emitted, closed, complete (see ``feeders.protocol.EpochState``)."""
        with self._cond:
            ep = self._epochs.get(epoch)
            waits_past = self._waits_past_pushed()
            if ep is None:
                return {"rows": 0, "emitted": 0, "closed": self._consumer_done, "complete": False,
                        "ended_feed": self._consumer_done, "dataset": bool(self._readers),
                        "waits_past": waits_past}
            out = {"rows": ep.rows_in, "emitted": ep.emitted, "closed": ep.closed,
                   "waits_past": waits_past,
                   "complete": ep.complete, "feeding": ep.feeding, "ended_feed": ep.ended_feed,
                   "failure": ep.failure, "carried_in": ep.carried_in,
                   "carried_out": ep.carried_out,
                   "dataset": ep.info.split in self._readers,
                   "repeat": ep.in_repeat,
                   # left by its reader, who read on: not the pass main was in when it
                   # returned or raised, which the driver must tell apart (a failure)
                   "left_early": (ep.finished and not ep.complete and ep.failure is None
                                  and self._newest_claim.get(ep.info.split, -1) > epoch)}
            if ep.info.replay is not None:
                cache = self._caches.get(ep.info.replay)
                out["cache_rows"] = cache.rows if cache is not None and cache.sealed else None
            return out

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """The node is shutting down: passes end, even over rows already taken."""
        return self._stopped

    def consumer_finished(self) -> None:
        """The node's main returned, or will read no more pushed data (it serves inference):
        refuse further data, drop what is queued, close every open epoch."""
        with self._cond:
            self._consumer_done = True
            self.metrics["consumer_finished"] = True
            self._carry.clear()
            for ep in self._epochs.values():
                ep.ended_feed = ep.ended_feed or not ep.closed
                self._close(ep)
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    # -- producer side (do_put) --------------------------------------------------------------
    def put_stream(self, epoch: int, partition: int, batches: Iterator[Any]) -> int:
        """Accept one attempt's stream of a partition; returns rows accepted (after dedupe).

        ``batches`` yields record batches, or ``(batch_or_None, seen)`` pairs where ``seen`` is
        how many rows of the partition its task had split when it sent them (``None``: unknown),
        or ``(batch_or_None, seen, batch_nulls)`` with the nulls of the whole Arrow batch the
        chunk was cut from (see :meth:`_check_nulls`).
        A recording epoch (``cache=True``) keeps taking rows into its cache after the consumer
        left it: later epochs replay them.

        Raises:
            FeedStopped: the node is shutting down.
            ConsumerFinished: the node's main has returned.
            EpochClosed: the node's pass over this epoch has ended.
            FeedError: the epoch was never announced, or the schema does not match it.
        """
        offset = 0  # rows of this attempt's stream seen so far
        accepted = 0
        with self._cond:
            ep = self._epochs.get(epoch)
            if ep is None:
                raise FeedError(
                    f"data for epoch {epoch} (partition {partition}) arrived before the driver "
                    f"announced that epoch; this is a bug in the feeding job."
                )
            ep.accepted.setdefault(partition, 0)
            self._check_open(ep)
        for item in batches:
            batch_nulls = None
            if isinstance(item, tuple):
                batch, seen, *rest = item
                if rest:
                    batch_nulls = rest[0]
            else:
                batch, seen = item, None
            if batch is not None and batch.num_rows:
                # before the seen count: a refused chunk must not raise what this node may yield
                self._check_nulls(ep, partition, batch, batch_nulls)
            if seen is not None:
                with self._cond:
                    if seen > ep.seen.get(partition, 0):
                        ep.seen[partition] = seen
                        self._cond.notify_all()
            if batch is None or batch.num_rows == 0:
                continue
            n = batch.num_rows
            if not same_columns(batch.schema, ep.info.schema):
                raise FeedError(
                    f"partition {partition} of epoch {epoch} sent columns "
                    f"({schema_text(batch.schema)}), but the epoch was announced with "
                    f"({schema_text(ep.info.schema)})."
                )
            nbytes = batch.nbytes
            with self._cond:
                park = False
                while True:
                    self._check_open(ep)
                    if ep.closed:
                        break
                    park = self._parking(ep, nbytes)
                    if park or self._bytes == 0 or self._bytes + nbytes <= self.capacity:
                        break
                    self._stall(+1)
                    try:
                        self._cond.wait(0.2)
                    finally:
                        self._stall(-1)
                done = ep.accepted.get(partition, 0)
                start, end = offset, offset + n
                offset = end
                if end <= done:
                    self.metrics["rows_duplicate"] += n
                    continue
                if start < done:
                    self.metrics["rows_duplicate"] += done - start
                    batch = batch.slice(done - start)
                    nbytes = batch.nbytes
                ep.accepted[partition] = end
                accepted += batch.num_rows
                if ep.cache is not None:
                    ep.cache.add(batch, (partition, end - batch.num_rows))
                if ep.closed:  # recording only: the consumer has left this epoch
                    ep.rows_in += batch.num_rows
                    continue
                if park:
                    self._park(ep, batch, spill=True)
                    continue
                self._queue(ep, batch, nbytes)
        with self._cond:
            self._check_open(ep)
        return accepted

    def _stall(self, change: int) -> None:
        """Count producers waiting on a full buffer; ``stall_seconds`` is the wall time during
        which at least one waited (not the sum over producers waiting at the same time)."""
        now = time.monotonic()
        if self._stalled:
            self.metrics["stall_seconds"] += now - self._stall_mark
        self._stall_mark = now
        self._stalled += change

    def _check_open(self, ep: NodeEpoch) -> None:
        if self._stopped:
            raise FeedStopped("the node is shutting down")
        if ep.cache is not None and not ep.cache.sealed and not self._consumer_done:
            return  # a recording epoch takes every row, read or not
        if self._consumer_done:
            raise ConsumerFinished("the node's main has returned")
        if ep.closed:
            raise EpochClosed(f"the node's pass over epoch {ep.info.epoch} has ended")

    # -- consumer side (tf.data generator) -----------------------------------------------------
    def wait_epoch_info(self, epoch: int, timeout: float | None = None) -> EpochInfo | None:
        """The announced info of ``epoch``; ``None`` if the node stopped first (or timeout)."""
        with self._cond:
            if not self._await(lambda: epoch in self._epochs, timeout, idle=True):
                return None
            return self._epochs[epoch].info

    def take(self, epoch: int, num_workers: int = 1) -> tuple[list[pa.RecordBatch], int, int | None]:
        """Block until there is data or news for ``epoch``; take every queued batch, and of
        the rows parked for it (see :class:`ParkedRows`) up to a buffer's worth.

        Returns:
            (batches, safe, limit). ``safe`` is how many rows of the epoch this node may yield
            now without ever yielding more than any other worker: every worker ends up with at
            least ``seen // num_workers`` rows of a partition whose task had split ``seen`` rows
            (see :mod:`feeders.protocol`); for a partition whose task sent no such count, all
            but one of the rows accepted. ``limit`` is the final, equalised row count, set by
            the driver once the epoch's job has finished (None while parked rows are left).
        """
        with self._cond:
            ep = self._epochs[epoch]
            try:
                while True:
                    if self._stopped:
                        raise FeedStopped("the node is shutting down")
                    if ep.withdrawn:
                        raise EpochWithdrawn(epoch)
                    if ep.closed:
                        # the node ended its feed (ctx.end_feed, TFoS's terminate) while this
                        # pass was open: its queued rows are dropped, so the pass ends here
                        # rather than finding fewer rows than the driver's limit
                        raise FeedStopped(f"epoch {epoch} was closed: the node ended its feed")
                    if not ep.held and (ep.queue or (ep.parked is not None and ep.parked.rows) or (
                            ep.limit is not None and not ep.feeding)):
                        break
                    self._starving.setdefault(epoch, time.monotonic())
                    self._cond.wait(0.2)
            finally:
                self._starving.pop(epoch, None)
            out = list(ep.queue)
            if ep.parked is not None and ep.parked.rows:
                # parked after everything queued (order is kept), a buffer's worth a take:
                # a pile set aside while another pass starved may be many times that
                out += ep.parked.pop(self.capacity)
            self.metrics["rows_taken"] += sum(b.num_rows for b in out)
            ep.last_move = time.monotonic()
            ep.queue.clear()
            self._bytes -= ep.queued_bytes
            ep.queued_bytes = 0
            self.metrics["buffer_bytes"] = self._bytes
            if ep.info.replay is not None:
                # the limit is known before the rows are: every worker replays at least it
                safe = ep.limit or 0
            else:
                safe = 0
                for p, n in ep.accepted.items():
                    seen = ep.seen.get(p)
                    safe += seen // num_workers if seen is not None else max(n - 1, 0)
            self._cond.notify_all()
            more = ep.feeding or (ep.parked is not None and ep.parked.rows)  # (popped in parts)
            return out, min(safe, ep.rows_in), (None if more else ep.limit)

    def take_carry(self, epoch: int) -> list[pa.RecordBatch]:
        """The rows a pass over ``epoch`` begins with: those the complete pass over its
        ``carry_from`` epoch held back (``EpochInfo.carry``), which the driver counted in this
        epoch's limit. Rows of the split held back from any other epoch are dropped here: the
        driver counted them as dropped or unconsumed when it began this epoch (a micro-batch
        whose columns differ, an epoch this node left early)."""
        with self._cond:
            ep = self._epochs[epoch]
            held = self._carry.pop(ep.info.split, None)
            if held is None or ep.info.carry_from is None or held[0] != ep.info.carry_from:
                return []
            ep.carried_in = held[2]
            if all(b.schema.equals(ep.info.schema) for b in held[1]):
                return held[1]
            # (same columns as the driver checked, but Spark's nullability or list child
            # names may differ between micro-batches: one schema within a pass)
            return pa.Table.from_batches(held[1]).cast(ep.info.schema).to_batches()

    def finish_epoch(self, epoch: int, rows_out: int, *, complete: bool = True,
                     failure: str | None = None, carry: list[pa.RecordBatch] | None = None) -> None:
        """The consumer's pass over ``epoch`` has ended, having handed ``rows_out`` rows to
        TensorFlow; ``complete=False``: it was left early (the rest is refused from now on);
        ``failure``: it ended with that error, which main is about to raise; ``carry``: the
        rows past the limit of a complete pass over a carry epoch, held back for the next
        (see :meth:`take_carry`). A no-op for a pass already ended as abandoned (its generator
        closes later)."""
        with self._cond:
            ep = self._epochs.get(epoch)
            if ep is not None and ep.finished:
                return
            if ep is not None:
                if complete and ep.info.carry and carry:
                    ep.carried_out = sum(b.num_rows for b in carry)
                    self._carry[ep.info.split] = (epoch, carry, ep.carried_out)
                self._finish(ep, rows_out, complete=complete, failure=failure)
            else:
                self.metrics["rows_out"] += rows_out
                self.metrics["epochs_consumed"] += 1
            self._cond.notify_all()

    def emit(self, epoch: int, rows: int) -> bool:
        """Count ``rows`` of ``epoch`` as handed to TensorFlow, unless its pass has ended (then
        False, and they must not be): the counts stay exact when an abandoned pass is ended
        while its generator still runs.

        Waits while the epoch is held (:meth:`hold_epochs` found nothing yielded, and a pass
        that took rows before the hold must not yield them before the driver decides), and
        raises :class:`EpochWithdrawn` if it was then withdrawn."""
        with self._cond:
            ep = self._epochs.get(epoch)
            if ep is None:
                return True
            # release_epochs and stop both notify: nothing to poll for
            self._cond.wait_for(lambda: not ep.held or self._stopped)
            if ep.withdrawn:
                raise EpochWithdrawn(epoch)
            if ep.closed:
                return False
            ep.emitted += rows
            ep.last_move = time.monotonic()
            self.metrics["rows_yielded"] += rows
            return True

    def _finish(self, ep: NodeEpoch, rows_out: int, *, complete: bool, failure: str | None) -> None:
        ep.emitted = rows_out
        ep.complete = complete
        ep.failure = failure
        ep.finished = True
        self._close(ep)
        if not complete:
            self.metrics["epochs_left_early"] += 1
        self.metrics["rows_out"] += rows_out
        self.metrics["epochs_consumed"] += 1
        self._cond.notify_all()

    def _close(self, ep: NodeEpoch) -> None:
        if ep.closed:
            return
        ep.closed = True
        self._collect_after.pop(ep.info.epoch, None)
        self._bytes -= ep.queued_bytes
        ep.queued_bytes = 0
        ep.queue.clear()
        if ep.parked is not None:
            ep.parked.clear()
        self.metrics["buffer_bytes"] = self._bytes

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return dict(self.metrics)
