"""Attempt-keyed staging and driver commit for the TFRecord export jobs.

Every export job that writes TFRecords (:func:`formats.write_tfrecords`,
:func:`formats.parquet_to_tfrecords`) goes through the same steps, kept here so they cannot drift:

1. :meth:`StagedOutput.prepare` checks the output directory (refuses a non-empty one unless
   ``mode="overwrite"``) and creates ``<path>/_temporary/<job id>/``.
2. Each Spark task writes one file named by partition *and* task attempt into that staging
   directory with :func:`write_partition` and returns one stats row (:data:`STATS_SCHEMA`).
3. ``collect()`` hands the driver exactly the stats rows of the attempts Spark counted as
   successful; :meth:`StagedOutput.commit` renames exactly those files to
   ``part-<partition>.tfrecord[.gz]``, deletes the staging area (failed, retried and speculative
   attempts' files with it) and writes the schema file. A list column whose lists had one
   length at every level in every row (Spark's ``array<float>`` holding images, say) is
   declared dense there: each task reports the shortest and longest list per level
   (:func:`formats.schema.list_lengths`), so readers get ``[batch, 784]`` tensors, not ragged ones.
4. On any failure :meth:`StagedOutput.abort` deletes the staging area, and the output directory
   too when the job created it, so nothing partial is left behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa

from formats.errors import SchemaError, StorageError
from formats.schema import ColumnSpec, column_array, list_lengths, uniform_shape
from formats.tfrecord import compression_suffix

__all__ = [
    "ExportResult", "STATS_SCHEMA", "StagedOutput", "write_partition", "job_progress", "task_error",
    "dense_specs", "check_not_reading_from",
]

logger = logging.getLogger(__name__)

STATS_SCHEMA = (
    "partition INT, attempt INT, file STRING, rows BIGINT, bytes BIGINT, nulls STRING, lengths STRING"
)
"""The one row each writing task returns (Spark DDL)."""


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        path: the output directory (as given).
        rows: rows written.
        files: data files written (empty partitions write none).
        bytes: bytes of the data files (compressed size when compressed).
        seconds: wall time of the whole export, commit included.
    """

    path: str
    rows: int
    files: int
    bytes: int
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


_TASK_ERROR = re.compile(r"^\s*(?:[\w.]+\.)?(SchemaError|RecordError|StorageError): (.+)$")


def task_error(exc: BaseException) -> Exception | None:
    """The error one of our Spark tasks raised, rebuilt on the driver, or None.

    A failed job reaches the driver as Spark's own exception (``PythonException``,
    ``Py4JJavaError``) whose text holds the task's Python traceback. When its last exception
    is a :class:`SchemaError`, :class:`RecordError` or :class:`StorageError`, the export call
    raises that type with that message (``from`` Spark's exception), so callers catch what
    they would catch from a check on the driver.
    """
    from formats.errors import RecordError

    text = str(exc)
    if "Traceback (most recent call last)" not in text:
        return None
    tail = text.rsplit("Traceback (most recent call last)", 1)[1].splitlines()
    for line in reversed(tail):
        m = _TASK_ERROR.match(line)
        if m:
            kind = {"SchemaError": SchemaError, "RecordError": RecordError,
                    "StorageError": StorageError}[m.group(1)]
            return kind(m.group(2).strip())
    return None


# ---------------------------------------------------------------------------------------------
# executor side


def _merge_lengths(a: list[list[int]] | None, b: list[list[int]] | None) -> list[list[int]] | None:
    if a is None or b is None:
        return a if b is None else b
    return [[min(x[0], y[0]), max(x[1], y[1])] for x, y in zip(a, b)]


def dense_specs(specs: Sequence[ColumnSpec], lengths: dict[str, Any], nulls: dict[str, int]) -> list[ColumnSpec]:
    """``specs`` with every list column whose lists had one length per level made dense.

    A column with a null row stays ragged: a dense reader would need a fill value for it,
    where the ragged one reads an empty row. So does a column with an empty list level.
    """
    from dataclasses import replace

    out = []
    for s in specs:
        shape = uniform_shape(lengths.get(s.name)) if s.is_ragged and not nulls.get(s.name, 0) else None
        if shape is not None:
            it = iter(shape)
            s = replace(s, shape=tuple(next(it) if d is None else d for d in s.shape), ragged_rank=0)
        out.append(s)
    return out


