"""``tfrecord_dataset``: the TFRecord pull reader's arguments checked and its ``tf.data``
pipeline built (the generator source, a parallel graph ``map`` that parses or takes the decoded
chunk, ``rebatch`` when dense, then a fixed prefetch)."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

from feeders.elements import validate_reader_args
from feeders.generator import generator_dataset
from feeders.shard import normalize_shard
from feeders.tfrecord.plan import agreed_files, check_records, plan_tfrecord, select_columns, shard_files
from feeders.tfrecord.stream import RecordBatches, layout_holds
from formats.example_layout import VALUE_DTYPES, layout_columns
from formats.features import ragged_dims, row_lengths_key
from formats.schema import ColumnSpec, declare_shapes
from formats.tfrecord import normalize_compression

__all__ = ["tfrecord_dataset"]

_PREFETCH = 8  # parsed batches kept ready


def _length_checks(written: Sequence[ColumnSpec], read: Sequence[ColumnSpec]) -> dict[str, list[tuple[int, int]]]:
    """For each column written ragged and nested but read with a declared dense shape:
    ``(dim, length)`` pairs that the lists' recorded lengths (``<name>/row_lengths_<dim>``)
    must all equal. The dense parse checks only a row's total value count, so without this
    ``[[1, 2, 3], [4]]`` read under shape (2, 2) as ``[[1, 2], [3, 4]]``."""
    out: dict[str, list[tuple[int, int]]] = {}
    before = {s.name: s for s in written}
    for spec in read:
        old = before.get(spec.name)
        if old is None or not old.is_ragged or spec.is_ragged or len(spec.shape) < 2:
            continue
        pairs = []
        for d in ragged_dims(old.shape):
            if d < len(spec.shape):
                last = d == min(len(old.shape), len(spec.shape)) - 1
                pairs.append((d, math.prod(spec.shape[d:]) if last else int(spec.shape[d])))  # type: ignore[arg-type]
        if pairs:
            out[spec.name] = pairs
    return out


def _parser(specs: Sequence[ColumnSpec], label: str | None,
            checks: dict[str, list[tuple[int, int]]] | None = None):
    """Graph functions for the chunks: ``parse(serialized)`` and ``parse_or_take(serialized,
    decoded)``, each giving a dict of tensors (or ``(features, label)``) in the columns' dtypes.

    ``parse_or_take`` takes chunks from the layout decoder: ``decoded`` holds the values when
    the chunk's records were decoded in Python, else ``serialized`` holds the records and they
    are parsed here (exactly one of the two is non-empty).
    """
    import tensorflow as tf

    from formats.example import parse_features

    features = parse_features(specs)
    checks = checks or {}
    shapes = {s.name: s.shape for s in specs}
    for name, pairs in checks.items():
        for d, _ in pairs:
            key = row_lengths_key(name, d)
            features[key] = tf.io.RaggedFeature(tf.int64, value_key=key, row_splits_dtype=tf.int64)
    targets = {s.name: tf.string if s.dtype == "string" else tf.as_dtype(s.dtype) for s in specs}

    def finish(parsed):
        out = {}
        for s in specs:
            t = parsed[s.name]
            if t.dtype != targets[s.name]:
                t = tf.cast(t, targets[s.name])
            asserts = [
                tf.debugging.assert_equal(
                    parsed[row_lengths_key(s.name, d)].flat_values, tf.constant(want, tf.int64),
                    # (the name unquoted: TF escapes quotes in an Assert message)
                    message=(f"SchemaError: column {s.name} is read as dense shape "
                             f"{shapes[s.name]}, but a record holds a list of another length at "
                             f"nesting level {d + 1} (expected {want}); declare the column "
                             f"ragged (leave it out of shapes=) or fix the data"),
                )
                for d, want in checks.get(s.name, ())
            ]
            if asserts:
                with tf.control_dependencies(asserts):
                    t = tf.identity(t)
            out[s.name] = t
        if label is None:
            return out
        y = out.pop(label)
        return out, y

    def parse(serialized):
        return finish(tf.io.parse_example(serialized, features))

    def parse_or_take(serialized, decoded):
        return finish(
            tf.cond(
                tf.size(serialized) > 0,
                lambda: tf.io.parse_example(serialized, features),
                lambda: decoded,
            )
        )

    return parse, parse_or_take


def _parse_calls() -> int:
    """Chunks parsed at once: one per core, at least 2 (so reading overlaps parsing), at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


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
    shapes: Mapping[str, Sequence[int]] | None = None,
):
    """A ``tf.data.Dataset`` of batches parsed from ``tf.train.Example`` TFRecord files.

    Args:
        path_or_url: a TFRecord file, a directory of them or a glob pattern
            (``data/part-*``), local, ``file://``, ``s3://`` or ``hdfs://``. Names starting with ``_`` or ``.``, and ``.json``/``.crc`` files,
            are skipped.
        schema: the columns: a ``pyarrow.Schema``, a list of ``formats.ColumnSpec`` or a
            ``TFRecordSchema``. Default: the ``_tf_schema.json`` beside the data, else
            inferred from the first ``sample`` records.
        batch_size: records per batch (the last batch may be short).
        label: a column to yield apart: batches become ``(features, label)``.
        shard: ``None``, ``(index, count)`` or a node ``ctx``: shard ``index`` of ``count``,
            a contiguous run of files holding about ``1/count`` of the bytes (a warning says
            when shards differ much); with fewer files than shards, every ``count``-th record
            instead (every shard then reads every file).
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None``. ``None`` means: what the schema file
            says, else by file suffix (``.gz``, ``.zlib``), else uncompressed.
        columns: columns to yield, in this order (default: all).
        fill_values: per-column value for records where the feature is absent (a null when
            written); by default an absent dense feature is a parse error.
        filesystem: a ``pyarrow.fs`` filesystem to read with instead of the URL's.
        sample: records to look at when inferring the schema.
        shapes: declared per-row shapes for list features (dense instead of ragged), e.g.
            ``{"image": [28, 28]}`` for records holding 784 floats each. An inferred schema
            reads every list feature ragged (a sample cannot prove a length); files from
            ``formats.write_tfrecords`` say which are dense.

    Returns:
        A ``tf.data.Dataset`` of ``dict[str, tf.Tensor | tf.RaggedTensor]`` or
        ``(features, label)``, typed as the schema's columns.

    Raises:
        StorageError: the path does not exist or cannot be read.
        SchemaError: a missing column, or no schema and nothing to infer one from.
        RecordError: a sampled record is corrupt or truncated.

    A corrupt record, or a value that does not fit the schema, met while iterating stops the
    iteration with ``tf.errors.InvalidArgumentError`` (TensorFlow carries a Python error out of a
    dataset only as its own), whose message starts with ``RecordError: <file>: ...`` or
    ``SchemaError: ...``.
    """
    import tensorflow as tf

    validate_reader_args(batch_size, label, columns)
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise ValueError(f"sample must be an int >= 1 (records to infer the schema from), got {sample!r}.")
    shard_t = normalize_shard(shard)
    normalize_compression(compression)
    plan = plan_tfrecord(
        path_or_url, schema=schema, compression=compression, filesystem=filesystem, sample=sample
    )
    sizes = None
    if shard_t is not None:
        plan, sizes = agreed_files(plan, shard)
    chosen = select_columns(plan.specs, columns, label, fill_values, plan.location.url)
    specs = declare_shapes(chosen, shapes)
    check_records(plan.location, plan.files, plan.compression, specs)
    checks = _length_checks(chosen, specs)
    parse, parse_or_take = _parser(specs, label, checks)
    files, record_shard = plan.files, None
    if shard_t is not None:
        if len(files) >= shard_t[1]:
            files = shard_files(plan.location, files, shard_t, sizes)
        else:
            record_shard = shard_t
    dense = not any(s.is_ragged for s in specs)
    layout = layout_columns(specs) if dense and not checks else None
    if layout is not None and files and not layout_holds(
        plan.location, files[0], plan.compression, layout
    ):
        layout = None
    stream = RecordBatches(
        plan.location, files, plan.compression, int(batch_size), record_shard, chunked=dense,
        layout=layout,
    )
    if layout is None:
        chunks = generator_dataset(stream, tf.TensorSpec((None,), tf.string))
        ds = chunks.map(parse, num_parallel_calls=_parse_calls())
    else:
        decoded = {
            name: tf.TensorSpec((None, *shape), tf.as_dtype(VALUE_DTYPES[kind]))
            for name, (kind, shape) in layout.items()
        }
        chunks = generator_dataset(stream, (tf.TensorSpec((None,), tf.string), decoded))
        ds = chunks.map(parse_or_take, num_parallel_calls=_parse_calls())
    if dense:  # rebatch of ragged tensors is slow; those chunks are exact batches already
        ds = ds.rebatch(int(batch_size))
    opts = tf.data.Options()
    # Fixed parallelism and prefetch instead of autotuning: with it on, epochs took either
    # 0.32 s or 0.64 s at random (200k narrow rows, 2 cores); off, 0.31-0.34 s every time.
    opts.autotune.enabled = False
    if shard_t is not None:
        # Already sharded here; a distribution strategy must not shard again.
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(opts).prefetch(_PREFETCH)
