"""Spark jobs between DataFrames and TFRecord files: :func:`write_tfrecords`, :func:`read_tfrecords`.

Writing is one ``DataFrame.mapInArrow`` job (so it also runs under Spark Connect). Each task
encodes its Arrow batches with :func:`formats.example.encode_example_array` (vectorised, no
Python object per row) and frames them into one file per partition, named by partition *and*
task attempt; the driver commits exactly the successful attempts' files and writes the schema
file (:mod:`formats.staging` has the staging and commit steps, shared with
:func:`formats.parquet_to_tfrecords`). A failed job deletes the staging area, and the output
directory too when the job created it, so nothing partial is left behind.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable, Iterator

import pyarrow as pa

from formats.errors import SchemaError, StorageError
from formats.schema import ColumnSpec, column_specs, is_list_type
from formats.schemafile import SCHEMA_FILE_NAME, TFRecordSchema, empty_export, find_schema_file, read_schema_file
from formats.staging import STATS_SCHEMA, ExportResult, StagedOutput, job_progress, task_error, write_partition
from formats.tfrecord import normalize_compression
from formats.sparkframe import (
    RECORDS_PER_BATCH, arrow_batches_by_rows, dense_vectors, map_in_arrow, not_a_spark_frame, records_per_batch,
    sampled_row_bytes, with_conf,
)

__all__ = ["ExportResult", "write_tfrecords", "read_tfrecords", "spark_arrow_schema", "job_progress"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Spark <-> Arrow types


def _to_arrow_type(dt: Any) -> pa.DataType:
    from pyspark.sql.pandas.types import to_arrow_type

    try:
        return to_arrow_type(dt, timezone="UTC")  # pyspark >= 4
    except TypeError:
        return to_arrow_type(dt)  # pyspark 3.5


def spark_arrow_schema(schema: Any) -> pa.Schema:
    """The Arrow schema Spark hands ``mapInArrow`` for a Spark ``StructType``.

    Raises:
        SchemaError: a column has a Spark type with no Arrow form (names the column).
    """
    fields = []
    for f in schema.fields:
        try:
            t = _to_arrow_type(f.dataType)
        except Exception as exc:  # pyspark raises several types for unsupported types
            raise SchemaError(
                f"column {f.name!r} has Spark type {f.dataType.simpleString()}, which has no "
                f"Arrow form ({exc}); cast or drop it before exporting."
            ) from exc
        fields.append(pa.field(f.name, t, nullable=f.nullable))
    return pa.schema(fields)


def _spark_type_for(name: str, t: pa.DataType) -> Any:
    """A Spark type that can hold Arrow type ``t`` (unsigned ints widen, dictionaries decode)."""
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import from_arrow_type

    if pa.types.is_dictionary(t):
        return _spark_type_for(name, t.value_type)
    widen = {pa.uint8(): T.ShortType(), pa.uint16(): T.IntegerType(), pa.uint32(): T.LongType(),
             pa.uint64(): T.LongType(), pa.float16(): T.FloatType()}
    if t in widen:
        return widen[t]
    if pa.types.is_large_string(t):
        return T.StringType()
    if pa.types.is_large_binary(t):
        return T.BinaryType()
    if is_list_type(t):
        return T.ArrayType(_spark_type_for(name, t.value_type), containsNull=False)
    try:
        return from_arrow_type(t, prefer_timestamp_ntz=t.tz is None) if pa.types.is_timestamp(t) else from_arrow_type(t)
    except Exception as exc:
        raise SchemaError(f"column {name!r}: Arrow type {t} has no Spark type ({exc}).") from exc


# ---------------------------------------------------------------------------------------------
# the write job


class _WriteTask:
    """The per-partition writer shipped to executors (picklable; opens its file lazily)."""

    def __init__(self, filesystem: Any, staging: str, specs: list[ColumnSpec], compression: str | None) -> None:
        self.filesystem = filesystem
        self.staging = staging
        self.specs = specs
        self.compression = compression

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield write_partition(
            ((b, None) for b in batches),
            filesystem=self.filesystem,
            staging=self.staging,
            specs=self.specs,
            compression=self.compression,
        )


def _resolve(path: str | os.PathLike, filesystem: Any) -> Any:
    from formats.fs import resolve

    return resolve(path, filesystem=filesystem)


def write_tfrecords(
    df: Any,
    path: str | os.PathLike,
    *,
    compression: str | None = None,
    num_files: int | None = None,
    filesystem: Any = None,
    mode: str = "error",
    flatten_structs: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write a DataFrame as ``tf.train.Example`` TFRecord files plus a schema file.

    For a Parquet dataset on storage, :func:`formats.parquet_to_tfrecords` writes the same
    records without moving the rows through the JVM (much faster for wide array columns).

    Args:
        df: a Spark DataFrame (classic or Spark Connect).
        path: output directory: local path, ``file://``, ``s3://`` or ``hdfs://`` URL.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None`` (default: uncompressed, the fastest to
            read back).
        num_files: repartition into this many tasks, one file each (default: one file per
            existing partition; empty partitions write no file).
        filesystem: a ``pyarrow.fs.FileSystem`` to write with (default: from the URL).
        mode: ``"error"`` (default: refuse a non-empty existing directory, like Spark) or
            ``"overwrite"``.
        flatten_structs: write struct columns as ``"parent.child"`` features (default False:
            a struct column is a SchemaError).
        progress: called with (tasks done, tasks total) while the job runs (classic Spark only).

    Returns:
        An :class:`ExportResult`.

    Raises:
        SchemaError: a column TF cannot hold (named), before any file is written.
        StorageError: the output exists (mode="error") or cannot be written.
    """
    if not (hasattr(df, "mapInArrow") and hasattr(df, "schema")):
        raise TypeError(
            f"write_tfrecords: df must be a Spark DataFrame, got {not_a_spark_frame(df)}; for a "
            f"Parquet dataset on storage use formats.parquet_to_tfrecords(spark, src, path)."
        )
    comp = normalize_compression(compression)
    if num_files is not None and (
        not isinstance(num_files, int) or isinstance(num_files, bool) or num_files < 1
    ):
        raise ValueError(f"num_files must be a positive int or None, got {num_files!r}.")
    if mode not in ("error", "overwrite"):
        raise ValueError(f"mode must be 'error' or 'overwrite', got {mode!r}.")
    if not df.columns:
        raise SchemaError(
            "write_tfrecords: the DataFrame has no columns, so its records would be empty. "
            "Select the columns to write (df.select('features', 'label'))."
        )
    df = dense_vectors(df)  # Spark ML vectors (VectorAssembler's) as float64 arrays
    arrow_schema = spark_arrow_schema(df.schema)
    specs = column_specs(arrow_schema, flatten_structs=flatten_structs)
    out = StagedOutput.prepare(path, filesystem=filesystem, mode=mode, sources=_input_files(df))
    task = _WriteTask(out.filesystem, out.staging, specs, comp)
    try:
        batch_rows = _batch_rows(df, arrow_schema)
        data = df.repartition(num_files) if num_files else df
        with job_progress(df.sparkSession, progress):
            try:
                stats = with_conf(df.sparkSession, RECORDS_PER_BATCH, batch_rows,
                                  map_in_arrow(data, task, STATS_SCHEMA).collect)
            except Exception as exc:
                ours = task_error(exc)
                if ours is None:
                    raise
                raise ours from exc
        return out.commit(
            stats, specs=specs, compression=comp,
            spark_schema=None if flatten_structs else df.schema.jsonValue(),
        )
    except BaseException:
        out.abort()
        raise