def write_partition(
    batches: Iterator[tuple[pa.RecordBatch, str | None]],
    *,
    filesystem: Any,
    staging: str,
    specs: Sequence[ColumnSpec],
    compression: str | None,
) -> pa.RecordBatch:
    """Encode and frame ``batches`` into this task attempt's staging file; returns its stats row.

    Runs inside a Spark task. ``batches`` yields (batch, source) pairs; ``source`` (a file
    name, or None) is put in front of encoding errors so they say where the bad rows came from.
    The file is opened at the first non-empty batch, so an empty partition writes nothing.

    Raises:
        SchemaError: a batch cannot be encoded (the message names the column, and the source).
    """
    from pyspark import TaskContext

    from formats.sparktask import prepare_task
    from formats.example import encode_example_array
    from formats.tfrecord import open_compressed, write_record_array

    prepare_task()
    ctx = TaskContext.get()
    pid = ctx.partitionId() if ctx else 0
    attempt = ctx.attemptNumber() if ctx else 0
    tid = ctx.taskAttemptId() if ctx else 0
    name = f"{staging}/part-{pid:05d}-attempt-{attempt}-{tid}.tfrecord{compression_suffix(compression)}"
    rows = 0
    nulls = {s.name: 0 for s in specs}
    lengths: dict[str, Any] = {}
    raw = stream = None
    try:
        for batch, source in batches:
            if batch.num_rows == 0:
                continue
            if raw is None:
                raw = filesystem.open_output_stream(name, compression=None)
                stream = open_compressed(raw, compression, mode="wb")
            try:
                for s in specs:
                    arr = column_array(batch, s.name)
                    nulls[s.name] += arr.null_count
                    if s.is_ragged:
                        lengths[s.name] = _merge_lengths(lengths.get(s.name), list_lengths(arr, s))
                records = encode_example_array(batch, specs)
            except SchemaError as exc:
                # The source file says where the bad rows are; without one, the partition does.
                raise SchemaError(f"{source or f'partition {pid}'}: {exc}") from exc
            write_record_array(stream, records)
            rows += batch.num_rows
    finally:
        if stream is not None and stream is not raw:
            stream.close()
        if raw is not None:
            raw.close()
    size = filesystem.get_file_info(name).size if raw is not None else 0
    return pa.RecordBatch.from_pydict(
        {
            "partition": pa.array([pid], pa.int32()),
            "attempt": pa.array([attempt], pa.int32()),
            "file": pa.array([name if raw is not None else None], pa.string()),
            "rows": pa.array([rows], pa.int64()),
            "bytes": pa.array([size or 0], pa.int64()),
            "nulls": pa.array([json.dumps(nulls)], pa.string()),
            "lengths": pa.array([json.dumps(lengths)], pa.string()),
        }
    )


# ---------------------------------------------------------------------------------------------
# driver side


def _remove(fs: Any, path: str) -> None:
    try:
        fs.delete_dir(path)
    except (OSError, FileNotFoundError):
        logger.debug("could not remove %s", path, exc_info=True)


def _place(path_or_url: str) -> str:
    """``scheme://host/path`` of a local path or URL, without touching any filesystem; a glob
    pattern stands for the folder before its first wildcard."""
    from urllib.parse import unquote

    p = os.fspath(path_or_url)
    if p[:5].lower() == "file:" and p[5:6] == "/" and p[5:7] != "//":
        p = "file://" + p[5:]  # Hadoop's file:/path
    cut = min((p.index(c) for c in "*?[" if c in p), default=-1)
    if cut >= 0:
        p = p[:cut].rsplit("/", 1)[0]
    if "://" not in p:
        return "file://" + os.path.abspath(p)
    scheme, rest = p.split("://", 1)
    if scheme.lower() == "file":
        return "file://" + os.path.abspath(unquote(rest) or "/")
    return f"{scheme.lower()}://{rest.rstrip('/')}"


