"""Driver side of ``cluster.train``: the :class:`Feeder` a cluster holds.

The driver never touches the data: it announces a call's epochs to the workers, runs a
``mapInArrow`` job per pushed epoch whose tasks push straight to the nodes (:mod:`feeders.push`,
:mod:`dataplane.driver.pushjob`), and from the tasks' own counts tells every worker still reading
how many rows to yield (the minimum, so all yield the same number of batches). ``train`` returns
once every worker's pass over each epoch has ended (read to its end, left early, or its main
returned), so its :class:`FeedReport` accounts for every row: consumed + ``rows_unconsumed`` +
``dropped_for_balance`` = rows pushed.

A stream's micro-batches (``train(carry=True)``, used by :mod:`dataplane.workloads.streaming`)
do not drop the rows past the limit: each worker holds them back for the next micro-batch, whose
pass begins with them, and the driver counts them in that epoch's limit. The next push hands
every partition's extra rows to the workers holding back the fewest (in turn by partition among
equals), so what a worker holds back stays within about one row per partition of a micro-batch
instead of growing from batch to batch.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa

from dataplane.driver.pushjob import FeedClock, Moved, PushJobs, feed_timeout_error
from dataplane.driver.sparkjobs import arrow_schema_of
from dataplane.errors import ClusterStateError, FeedError, NodeError, SchemaError
from dataplane.topology import NodeInfo
from feeders.protocol import Action, BeginEpoch, EpochState
from formats.sparkframe import row_bytes

__all__ = ["FeedReport", "Feeder"]

logger = logging.getLogger(__name__)


@dataclass
class FeedReport:
    """What ``cluster.train`` pushed, and what became of it.

    Attributes:
        rows: rows pushed or replayed in all epochs (``df.count() * num_epochs`` when nothing
            failed, ``cache=True`` or not).
        bytes: Arrow payload bytes that went over the network: with ``cache=True`` the one push
            only (the nodes replay the later epochs from their caches), so ``bytes / rows`` is
            a row's size only without the cache.
        seconds: wall time of the feed.
        rows_per_node: node id -> rows that node received (after dedupe of retried tasks):
            for a replayed epoch (``cache=True``) the rows its cache holds, and for a pushed
            one the rows that reached it, so a node that refused the rest of an epoch (its
            pass ended, its main returned) counts only what arrived before; how much depends on
            when it refused. What the node's dataset did not hand to TensorFlow is in
            ``rows_unconsumed`` either way.
        dropped_for_balance: rows received but not yielded, so every worker yields the same
            number of rows (and batches) per epoch.
        rows_unconsumed: node id -> rows pushed for that node that its dataset never handed to
            TensorFlow: the rest of an epoch left early (``break``, ``take``,
            ``steps_per_epoch``), an epoch's tail cut by ``drop_remainder``, or rows pushed
            after its main had returned. Rows a pass had already read ahead when it was left
            count as consumed: the prefetched batches and, for narrow rows, the block
            ``ctx.dataset`` takes from the buffer at a time, which ends at a pass's 1st,
            2nd, 4th, ... 64th batch and then every 64th (fewer when a batch holds over
            128 KiB): a pass left after k batches counts at most about min(2k, k + 64) + 2.
        spark_jobs: Spark jobs that pushed data (one per DataFrame with ``cache=True``, none
            when the workers already hold it; one per epoch and DataFrame otherwise).
        spark_tasks: the tasks of those jobs that pushed (one per partition, but a DataFrame
            of many partitions is pushed by at most a few tasks per task slot).
        rows_per_split: rows pushed or replayed per split (``"train"``, ``"validation"``).
        carried_in: rows an earlier micro-batch of a stream held back on the workers (instead
            of dropping them for balance) that this one began with
            (:func:`dataplane.workloads.streaming.feed_stream`). A ``cluster.train`` call
            after a stream, or a micro-batch whose columns or array lengths differ, counts
            them here and in ``dropped_for_balance`` (its messages say so).
        carried_out: rows of this micro-batch past the balanced count, held back on the
            workers for the next one. consumed + ``rows_unconsumed`` + ``dropped_for_balance``
            + ``carried_out`` = ``rows`` + ``carried_in``.
        epochs: epoch ids used for this feed. Ids count on over the cluster's calls, and a
            call's train and validation epochs take turns (``train(df, 3, validation=v)`` as
            a cluster's first call: train 0, 2, 4; validation 1, 3, 5).
        messages: notes for the user (e.g. a node that stopped consuming early). They name an
            epoch by its id, its split and its place in the call: ``epoch 4 (train, 3 of 3)``.
    """

    rows: int
    bytes: int
    seconds: float
    rows_per_node: dict[int, int]
    dropped_for_balance: int
    rows_unconsumed: dict[int, int] = field(default_factory=dict)
    spark_jobs: int = 0
    spark_tasks: int = 0
    rows_per_split: dict[str, int] = field(default_factory=dict)
    epochs: list[int] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    carried_in: int = 0
    carried_out: int = 0

    @property
    def rows_consumed(self) -> int:
        """Rows the workers' datasets handed to TensorFlow."""
        return (self.rows + self.carried_in - sum(self.rows_unconsumed.values())
                - self.dropped_for_balance - self.carried_out)


@dataclass
class _EpochBooks:
    """The driver's books on one pushed epoch."""

    epoch: int
    workers: list[NodeInfo]
    split: str = "train"
    source: "_Split | None" = None
    record: str | None = None  # the nodes keep this epoch's rows under this cache id
    replay: str | None = None  # the nodes replay this cache instead of a Spark job
    assigned: dict[int, int] = field(default_factory=dict)  # node -> rows the split gave it
    received: dict[int, int] = field(default_factory=dict)
    limit: int | None = None  # rows every reading worker yields (balanced), else the fewest
    limits: dict[int, int] = field(default_factory=dict)  # node -> rows it was told to yield
    reading: set[int] = field(default_factory=set)  # nodes told the limit
    balance: bool = True  # every reading worker yields the same rows (MWMS needs it)
    ending: list[Any] = field(default_factory=list)  # (node, future) of the END_EPOCH actions
    carry: bool = False  # a stream's micro-batch: rows past the limit are held back, not dropped
    carried_in: dict[int, int] = field(default_factory=dict)  # node -> rows it begins with
    withdrawn: bool = False  # a failed call took it back before any worker yielded from it (Feeder._abort)
    nth: int = 1  # its place among its call's epochs of its split (1-based) ...
    of: int = 1  # ... of this many (train(num_epochs=...))

    @property
    def name(self) -> str:
        """How the driver's messages name it: the id (``FeedReport.epochs``; ids count on over
        the cluster's calls, a call's train and validation epochs interleaved), the split and
        its place in the call, since "epoch 4" alone reads as the user's 5th epoch."""
        if self.carry:  # a stream's micro-batch: a call of one epoch
            return f"epoch {self.epoch} ({self.split})"
        return f"epoch {self.epoch} ({self.split}, {self.nth} of {self.of})"


@dataclass
class _Split:
    """One DataFrame a train() call pushes: "train", or "validation"."""

    name: str
    df: Any
    schema: pa.Schema
    schema_ipc: bytes
    shapes: dict[str, tuple[int, ...]]
    rows: int | None = None  # counted by the shape scan; None when there was none
    ragged: dict[str, tuple[int, int | None, int | None]] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)  # bytes of ragged and binary columns (row_bytes)