def _batch_rows(df: Any, schema: pa.Schema) -> int | None:
    """Rows an Arrow batch of the export job may hold where Spark cuts batches by rows alone
    (Spark 3.5: 10,000 images of 100 KB made 1 GB batches, and the job waited for ever), from
    a sample of the binary, string and array columns' sizes; None: the session's setting."""
    spark = df.sparkSession
    if not arrow_batches_by_rows(spark):
        return None
    return records_per_batch(spark, sampled_row_bytes(df, schema))


def _input_files(df: Any) -> list[str]:
    """The files a DataFrame reads (``df.inputFiles()``; none for one built in memory)."""
    try:
        return list(df.inputFiles())
    except Exception:  # noqa: BLE001 - a plan Spark cannot list files for
        return []


# ---------------------------------------------------------------------------------------------
# the read job


def _compression_of(name: str, declared: str | None) -> str | None:
    if declared is not None:
        return declared
    if name.endswith(".gz"):
        return "GZIP"
    if name.endswith(".zlib"):
        return "ZLIB"
    return None


class _ReadTask:
    """Decodes the files whose indices arrive in its input batches (picklable)."""

    def __init__(self, filesystem: Any, files: list[str], comps: list[str | None], specs: list[ColumnSpec],
                 target: pa.Schema, batch_size: int, unknown: str | None = None) -> None:
        self.unknown = unknown  # see decode_examples: set when the specs were inferred
        self.filesystem = filesystem
        self.files = files
        self.comps = comps
        self.specs = specs
        self.target = target
        self.batch_size = batch_size

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from formats.sparktask import prepare_task
        from formats.example import decode_examples
        from formats.tfrecord import iter_records, open_compressed

        prepare_task()
        for b in batches:
            for idx in b.column(0).to_pylist():
                path = self.files[idx]
                with self.filesystem.open_input_stream(path, compression=None, buffer_size=1 << 20) as raw:
                    stream = open_compressed(raw, self.comps[idx])
                    chunk: list[bytes] = []
                    for rec in iter_records(stream, name=path):
                        chunk.append(rec)
                        if len(chunk) >= self.batch_size:
                            yield self._decode(decode_examples, chunk, path)
                            chunk = []
                    if chunk:
                        yield self._decode(decode_examples, chunk, path)

    def _decode(self, decode: Any, chunk: list[bytes], path: str) -> pa.RecordBatch:
        table = decode(chunk, self.specs, name=path, unknown=self.unknown)
        cols = [table.column(i).cast(f.type) for i, f in enumerate(self.target)]
        return pa.Table.from_arrays(cols, schema=self.target).combine_chunks().to_batches()[0]


