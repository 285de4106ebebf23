"""The TFRecord pull reader: ``tf.train.Example`` files to batches of tensors.

Local files take the canonical tf.data pipeline: list the files, shard them, read them with a
parallel interleave of ``TFRecordDataset``, batch the serialized records, ``tf.io.parse_example``
a whole batch at once (features from :func:`formats.example.parse_features`), cast to the
columns' own dtypes, prefetch; every stage AUTOTUNEd. TensorFlow 2.21 reads neither ``s3://``
nor ``hdfs://``, so remote files are streamed through ``pyarrow.fs``, framed (and CRC-checked)
by :func:`formats.tfrecord.iter_records`, and then batched and parsed the same way.

The column layout comes from, in order: ``schema=``; the schema file the export job writes
beside the data (``_tf_schema.json``, :mod:`formats.schemafile`); or inference from the first
records (:func:`formats.example.infer_specs`; lists are then ragged and dtypes are the Example
kinds, so pass a schema for exact types and fixed shapes).

Errors: a corrupt or truncated record met while sampling, or anywhere on the streamed (remote)
path, is a :class:`~dataplane.errors.RecordError` naming the file and byte offset. On the local
path the check is TensorFlow's own and surfaces as ``tf.errors.DataLossError`` ("corrupted
record at <offset>"), which does not name the file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from dataplane.errors import SchemaError, StorageError
from feeders.fs import Location, list_files, resolve, storage_error
from feeders.elements import validate_reader_args
from feeders.generator import generator_dataset
from feeders.shard import normalize_shard, take_shard
from formats.schema import ColumnSpec, column_specs
from formats.schemafile import SCHEMA_FILE_NAME, TFRecordSchema, find_schema_file
from formats.tfrecord import iter_records, normalize_compression, open_compressed

__all__ = ["tfrecord_dataset", "TFRecordPlan", "plan_tfrecord", "sample_records"]

logger = logging.getLogger(__name__)

_NOT_DATA = (".json", ".crc", ".parquet", ".txt", ".md")
_SUFFIX_COMPRESSION = {".gz": "GZIP", ".gzip": "GZIP", ".zlib": "ZLIB"}


@dataclasses.dataclass
class TFRecordPlan:
    """What a TFRecord reader will read.

    Attributes:
        location: the resolved path/URL.
        files: every data file, sorted (paths on ``location.filesystem``).
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None``.
        specs: the columns, in output order.
        schema_source: ``"argument"``, ``"schema file"`` or ``"inferred"``.
        schema_file: the schema file's contents when there is one.
    """

    location: Location
    files: list[str]
    compression: str | None
    specs: list[ColumnSpec]
    schema_source: str
    schema_file: TFRecordSchema | None = None


def _detect_compression(loc: Location, files: Sequence[str], from_file: str | None) -> str | None:
    kinds = {next((c for s, c in _SUFFIX_COMPRESSION.items() if f.endswith(s)), None) for f in files}
    if len(kinds) > 1:
        raise StorageError(
            f"{loc.url} mixes compressed and uncompressed TFRecord files (by suffix); pass "
            f"compression= or keep one kind of file per directory."
        )
    by_suffix = kinds.pop()
    return normalize_compression(from_file) if from_file is not None and by_suffix is None else by_suffix


def _open_records(loc: Location, path: str, compression: str | None) -> Iterator[bytes]:
    where = loc.display(path)
    try:
        # compression=None: pyarrow would otherwise un-gzip ".gz" files itself, by suffix.
        raw = loc.filesystem.open_input_stream(path, compression=None, buffer_size=1 << 20)
    except OSError as exc:
        raise storage_error(exc, "open", where) from exc
    with raw:
        stream = open_compressed(raw, compression)
        try:
            yield from iter_records(stream, name=where)
        finally:
            if stream is not raw:
                stream.close()


def sample_records(loc: Location, files: Sequence[str], compression: str | None, n: int) -> list[bytes]:
    """The first ``n`` records across ``files`` in order (CRC-checked)."""
    out: list[bytes] = []
    for path in files:
        for rec in _open_records(loc, path, compression):
            out.append(rec)
            if len(out) >= n:
                return out
    return out


def _schema_file_near(loc: Location, files: Sequence[str]) -> TFRecordSchema | None:
    from pyarrow import fs

    info = loc.filesystem.get_file_info(loc.path)
    directory = loc.path if info.type == fs.FileType.Directory else os.path.dirname(files[0])
    try:
        return find_schema_file(directory, filesystem=loc.filesystem)
    except OSError as exc:
        raise storage_error(exc, f"read {SCHEMA_FILE_NAME} for", loc.url) from exc


def _specs_from(schema: Any, where: str) -> list[ColumnSpec]:
    if isinstance(schema, pa.Schema):
        return column_specs(schema)
    if isinstance(schema, TFRecordSchema):
        return list(schema.specs)
    if isinstance(schema, Sequence) and schema and all(isinstance(s, ColumnSpec) for s in schema):
        return list(schema)
    raise ValueError(
        f"schema for {where} must be a pyarrow.Schema, a list of formats.ColumnSpec or a "
        f"formats.schemafile.TFRecordSchema; got {type(schema).__name__}."
    )


def plan_tfrecord(
    path_or_url: str | os.PathLike,
    *,
    schema: Any = None,
    compression: str | None = None,
    filesystem: Any = None,
    sample: int = 1000,
) -> TFRecordPlan:
    """List the files and settle compression and the column specs (see the module doc).

    Raises:
        StorageError: the path does not exist or cannot be read.
        SchemaError: no schema given or found and no records to infer one from.
        RecordError: a sampled record is corrupt or truncated.
    """
    loc = resolve(path_or_url, filesystem=filesystem)
    files = list_files(loc, accept=lambda p: not p.endswith(_NOT_DATA))
    found = _schema_file_near(loc, files) if schema is None or compression is None else None
    comp = (
        normalize_compression(compression)
        if compression is not None
        else _detect_compression(loc, files, found.compression if found else None)
    )
    if schema is not None:
        return TFRecordPlan(loc, files, comp, _specs_from(schema, loc.url), "argument", found)
    if found is not None:
        return TFRecordPlan(loc, files, comp, list(found.specs), "schema file", found)
    from formats.example import infer_specs

    records = sample_records(loc, files, comp, sample)
    if not records:
        shown = ", ".join(loc.display(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
        raise SchemaError(
            f"{loc.url}: no records to infer a schema from: every file is empty ({shown}) and "
            f"there is no {SCHEMA_FILE_NAME}. Pass schema= or point at non-empty TFRecord files."
        )
    specs = infer_specs(records, name=loc.url)
    return TFRecordPlan(loc, files, comp, specs, "inferred", None)


def _select(
    specs: Sequence[ColumnSpec],
    columns: Sequence[str] | None,
    label: str | None,
    fill_values: Mapping[str, Any] | None,
    where: str,
) -> list[ColumnSpec]:
    by_name = {s.name: s for s in specs}
    wanted = list(columns) if columns is not None else [s.name for s in specs]
    if label is not None and label not in wanted:
        wanted.append(label)
    for name in list(wanted) + list(fill_values or {}):
        if name not in by_name:
            raise SchemaError(
                f"{where}: column {name!r} is not in the records; the columns are "
                f"{sorted(by_name)}."
            )
    fills = dict(fill_values or {})
    return [
        dataclasses.replace(by_name[n], fill=fills[n]) if n in fills else by_name[n] for n in wanted
    ]


def _parser(specs: Sequence[ColumnSpec], label: str | None):
    """A graph function: a batch of serialized Examples -> dict of tensors (or features, label)."""
    import tensorflow as tf

    from formats.example import parse_features

    features = parse_features(specs)
    targets = {s.name: tf.string if s.dtype == "string" else tf.as_dtype(s.dtype) for s in specs}

    def parse(serialized):
        parsed = tf.io.parse_example(serialized, features)
        out = {}
        for s in specs:
            t = parsed[s.name]
            if t.dtype != targets[s.name]:
                t = tf.cast(t, targets[s.name])
            out[s.name] = t
        if label is None:
            return out
        y = out.pop(label)
        return out, y

    return parse


class _RecordBatches:
    """Streams records of remote files through ``pyarrow.fs`` in batches (picklable)."""

    def __init__(
        self,
        loc: Location,
        files: list[str],
        compression: str | None,
        batch_size: int,
        record_shard: tuple[int, int] | None,
    ) -> None:
        self.loc = loc
        self.files = files
        self.compression = compression
        self.batch_size = batch_size
        self.record_shard = record_shard

    def __call__(self) -> Iterator[np.ndarray]:
        batch: list[bytes] = []
        i = 0
        index, count = self.record_shard or (0, 1)
        for path in self.files:
            for rec in _open_records(self.loc, path, self.compression):
                keep = i % count == index
                i += 1
                if not keep:
                    continue
                batch.append(rec)
                if len(batch) == self.batch_size:
                    yield np.array(batch, dtype=object)
                    batch = []
        if batch:
            yield np.array(batch, dtype=object)


def tfrecord_dataset(
    path_or_url: str | os.PathLike,
    *,
    schema: Any = None,
    batch_size: int = 1024,
    label: str | None = None,
    shard: Any = None,
    compression: str | None = None,
    columns: Sequence[str] | None = None,
    fill_values: Mapping[str, Any] | None = None,
    filesystem: Any = None,
    sample: int = 1000,
    num_parallel_reads: int | None = None,
):
    """A ``tf.data.Dataset`` of batches parsed from ``tf.train.Example`` TFRecord files.

    Args:
        path_or_url: a TFRecord file or a directory of them (local, ``file://``, ``s3://``,
            ``hdfs://``). Names starting with ``_`` or ``.``, and ``.json``/``.crc`` files,
            are skipped.
        schema: the columns: a ``pyarrow.Schema``, a list of ``formats.ColumnSpec`` or a
            ``TFRecordSchema``. Default: the ``_tf_schema.json`` beside the data, else
            inferred from the first ``sample`` records.
        batch_size: records per batch (the last batch may be short).
        label: a column to yield apart: batches become ``(features, label)``.
        shard: ``None``, ``(index, count)`` or a node ``ctx``: every ``count``-th file from
            ``index``; with fewer files than shards, every ``count``-th record instead.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None``. ``None`` means: what the schema file
            says, else by file suffix (``.gz``, ``.zlib``), else uncompressed.
        columns: columns to yield, in this order (default: all).
        fill_values: per-column value for records where the feature is absent (a null when
            written); by default an absent dense feature is a parse error.
        filesystem: a ``pyarrow.fs`` filesystem to read with instead of the URL's.
        sample: records to look at when inferring the schema.
        num_parallel_reads: files read at once (default ``tf.data.AUTOTUNE``).

    Returns:
        A ``tf.data.Dataset`` of ``dict[str, tf.Tensor | tf.RaggedTensor]`` or
        ``(features, label)``, typed as the schema's columns.

    Raises:
        StorageError: the path does not exist or cannot be read.
        SchemaError: a missing column, or no schema and nothing to infer one from.
        RecordError: a sampled record is corrupt or truncated.
    """
    import tensorflow as tf

    validate_reader_args(batch_size, label, columns)
    shard_t = normalize_shard(shard)
    normalize_compression(compression)
    plan = plan_tfrecord(
        path_or_url, schema=schema, compression=compression, filesystem=filesystem, sample=sample
    )
    specs = _select(plan.specs, columns, label, fill_values, plan.location.url)
    parse = _parser(specs, label)
    files, record_shard = plan.files, None
    if shard_t is not None:
        if len(files) >= shard_t[1]:
            files = take_shard(files, shard_t)
        else:
            record_shard = shard_t
    autotune = tf.data.AUTOTUNE
    if plan.location.scheme == "file":
        names = tf.data.Dataset.from_tensor_slices(files)
        records = names.interleave(
            lambda f: tf.data.TFRecordDataset(f, compression_type=plan.compression or ""),
            cycle_length=min(len(files), 8) if num_parallel_reads is None else num_parallel_reads,
            num_parallel_calls=autotune if num_parallel_reads is None else num_parallel_reads,
            deterministic=True,
        )
        if record_shard is not None:
            records = records.shard(record_shard[1], record_shard[0])
        batches = records.batch(int(batch_size))
    else:
        stream = _RecordBatches(plan.location, files, plan.compression, int(batch_size), record_shard)
        batches = generator_dataset(stream, tf.TensorSpec((None,), tf.string))
    ds = batches.map(parse, num_parallel_calls=autotune)
    if shard_t is not None:
        opts = tf.data.Options()
        # Already sharded here; a distribution strategy must not shard again.
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(opts)
    return ds.prefetch(autotune)