def _ragged_notes(splits: Sequence[_Split]) -> list[str]:
    """Array columns whose rows differ in length: ctx.dataset() yields them as tf.RaggedTensor,
    which a model expecting a fixed-size input fails on with an error about ragged shapes."""
    notes = []
    for sp in splits:
        for name, (level, lo, hi) in sp.ragged.items():
            where = "" if sp.name == "train" else " of train(validation=...)"
            what = f"arrays of {lo} to {hi} values" if level == 0 else (
                f"nested arrays whose level-{level} arrays have {lo} to {hi} values")
            find = (f"If every row should have {hi} values, the others are bad rows: "
                    f"df.where(F.size({name!r}) != {hi}) finds them, or declare "
                    if level == 0 else "Declare ")
            notes.append(
                f"column {name!r}{where} holds {what}, so ctx.dataset() "
                f"yields it as a tf.RaggedTensor, which a model with a fixed-size input (a Dense "
                f"layer) cannot take. {find}ctx.dataset(..., shapes={{{name!r}: (...)}}) to have "
                f"the node name the first row that does not fit; variable-length data needs "
                f"padding or a model that takes ragged input."
            )
    return notes


def _empty_message(split: str, stream: bool = False) -> str:
    if stream:
        return ("the micro-batch has no rows (feed_stream(skip_empty=False) pushes empty ones), "
                "so every worker's pass over it is empty; array columns then come ragged unless "
                "declared, e.g. ctx.dataset(shapes={'x': [4]}).")
    what = "train(df)" if split == "train" else "train(validation=...)"
    return (
        f"the DataFrame given to {what} has no rows, so every worker's pass over it is empty; "
        f"check the filters or joins that built it."
    )


def _too_few_message(ep: "_EpochBooks", pushed: int) -> str:
    return (
        f"{ep.name}: its {pushed} row(s) over {len(ep.workers)} workers "
        f"leave some worker none, so every worker yielded none (each yields the smallest "
        f"worker's share); push at least one row per worker."
    )


# A training pass left early having read at most 1 / GLANCE_SHARE of its rows is said with the
# likeliest cause users do not mean: a look at a batch before training (next(iter(ds))), which
# is a pass of its own and takes a pushed epoch.
GLANCE_SHARE = 2


def _few(counts: Iterable[int]) -> str:
    """``192`` when every count is the same, else ``192-256``."""
    c = sorted(counts)
    return f"{c[0]:,}" if c[0] == c[-1] else f"{c[0]:,}-{c[-1]:,}"


# The cause of a training epoch no pass read while main read on or returned (said in full by
# _fewer_passes_note the first time, then as one line pointing back to it).
_FEWER_PASSES = "their main read fewer passes than train(num_epochs=...) pushed"


def _fewer_passes_note(ep: "_EpochBooks", pushed: int) -> str:
    """Why main read fewer passes than a call pushed: the usual causes, with the MWMS step
    arithmetic users get wrong."""
    cached = ep.record is not None or ep.replay is not None
    workers = len(ep.workers)
    return (
        f"{_FEWER_PASSES[0].upper()}{_FEWER_PASSES[1:]}: "
        "a fit that EarlyStopping ended, fit(epochs=) below num_epochs (a "
        "fit(initial_epoch=k), or one that BackupAndRestore resumed at epoch k, "
        "reads epochs - k passes), a "
        "Keras fit that ran out of data on a pass shorter than its first, "
        "fit(steps_per_epoch=...) on a dataset without repeat=True (Keras "
        "then reads one pass for all its epochs: use ctx.dataset(repeat=True)), "
        "fit(steps_per_epoch=k, epochs=E) on a repeat=True stream whose E x k "
        "steps take fewer rows than were pushed" + (
            f" (under MultiWorkerMirroredStrategy a step takes batch_size / "
            f"{workers} rows from each worker, so this epoch's {pushed:,} "
            f"rows last {pushed:,} // batch_size steps, not {pushed:,} // "
            f"batch_size // {workers})" if workers > 1 else "") +
        ", or a Dataset.cache() over ctx.dataset (TensorFlow then reads the feed once)."
        + ("" if cached else " To push once and train many epochs, use "
           "train(..., cache=True).")
    )


def _empty_notes(splits: Sequence[_Split], books: Sequence["_EpochBooks"]) -> list[str]:
    """Why a train() call's passes were empty, if they were: a DataFrame without rows, or
    fewer rows than workers."""
    stream = any(ep.carry for ep in books)
    notes = [_empty_message(sp.name, stream) for sp in splits if sp.rows == 0]
    for ep in books:
        pushed = sum(ep.assigned.values())
        known = any(sp.name == ep.split and sp.rows == 0 for sp in splits)
        # (limit 0 with rows pushed: too few rows only if two or more workers still read it;
        # with none reading, every worker left the epoch early)
        if ep.limit == 0 and ep.assigned and not known and (pushed == 0 or (
                ep.balance and not ep.carry and len(ep.reading) > 1)):
            notes.append(_empty_message(ep.split, stream) if pushed == 0 else _too_few_message(ep, pushed))
            break
    return list(dict.fromkeys(notes))


def _epochs_text(epochs: Sequence[int]) -> str:
    return f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}-{epochs[-1]}"


def _failed_call_note(err: BaseException, cut: Sequence[int], withdrawn: Sequence[int]) -> str:
    """Why a main that fails after a failed train() call may have failed: that call's
    unfinished epochs that a worker had begun were ended with what had arrived; the others
    were withdrawn (see ``Feeder._abort``)."""
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    told = [f"an earlier train() call failed ({reason})"]
    if cut:
        told.append(
            f"its {_epochs_text(cut)} ended early with only the rows that had arrived, "
            f"possibly none (a Keras fit stops or fails on an empty epoch)"
        )
    if withdrawn:
        told.append(f"its {_epochs_text(withdrawn)}, which no worker had begun, were withdrawn")
    return (
        "; ".join(told) + ". A main that failed cannot pick up the training where it stopped: "
        "fix the cause and start a new cluster (dataplane.run) for the next try."
    )


@dataclass
class DataNotes:
    """What the driver knows of the data that may explain why a node's main failed, added to
    that NodeError's message: a main that fails on bad data rarely says so (Keras: a shape
    error, "Empty logs", an error about ragged tensors)."""

    # an earlier train() call failed and cut its epochs short; kept until a call succeeds
    failed_call: str | None = None
    # the last call's passes were empty (no rows, or fewer rows than workers)
    empty: list[str] = field(default_factory=list)
    # array columns of the last call whose rows differ in length: only for a failure about
    # ragged tensors (a text model takes ragged columns as they are, and fails for reasons of
    # its own)
    ragged: list[str] = field(default_factory=list)

    def after_call(self, splits: Sequence[_Split], books: Sequence["_EpochBooks"]) -> None:
        self.empty = _empty_notes(splits, books)
        self.ragged = _ragged_notes(splits)

    def add_to(self, err: NodeError) -> None:
        """End ``err``'s message with the notes that bear on it (once)."""
        told = f"{err.args[0] if err.args else ''}\n{getattr(err, 'remote_traceback', '')}"
        notes = [self.failed_call] if self.failed_call else []
        notes += self.empty + (self.ragged if "ragged" in told.lower() else [])
        if notes and err.args and isinstance(err.args[0], str) and notes[0] not in err.args[0]:
            err.args = (f"{err.args[0]}\nThe data may be why: {' '.join(notes)}",)