def _sample_records(fs: Any, files: list[str], comps: list[str | None], n: int) -> list[bytes]:
    from formats.tfrecord import iter_records, open_compressed

    out: list[bytes] = []
    for path, comp in zip(files, comps):
        with fs.open_input_stream(path, compression=None, buffer_size=1 << 20) as raw:
            for rec in iter_records(open_compressed(raw, comp), name=path):
                out.append(rec)
                if len(out) >= n:
                    return out
    return out


def read_tfrecords(
    spark: Any,
    path: str | os.PathLike,
    *,
    schema: Any = None,
    filesystem: Any = None,
    compression: str | None = None,
    sample: int = 1000,
    batch_size: int = 4096,
) -> Any:
    """Read ``tf.train.Example`` TFRecord files into a DataFrame with the right Spark types.

    Args:
        spark: the SparkSession (classic or Connect).
        path: a TFRecord file or a directory of them (names starting with ``_``/``.`` skipped).
        schema: ``None`` (default: the schema file beside the data, else inferred from the first
            ``sample`` records, see :mod:`formats.example_decode`), a schema file path, a
            :class:`~formats.schemafile.TFRecordSchema`, a ``pyarrow.Schema`` or a list of
            :class:`ColumnSpec`.
        filesystem: a ``pyarrow.fs.FileSystem`` to read with (default: from the URL).
        compression: ``"GZIP"``/``"ZLIB"``/``None``; default: the schema file's, else by file
            suffix (``.gz``, ``.zlib``).
        sample: records looked at when inferring the schema.
        batch_size: records per Arrow batch handed to Spark.

    Returns:
        A DataFrame, one row per record; absent features are nulls.

    Raises:
        StorageError: the path does not exist or holds no TFRecord file.
        SchemaError: no schema given or found and nothing to infer one from, or one of the
            first records (checked on the driver) does not fit the schema.
        RecordError: one of the first records is corrupt.

    The DataFrame is lazy: a record past the first ones that is corrupt or does not fit fails
    the Spark action that reads it (``count()``, ``write``) as Spark's ``PythonException``,
    whose message ends with the ``RecordError: <file>: ...`` or ``SchemaError: ...`` line
    naming the file and the fix (:func:`formats.staging.task_error` rebuilds that error).
    """
    from pyarrow import fs as pafs
    from pyspark.sql import types as T

    from formats.fs import list_files

    loc = _resolve(path, filesystem)
    fs = loc.filesystem
    found = None
    if schema is None and fs.get_file_info(loc.path).type == pafs.FileType.Directory:
        found = find_schema_file(loc.path, filesystem=fs)
    try:
        files = list_files(loc)
    except StorageError:
        if empty_export(loc.path, filesystem=fs) is None:
            raise
        files = []  # an export of an empty DataFrame: only the schema file
    if isinstance(schema, (str, os.PathLike)):
        found = read_schema_file(schema, filesystem=filesystem)
    elif isinstance(schema, TFRecordSchema):
        found = schema
    declared = normalize_compression(compression) if compression else (found.compression if found else None)
    comps = [_compression_of(f, declared) for f in files]
    spark_schema = None
    unknown = None
    if found is not None:
        specs = list(found.specs)
        if found.spark_schema:
            spark_schema = T.StructType.fromJson(found.spark_schema)
    elif isinstance(schema, pa.Schema):
        specs = column_specs(schema)
    elif schema is not None:
        if isinstance(schema, (str, bytes)) or not isinstance(schema, (list, tuple)) or not all(
            isinstance(s, ColumnSpec) for s in schema
        ):
            raise ValueError(
                f"read_tfrecords: schema must be None, a schema file path, a TFRecordSchema, a "
                f"pyarrow.Schema or a list of formats.ColumnSpec; got {type(schema).__name__}."
            )
        specs = list(schema)
    else:
        specs = _infer(fs, files, comps, sample, loc.url)
        unknown = (
            f"inferred from the first {sample} records; pass a larger sample= (dataplane export "
            f"--sample N) or schema= naming every feature"
        )
    if spark_schema is None:
        spark_schema = T.StructType(
            [T.StructField(s.name, _spark_type_for(s.name, s.arrow_type or _default_arrow(s)), True)
             for s in specs]
        )
    target = spark_arrow_schema(spark_schema)
    specs = [replace(s, arrow_type=target.field(s.name).type) for s in specs]
    if not files:
        return spark.createDataFrame([], spark_schema)
    _check_first_records(fs, files, comps, specs, loc)
    task = _ReadTask(fs, files, comps, specs, target, batch_size, unknown)
    ids = spark.range(0, len(files), 1, numPartitions=len(files))
    return ids.mapInArrow(task, spark_schema)


