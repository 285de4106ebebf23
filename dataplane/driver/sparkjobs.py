"""Running a Spark job in the background so the driver can watch nodes while it runs.

Works with classic sessions (job groups) and Spark Connect sessions (operation tags).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Iterator

__all__ = ["SparkJob", "PerDataFrame", "is_connect", "on_jvm_exit", "arrow_schema_of", "sample_arrow"]

logger = logging.getLogger(__name__)


def is_connect(spark: Any) -> bool:
    """True for a Spark Connect session (``SparkSession.builder.remote(...)``)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def spark_stopped(spark: Any) -> bool:
    """True once ``spark.stop()`` has been called on this session (classic or Connect)."""
    if is_connect(spark):
        return bool(getattr(spark, "is_stopped", False))
    sc = getattr(spark, "_sc", None)
    return sc is None or getattr(sc, "_jsc", None) is None


@contextlib.contextmanager
def on_jvm_exit(spark: Any, what: str) -> Iterator[None]:
    """Inside the block, a call into Spark that fails because its JVM has exited (py4j's
    ConnectionRefusedError, or a Py4JJavaError that cannot fetch its own text) raises a
    FeedError saying so and what to do; our own errors pass as they are."""
    from dataplane.errors import DataplaneError, FeedError, jvm_gone, spark_jvm_exited

    try:
        yield
    except DataplaneError:
        raise
    except Exception:
        if jvm_gone(spark):
            raise FeedError(spark_jvm_exited(what)) from None
        raise


class PerDataFrame:
    """Values worked out once per live DataFrame object (by identity), so repeated
    ``train(df)`` calls on the same DataFrame neither rerun a Spark query nor build new plans.
    Entries whose DataFrame is gone are dropped once more than ``limit`` are held."""

    def __init__(self, limit: int = 64) -> None:
        self._entries: dict[int, tuple[Any, Any]] = {}
        self._limit = limit

    def get(self, df: Any, make: Callable[[], Any]) -> Any:
        import weakref

        hit = self._entries.get(id(df))
        if hit is not None and hit[0]() is df:
            return hit[1]
        value = make()
        try:
            self._entries[id(df)] = (weakref.ref(df), value)
        except TypeError:  # not weak-referenceable: just do not remember
            pass
        if len(self._entries) > self._limit:
            self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
        return value


