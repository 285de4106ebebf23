"""Parquet -> TFRecord as a Spark job that reads the Parquet files in its tasks: :func:`parquet_to_tfrecords`.

``write_tfrecords(spark.read.parquet(src), dst)`` moves every row through the JVM: Spark decodes
Parquet into its own rows, then converts them to Arrow for Python. For wide array columns (an
MNIST image is 784 floats) that conversion costs far more than the TFRecord encoding. Here the
driver only plans: it lists the files, reads their footers and splits the row groups into tasks.
The job is ``sc.parallelize(range(tasks), tasks).mapPartitions(...)`` on classic Spark and
``spark.range(tasks).mapInArrow(...)`` under Spark Connect (the same task code; the RDD job just
starts faster). Task *i* reads its row groups with ``pyarrow.parquet``, converts each batch to
exactly the Arrow types Spark would have handed ``mapInArrow`` for ``spark.read.parquet(src)``
(see :func:`parquet_spark_schema`), and encodes and writes them like
:func:`formats.write_tfrecords` does. So the records, the schema file and the guarantees are the
same: attempt-keyed staging with a driver commit (no duplicate or partial file after a retried or
speculative task; see :mod:`formats.staging`), null counts, progress, no output left after a
failure. The executors must be able to open ``src`` through ``pyarrow.fs`` (local, ``s3://``,
``hdfs://``).

Hive-style partition directories (``src/day=2024-01-31/...``, what ``df.write.partitionBy``
makes) become columns after the files' own, as the pull readers give them
(:mod:`formats.hive`). A column missing from some files is written as nulls in those files'
rows (as Spark reads it); a column whose type differs between files is a
:class:`~dataplane.errors.SchemaError` naming the file.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa

from formats.errors import SchemaError, StorageError
from formats.schema import INT96_UNIT, ColumnSpec, column_specs, timestamps_as_micros
from formats.hive import HiveColumns
from formats.staging import STATS_SCHEMA, ExportResult, StagedOutput, job_progress, task_error, write_partition
from formats.tfrecord import normalize_compression

__all__ = ["parquet_to_tfrecords", "parquet_spark_schema"]

logger = logging.getLogger(__name__)

_TASK_BYTES = 128 << 20  # like spark.sql.files.maxPartitionBytes: Parquet bytes per task
_BATCH_BYTES = 8 << 20  # uncompressed bytes per Arrow batch read in a task
_MIN_BATCH, _MAX_BATCH = 1024, 65536

# (file index, row group, first row, end row) within that row group
Unit = tuple[int, int, int, int]


@dataclass(frozen=True)
class _RowGroup:
    file: int
    index: int
    rows: int
    bytes: int  # compressed bytes on storage


@dataclass(frozen=True)
class _FileInfo:
    path: str
    schema: pa.Schema  # the Arrow schema pyarrow reads it as
    int96: frozenset[str]  # top-level columns stored as INT96 (Spark's legacy timestamps)
    row_groups: list[_RowGroup]
    batch_rows: int


def _footer(fs: Any, path: str, index: int) -> _FileInfo:
    import pyarrow.parquet as pq

    try:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f, coerce_int96_timestamp_unit=INT96_UNIT)
            meta = pf.metadata
            schema = pf.schema_arrow
            pschema = pf.schema
            int96 = frozenset(  # top-level columns only (a nested one keeps its naive type)
                pschema.column(i).path
                for i in range(len(pschema))
                if pschema.column(i).physical_type == "INT96" and "." not in pschema.column(i).path
            )
            groups = []
            raw_bytes = rows = 0
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                comp = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
                groups.append(_RowGroup(index, g, rg.num_rows, comp))
                raw_bytes += rg.total_byte_size
                rows += rg.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise StorageError(f"{path}: cannot read it as Parquet: {exc}") from exc
    per_row = max(1.0, raw_bytes / rows) if rows else 1.0
    batch = int(min(_MAX_BATCH, max(_MIN_BATCH, _BATCH_BYTES // per_row)))
    return _FileInfo(path, schema, int96, groups, batch)


def _asnullable(dt: Any) -> Any:
    """``dt`` with every level nullable, as Spark's file sources report it."""
    from pyspark.sql import types as T

    if isinstance(dt, T.ArrayType):
        return T.ArrayType(_asnullable(dt.elementType), True)
    if isinstance(dt, T.MapType):
        return T.MapType(_asnullable(dt.keyType), _asnullable(dt.valueType), True)
    if isinstance(dt, T.StructType):
        return T.StructType([T.StructField(f.name, _asnullable(f.dataType), True) for f in dt.fields])
    return dt


