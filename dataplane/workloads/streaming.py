"""Feed a running TF cluster from a Structured Streaming query (``foreachBatch``).

Every micro-batch is pushed with ``cluster.train(batch_df)`` as one epoch, so on the node each
iteration of ``ctx.dataset()`` is one micro-batch, in the order Spark produced them (foreachBatch
runs one batch at a time). A micro-batch Spark replays (same ``batch_id``) is skipped, so each
row reaches the nodes once: after a failure within the same query run, and when a query stopped
while a micro-batch was being pushed (Spark had not yet committed it) is started again on the
same ``checkpoint_location``, against the same cluster or a new one (a driver restarted): the
last batch id pushed is kept in ``<checkpoint_location>/dataplane-pushed.json``.

Stopping: ``query.stop()`` lets the micro-batch in flight finish its push (the push is a Spark job
the stop does not cancel), then ends the query; no later batch starts. Then call
``cluster.shutdown()``: the nodes finish the pushed micro-batches, and an iteration of
``ctx.dataset()`` waiting for the next one ends empty with ``ctx.should_stop`` set. Read
``ctx.should_stop`` after every iteration (``if ctx.should_stop and seen == 0: break``), so the
node knows main loops until shutdown and does not log that last empty iteration as a pass main
read too many (see ``examples/streaming_digits.py``). A query still running when the cluster
shuts down fails at its next micro-batch with :class:`~dataplane.errors.ClusterStateError`
saying so: stop it first.

With several workers each micro-batch is an epoch of its own, and every worker yields as many
rows of it (MultiWorkerMirroredStrategy needs equal batch counts). The rows a worker received
past that count are not dropped: it holds them back and yields them first in the next
micro-batch, and the next push gives every partition's extra rows to the workers holding back
the fewest. So every row is read once, in its own micro-batch's pass or, held back, in a later
one. A small micro-batch (fewer rows than workers, or a few rows over several partitions) may
give every worker an empty pass, all of it held back: a loop over ``ctx.dataset()`` should take
that in its stride. What the workers hold back after the last micro-batch
(``StreamFeed.held_back``, at most about one row per partition of a micro-batch and worker) is
not read; so are rows held back when the next micro-batch's columns or array lengths differ
(``dropped_for_balance``).

Classic Spark only: the batch function calls the cluster object living in the driver process.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["feed_stream", "StreamFeed"]

# cluster -> query id -> the last batch id pushed by a run of that query, so that a run started
# again on the same checkpoint (the same query id) skips the micro-batch Spark replays
_PUSHED: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()

logger = logging.getLogger(__name__)


class StreamFeed:
    """The ``foreachBatch`` function: pushes each micro-batch into the cluster, in order.

    Attributes:
        batches: micro-batches pushed so far.
        rows: rows pushed so far (all epochs of all batches).
        dropped_for_balance: rows of those the workers never read because of balance: rows
            held back when a micro-batch's columns differ from the last one's (``FeedReport``'s
            field; 0 while the columns stay the same).
        held_back: rows the workers hold back from the last micro-batch for the next one.
        last_batch_id: the last batch id pushed (-1 before the first), by this run of the
            query or an earlier run of it (the same checkpoint) into this cluster or, with a
            ``checkpoint_location``, any cluster.
    """

    def __init__(
        self,
        cluster: Any,
        *,
        skip_empty: bool = True,
        feed_timeout: float = 600.0,
        on_batch: Callable[[int, Any], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.skip_empty = skip_empty
        self.feed_timeout = feed_timeout
        self.on_batch = on_batch
        self.batches = 0
        self.rows = 0
        self.dropped_for_balance = 0
        self.held_back = 0
        self.last_batch_id = -1
        self._pushed: dict[str, int] | None = None  # this cluster's books on the query's runs
        self._query_id: str | None = None
        self._record: Any = None  # (filesystem, path) of the checkpoint's dataplane-pushed.json
        self._bound = threading.Event()  # cleared by feed_stream until the query's id is known
        self._bound.set()
        self._lock = threading.Lock()
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="dataplane-stream-isempty")

    def __repr__(self) -> str:
        return (f"StreamFeed(batches={self.batches}, rows={self.rows}, "
                f"last_batch_id={self.last_batch_id}, held_back={self.held_back}, "
                f"dropped_for_balance={self.dropped_for_balance})")

    def _is_empty(self, batch_df: Any) -> bool:
        """``batch_df.isEmpty()`` as a Spark job started from a thread of its own, as the push
        is: ``query.stop()`` interrupts the query's thread, which cancelled a check running
        there, so the batch in flight was dropped instead of pushed."""
        return bool(self._checks.submit(batch_df.isEmpty).result())

    def _too_late(self, batch_id: int) -> Exception:
        from dataplane.errors import ClusterStateError

        return ClusterStateError(
            f"feed_stream: micro-batch {batch_id} arrived after the cluster began to shut down "
            f"(it is {self.cluster.state}); stop the streaming query (query.stop()) before "
            f"cluster.shutdown() or the end of the `with dataplane.run(...)` block."
        )

    def bind(self, query_id: str | None, checkpoint_location: str | None = None) -> None:
        """The started query's id (the same on every run from one checkpoint): the batches an
        earlier run of it pushed into this cluster, or into any cluster when the checkpoint
        records it, are not pushed again. ``None``: no memory across runs. ``feed_stream``
        calls it, and the batches wait for it."""
        if query_id is not None and checkpoint_location is not None:
            self._query_id = query_id
            self._record = _pushed_record(checkpoint_location)
            self.last_batch_id = max(self.last_batch_id, _read_pushed(self._record, query_id))
        if query_id is not None:
            try:
                self._pushed = _PUSHED.setdefault(self.cluster, {})
            except TypeError:  # a cluster object that cannot be weakly referenced
                self._pushed = None
            if self._pushed is not None:
                self._query_id = query_id
                self.last_batch_id = max(self.last_batch_id, self._pushed.get(query_id, -1))
        self._bound.set()

    def _done(self, batch_id: int) -> None:
        self.last_batch_id = batch_id
        if self._pushed is not None and self._query_id is not None:
            self._pushed[self._query_id] = batch_id
        if self._record is not None and self._query_id is not None:
            _write_pushed(self._record, self._query_id, batch_id)

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        self._bound.wait()
        with self._lock:  # one batch at a time, even if Spark ever overlapped calls
            if batch_id <= self.last_batch_id:
                logger.info("stream feed: micro-batch %d was already pushed; skipping", batch_id)
                return
            if self.cluster.state != "running":
                raise self._too_late(batch_id)
            if self.skip_empty and self._is_empty(batch_df):
                self._done(batch_id)
                return
            from dataplane.errors import ClusterStateError

            try:
                report = self.cluster._train_micro_batch(batch_df, self.feed_timeout)
            except ClusterStateError as e:  # shutdown began while the batch was checked
                if self.cluster.state == "running":
                    raise
                raise self._too_late(batch_id) from e
            self.batches += 1
            self.rows += report.rows
            self.dropped_for_balance += report.dropped_for_balance
            self.held_back = report.carried_out
            self._done(batch_id)
            logger.info("stream feed: micro-batch %d pushed %d rows", batch_id, report.rows)
            if self.on_batch is not None:
                self.on_batch(batch_id, report)


_RECORD_NAME = "dataplane-pushed.json"


def _pushed_record(checkpoint_location: str) -> tuple[Any, str]:
    from formats.fs import resolve

    loc = resolve(checkpoint_location)
    return loc.filesystem, loc.path.rstrip("/") + "/" + _RECORD_NAME


def _read_pushed(record: tuple[Any, str], query_id: str) -> int:
    """The last batch id a run of ``query_id`` pushed, by the checkpoint's record (-1: none)."""
    import json

    fs, path = record
    try:
        with fs.open_input_stream(path) as f:
            got = json.loads(f.read().decode())
    except (OSError, ValueError):  # none yet (a new checkpoint), or unreadable: nothing known
        return -1
    return int(got.get("batch_id", -1)) if got.get("query_id") == query_id else -1