class SparkJob:
    """``fn()`` (which runs Spark actions) in a daemon thread, cancellable as one unit.

    ``local_properties`` (classic sessions only) are set in that thread before ``fn`` runs, so
    every task of its jobs can read them with ``TaskContext.getLocalProperty``.
    """

    def __init__(
        self,
        spark: Any,
        description: str,
        fn: Callable[[], Any],
        local_properties: dict[str, str] | None = None,
    ) -> None:
        self.spark = spark
        self._properties = dict(local_properties or {})
        self.tag = f"dataplane-{uuid.uuid4().hex[:12]}"
        self.description = description
        self._fn = fn
        self.future: Future = Future()
        self._cancelled = False
        self._finished = 0  # Spark Connect: tasks finished, from the server's progress reports
        self._chaser: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, name=self.tag, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        watch = is_connect(self.spark) and hasattr(self.spark, "registerProgressHandler")  # pyspark 4
        try:
            if watch:
                self.spark.registerProgressHandler(self._progress)
            if is_connect(self.spark):
                self.spark.addTag(self.tag)
            else:
                sc = self.spark.sparkContext
                sc.setJobGroup(self.tag, self.description, True)
                for key, value in self._properties.items():
                    sc.setLocalProperty(key, value)
            if self._cancelled:
                raise RuntimeError(f"Spark job {self.tag} ({self.description}) was cancelled "
                                   f"before it started")
            self.future.set_result(self._fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            self.future.set_exception(e)
        finally:
            try:
                if is_connect(self.spark):
                    self.spark.removeTag(self.tag)
                if watch:
                    self.spark.removeProgressHandler(self._progress)
            except Exception:  # noqa: BLE001
                pass

    def done(self) -> bool:
        return self.future.done()

    def _progress(self, stages: Any, inflight_tasks: int, operation_id: Any, done: bool) -> None:
        # called for every operation of the session, each in the thread that runs it
        if threading.current_thread() is self._thread:
            self._finished = sum(int(st.num_completed_tasks) for st in stages or ())

    def progress(self) -> int | None:
        """A count that grows as Spark finishes tasks of this job (of every stage, those
        computing the rows before a shuffle too); None when Spark does not say (Spark Connect
        before pyspark 4). Spark's own counts lag by up to an executor heartbeat."""
        if is_connect(self.spark):
            return self._finished if hasattr(self.spark, "registerProgressHandler") else None
        try:
            tracker = self.spark.sparkContext.statusTracker()
            done = 0
            for job_id in tracker.getJobIdsForGroup(self.tag):
                job = tracker.getJobInfo(job_id)
                for stage_id in (job.stageIds if job is not None else ()):
                    stage = tracker.getStageInfo(stage_id)
                    done += stage.numCompletedTasks if stage is not None else 0
            return done
        except Exception:  # noqa: BLE001 - the session may be stopping
            return None

    def cancel(self) -> None:
        """Cancel every Spark job started by ``fn`` (running tasks are interrupted), including
        those ``fn`` starts afterwards.

        Spark registers a job only once ``collect()`` has planned it, and cancelling a job
        group (or an operation tag) reaches only the jobs registered by then: a Ctrl-C that
        came while the push was being planned left its job to run beside the next call's. So a
        thread keeps cancelling the jobs that appear in the group until ``fn`` has returned.
        """
        self._cancelled = True
        if self.future.done():
            return  # nothing left to cancel (Spark would warn that it found no active job)
        connect = is_connect(self.spark)
        cancelled = set() if connect else self._group_jobs()  # (before: none slips between)
        self._cancel_now()
        if self._chaser is None:
            self._chaser = threading.Thread(target=self._chase, args=(cancelled,),
                                            name=f"{self.tag}-cancel", daemon=True)
            self._chaser.start()

    def _cancel_now(self, *, quiet: bool = False) -> None:
        """``quiet``: a failure is logged at debug level (the chase: the user may have stopped
        the session meanwhile, and py4j's error carries the JVM's whole stack)."""
        try:
            if is_connect(self.spark):
                self.spark.interruptTag(self.tag)
            else:
                self.spark.sparkContext.cancelJobGroup(self.tag)
        except Exception as e:  # noqa: BLE001 - best effort; the session may be stopping
            if quiet or spark_stopped(self.spark):
                logger.debug("could not cancel Spark job %s: %s", self.tag, e)
            else:
                logger.warning("could not cancel Spark job %s: %s", self.tag, str(e).splitlines()[0] if str(e) else repr(e))

    def _chase(self, seen: set[int], limit: float = 600.0) -> None:
        """Cancel the jobs that ``fn`` starts after :meth:`cancel` (see there), until it
        returns. Classic sessions: a new job id in the group is cancelled as it appears (a
        cancel with none running only makes Spark warn). Connect: the tag is interrupted again
        every half second."""
        import time
        from concurrent.futures import wait

        connect = is_connect(self.spark)
        deadline = time.monotonic() + limit
        while not self.future.done() and time.monotonic() < deadline:
            wait([self.future], timeout=0.5 if connect else 0.1)
            if self.future.done() or spark_stopped(self.spark):
                return
            if connect:
                self._cancel_now(quiet=True)
                continue
            jobs = self._group_jobs()
            if jobs - seen:
                seen = jobs
                self._cancel_now(quiet=True)

    def _group_jobs(self) -> set[int]:
        try:
            return set(self.spark.sparkContext.statusTracker().getJobIdsForGroup(self.tag))
        except Exception:  # noqa: BLE001 - the session may be stopping
            return set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@contextlib.contextmanager
def plain_ctrl_c(spark: Any) -> Iterator[None]:
    """Ctrl-C raises a plain KeyboardInterrupt while the block runs (main thread, classic
    Spark); the Spark jobs still running when it leaves that way are cancelled then.

    PySpark's own SIGINT handler calls ``SparkContext.cancelAllJobs()`` inside the signal,
    that is in the middle of whatever py4j call the main thread is waiting in: that nested
    call fails ("reentrant call") and py4j prints its tracebacks. Cancelling here, once the
    interrupted call has unwound, does what that handler meant. (Our own waits cancel their
    jobs too: ``SparkJob.cancel``.)"""
    handler = None
    if threading.current_thread() is threading.main_thread():
        current = signal.getsignal(signal.SIGINT)
        if getattr(current, "__module__", "").startswith("pyspark"):
            handler = current
    if handler is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    except KeyboardInterrupt:
        try:
            spark.sparkContext.cancelAllJobs()
        except Exception as e:  # noqa: BLE001 - the session may be stopping
            logger.debug("could not cancel Spark's jobs after Ctrl-C: %s", e)
        raise
    finally:
        signal.signal(signal.SIGINT, handler)


def arrow_schema_of(df: Any):  # type: ignore[no-untyped-def]
    """The Arrow schema Spark's mapInArrow uses for ``df``'s rows: timestamps carry the
    session's time zone, as the batches Spark hands the tasks do."""
    from pyspark.sql.pandas.types import to_arrow_schema

    tz = _session_time_zone(df)
    try:
        schema = to_arrow_schema(df.schema, timezone=tz, prefers_large_types=False)
    except TypeError:  # pyspark 3.5 takes neither keyword, and writes every timestamp as UTC
        schema = to_arrow_schema(df.schema)
    return pa_schema_in_time_zone(schema, tz)


def _session_time_zone(df: Any) -> str:
    try:
        return str(df.sparkSession.conf.get("spark.sql.session.timeZone"))
    except Exception:  # noqa: BLE001 - only the unit matters to the node (int64 counts)
        return "UTC"


def pa_schema_in_time_zone(schema: Any, tz: str) -> Any:
    """``schema`` with every zoned timestamp (nested ones too) in time zone ``tz``."""
    import pyarrow as pa

    def fix(t: Any) -> Any:
        if pa.types.is_timestamp(t):
            return pa.timestamp(t.unit, tz=tz) if t.tz is not None else t
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            kind = pa.list_ if pa.types.is_list(t) else pa.large_list
            return kind(t.value_field.with_type(fix(t.value_type)))
        if pa.types.is_struct(t):
            return pa.struct([f.with_type(fix(f.type)) for f in t])
        if pa.types.is_map(t):
            return pa.map_(t.key_field.with_type(fix(t.key_type)), t.item_field.with_type(fix(t.item_type)))
        return t

    return pa.schema([f.with_type(fix(f.type)) for f in schema], metadata=schema.metadata)


def sample_arrow(df: Any, n: int):  # type: ignore[no-untyped-def]
    """The first ``n`` rows of ``df`` as a pyarrow Table (on the driver)."""
    import pyarrow as pa

    small = df.limit(n)
    if hasattr(small, "toArrow"):
        return small.toArrow()
    if hasattr(small, "_collect_as_arrow"):
        return pa.Table.from_batches(small._collect_as_arrow(), schema=arrow_schema_of(df))
    return pa.Table.from_pandas(small.toPandas(), schema=arrow_schema_of(df), preserve_index=False)
