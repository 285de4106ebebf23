"""The Spark side of a push: the ``mapInArrow`` job whose tasks send an epoch to the nodes.

:class:`PushJobs` builds the job (reused across epochs of the same DataFrame on classic Spark),
runs it while watching the nodes, and turns a failed job into the error that says why: a
task's SchemaError, a failed node's NodeError, or a FeedError with the task's own first line.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, NamedTuple, Sequence

import pyarrow as pa

from dataplane.driver.sparkjobs import PerDataFrame, SparkJob, is_connect
from dataplane.errors import (
    SPARK_OOM_FIX, FeedError, NodeError, SchemaError, jvm_gone, spark_error_text, spark_jvm_exited,
)
from dataplane.topology import NodeInfo
from feeders.protocol import chunk_bytes
from formats.sparkframe import (
    RECORDS_PER_BATCH, arrow_batches_by_rows, records_per_batch, shuffles, value_bytes, value_width,
    with_conf,
)

__all__ = ["PushJobs", "FeedClock", "Moved", "ShapeScan", "array_shapes", "feed_timeout_error", "TASKS_PER_SLOT"]

# Push tasks per task slot at most (PushJobs.as_pushed): enough to keep every slot busy and
# balanced, few enough that Spark's per-task cost stays small (docs/design.md, "Few tasks").
TASKS_PER_SLOT = 4


class Moved(NamedTuple):
    """What :class:`FeedClock` reads from the nodes at each look."""

    rows: int  # rows taken into, out of and on from the workers' buffers so far
    stall_seconds: float | None  # time pushing tasks waited on a full buffer (None: unknown)


class FeedClock:
    """``feed_timeout`` as a limit on standing still, not on the call's length.

    ``expired()`` is true once no row has moved into or out of any worker's buffer, nor on to
    TensorFlow, for ``timeout`` seconds, so a training run of hours that keeps reading never hits it, while a
    node that stops reading (or a job that stops sending) fails the call after ``timeout``
    (and at most a tenth of it, or 5 s, more). ``moved()`` is asked that often: a round of
    node metrics every few seconds. (Asked only once the time was up, rows that moved early
    in a window restarted the wait from then: a node that stalled soon after the push ended
    failed the call after twice ``feed_timeout``.)

    Spark finishing work on the rows is not standing still either: a look at which no row
    moved, but ``spark_progress()`` (tasks the push job finished, in any of its stages) grew
    and no pushing task waited on a full buffer since the last look, counts as a move. So an
    expensive DataFrame (a long shuffle before the push) is not cut off by ``feed_timeout``,
    while a task held back by a node that stops reading, or a Spark job that finishes nothing
    (a task that hangs), still is.
    """

    def __init__(self, timeout: float, moved: Callable[[], Moved]) -> None:
        self.timeout = timeout
        self._moved = moved
        self._seen = moved()
        self._step = min(max(timeout / 10, 0.05), 5.0)
        self._last_move = time.monotonic()
        self._next_look = self._last_move + self._step
        self._verdict = False
        self._spark: int | None = None  # spark_progress() at the last look

    def expired(self, spark_progress: Callable[[], int | None] | None = None) -> bool:
        """Whether nothing moved for ``timeout``, as of the last look at the nodes; a look is
        taken when one is due. Between looks the last answer stands, so asking twice in one
        round answers alike (a False between looks made a second question in a round never
        true, and a node that stopped reading then never failed the call)."""
        now = time.monotonic()
        if now < self._next_look:
            return self._verdict
        self._next_look = now + self._step
        try:
            seen = self._moved()
        except Exception:  # noqa: BLE001 - nodes that cannot answer are not moving rows
            seen = Moved(self._seen.rows, None)
        held_back = seen.stall_seconds is None or seen.stall_seconds != self._seen.stall_seconds
        spark = spark_progress() if spark_progress is not None else None
        spark_moved = None not in (spark, self._spark) and spark != self._spark
        self._spark = spark
        if seen.rows != self._seen.rows or (spark_moved and not held_back):
            self._last_move = now
        self._seen = seen
        self._verdict = now - self._last_move >= self.timeout
        return self._verdict


def feed_timeout_error(what: str, timeout: float, why: str = "") -> FeedError:
    """The error for a push during which nothing moved for ``feed_timeout``; ``why``: what the
    nodes say."""
    why = why or (
        "Check that the nodes consume their dataset (cluster.metrics() shows each node's buffer "
        "and stall time), or raise feed_timeout if a node may rightly read nothing for longer."
    )
    return FeedError(
        f"{what}: no row moved into or out of any node for feed_timeout={timeout:.0f} s; the job "
        f"was cancelled. {why}"
    )


class ShapeScan(NamedTuple):
    """What :func:`array_shapes` found: dense shapes, and the rows it counted (None when the
    DataFrame has no array column, so nothing was scanned)."""

    shapes: dict[str, tuple[int, ...]]
    rows: int | None
    #: array columns of varying length: name -> the first list level whose lengths differ,
    #: with its shortest and longest length (level 0: the arrays themselves); None: none
    ragged: dict[str, tuple[int, int | None, int | None]] | None = None
    #: those of fixed-width values: name -> the average bytes of a row's values
    ragged_bytes: dict[str, float] | None = None


def array_shapes(df: Any, schema: pa.Schema) -> ShapeScan:
    """Per-row shapes of array columns whose shape is the same in every row.

    One aggregate query over ``df``: the smallest and largest length at every nesting level
    (an 8x8 image given as ``array<array<float>>`` is ``(8, 8)``). Such columns are fed as
    dense ``[batch, *shape]`` tensors, the others as ragged tensors. The query counts the rows
    too, and the average number of values a row's array holds (for the ragged columns' size).
    """
    from pyspark.sql import functions as F

    from formats.schema import list_depth

    lists = {f.name: list_depth(f.type) for f in schema if list_depth(f.type)}
    if not lists:
        return ShapeScan({}, None)
    def size(c: Any) -> Any:
        # a null array has no length (Spark 3.5's size() says -1 for it, unless ANSI mode):
        # null rows must not make a column of one length ragged
        return F.when(c.isNotNull(), F.size(c))

    aggs = [F.count(F.lit(1)).alias("rows")]
    for i, (name, depth) in enumerate(lists.items()):
        col = F.col(f"`{name}`")
        aggs += [F.min(size(col)).alias(f"mn{i}_0"), F.max(size(col)).alias(f"mx{i}_0")]
        inner = col  # the arrays one level down, every row's concatenated
        for level in range(1, depth):
            sizes = F.transform(inner, size)
            aggs += [F.min(F.array_min(sizes)).alias(f"mn{i}_{level}"),
                     F.max(F.array_max(sizes)).alias(f"mx{i}_{level}")]
            inner = F.flatten(inner)
        aggs.append(F.avg(size(inner)).alias(f"av{i}"))  # values a row holds, all levels down
    row = df.agg(*aggs).collect()[0]
    from formats.schema import uniform_shape

    out, ragged, ragged_bytes = {}, {}, {}
    for i, (name, depth) in enumerate(lists.items()):
        lengths = [(row[f"mn{i}_{level}"], row[f"mx{i}_{level}"]) for level in range(depth)]
        shape = uniform_shape(lengths)
        if shape is not None:
            out[name] = shape
        elif int(row["rows"]):
            level = next((k for k, (lo, hi) in enumerate(lengths) if lo != hi), 0)
            ragged[name] = (level, *lengths[level])
            width = value_width(schema.field(name).type)
            if width:  # strings or binaries inside: not counted
                ragged_bytes[name] = float(row[f"av{i}"] or 0) * width
    return ShapeScan(out, int(row["rows"]), ragged, ragged_bytes)


def _schema_message(text: str) -> str | None:
    """A pushing task's SchemaError message, if that is why the job failed (``text``: its error's)."""
    m = re.search(r"SchemaError: (.+)", text)
    return m.group(1).strip() if m else None


class PushJobs:
    """Push jobs for one cluster.

    ``failure(grace=)`` returns the first failed node's NodeError (or None): a job is
    cancelled as soon as a node fails, and a failed job is blamed on the node behind it.
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
        failure: Callable[..., NodeError | None],
    ) -> None:
        self.spark = spark
        self._secret = secret
        self._tls_root = tls_root
        self._max_chunk_bytes = max_chunk_bytes
        self._buffer_bytes = buffer_bytes
        self._node_timeout = node_timeout
        self._failure = failure
        self._push_frame: tuple[Any, ...] | None = None  # the reusable push job (classic Spark)
        self._shapes = PerDataFrame()
        self._values = PerDataFrame()
        self._pushed = PerDataFrame()

    def run(self, df: Any, workers: Sequence[NodeInfo], schema_ipc: bytes, epoch: int, *,
            what: str, clock: FeedClock, why_late: Callable[[], str] | None = None,
            held: tuple[int, ...] | None = None, row_size: int = 0) -> list[Any]:
        """Push ``df`` as ``epoch`` to ``workers``; the tasks' result rows (PUSH_RESULT_FIELDS).
        ``why_late``: asked, if nothing moves for ``clock.timeout``, what the nodes say about it.
        ``held``: see :class:`feeders.push.PartitionPusher`. ``row_size``: bytes a row takes
        at least (``formats.sparkframe.row_bytes``), for the Arrow batch size on Spark 3.5."""
        pushed, properties = self._push_frame_for(df, workers, schema_ipc, epoch, held)
        rows = records_per_batch(self.spark, row_size)
        collect = lambda: with_conf(self.spark, RECORDS_PER_BATCH, rows, pushed.collect)  # noqa: E731
        job = SparkJob(self.spark, f"dataplane: {what}", collect, properties)
        try:
            return self._wait(job, clock, what, why_late)
        except BaseException:
            # Spark's adaptive execution keeps a cancelled or failed run in the DataFrame's
            # plan: collect() on the same object raises it again without running a job (a
            # train() called again after Ctrl-C failed with the first call's "Job N
            # cancelled"). The next push builds its frame afresh.
            self._push_frame = None
            raise

    def value_bytes(self, df: Any, schema: pa.Schema) -> dict[str, float]:
        """``formats.sparkframe.value_bytes`` of ``df``, remembered while it is alive, where the push job's
        Arrow batch size depends on it: a Spark that cuts batches by rows, and a binary column
        (image or audio bytes: 10,000 JPEGs of 100 KB make a 1 GB batch; the default rows per
        batch ran Spark 3.5's executor out of memory) or a string column of a frame computed
        without a shuffle (long documents read from files; a shuffled frame's sample would
        compute its shuffle, a high price for the names and keys most strings are). Else {}."""
        if not arrow_batches_by_rows(self.spark):
            return {}
        binary = any(pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) for f in schema)
        strings = any(pa.types.is_string(f.type) or pa.types.is_large_string(f.type) for f in schema)
        if not binary and not strings:
            return {}
        # (the plan is read once per DataFrame too, with the sample it decides on)
        return self._values.get(df, lambda: value_bytes(df, schema) if binary or not shuffles(df) else {})

    def shapes(self, df: Any, schema: pa.Schema) -> ShapeScan:
        """Array lengths of ``df`` (a Spark pass over it), remembered while ``df`` is alive, so
        repeated ``train(df)`` calls on the same DataFrame do not scan it again."""
        return self._shapes.get(df, lambda: array_shapes(df, schema))

    def as_pushed(self, df: Any) -> Any:
        """``df`` as the push jobs read it, the same DataFrame object for the same ``df`` while
        it is alive (so its push job, shapes and node caches are reused):

        * Spark ML vector columns as float64 arrays (:mod:`formats.sparkframe`);
        * at most :data:`TASKS_PER_SLOT` tasks per task slot (``coalesce``, which never adds
          partitions nor shuffles). Spark spends tens of milliseconds on every Python task
          whatever its size, so a frame of many small partitions (200 after any join or
          aggregation, by ``spark.sql.shuffle.partitions``) would spend seconds per pushed
          epoch on task overhead alone.
        """
        from formats.sparkframe import dense_vectors

        return self._pushed.get(df, lambda: self.few_tasks(dense_vectors(df)))

    def few_tasks(self, df: Any) -> Any:
        """``df`` in at most :data:`TASKS_PER_SLOT` partitions per task slot (``coalesce``:
        never more partitions, no shuffle); see :meth:`as_pushed`."""
        return df.coalesce(TASKS_PER_SLOT * self._concurrent_tasks())

    def _concurrent_tasks(self) -> int:
        """Task slots that may push at once (chunks are sized so that all of them together
        stay well inside a node's buffer: see feeders.protocol)."""
        try:
            if not is_connect(self.spark):
                return max(1, int(self.spark.sparkContext.defaultParallelism))
            return max(1, int(self.spark.conf.get("spark.default.parallelism", "8")))
        except Exception:  # noqa: BLE001 - a guess is fine: it only sizes chunks
            return 8

    def _push_frame_for(self, df: Any, workers: Sequence[NodeInfo], schema_ipc: bytes, epoch: int,
                        held: tuple[int, ...] | None = None) -> tuple[Any, dict[str, str]]:
        """The push job's DataFrame for ``epoch`` and the job-local properties to run it with.

        On classic Spark the epoch travels as a job-local property, so one ``mapInArrow``
        DataFrame serves every epoch of the same ``df`` and workers: building it costs tens of
        py4j calls (about 60 ms), every epoch otherwise. Spark Connect has no job-local
        properties: the epoch is baked into a new DataFrame each time.
        """
        from feeders.protocol import EPOCH_PROPERTY, PUSH_RESULT_SCHEMA
        from feeders.push import PartitionPusher
        from formats.sparkframe import map_in_arrow

        locations = [(n.node_id, n.flight_location) for n in workers]
        chunk = chunk_bytes(self._buffer_bytes, self._concurrent_tasks(), self._max_chunk_bytes)

        def frame(fixed_epoch: int | None) -> Any:
            pusher = PartitionPusher(
                secret=self._secret,
                epoch=fixed_epoch,
                locations=locations,
                schema_ipc=schema_ipc,
                max_chunk_bytes=chunk,
                tls_root_certs=self._tls_root,
                held=held,
            )
            return map_in_arrow(df, pusher, PUSH_RESULT_SCHEMA)

        if is_connect(self.spark):
            return frame(epoch), {}
        key = (id(df), tuple(locations), schema_ipc, chunk, held)
        cached = self._push_frame
        if cached is None or cached[0] != key or cached[1]() is not df:
            import weakref

            try:
                ref = weakref.ref(df)
            except TypeError:  # not weak-referenceable: no reuse
                return frame(None), {EPOCH_PROPERTY: str(epoch)}
            self._push_frame = (key, ref, frame(None))
        return self._push_frame[2], {EPOCH_PROPERTY: str(epoch)}

    def _wait(self, job: SparkJob, clock: FeedClock, what: str,
              why_late: Callable[[], str] | None = None) -> Any:
        """Wait for ``job`` while watching the nodes; cancel it if a node fails, nothing moves
        for ``clock.timeout`` or the wait itself is interrupted (Ctrl-C on the driver)."""
        try:
            return self._watch(job, clock, what, why_late)
        except BaseException as e:
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit
                job.cancel()
            raise

    def _watch(self, job: SparkJob, clock: FeedClock, what: str,
               why_late: Callable[[], str] | None) -> Any:
        while True:
            try:
                return job.future.result(timeout=0.25)
            except TimeoutError:
                pass
            except Exception as e:
                try:
                    text = str(e)  # once: a Py4JJavaError fetches it from a JVM that may be going
                except Exception:  # noqa: BLE001 - that JVM has exited already
                    text = None
                if text is None or jvm_gone(self.spark):  # no node is to blame
                    raise FeedError(spark_jvm_exited(what)) from None
                schema = _schema_message(text)
                if schema is not None:
                    raise SchemaError(schema) from None
                # The job failed: if a node is behind it, say so. A node that cannot be reached
                # may be dead: give the heartbeat monitor long enough to decide.
                unreachable = any(
                    k in text for k in ("Unavailable", "unreachable", "Connection refused", "failed to connect")
                )
                err = self._failure(grace=self._node_timeout + 2.0 if unreachable else 3.0)
                if err is not None:
                    raise err from e
                said = spark_error_text(text) or repr(e)
                if jvm_gone(self.spark):  # an OutOfMemoryError in local mode ends the JVM after the job
                    raise FeedError(spark_jvm_exited(what, said)) from None
                fix = f"{'' if said.endswith('.') else '.'} {SPARK_OOM_FIX}" if "OutOfMemoryError" in said else ""
                raise FeedError(f"{what} failed: {type(e).__name__}: {said}{fix}") from e
            err = self._failure()
            if err is not None:
                job.cancel()
                raise err
            if clock.expired(job.progress):
                job.cancel()
                raise feed_timeout_error(what, clock.timeout, why_late() if why_late else "")