_CHECK_RECORDS = 256


def _check_first_records(fs: Any, files: list[str], comps: list[str | None], specs: list[ColumnSpec],
                         loc: Any) -> None:
    """Decode the first records with ``specs`` on the driver, so that a schema the records do
    not fit (a feature of another kind, a dense column of another length) or a damaged first
    record fails ``read_tfrecords`` itself, naming the file, rather than the first action on
    the DataFrame it returns. Records further on are checked by the tasks."""
    from formats.example import decode_examples
    from formats.tfrecord import iter_records, open_compressed

    left = _CHECK_RECORDS
    for path, comp in zip(files, comps):
        if left <= 0:
            return
        records: list[bytes] = []
        with fs.open_input_stream(path, compression=None, buffer_size=1 << 20) as raw:
            for rec in iter_records(open_compressed(raw, comp), name=loc.display(path)):
                records.append(rec)
                if len(records) >= left:
                    break
        if records:
            decode_examples(records, specs, name=loc.display(path))
            left -= len(records)


def _default_arrow(spec: ColumnSpec) -> pa.DataType:
    from formats.example_decode import _default_type

    return _default_type(spec)


def _infer(fs: Any, files: list[str], comps: list[str | None], sample: int, url: str) -> list[ColumnSpec]:
    from formats.example import infer_specs

    records = _sample_records(fs, files, comps, sample)
    if not records:
        raise SchemaError(
            f"{url}: no records to infer a schema from and no {SCHEMA_FILE_NAME}; pass schema=."
        )
    return infer_specs(records, name=url)