@dataclass
class _Carry:
    """Rows the workers held back from the last micro-batch of a stream (``train(carry=True)``)."""

    epoch: int
    schema: pa.Schema
    shapes: dict[str, tuple[int, ...]]  # fixed array lengths: a pass converts them as dense
    rows: dict[int, int]  # node -> rows


@dataclass
class _Cached:
    """A DataFrame the workers hold in their caches (train(cache=True))."""

    ref: Any  # weakref to the DataFrame
    cache_id: str
    schema_ipc: bytes
    workers: tuple[int, ...]
    assigned: dict[int, int] = field(default_factory=dict)  # node -> rows recorded for it


def _unstarted(states: dict[int, EpochState]) -> list[int]:
    """Nodes whose main runs but that have read none of an epoch (their pass is still open)."""
    return sorted(nid for nid, st in states.items()
                  if st.main == "running" and not st.closed and st.emitted == 0)


def _reading_text(states: dict[int, EpochState]) -> str:
    """Each node's pass in words: 'node 0 read 2,000 of 2,000 rows, node 1 read 0 of 2,000'."""
    parts = []
    for nid, st in sorted(states.items()):
        state = "" if st.main == "running" else f", main {st.main}"
        parts.append(f"node {nid} read {st.emitted:,} of {st.rows:,} rows"
                     f"{' (pass ended)' if st.closed else ''}{state}")
    return "; ".join(parts)


def _without_dataset(states: dict[int, EpochState], blamed: Sequence[int], split: str) -> str:
    """What to say when the nodes blamed for a push that stands still have not built a
    ``ctx.dataset()`` over its split at all ("" if some of them have)."""
    if not blamed or any(states[nid].dataset for nid in blamed):
        return ""
    return (
        f"Node(s) {sorted(blamed)} have not built ctx.dataset(split='{split}') yet while their "
        f"main runs: a main that sets up for long before its first pass (a model to load, a "
        f"strategy's start-up) needs a larger feed_timeout; a main that gets its data some "
        f"other way should not be sent any (leave the data out of train(), or call "
        f"ctx.end_feed() in main)."
    )


def _waiting_past(states: dict[int, EpochState], blamed: Sequence[int], ep: "_EpochBooks",
                  books: Sequence["_EpochBooks"]) -> str:
    """What to say when the mains of nodes blamed for ``ep``'s pass standing still wait in a
    pass over another split past the epochs this call pushes ("" if none does): a main that
    reads both in one loop waits there for a later train() call, which cannot begin."""
    waiting = {nid: [s for s in states[nid].waits_past if s != ep.split] for nid in blamed}
    nodes = sorted(nid for nid, splits in waiting.items() if splits)
    if not nodes:
        return ""
    split = waiting[nodes[0]][0]
    pushed = sum(1 for b in books if b.split == split)
    return (
        f"Node(s) {nodes}'s main waits in a pass over ctx.dataset(split='{split}') past the "
        f"{pushed} {split} epoch(s) this call pushes, while its pass over {ep.name} stands "
        f"open: a later train() call, which would push more, cannot begin before this one "
        f"ends. Every pass (every for loop or iter() over a ctx.dataset, val_ds.take(k) "
        f"inside a training loop too) reads one pushed epoch; to look at a few {split} "
        f"batches now and then, read one pass per training epoch: val_it = iter(val_ds) when "
        f"the epoch begins, next(val_it) each time."
    )


def _not_reading(states: dict[int, EpochState]) -> list[int]:
    """The nodes to blame for an epoch's passes that stand still: those that hold rows they have
    not read; else those that read none of it; else every node whose pass is open. (A node
    that read all it holds is waiting for rows, not refusing them.)"""
    open_ = {nid: st for nid, st in states.items() if st.main == "running" and not st.closed}
    behind = sorted(nid for nid, st in open_.items() if st.emitted < st.rows)
    return behind or _unstarted(states) or sorted(open_) or sorted(states)


_WAITED_FOR_SHUTDOWN = (
    "cluster.shutdown() began while this train() call waited for another train() call on the "
    "cluster to return; nothing of it was pushed."
)