def parquet_spark_schema(arrow_schema: pa.Schema, *, int96: Sequence[str] = ()) -> Any:
    """The Spark schema ``spark.read.parquet`` gives a Parquet file read by pyarrow as ``arrow_schema``.

    Every field and array element is nullable (Spark's file sources make them so); unsigned
    integers widen (uint64 to bigint), tz-aware timestamps are ``timestamp`` and naive ones
    ``timestamp_ntz``, except columns named in ``int96`` (Spark's legacy INT96 timestamps, which
    pyarrow reads as naive nanoseconds) which are ``timestamp``.

    Raises:
        SchemaError: a column has no Spark type (names it).
    """
    from pyspark.sql import types as T

    from formats.export import _spark_type_for

    fields = []
    for f in arrow_schema:
        dt = T.TimestampType() if f.name in int96 else _spark_type_for(f.name, f.type)
        fields.append(T.StructField(f.name, _asnullable(dt), True))
    return T.StructType(fields)


def _plan(groups: list[_RowGroup], num_files: int | None, parallelism: int) -> list[list[Unit]]:
    """Split the row groups into tasks, keeping file and row order (task i before task i+1).

    ``num_files`` given: that many tasks with equal row counts (row groups split where needed).
    Otherwise whole row groups, packed by rows into max(bytes / 128 MiB, min(parallelism, row
    groups)) tasks.
    """
    total = sum(g.rows for g in groups)
    if num_files is not None:
        import bisect

        bounds = [k * total // num_files for k in range(num_files + 1)]
        tasks: list[list[Unit]] = [[] for _ in range(num_files)]
        start = 0
        for g in groups:
            end = start + g.rows
            k = max(0, bisect.bisect_right(bounds, start) - 1)
            while k < num_files and bounds[k] < end:
                lo, hi = max(start, bounds[k]), min(end, bounds[k + 1])
                if lo < hi:
                    tasks[k].append((g.file, g.index, lo - start, hi - start))
                k += 1
            start = end
        return tasks
    nonempty = [g for g in groups if g.rows]
    if not nonempty:
        return []
    want = max(math.ceil(sum(g.bytes for g in nonempty) / _TASK_BYTES), min(parallelism, len(nonempty)))
    grouped: dict[int, list[Unit]] = {}
    before = 0
    for g in nonempty:
        k = min(want - 1, int((before + g.rows / 2) * want / total))
        grouped.setdefault(k, []).append((g.file, g.index, 0, g.rows))
        before += g.rows
    return [grouped[k] for k in sorted(grouped)]


def _spark_context(spark: Any) -> Any:
    """The SparkContext of a classic session; None under Spark Connect."""
    try:
        return spark.sparkContext
    except Exception:  # noqa: BLE001 - Spark Connect raises its own error types here
        return None


def _parallelism(spark: Any) -> int:
    sc = _spark_context(spark)
    if sc is not None:
        return int(sc.defaultParallelism)
    try:
        value = spark.conf.get("spark.default.parallelism", None)
        if value:
            return int(value)
    except Exception:  # noqa: BLE001
        pass
    return os.cpu_count() or 2


class _ParquetWriteTask:
    """Reads the row groups of the task ids it is given, encodes and writes them (picklable)."""

    def __init__(self, src_fs: Any, files: list[str], batch_rows: list[int], plan: list[list[Unit]],
                 target: pa.Schema, dst_fs: Any, staging: str, specs: list[ColumnSpec],
                 compression: str | None, hive: HiveColumns) -> None:
        self.src_fs = src_fs
        self.hive = hive  # partition columns: one value per file
        self.files = files
        self.batch_rows = batch_rows
        self.plan = plan
        self.target = target
        self.dst_fs = dst_fs
        self.staging = staging
        self.specs = specs
        self.compression = compression

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``mapInArrow`` form: task ids arrive as Arrow batches, one stats batch goes back."""
        yield self._write([i for b in batches for i in b.column(0).to_pylist()])

    def rdd_partition(self, ids: Iterator[int]) -> Iterator[dict[str, Any]]:
        """RDD form (classic Spark): task ids arrive as ints, one stats dict goes back."""
        yield self._write(list(ids)).to_pylist()[0]

    def _write(self, ids: list[int]) -> pa.RecordBatch:
        units = [u for i in ids for u in self.plan[i]]
        return write_partition(
            self._read(units), filesystem=self.dst_fs, staging=self.staging, specs=self.specs,
            compression=self.compression,
        )

    def _read(self, units: list[Unit]) -> Iterator[tuple[pa.RecordBatch, str]]:
        import pyarrow.parquet as pq

        current: tuple[int, Any, Any] | None = None
        try:
            for fidx, group, lo, hi in units:
                path = self.files[fidx]
                if current is None or current[0] != fidx:
                    if current is not None:
                        current[1].close()
                    f = self.src_fs.open_input_file(path)
                    current = (fidx, f, pq.ParquetFile(f, **self._read_options()))
                pf = current[2]
                names = [n for n in self.target.names if n in pf.schema_arrow.names]
                pos = 0
                try:
                    for batch in pf.iter_batches(batch_size=self.batch_rows[fidx], row_groups=[group],
                                                 columns=names):
                        a, b = max(lo - pos, 0), min(hi - pos, batch.num_rows)
                        pos += batch.num_rows
                        if a < b:
                            yield self._conform(batch.slice(a, b - a), path), path
                        if pos >= hi:
                            break
                except (OSError, pa.ArrowException) as exc:
                    if isinstance(exc, (SchemaError, StorageError)):
                        raise
                    raise StorageError(f"{path}: cannot read row group {group}: {exc}") from exc
        finally:
            if current is not None:
                current[1].close()

    def _read_options(self) -> dict[str, Any]:
        """How to open a source file: local files stream their pages through a 1 MiB buffer,
        remote ones pre-buffer (coalesced reads: fewer requests).

        Measured on an MNIST-shaped row group: pyarrow 14 reads it 45% faster buffered than by
        whole column chunks (265k against 180k rows/s); pyarrow 26 is as fast either way.
        """
        if getattr(self.src_fs, "type_name", "") == "local":
            return {"buffer_size": 1 << 20, "coerce_int96_timestamp_unit": INT96_UNIT}
        return {"pre_buffer": True, "coerce_int96_timestamp_unit": INT96_UNIT}

    def _conform(self, batch: pa.RecordBatch, path: str) -> pa.RecordBatch:
        """``batch`` with the target's columns and types (missing columns as nulls, partition
        columns from the file's directories)."""
        cols = []
        consts = self.hive.values[path] if self.hive else {}
        for field in self.target:
            if field.name in consts:
                cols.append(pa.repeat(consts[field.name], batch.num_rows).cast(field.type))
                continue
            idx = batch.schema.get_field_index(field.name)
            if idx < 0:
                cols.append(pa.nulls(batch.num_rows, field.type))
                continue
            col = batch.column(idx)
            if pa.types.is_timestamp(col.type) and pa.types.is_timestamp(field.type) and field.type.unit == "us":
                # as every reader converts them (nanoseconds floored), not a cast that refuses
                col = timestamps_as_micros(field.name, col)
            if col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise SchemaError(
                        f"{path}: column {field.name!r} has type {col.type}, which cannot be "
                        f"converted to {field.type} (the type Spark reads it as): {exc}. Fix "
                        f"the file, or export spark.read.parquet(...) with write_tfrecords."
                    ) from exc
            cols.append(col)
        return pa.RecordBatch.from_arrays(cols, schema=self.target)


def parquet_to_tfrecords(
    spark: Any,
    src: str | os.PathLike,
    path: str | os.PathLike,
    *,
    compression: str | None = None,
    num_files: int | None = None,
    filesystem: Any = None,
    src_filesystem: Any = None,
    mode: str = "error",
    flatten_structs: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write a Parquet dataset as ``tf.train.Example`` TFRecord files plus a schema file.

    The records and schema file are those ``write_tfrecords(spark.read.parquet(src), path)``
    writes, but the Spark tasks read the Parquet files themselves with pyarrow instead of
    receiving rows from the JVM (see the module docstring), which is several times faster.
    Spark ML vector columns are the exception: ``write_tfrecords`` writes them as float64
    arrays, this refuses them, naming ``vector_to_array`` as the fix.

    Args:
        spark: the SparkSession (classic or Spark Connect) that runs the job.
        src: a Parquet file or a directory of them (searched recursively; names starting with
            ``_`` or ``.`` skipped): local path, ``file://``, ``s3://`` or ``hdfs://`` URL. The
            executors open it through ``pyarrow.fs``, so it must be reachable from them.
        path: output directory (local path or URL).
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None`` (default: uncompressed).
        num_files: write this many files with equal row counts (default: one task per run of
            whole row groups, about 128 MiB of Parquet each and at least as many tasks as
            Spark's default parallelism allows; a task with no rows writes no file).
        filesystem: ``pyarrow.fs.FileSystem`` for ``path`` (default: from the URL).
        src_filesystem: ``pyarrow.fs.FileSystem`` for ``src`` (default: from the URL).
        mode: ``"error"`` (default: refuse a non-empty existing directory) or ``"overwrite"``.
        flatten_structs: write struct columns as ``"parent.child"`` features (default False:
            a struct column is a SchemaError).
        progress: called with (tasks done, tasks total) while the job runs (classic Spark only).

    Returns:
        An :class:`~formats.staging.ExportResult`.

    Raises:
        SchemaError: a column TF cannot hold, a column whose type differs between files, or
            files under different partition keys, before any file is written; from the job, a value that
            cannot be encoded (the message names the Parquet file and the column).
        StorageError: ``src`` is missing, empty or unreadable (names the file), or the output
            exists (mode="error") or cannot be written.
    """
    from formats.export import _spark_type_for, spark_arrow_schema
    from formats.fs import list_files, listing_root, parquet_files, resolve
    from formats.hive import hive_columns

    comp = normalize_compression(compression)
    if num_files is not None and (not isinstance(num_files, int) or isinstance(num_files, bool) or num_files < 1):
        raise ValueError(f"num_files must be a positive int or None, got {num_files!r}.")
    if mode not in ("error", "overwrite"):
        raise ValueError(f"mode must be 'error' or 'overwrite', got {mode!r}.")
    loc = resolve(src, filesystem=src_filesystem)
    files = parquet_files(loc, list_files(loc))
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        infos = list(pool.map(lambda a: _footer(loc.filesystem, a[1], a[0]), enumerate(files)))
    first = infos[0]
    spark_schema = parquet_spark_schema(first.schema, int96=sorted(first.int96))
    for info in infos[1:]:
        other = parquet_spark_schema(info.schema, int96=sorted(info.int96))
        theirs = {f.name: f.dataType for f in other.fields}
        for f in spark_schema.fields:
            if f.name in theirs and theirs[f.name] != f.dataType:
                raise SchemaError(
                    f"{info.path}: column {f.name!r} is {theirs[f.name].simpleString()} there "
                    f"but {f.dataType.simpleString()} in {first.path}; the files of one dataset "
                    f"must agree. Rewrite the odd file, or drop or cast the column."
                )
    hive = hive_columns(files, listing_root(loc), spark_schema.names, display=loc.display)
    if hive:
        from pyspark.sql import types as T

        spark_schema = T.StructType(
            spark_schema.fields
            + [T.StructField(f.name, _spark_type_for(f.name, f.type), True) for f in hive.fields]
        )
    if not spark_schema.fields:
        raise SchemaError(
            f"{loc.url}: the Parquet files have no columns ({first.path} and the rest), so "
            f"their records would be empty. Rewrite them with at least one column."
        )
    target = spark_arrow_schema(spark_schema)
    specs = column_specs(target, flatten_structs=flatten_structs)
    groups = [g for info in infos for g in info.row_groups]
    plan = _plan(groups, num_files, _parallelism(spark))
    out = StagedOutput.prepare(path, filesystem=filesystem, mode=mode, sources=[os.fspath(src)])
    try:
        stats = []
        if plan:
            task = _ParquetWriteTask(
                loc.filesystem, files, [i.batch_rows for i in infos], plan, target,
                out.filesystem, out.staging, specs, comp, hive,
            )
            sc = _spark_context(spark)
            with job_progress(spark, progress):
                try:
                    if sc is not None:  # a plain RDD job starts ~40 ms faster than a SQL one
                        stats = sc.parallelize(range(len(plan)), len(plan)).mapPartitions(
                            task.rdd_partition).collect()
                    else:  # Spark Connect: no RDDs
                        ids = spark.range(0, len(plan), 1, numPartitions=len(plan))
                        stats = ids.mapInArrow(task, STATS_SCHEMA).collect()
                except Exception as exc:
                    ours = task_error(exc)
                    if ours is None:
                        raise
                    raise ours from exc
        return out.commit(
            stats, specs=specs, compression=comp,
            spark_schema=None if flatten_structs else spark_schema.jsonValue(),
        )
    except BaseException:
        out.abort()
        raise
