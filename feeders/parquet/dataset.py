"""``parquet_dataset``: the Parquet pull reader's arguments checked and its ``tf.data`` pipeline
built (the generator source, then ``rebatch`` or a graph ``map`` to ragged tensors, then a
fixed prefetch)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from feeders.elements import assemble, check_representable, flat_signature, signature, validate_reader_args
from feeders.generator import generator_dataset
from feeders.parquet.plan import check_nulls, chunk_rows_for, plan_parquet
from feeders.parquet.stream import ChunkStream
from formats.errors import SchemaError
from formats.schema import column_specs

__all__ = ["parquet_dataset"]

_DEFAULT_PREFETCH = 8


def parquet_dataset(
    path_or_url: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
    batch_size: int = 1024,
    label: str | None = None,
    shard: Any = None,
    filesystem: Any = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    fill_values: Mapping[str, Any] | None = None,
    prefetch: int | None = None,
):
    """A ``tf.data.Dataset`` of batches read from Parquet files with pyarrow.

    Args:
        path_or_url: a Parquet file, a directory of them, or a glob pattern
            (``data/day=*/part-*.parquet``): local path, ``file://``, ``s3://`` (endpoint and
            keys from the AWS variables, or ``filesystem=``) or ``hdfs://``.
            Files whose names start with ``_`` or ``.`` are skipped. Hive-style ``key=value``
            directories (``df.write.partitionBy("day")``) become columns after the files' own:
            ``int64`` when every value is an integer, ``float64`` when every value is a number,
            otherwise ``string``.
        columns: columns to read, in this order (default: all but the ``__index_level_0__``
            column pandas writes for the index of a filtered DataFrame). Only these are decoded.
        batch_size: rows per batch; every batch has exactly this many rows except the last.
        label: a column to yield apart: batches become ``(features, label)``.
        shard: ``None``, ``(index, count)`` or a node ``ctx``: read shard ``index`` of
            ``count``: rows ``[index * N // count, (index + 1) * N // count)`` of the ``N``
            rows in file order, so shards differ by one row at most (and yield the same batch
            count unless that row starts a batch). A row group at a shard boundary is decoded
            by both shards, each keeping its part; the rest is read by one shard only.
        filesystem: a ``pyarrow.fs`` (or fsspec) filesystem to read with instead of the one the
            URL implies.
        shapes: declared per-row shapes for list columns (dense instead of ragged).
        fill_values: per-column value for nulls (default: a null is a ``SchemaError``). In a
            list column it fills null elements, and a null list becomes an empty list (ragged)
            or a list of the declared shape holding the value.
        prefetch: batches to prefetch (default 8; ``tf.data.AUTOTUNE`` turns tf.data's
            autotuning back on for this dataset).

    Returns:
        A ``tf.data.Dataset`` of ``dict[str, tf.Tensor | tf.RaggedTensor]`` (or
        ``(features, label)``). Each iteration reads the shard once, in file order.

    Raises:
        StorageError: the path does not exist or cannot be read (names the URL and the fix).
        SchemaError: a missing column, a type TF cannot hold, schemas that differ between
            files, or a null (counted in the footers' statistics) in a column without a fill
            value.

    What only reading the rows can show (a null in a file written without statistics, a row
    of another length than ``shapes=`` declares, a damaged page) stops the iteration with
    a ``tf.errors.OpError`` (``InvalidArgumentError`` for a ``SchemaError``), since TensorFlow
    carries a Python error out of a dataset only as its own; the message starts with
    ``SchemaError: reading <file>: ...`` (or ``StorageError: ...``), naming the file and the fix.
    """
    import tensorflow as tf

    validate_reader_args(batch_size, label, columns)
    plan = plan_parquet(path_or_url, columns=columns, shard=shard, filesystem=filesystem)
    wanted = list(columns) if columns is not None else list(plan.columns)
    if label is not None and label not in wanted:
        wanted.append(label)
    if not wanted:
        raise SchemaError(
            f"{plan.location.url}: the Parquet files have no columns "
            f"({plan.location.display(plan.files[0])} and the rest), so there is nothing to read. "
            f"Rewrite them with at least one column (a DataFrame with no columns writes such files)."
        )
    if prefetch is not None and (
        isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < tf.data.AUTOTUNE
    ):
        raise ValueError(
            f"prefetch must be an int >= 0 or tf.data.AUTOTUNE (-1), got {prefetch!r}."
        )
    try:
        specs = column_specs(plan.schema, columns=wanted, shapes=shapes, fill_values=fill_values)
    except SchemaError as exc:
        raise SchemaError(f"{plan.location.url}: {exc}") from exc
    check_representable(specs)
    check_nulls(plan.location, plan.files, plan.metadata, specs, plan.hive)
    dense = not any(s.is_ragged for s in specs)
    chunk = chunk_rows_for(plan.metadata, wanted, int(batch_size)) if dense else int(batch_size)
    stream = ChunkStream(plan.location, plan.units, specs, plan.schema, chunk, label, plan.hive, plan.window,
                         dict(zip(plan.files, plan.row_counts)))
    if dense:
        sig = signature(plan.schema, wanted, label, shapes)
        ds = generator_dataset(stream, sig)
        ds = ds.rebatch(int(batch_size))
    else:
        ds = generator_dataset(stream, flat_signature(specs))
        ds = ds.map(lambda *flat: assemble(flat, specs, label))
    opts = tf.data.Options()
    if shard is not None:
        # Sharded here by rows; a distribution strategy must not shard again.
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    depth = _DEFAULT_PREFETCH if prefetch is None else int(prefetch)
    opts.autotune.enabled = depth == tf.data.AUTOTUNE
    return ds.with_options(opts).prefetch(depth)