def check_not_reading_from(url: str, sources: Sequence[str]) -> None:
    """Refuse to overwrite a directory that holds what the job reads: its commit would delete
    the data it exported (Spark's writer refuses the same for a path read from)."""
    root = _place(url).rstrip("/") + "/"
    for src in sources:
        if (_place(src).rstrip("/") + "/").startswith(root):
            raise StorageError(
                f"{url} holds {src}, which this export reads: mode='overwrite' would delete the "
                f"data being exported. Write to a new path (then move it, if it must replace "
                f"the source)."
            )


class StagedOutput:
    """The output directory of one export job: staging area, commit, clean-up.

    Attributes:
        url: the output as given (for ExportResult and messages).
        filesystem: the ``pyarrow.fs`` filesystem it is on (picklable, shipped to tasks).
        root: the output directory's path on ``filesystem``.
        staging: this job's staging directory (``<root>/_temporary/<job id>``).
        created: whether this job created ``root`` (then an aborted job removes it).
    """

    def __init__(self, url: str, filesystem: Any, root: str, staging: str, created: bool) -> None:
        self.url = url
        self.filesystem = filesystem
        self.root = root
        self.staging = staging
        self.created = created
        self.replace = False  # the directory held an earlier output, deleted at commit
        self.started = time.perf_counter()

    @classmethod
    def prepare(cls, path: str | os.PathLike, *, filesystem: Any = None, mode: str = "error",
                sources: Sequence[str] = ()) -> "StagedOutput":
        """Check the output directory and create this job's staging directory.

        With ``mode="overwrite"`` what the directory holds is deleted at :meth:`commit`, once
        every task has written: a job that fails leaves the previous output as it was.

        Args:
            sources: the files the job reads (paths or URLs); with ``mode="overwrite"`` none
                may lie in the output directory, which the commit empties.

        Raises:
            StorageError: ``path`` is a file, exists and is not empty with ``mode="error"``, or
                holds a source file with ``mode="overwrite"``.
        """
        from pyarrow import fs as pafs

        from formats.fs import resolve, storage_error

        if mode not in ("error", "overwrite"):
            raise ValueError(f"mode must be 'error' or 'overwrite', got {mode!r}.")
        loc = resolve(path, filesystem=filesystem)
        fs, root = loc.filesystem, loc.path.rstrip("/")
        try:
            info = fs.get_file_info(root)
            created = info.type == pafs.FileType.NotFound
            if info.type == pafs.FileType.File:
                raise StorageError(f"{loc.url} is a file; a TFRecord export needs a directory path.")
            replace = not created and bool(fs.get_file_info(pafs.FileSelector(root)))
            if replace and mode == "error":
                raise StorageError(
                    f"{loc.url} already exists and is not empty; choose a new path or pass "
                    f"mode='overwrite'."
                )
            if replace:
                check_not_reading_from(str(path), sources)
            staging = f"{root}/_temporary/{uuid.uuid4().hex[:16]}"
            fs.create_dir(staging, recursive=True)
        except StorageError:
            raise
        except OSError as exc:  # credentials, a missing bucket, an unreachable endpoint
            raise storage_error(exc, "write to", loc.url) from exc
        out = cls(str(path), fs, root, staging, created)
        out.replace = replace
        return out

    def abort(self) -> None:
        """Remove everything this job wrote (the whole directory if the job created it)."""
        _remove(self.filesystem, self.root if self.created else f"{self.root}/_temporary")

    def commit(
        self,
        stats: Sequence[Any],
        *,
        specs: Sequence[ColumnSpec],
        compression: str | None,
        spark_schema: dict[str, Any] | None,
    ) -> ExportResult:
        """Move each partition's one successful attempt file into place and write the schema file.

        Args:
            stats: the collected :data:`STATS_SCHEMA` rows (one per successful task).
            specs: the column specs the files were written with.
            compression: the files' compression.
            spark_schema: the Spark schema (``StructType.jsonValue()``) readers should restore,
                or None.
        """
        from formats.schemafile import TFRecordSchema, write_schema_file

        fs, root = self.filesystem, self.root
        if self.replace:  # the earlier output goes only now that every task has written
            from pyarrow import fs as pafs

            for info in fs.get_file_info(pafs.FileSelector(root)):
                if info.base_name == "_temporary":
                    continue
                if info.type == pafs.FileType.Directory:
                    fs.delete_dir(info.path)
                else:
                    fs.delete_file(info.path)
        seen: set[int] = set()
        committed = []
        for r in sorted(stats, key=lambda r: r["partition"]):
            pid = r["partition"]
            if pid in seen:  # cannot happen with collect(); never commit a partition twice
                logger.warning("partition %d reported twice; keeping its first attempt", pid)
                continue
            seen.add(pid)
            if not r["file"] or not r["rows"]:
                continue
            name = f"part-{pid:05d}.tfrecord{compression_suffix(compression)}"
            fs.move(r["file"], f"{root}/{name}")
            committed.append({"path": name, "rows": int(r["rows"]), "bytes": int(r["bytes"])})
        _remove(fs, f"{root}/_temporary")
        rows = sum(r["rows"] for r in committed)
        nulls: dict[str, int] = {s.name: 0 for s in specs}
        lengths: dict[str, Any] = {}
        for r in stats:
            for k, v in json.loads(r["nulls"]).items():
                nulls[k] = nulls.get(k, 0) + int(v)
            for k, v in json.loads(r["lengths"]).items():
                lengths[k] = _merge_lengths(lengths.get(k), v)
        schema = TFRecordSchema(
            specs=dense_specs(specs, lengths, nulls),
            compression=compression,
            num_rows=rows,
            files=committed,
            null_counts=nulls,
            spark_schema=spark_schema,
        )
        write_schema_file(root, schema, filesystem=fs)
        return ExportResult(
            path=self.url,
            rows=rows,
            files=len(committed),
            bytes=sum(r["bytes"] for r in committed),
            seconds=time.perf_counter() - self.started,
        )