class Feeder:
    """Feed orchestration for one cluster: push jobs, epochs, the accounting.

    The cluster hands it what it needs explicitly: ``action(node, name, body, timeout=)``
    sends a control action, ``live_workers()`` lists the workers whose main still runs,
    ``failure(grace=)`` returns the first failed node's NodeError (or None), ``stopping()``
    is True once ``cluster.shutdown()`` has begun (a running ``train`` then pushes no new
    epoch).
    """

    def __init__(
        self,
        spark: Any,
        *,
        secret: str,
        tls_root: bytes | None,
        max_chunk_bytes: int,
        buffer_bytes: int,
        node_timeout: float,
        action: Callable[..., dict[str, Any]],
        live_workers: Callable[[], list[NodeInfo]],
        failure: Callable[..., NodeError | None],
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.spark = spark
        self._stopping = stopping
        self._secret = secret
        self._tls_root = tls_root
        self._action = action
        self._live_workers = live_workers
        self._failure = failure
        self._epoch = 0
        self._caches: dict[str, _Cached] = {}  # split -> what the workers hold for it
        self._carry: _Carry | None = None  # rows held back from the last micro-batch
        self._read: set[tuple[int, str]] = set()  # (node, split) whose main has read a pass
        self._pool: Any = None  # threads sending control actions to the nodes at once
        self._call = threading.Lock()  # held by the train() call running (see _turn)
        self._caller: threading.Thread | None = None
        self.notes = DataNotes()  # added to a node's failure by train() and the cluster
        self._jobs = PushJobs(spark, secret=secret, tls_root=tls_root, max_chunk_bytes=max_chunk_bytes,
                              buffer_bytes=buffer_bytes, node_timeout=node_timeout, failure=failure)

    # -- helpers ------------------------------------------------------------------------------
    def _each(self, nodes: Sequence[NodeInfo], name: Action, body: Callable[[NodeInfo], dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Send one control action to every node at once; replies by node id (first error raised).

        A node busy converting its tail of an epoch answers in a few ms; asked one after
        another, those waits added up at every epoch boundary.
        """
        if len(nodes) <= 1:
            return {n.node_id: self._action(n, name.value, body(n)) for n in nodes}
        return {n.node_id: f.result() for n, f in self._send(nodes, name, body)}

    def _send(self, nodes: Sequence[NodeInfo], name: Action, body: Callable[[NodeInfo], dict[str, Any]]) -> list[tuple[NodeInfo, Any]]:
        """Send one control action to every node without waiting: (node, future) pairs."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dataplane-action")
        return [(n, self._pool.submit(self._action, n, name.value, body(n))) for n in nodes]

    def close(self) -> None:
        """The cluster is shutting down: stop the action threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # -- train --------------------------------------------------------------------------------
    def _split(self, name: str, df: Any, stream: bool = False) -> _Split:
        from pyspark.sql.types import StructType

        what = "train()" if name == "train" else "train(validation=...)"
        if not hasattr(df, "mapInArrow") or not isinstance(getattr(df, "schema", None), StructType):
            from formats.sparkframe import not_a_spark_frame

            raise TypeError(f"{what} needs a Spark DataFrame, got {not_a_spark_frame(df)}")
        if getattr(df, "isStreaming", False):
            raise TypeError(
                f"{what} got a streaming DataFrame (spark.readStream), which has no end to push "
                f"as epochs; train on each micro-batch instead: "
                f"dataplane.workloads.streaming.feed_stream(cluster, df) (or "
                f"df.writeStream.foreachBatch(lambda batch, _: cluster.train(batch, 1)))."
            )
        df = self._jobs.as_pushed(df)  # vectors as arrays, at most a few tasks per slot
        schema = arrow_schema_of(df)
        if len(schema) == 0:
            raise SchemaError(
                f"{what} got a DataFrame with no columns; select the feature and label columns "
                f"to push (df.select('features', 'label'))."
            )
        _check_column_types(schema, what)
        scan = self._jobs.shapes(df, schema)
        if scan.rows == 0:  # said now: a main may fail on the empty pass before train returns
            logger.warning(_empty_message(name, stream))
        return _Split(name, df, schema, schema.serialize().to_pybytes(), scan.shapes, scan.rows,
                      dict(scan.ragged or {}), {**(scan.ragged_bytes or {}), **self._jobs.value_bytes(df, schema)})

    def train(
        self,
        df: Any,
        *,
        num_epochs: int,
        feed_timeout: float,
        progress: Callable[[dict[str, Any]], None] | None = None,
        cache: bool = False,
        shuffle: bool = False,
        seed: int | None = None,
        validation: Any = None,
        balance: bool = True,
        carry: bool = False,
    ) -> FeedReport:
        """``carry``: ``df`` is a stream's micro-batch (one epoch, no validation, no cache): rows
        past the balanced count are held back for the next micro-batch (see the module
        docstring)."""
        if carry and (num_epochs != 1 or validation is not None or cache or not balance):
            raise ValueError("train(carry=True) pushes one micro-batch: one epoch, balanced, "
                             "no validation, no cache")
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be an int >= 1, got {num_epochs!r}")
        for name, value in (("cache", cache), ("shuffle", shuffle)):
            if not isinstance(value, bool):
                raise TypeError(f"train({name}=...) must be True or False, got {value!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"train(seed=...) must be an int or None, got {seed!r}")
        if not (isinstance(feed_timeout, (int, float)) and feed_timeout > 0):
            raise ValueError(f"feed_timeout must be > 0 seconds, got {feed_timeout!r}")
        with self._turn():
            return self._train(df, num_epochs=num_epochs, feed_timeout=feed_timeout, progress=progress,
                               cache=cache, shuffle=shuffle, seed=seed, validation=validation,
                               balance=balance, carry=carry)

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """One train() call at a time. The nodes read a cluster's epochs in the order its
        calls announce them, so two calls pushing at once (from two threads; a stream's
        micro-batch during a train() call) left each node's pass waiting on the other call's
        epochs: both calls stood still until feed_timeout. A second call now waits for the
        first to return, and says so; a shutdown begun while it waits ends it."""
        me = threading.current_thread()
        if self._caller is me:
            raise ClusterStateError(
                "train() was called from inside a train() call on the same cluster (its "
                "progress callback?); it would wait for itself. Call it after the first returns."
            )
        if not self._call.acquire(blocking=False):
            running = self._caller
            logger.warning(
                "train(): another train() call on this cluster is running (thread %r); this one "
                "waits for it to return: a cluster takes its train() calls one at a time, each "
                "call's epochs after the last one's.", running.name if running else "?")
            while not self._call.acquire(timeout=0.2):
                if self._stopping():
                    raise ClusterStateError(_WAITED_FOR_SHUTDOWN)
            if self._stopping():
                self._call.release()
                raise ClusterStateError(_WAITED_FOR_SHUTDOWN)
        self._caller = me
        try:
            yield
        finally:
            self._caller = None
            self._call.release()

    def _train(self, df: Any, *, num_epochs: int, feed_timeout: float,
               progress: Callable[[dict[str, Any]], None] | None, cache: bool, shuffle: bool,
               seed: int | None, validation: Any, balance: bool, carry: bool) -> FeedReport:
        """train(), once it has the cluster's turn."""
        splits = [self._split("train", df, stream=carry)]
        if validation is not None:
            splits.append(self._split("validation", validation))
        t0 = time.monotonic()
        report = FeedReport(0, 0, 0.0, {}, 0)
        if seed is not None and not shuffle:  # (a seed kept in a config while shuffle varies)
            msg = (f"train(seed={seed}) without shuffle=True: the seed changes nothing, rows "
                   f"arrive in Spark's order; pass shuffle=True to shuffle every epoch.")
            report.messages.append(msg)
            logger.warning(msg)
        workers = self._live_workers()
        if not workers:
            failed = self._failure()  # a main that failed since the cluster last looked
            if failed is not None:
                self.notes.add_to(failed)
                raise failed
            why = f" The data may be why: {self.notes.failed_call}" if self.notes.failed_call else ""
            raise FeedError(
                "train(): every chief and worker's main has returned (or failed), so nothing "
                "would read the data; cluster.shutdown() reports how each main ended." + why
            )
        carry_from, carried_in = self._carried(splits[0], workers, report, carry)
        clock = FeedClock(feed_timeout, lambda: self._rows_moved(workers))
        ids = tuple(n.node_id for n in workers)
        caches: dict[str, tuple[str, bool]] = {}  # split -> (cache id, already recorded)
        if cache:
            for sp in splits:
                caches[sp.name] = self._cache_for(sp, workers, ids)
        # Every epoch of this call is announced up front (train, then validation, per epoch): a
        # node whose repeat=True stream ends (fit with steps_per_epoch done before the data)
        # closes all of them at once, and no epoch of this call can be mistaken for the next
        # program step's data.
        books: list[_EpochBooks] = []
        last: list[bool] = []  # the call's last epoch of its split: a repeat=True stream ends there
        for e in range(num_epochs):
            for sp in splits:
                ep = _EpochBooks(self._epoch, list(workers), sp.name, sp, balance=balance,
                                 carry=carry, carried_in=dict(carried_in), nth=e + 1, of=num_epochs)
                self._epoch += 1
                if sp.name in caches:
                    cid, recorded = caches[sp.name]
                    if recorded or e > 0:
                        ep.replay = cid
                    else:
                        ep.record = cid
                books.append(ep)
                last.append(not carry and e == num_epochs - 1)
        begins = [
            BeginEpoch(ep.epoch, ep.source.schema_ipc, ep.source.shapes, split=ep.source.name,
                       shuffle=shuffle, seed=seed, record=ep.record, replay=ep.replay,
                       carry=ep.carry, carry_from=carry_from if ep.carried_in else None,
                       ends_call=ends).to_json()
            for ep, ends in zip(books, last)
        ]
        self._each(workers, Action.BEGIN_EPOCH, lambda n: {"epochs": begins})  # in order, at once
        try:
            try:
                self._run_epochs(books, report, clock, progress, t0)
                # (a cached call spends most of its time here, its replays' limits set)
                self._settle(books, report, clock)
            except BaseException as e:
                # a cache this call was recording holds only the rows that arrived: replaying
                # it in a later call with the same DataFrame would lose the rest, silently
                unfinished = {ep.split for ep in books if ep.record is not None and ep.limit is None}
                aborted = {ep.epoch for ep in books if ep.limit is None}
                self._abort(books)
                for name in unfinished:
                    self._drop_cache(self._caches.pop(name))
                cut = [ep.epoch for ep in books if ep.epoch in aborted and not ep.withdrawn]
                gone = [ep.epoch for ep in books if ep.withdrawn]
                if isinstance(e, Exception) and not isinstance(e, NodeError) and (cut or gone):
                    self.notes = DataNotes(failed_call=_failed_call_note(e, cut, gone))
                raise
        except NodeError as e:
            # (main may have failed on the passes a failed call before this one cut short)
            self.notes.after_call(splits, books)
            self.notes.add_to(e)
            raise
        self.notes = DataNotes()  # for a main that fails after train returns
        self.notes.after_call(splits, books)
        report.seconds = time.monotonic() - t0
        return report

    def _carried(self, sp: _Split, workers: Sequence[NodeInfo], report: FeedReport,
                 carry: bool) -> tuple[int | None, dict[int, int]]:
        """The rows the workers held back from the last micro-batch: (its epoch, node -> rows)
        for this call to begin with, if it is the stream's next micro-batch with the same
        columns. Rows that cannot go on are accounted for in ``report`` now: dropped for
        balance (a plain ``train`` call, or other columns), or unconsumed (a worker whose main
        returned). The nodes drop them as well (``FeedBuffer.take_carry``)."""
        from formats.schema import same_columns

        prev, self._carry = self._carry, None
        if prev is None or not any(prev.rows.values()):
            return None, {}
        live = {n.node_id for n in workers}
        # (a held-back row of another array length would fail the next pass's dense column)
        fits = carry and same_columns(prev.schema, sp.schema) and prev.shapes == sp.shapes
        report.carried_in = sum(prev.rows.values())
        kept: dict[int, int] = {}
        for nid, rows in prev.rows.items():
            if nid not in live:
                report.rows_unconsumed[nid] = report.rows_unconsumed.get(nid, 0) + rows
            elif fits:
                kept[nid] = rows
            else:
                report.dropped_for_balance += rows
        lost = report.carried_in - sum(kept.values())
        if lost:
            why = ("its main has returned" if fits else
                   "this micro-batch's columns or array lengths differ from the last one's"
                   if carry else "this train() call is not the stream's next micro-batch")
            msg = (f"{lost} row(s) the workers held back from the last micro-batch (epoch "
                   f"{prev.epoch}) were not read: {why}.")
            report.messages.append(msg)
            logger.warning(msg)
        return (prev.epoch if kept else None), kept

    def _abort(self, books: list[_EpochBooks]) -> None:
        """A push failed (or the call was interrupted): take back every epoch of the call
        that has no limit yet and that no worker has begun (``withdrawn``), so main's next
        pass reads the next call's data, not an empty epoch (a Keras fit would stop on it);
        end the others with the rows that did arrive, so the nodes' readers finish (equally
        on every worker) and the cluster stays usable for the next call.

        Taking back is in two steps, since under MWMS an epoch may only go if no worker has
        begun it: each node holds the epochs its passes have yielded nothing of (none can be
        claimed or read while held), then every node withdraws those held everywhere and
        releases the rest.

        An epoch whose limit is already set is taken back too if no worker has begun it: a
        cached call's replays get their limits as soon as the caches are known, well before
        main reads them (Ctrl-C in the middle of train(df, 4, cache=True) left three epochs
        the user had cancelled for main to train on)."""
        unfinished = [ep for ep in books if ep.limit is None]
        if not books:
            return
        held: dict[int, set[int]] = {}
        nodes: list[NodeInfo] = []
        try:
            live = {n.node_id for n in self._live_workers()}
            nodes = [n for n in books[0].workers if n.node_id in live]
            numbers = [ep.epoch for ep in books]
            held = {nid: set(r["held"]) for nid, r in
                    self._each(nodes, Action.HOLD_EPOCHS, lambda n: {"epochs": numbers}).items()}
            for ep in books:
                ep.withdrawn = bool(nodes) and all(ep.epoch in held[n.node_id] for n in nodes)
            gone = {ep.epoch for ep in books if ep.withdrawn}
            self._each(nodes, Action.RELEASE_EPOCHS, lambda n: {
                "withdraw": sorted(held[n.node_id] & gone), "keep": sorted(held[n.node_id] - gone)})
        except BaseException as e:  # noqa: BLE001 - the original error is what the user needs
            logger.warning("could not take back the unbegun epochs of a failed push: %s", repr(e))
            for ep in books:
                ep.withdrawn = False
            try:  # a held epoch blocks every pass over its split: let them all be read again
                self._each([n for n in nodes if held.get(n.node_id)], Action.RELEASE_EPOCHS,
                           lambda n: {"withdraw": [], "keep": sorted(held[n.node_id])})
            except Exception:  # noqa: BLE001 - ended below, or the node is gone
                pass
            if not isinstance(e, Exception):  # a second Ctrl-C
                raise
        for ep in unfinished:
            if ep.withdrawn:
                continue
            try:
                live = {n.node_id for n in self._live_workers()}
                nodes = [n for n in ep.workers if n.node_id in live]
                replies = self._each(nodes, Action.EPOCH_STATE, lambda n: {"epoch": ep.epoch})
                states = {nid: EpochState.from_json(r) for nid, r in replies.items()}
                reading = {nid for nid, st in states.items() if not st.closed}
                self._end_epoch(ep, reading, {nid: st.rows for nid, st in states.items()}, nodes, cut=True)
                for _, sent in ep.ending:
                    sent.result()
            except Exception as e:  # noqa: BLE001 - the original error is what the user needs
                logger.warning("could not end epoch %d on every node after a failed push: %s", ep.epoch, e)
                return

    def _rows_moved(self, workers: Sequence[NodeInfo]) -> Moved:
        """Rows the workers have taken in, taken out of their buffers and handed to TensorFlow
        so far (progress for :class:`FeedClock`), and how long pushing tasks waited on their
        full buffers. Rows handed on count too because a pass takes up to a buffer's worth at
        once: 64 MiB of narrow rows is minutes of steps for a slow model, and while it trains
        on them nothing else moves."""
        replies = self._each(workers, Action.METRICS, lambda n: {})
        return Moved(
            sum(int(m.get("rows_in", 0)) + int(m.get("rows_taken", 0)) + int(m.get("rows_yielded", 0))
                for m in replies.values()),
            sum(float(m.get("stall_seconds", 0.0)) for m in replies.values()),
        )

    def _run_epochs(self, books, report, clock, progress, t0) -> None:  # type: ignore[no-untyped-def]
        for i, ep in enumerate(books):
            if self._stopping():
                # shutdown() from another thread lets the mains finish the epochs they have;
                # pushing more would keep them busy, and shutdown waiting, to the call's end
                trained = sum(1 for b in books[:i] if b.split == "train")
                total = sum(1 for b in books if b.split == "train")
                raise ClusterStateError(
                    f"train() stopped after {trained} of its {total} epochs: cluster.shutdown() "
                    f"was called while it ran, so the rest were not pushed."
                )
            report.epochs.append(ep.epoch)
            if ep.replay is not None:
                self._replay_epoch(ep, clock)
            else:
                self._push_epoch(ep, report, clock)
            report.rows += sum(ep.assigned.values())
            report.rows_per_split[ep.split] = report.rows_per_split.get(ep.split, 0) + sum(ep.assigned.values())
            if progress is not None:
                progress({"epoch": ep.epoch, "split": ep.split, "rows": report.rows,
                          "seconds": time.monotonic() - t0})

    def _cache_for(self, sp: _Split, workers: Sequence[NodeInfo], ids: tuple[int, ...]) -> tuple[str, bool]:
        """(cache id, recorded already) for ``sp``: the same live DataFrame pushed to the same
        workers with cache=True before is replayed, with no Spark job at all; otherwise the
        split's previous cache is dropped on the nodes and a new one is recorded."""
        import uuid
        import weakref

        old = self._caches.get(sp.name)
        if old is not None and old.ref() is sp.df and old.schema_ipc == sp.schema_ipc and old.workers == ids:
            return old.cache_id, True
        if old is not None:
            self._drop_cache(old)
        try:
            ref = weakref.ref(sp.df)
        except TypeError:
            ref = lambda: None  # noqa: E731 - not weak-referenceable: never reused
        new = _Cached(ref, uuid.uuid4().hex[:12], sp.schema_ipc, ids)
        self._caches[sp.name] = new
        return new.cache_id, False

    def _drop_cache(self, old: _Cached) -> None:
        live = [n for n in self._live_workers() if n.node_id in old.workers]
        try:
            self._each(live, Action.DROP_CACHE, lambda n: {"cache": old.cache_id})
        except Exception as e:  # noqa: BLE001 - a node that cannot be told frees it at exit
            logger.warning("could not drop cache %s on every node: %s", old.cache_id, e)

    def _push_epoch(self, ep: _EpochBooks, report: FeedReport, clock: FeedClock) -> None:
        sp = ep.source
        what = (f"pushing the stream's micro-batch (epoch {ep.epoch})" if ep.carry else
                f"pushing {ep.name}")
        held = tuple(ep.carried_in.get(n.node_id, 0) for n in ep.workers) if ep.carry else None
        rows = self._jobs.run(sp.df, ep.workers, sp.schema_ipc, ep.epoch, what=what, clock=clock,
                              why_late=lambda: self._unread(ep), held=held,
                              row_size=row_bytes(sp.schema, sp.shapes, sp.values))
        report.spark_jobs += 1
        report.spark_tasks += len({r["partition"] for r in rows})
        sent: dict[int, int] = {}
        refused: set[int] = set()
        for r in rows:
            nid = r["node_id"]
            ep.assigned[nid] = ep.assigned.get(nid, 0) + r["rows_sent"] + r["rows_refused"]
            sent[nid] = sent.get(nid, 0) + r["rows_sent"]
            if r["refused"]:
                refused.add(nid)
            report.bytes += r["bytes_sent"]
        # Each successful task sent every worker its whole share of its partition (a node drops
        # what retried attempts repeat), so a worker that refused nothing holds exactly what
        # was sent to it: the limit needs no round trip to ask the nodes first.
        reading = {n.node_id for n in ep.workers if n.node_id not in refused}
        self._end_epoch(ep, reading, sent)
        if ep.record is not None:
            self._caches[ep.split].assigned = dict(ep.assigned)

    def _unread(self, ep: _EpochBooks) -> str:
        """Why a push is late, if the nodes say: workers whose main runs but read none of it."""
        try:
            replies = self._each(ep.workers, Action.EPOCH_STATE, lambda n: {"epoch": ep.epoch})
        except Exception:  # noqa: BLE001 - the timeout error stands without this
            return ""
        states = {nid: EpochState.from_json(r) for nid, r in replies.items()}
        if states and not any(st.rows or st.closed for st in states.values()):
            return (
                "No row of it reached any node: the push job's tasks, which finished none of "
                "their work meanwhile, sent nothing. A task that computes its first rows for "
                "longer (a slow UDF) needs a larger feed_timeout; else a task may be stuck: "
                "the executors' logs say why (on Spark 3.x an OutOfMemoryError in a 'stdout "
                "writer' thread leaves its task waiting for ever: lower "
                "spark.sql.execution.arrow.maxRecordsPerBatch for wide rows, or give the "
                "executors more memory)."
            )
        idle = _unstarted(states)
        if not idle:
            return ""
        return _without_dataset(states, idle, ep.split) or (
            f"Node(s) {idle} read none of it while their main still runs: a program that reads "
            f"fewer passes than train() pushes (a fit that EarlyStopping ended, fewer fit epochs "
            f"than num_epochs, a validation split it does not read) must call ctx.end_feed() or "
            f"return from main once it reads no more; otherwise raise feed_timeout if a node may "
            f"rightly read nothing for longer (a long set-up before its first pass)."
        )

    def _replay_epoch(self, ep: _EpochBooks, clock: FeedClock) -> None:
        """The nodes replay their caches: no Spark job; the limit is the smallest cache."""
        while True:
            replies = self._each(ep.workers, Action.EPOCH_STATE, lambda n: {"epoch": ep.epoch})
            states = {nid: EpochState.from_json(r) for nid, r in replies.items()}
            rows = {nid: r.get("cache_rows") for nid, r in replies.items()}
            if all(v is not None for v in rows.values()):
                break
            err = self._failure()
            if err is not None:
                raise err
            if clock.expired():
                raise feed_timeout_error(f"replaying {ep.name}", clock.timeout)
            time.sleep(0.05)
        recorded = self._caches[ep.split].assigned
        ep.assigned = {n.node_id: recorded.get(n.node_id, rows[n.node_id]) for n in ep.workers}
        ep.received = {nid: int(v) for nid, v in rows.items()}
        reading = {nid for nid, st in states.items() if not st.closed and st.main == "running"}
        self._end_epoch(ep, reading, ep.received)

    def _end_epoch(self, ep: _EpochBooks, reading: set[int], held: dict[int, int],
                   nodes: Sequence[NodeInfo] | None = None, *, cut: bool = False) -> None:
        """Tell every worker (``nodes``: those of them still alive, after a failed push) how
        many rows to yield for ``ep``: the fewest any worker still reading it holds, so all of
        them yield the same number (of rows, and of batches); with ``ep.balance`` off (TFoS's
        ``TFCluster.train``, which feeds every element), each its own. A worker that refused
        the epoch is never told more than it holds (``held``). ``cut``: a failed call ends
        the epoch with what arrived (a pass shorter than its first then goes on with the next
        call's epoch, see ``feeders.source``)."""
        nodes = ep.workers if nodes is None else nodes
        held = {nid: held.get(nid, 0) + ep.carried_in.get(nid, 0) for nid in {*held, *ep.carried_in}}
        limit = min((held.get(nid, 0) for nid in reading), default=0)
        ep.limit, ep.reading = limit, reading
        for n in nodes:
            own = held.get(n.node_id, 0)
            ep.limits[n.node_id] = own if not ep.balance or n.node_id not in reading else min(limit, own)
        # not waited for here: the next epoch's job starts at once, and _settle's long poll,
        # which needs the limit to have arrived, checks the replies first
        ep.ending = self._send(nodes, Action.END_EPOCH,
                               lambda n: {"epoch": ep.epoch, "limit": ep.limits[n.node_id], "cut": cut})

    def _states(self, ep: _EpochBooks, wait: float = 0.0) -> dict[int, EpochState]:
        replies = self._each(ep.workers, Action.EPOCH_STATE, lambda n: {"epoch": ep.epoch, "wait": wait})
        states = {nid: EpochState.from_json(r) for nid, r in replies.items()}
        failed = sorted(nid for nid, st in states.items() if st.main == "failed")
        # a pass that ended with an error (a batch did not convert): main is raising it unless
        # it catches it; never counted as a pass left early, which would let train() return a
        # clean report
        broken = sorted((nid, st.failure) for nid, st in states.items() if st.failure)
        if not (failed or broken):
            return states
        err = self._failure(grace=10.0)
        if err is not None:
            raise err
        if failed:
            raise FeedError(
                f"{ep.name}: the main of node(s) {failed} raised while data was being "
                f"pushed (its traceback has not reached the driver yet; cluster.shutdown() "
                f"reports it)."
            )
        nid, why = broken[0]
        raise FeedError(f"{ep.name}: node {nid}'s pass over it failed: {why}")

    def _settle(self, books: list[_EpochBooks], report: FeedReport, clock: FeedClock) -> None:
        """Wait until every worker's pass over each pushed epoch has ended, then account for
        every row: consumed (handed to TensorFlow), dropped for balance, or unconsumed."""
        pending = list(books)
        empty: set[str] = set()  # splits already reported as having no rows
        # (cause, nodes) -> the epoch whose note explained it: a 10-epoch fit that
        # EarlyStopping ended leaves up to 18 epochs unread for one reason, and the reason is
        # given once per call; the later epochs' notes are one line that points back to it
        explained: dict[tuple[str, tuple[int, ...]], str] = {}

        def note(msg: str, level: int, cause: str = "", nodes: Sequence[int] = (), short: str = "") -> None:
            if cause:
                key = (cause, tuple(sorted(nodes)))
                if key in explained:
                    msg, level = f"{short} (the note on {explained[key]} says why).", logging.INFO
                else:
                    explained[key] = ep.name
            report.messages.append(msg)
            logger.log(level, msg)

        while pending:
            ep = pending[0]
            for _, sent in ep.ending:
                sent.result()  # a node that did not take the limit fails here, with its error
            ep.ending = []
            states = self._states(ep, wait=1.0)  # each node answers once its pass has ended
            if not all(st.closed or st.main != "running" for st in states.values()):
                err = self._failure()
                if err is not None:
                    raise err
                expired = clock.expired()  # (asked once: it looks at the nodes' metrics)
                if expired and ep.carry:
                    raise FeedError(
                        f"the stream's micro-batch (epoch {ep.epoch}) was pushed, but node(s) "
                        f"{_not_reading(states)} stopped reading it: nothing moved for "
                        f"feed_timeout={clock.timeout:.0f} s ({_reading_text(states)}). Read a "
                        f"stream with ctx.dataset(repeat=True), or a pass per micro-batch until "
                        f"ctx.should_stop; stop the query (query.stop()) before main reads no "
                        f"more, or raise feed_stream(feed_timeout=...) if a node may rightly "
                        f"read nothing for longer."
                    )
                blamed = _not_reading(states)
                no_reader = _without_dataset(states, blamed, ep.split) if expired else ""
                if no_reader:
                    raise FeedError(
                        f"{ep.name} was pushed, but nothing moved for "
                        f"feed_timeout={clock.timeout:.0f} s ({_reading_text(states)}). {no_reader}"
                    )
                past = _waiting_past(states, blamed, ep, books) if expired else ""
                if past:
                    raise FeedError(
                        f"{ep.name} was pushed, but node(s) {blamed} stopped reading it: "
                        f"nothing moved for feed_timeout={clock.timeout:.0f} s "
                        f"({_reading_text(states)}). {past}"
                    )
                if expired:
                    raise FeedError(
                        f"{ep.name} was pushed, but node(s) "
                        f"{blamed} stopped reading it: nothing moved for "
                        f"feed_timeout={clock.timeout:.0f} s ({_reading_text(states)}). A program that reads fewer epochs than "
                        f"train(num_epochs=...) pushes (a fit ended early by EarlyStopping, "
                        f"fewer fit epochs) leaves the rest unread: read one pass per pushed "
                        f"epoch, use ctx.dataset(repeat=True), or call ctx.end_feed() or return "
                        f"from main once it reads no more."
                    )
                continue
            pending.pop(0)
            carried: dict[int, int] = {}  # node -> rows its complete pass held back
            left_early: dict[int, int] = {}
            returned: dict[int, int] = {}
            ended: dict[int, int] = {}  # main runs, but reads no more (ctx.end_feed, ctx.serve)
            never_read: dict[int, int] = {}  # main runs on, but the pass that would read it will not come
            remainders: dict[int, int] = {}  # a whole pass read, its last partial batch dropped
            pushed = sum(ep.assigned.values())
            if pushed == 0 and ep.split not in empty:
                empty.add(ep.split)
                msg = f"{ep.name}: {_empty_message(ep.split, ep.carry)}"
                report.messages.append(msg)
                logger.warning(msg)
            starved = ep.balance and ep.limit == 0 and pushed and len(ep.reading) > 1 and not ep.carry
            if starved:
                note(_too_few_message(ep, pushed), logging.WARNING, f"too few {ep.split}", ep.reading,
                     f"{ep.name}: its {pushed} row(s) over {len(ep.workers)} "
                     f"workers leave some worker none")
            for n in ep.workers:
                nid, st = n.node_id, states[n.node_id]
                assigned = ep.assigned.get(nid, 0)
                if st.rows > assigned:
                    raise FeedError(
                        f"{ep.name}: node {nid} received {st.rows} rows but the pushing "
                        f"tasks assigned it {assigned}; rows were duplicated."
                    )
                # a pushed epoch's rows as the node counts them; a replay's: its cache
                received = ep.received.get(nid, st.rows)
                report.rows_per_node[nid] = report.rows_per_node.get(nid, 0) + received
                if st.emitted:
                    self._read.add((nid, ep.split))
                carried_in = ep.carried_in.get(nid, 0)
                if nid in ep.reading and st.complete:
                    if st.carried_in != carried_in:
                        raise FeedError(
                            f"{ep.name}: node {nid} began with {st.carried_in} rows held "
                            f"back from the last micro-batch, but the driver counted "
                            f"{carried_in}; this is a bug."
                        )
                    carried[nid] = st.carried_out
                    dropped = received + carried_in - ep.limits.get(nid, ep.limit or 0) - st.carried_out
                    report.dropped_for_balance += dropped
                    report.carried_out += st.carried_out
                    left = assigned + carried_in - st.emitted - dropped - st.carried_out
                    if left:  # only ctx.dataset(drop_remainder=True) leaves rows of a whole pass
                        remainders[nid] = left
                else:
                    left = assigned + carried_in - st.emitted
                    if left:
                        # (a pass its reader left counts as left early though main has
                        # returned by now)
                        (left_early if st.left_early else returned if st.main != "running"
                         else ended if st.ended_feed
                         else never_read if st.emitted == 0 and ep.split == "train" and not ep.carry
                         else left_early)[nid] = left
                if left:
                    report.rows_unconsumed[nid] = report.rows_unconsumed.get(nid, 0) + left
            if ep.carry:
                self._carry = _Carry(ep.epoch, ep.source.schema, ep.source.shapes, carried)
            # (passes that yield nothing anyway, left unread)
            unread_empty = {**returned, **left_early, **never_read} if starved else {}
            if unread_empty:
                left_early = never_read = {}
                # Keras skips the later passes of a split whose first pass yielded nothing: not
                # a skipped validation or a main that stopped reading, so not said as one
                note(f"{ep.name}: node(s) {sorted(unread_empty)} did not read it; its "
                     f"{sum(unread_empty.values())} row(s) were not consumed (every worker's pass "
                     f"over it is empty, see above; Keras skips the later passes of a split "
                     f"whose pass yielded no batch).", logging.INFO)
            elif returned:
                msg = (
                    f"{ep.name}: node(s) {sorted(returned)} returned from main while data "
                    f"was still being pushed; {sum(returned.values())} row(s) were not consumed"
                )
                unread = all(states[nid].emitted == 0 for nid in returned)
                cause = short = ""
                if ep.split == "validation" and unread and all((nid, "validation") in self._read for nid in returned):
                    cause, short = "fit ended", f"{msg}: their fit ended before train(num_epochs=...)'s last epochs"
                    msg += (
                        ". Their main had read earlier validation epochs: its fit ended before "
                        "train(num_epochs=...)'s last epochs (EarlyStopping, or fit(epochs=) "
                        "below num_epochs)."
                    )
                elif ep.split == "validation" and unread:
                    cause = "validation never read"
                    short = f"{msg}: their main never read ctx.dataset(split='validation')"
                    msg += (
                        ". Their main never read this validation epoch: read it with "
                        "ctx.dataset(..., split='validation') (for fit(validation_data=...)), "
                        "or leave validation= out of train()."
                    )
                elif ep.carry:
                    cause, short = "stream", f"{msg}: their main no longer reads the stream"
                    msg += (
                        ". Their main no longer reads the stream: read it with "
                        "ctx.dataset(repeat=True), which ends when the cluster shuts down, or "
                        "stop the query (query.stop()) before main returns."
                    )
                elif unread:
                    cause = "fewer passes"
                    short = f"{msg}: {_FEWER_PASSES}"
                    msg += ". " + _fewer_passes_note(ep, pushed)
                else:
                    msg += "."
                note(msg, logging.WARNING, cause, returned, short)
            if ended:
                msg = (
                    f"{ep.name}: node(s) {sorted(ended)} ended their feed "
                    f"(ctx.end_feed(), ctx.wait_stop() or ctx.serve()); {sum(ended.values())} "
                    f"row(s) were refused."
                )
                report.messages.append(msg)
                logger.info(msg)
            if remainders:
                msg = (
                    f"{ep.name}: node(s) {sorted(remainders)} dropped the "
                    f"last partial batch of the pass (ctx.dataset(drop_remainder=True)): "
                    f"{sum(remainders.values())} row(s) not read."
                )
                report.messages.append(msg)
                logger.info(msg)
            if left_early and ep.split == "validation" and all(
                    states[nid].emitted == 0 for nid in left_early):
                msg = (
                    f"{ep.name}: node(s) {sorted(left_early)} began their "
                    f"next training pass without reading it, so its "
                    f"{sum(left_early.values())} row(s) were refused"
                )
                note(msg + (" (Keras skips validation this way with fit(validation_freq=k), "
                            "k > 1; a program that never reads ctx.dataset(split='validation') "
                            "skips every epoch's)."),
                     logging.INFO, "validation skipped", left_early, msg)
            elif left_early:
                # (a pass of its own, not a repeat=True stream's, that yielded a batch or so)
                glance = (ep.split == "train" and "glance" not in explained and all(
                    not states[n].repeat and 0 < states[n].emitted * GLANCE_SHARE <= states[n].emitted + left
                    for n, left in left_early.items()))
                read = f" after reading {_few(states[n].emitted for n in left_early)} row(s) each" if glance else ""
                msg = (
                    f"{ep.name}: node(s) {sorted(left_early)} ended their pass early{read}; the "
                    f"remaining {sum(left_early.values())} row(s) were not sent to them."
                )
                if glance:
                    # said once a call, and later passes left early not pointed back to it:
                    # a program that takes k batches every epoch means to
                    explained["glance"] = ep.name
                    msg += (
                        f" If main looked at a batch before training (next(iter(ds)), for b in "
                        f"ds.take(1)), that look was a pass of its own: it took this epoch, so a "
                        f"fit(epochs={ep.of}) after it trains on one pushed epoch fewer and its "
                        f"last epoch waits for a later train() call (or, at shutdown, ends "
                        f"without data). Take shapes from ds.element_spec (or the DataFrame's "
                        f"schema on the driver) instead."
                    )
                report.messages.append(msg)
                logger.log(logging.WARNING if glance else logging.INFO, msg)
            if never_read and not unread_empty:
                # main runs on, but no pass will come for it: a repeat=True stream that fit
                # dropped closed it (the same causes as a main that returned before it)
                msg = (f"{ep.name}: node(s) {sorted(never_read)} never read it; its "
                       f"{sum(never_read.values())} row(s) were refused")
                note(f"{msg}. {_fewer_passes_note(ep, pushed)}", logging.WARNING, "fewer passes",
                     never_read, f"{msg}: {_FEWER_PASSES}")

    # -- inference ------------------------------------------------------------------------------
    @property
    def secret(self) -> str:
        return self._secret

    @property
    def tls_root(self) -> bytes | None:
        return self._tls_root

    def few_tasks(self, df: Any) -> Any:
        """``df`` in at most a few partitions per task slot (see ``PushJobs.as_pushed``)."""
        return self._jobs.few_tasks(df)

    def live_workers(self) -> list[NodeInfo]:
        """The chief and workers whose main still runs."""
        return self._live_workers()

    def serving_workers(self) -> list[NodeInfo]:
        """The live chief and workers whose main is in ``ctx.serve`` now (by their metrics)."""
        out = []
        for n in self._live_workers():
            try:
                if self._action(n, Action.METRICS.value, {}, timeout=10.0).get("serving"):
                    out.append(n)
            except Exception:  # noqa: BLE001 - not answering: not one to route requests to
                continue
        return out

    def inference(self, df: Any, **kw: Any) -> Any:
        from dataplane.driver.inference import inference

        return inference(self, df, **kw)


def _check_column_types(schema: pa.Schema, what: str) -> None:
    """Every column must have a TensorFlow type: the pushing job sends them all. The error
    names the first bad column, says how to convert it, and lists every column that cannot
    go, for the program that reads only some columns to drop the rest."""
    from formats.schema import check_unique_names, untensorable_columns

    check_unique_names(schema, f"{what} pushes")
    bad = untensorable_columns(schema)
    if bad:
        names = ", ".join(repr(n) for n, _ in bad)
        raise SchemaError(
            f"{bad[0][1]} {what} pushes every column of the DataFrame; if main does not read "
            f"{'it' if len(bad) == 1 else 'them'}, leave {'it' if len(bad) == 1 else 'them'} out: "
            f"df.drop({names})."
        )