def _write_pushed(record: tuple[Any, str], query_id: str, batch_id: int) -> None:
    import json

    fs, path = record
    try:
        with fs.open_output_stream(path) as f:
            f.write(json.dumps({"query_id": query_id, "batch_id": batch_id}).encode())
    except OSError as e:  # the push stands; only a replay after a restart would repeat it
        logger.warning("stream feed: could not record micro-batch %d as pushed in %s (%s); a run "
                       "started again on this checkpoint may push it twice", batch_id, path, e)


def feed_stream(
    cluster: Any,
    stream_df: Any,
    *,
    checkpoint_location: str | None = None,
    trigger: dict[str, Any] | None = None,
    query_name: str | None = None,
    skip_empty: bool = True,
    feed_timeout: float = 600.0,
    on_batch: Callable[[int, Any], None] | None = None,
) -> Any:
    """Start a streaming query that pushes every micro-batch of ``stream_df`` into ``cluster``.

    Args:
        cluster: a running :class:`dataplane.Cluster` whose workers read ``ctx.dataset()``.
        stream_df: a streaming DataFrame (``spark.readStream...``); every column is pushed.
        checkpoint_location: the query's checkpoint directory (default: Spark's temporary one;
            give one to resume a stream across driver restarts, or to start a stopped query
            again: the micro-batch Spark replays then is not pushed twice, on the same cluster
            or a new one).
        trigger: keyword arguments for ``DataStreamWriter.trigger`` (e.g.
            ``{"processingTime": "2 seconds"}`` or ``{"availableNow": True}``); default: the next
            micro-batch starts as soon as the previous one has been pushed.
        query_name: name shown in the Spark UI and ``spark.streams``.
        skip_empty: do not push micro-batches without rows (default True: an empty epoch would
            only wake the nodes for nothing; costs one small check per batch).
        feed_timeout: seconds a micro-batch's push may stand still (no row moving) before it
            fails.
        on_batch: ``on_batch(batch_id, FeedReport)`` after each pushed micro-batch (progress).

    Returns:
        The started ``StreamingQuery``; its ``feed`` attribute is the :class:`StreamFeed` with
        batch and row counts.

    Raises:
        ValueError: ``stream_df`` is not streaming, or the cluster is not running.
    """
    if not getattr(stream_df, "isStreaming", False):
        raise ValueError(
            "feed_stream: stream_df is not a streaming DataFrame; build it with "
            "spark.readStream (for a static DataFrame call cluster.train(df) directly)."
        )
    if not hasattr(cluster, "_train_micro_batch"):
        raise TypeError(f"feed_stream: cluster must be a dataplane.Cluster, got {type(cluster)}.")
    if type(stream_df).__module__.startswith("pyspark.sql.connect"):
        raise TypeError(
            "feed_stream needs a classic SparkSession: under Spark Connect, foreachBatch runs its "
            "function in a Python process of the Spark server, which cannot hold this driver's "
            "cluster. Build the stream on a classic session (SparkSession.builder.master(...)), "
            "or train on static DataFrames with cluster.train. (Inference of a stream, "
            "cluster.inference(stream_df, output_schema=...), works under Spark Connect.)"
        )
    state = cluster.state
    if state != "running":
        raise ValueError(f"feed_stream: the cluster is {state}; start one with dataplane.run.")
    if trigger is not None and not isinstance(trigger, dict):
        raise TypeError(
            f"feed_stream: trigger must be a dict of DataStreamWriter.trigger keywords such as "
            f"{{'processingTime': '2 seconds'}}, got {trigger!r}."
        )
    feed = StreamFeed(cluster, skip_empty=skip_empty, feed_timeout=feed_timeout, on_batch=on_batch)
    writer = stream_df.writeStream.foreachBatch(feed)
    if checkpoint_location is not None:
        writer = writer.option("checkpointLocation", checkpoint_location)
    if trigger:
        writer = writer.trigger(**trigger)
    if query_name is not None:
        writer = writer.queryName(query_name)
    feed._bound.clear()  # its batches wait for the query's id
    try:
        query = writer.start()
    except BaseException:
        feed.bind(None)
        raise
    feed.bind(query.id, checkpoint_location)
    query.feed = feed
    return query