class _Progress:
    """Polls Spark's status tracker in a thread and reports (tasks done, tasks total)."""

    def __init__(self, spark: Any, callback: Callable[[int, int], None] | None, interval: float = 0.25) -> None:
        self.callback = callback
        self.group = f"dataplane-export-{uuid.uuid4().hex[:12]}"
        self.sc = None
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prev_group = None
        if callback is None:
            return
        try:
            self.sc = spark.sparkContext  # classic Spark only; Spark Connect has no tracker
        except Exception:  # noqa: BLE001 - Connect raises its own error types here
            self.sc = None

    def __enter__(self) -> "_Progress":
        if self.sc is not None:
            self._prev_group = self.sc.getLocalProperty("spark.jobGroup.id")
            self.sc.setJobGroup(self.group, "dataplane export", interruptOnCancel=True)
            self._thread = threading.Thread(target=self._run, name="export-progress", daemon=True)
            self._thread.start()
        return self

    def _counts(self) -> tuple[int, int]:
        tracker = self.sc.statusTracker()  # type: ignore[union-attr]
        done = total = 0
        for job in tracker.getJobIdsForGroup(self.group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info else []:
                s = tracker.getStageInfo(stage)
                if s is not None:
                    done += s.numCompletedTasks
                    total += s.numTasks
        return done, total

    def _report(self, done: int, total: int) -> None:
        """Call the user's callback; one that raises is reported once and not called again
        (the export goes on: progress must never break it)."""
        if self.callback is None or not total:
            return
        try:
            self.callback(done, total)
        except Exception as e:  # noqa: BLE001 - the user's code
            logger.warning("the export's progress callback raised %s: %s; progress is no longer "
                           "reported to it", type(e).__name__, e, exc_info=True)
            self.callback = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                counts = self._counts()
            except Exception:  # noqa: BLE001 - Spark's tracker: progress must never break the export
                logger.debug("progress poll failed", exc_info=True)
                continue
            self._report(*counts)

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            try:
                done, total = self._counts()
            except Exception:  # noqa: BLE001
                done = total = 0
            # a job that succeeded did all it needed (stages Spark skipped count tasks never run)
            self._report(total if exc_type is None else done, total)
            self.sc.setLocalProperty("spark.jobGroup.id", self._prev_group)  # type: ignore[union-attr]


def job_progress(spark: Any, callback: Callable[[int, int], None] | None) -> _Progress:
    """Context manager: Spark jobs started inside it report (tasks done, tasks total) to
    ``callback`` from a polling thread (classic Spark; a no-op under Spark Connect or with no
    callback)."""
    return _Progress(spark, callback)
