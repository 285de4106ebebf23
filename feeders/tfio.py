"""Adapter: read Parquet with tensorflow-io's ``IODataset.from_parquet`` (compat stack).

tensorflow-io 0.37.1 is the last release, built for TensorFlow 2.16; its ops fail to load on
TensorFlow >= 2.18, so on any other stack :func:`tfio_parquet_dataset` raises
:class:`~dataplane.errors.StackError` naming the compat stack.

tensorflow-io reads one row at a time per file; this adapter concatenates the files, batches,
and types the columns with :mod:`formats.schema` so the tensors match
:func:`feeders.parquet_dataset`'s. Its Parquet reader only handles flat primitive columns, so
list columns (fixed or variable length) and timestamps/dates are refused up front with a
:class:`SchemaError` naming them. Only local paths: through its own S3 plugin, tensorflow-io's
Parquet reader aborts the process (seen against a real S3 server), so remote URLs are refused
with a :class:`StorageError` before anything is read.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import pyarrow as pa

from formats.errors import SchemaError, StackError, StorageError
from feeders.elements import validate_reader_args
from feeders.parquet import plan_parquet
from feeders.parquet.plan import check_nulls
from formats.schema import ColumnSpec, column_specs

__all__ = ["tfio_parquet_dataset", "require_tfio", "tfio_unsupported"]

COMPAT_HINT = (
    "it needs the compat stack (TensorFlow 2.16 with tensorflow-io 0.37.1): run "
    "`bash .ci/setup compat` and use .venvs/compat/bin/python, or pip install "
    "'spark-tf-dataplane[tfio]' into an environment with tensorflow 2.16"
)


def require_tfio() -> Any:
    """Import and return ``tensorflow_io``, or raise StackError naming the compat stack."""
    import tensorflow as tf

    major, minor = (int(x) for x in tf.__version__.split(".")[:2])
    if (major, minor) >= (2, 18):
        raise StackError(
            f"feeders.tfio_parquet_dataset cannot run on TensorFlow {tf.__version__} "
            f"(tensorflow-io 0.37.1's ops do not load on TF >= 2.18): {COMPAT_HINT}."
        )
    try:
        import tensorflow_io
    except ImportError as exc:
        raise StackError(
            f"feeders.tfio_parquet_dataset: tensorflow-io is not installed; {COMPAT_HINT}."
        ) from exc
    return tensorflow_io


def tfio_unsupported(
    schema: pa.Schema, specs: Sequence[ColumnSpec], partition_columns: Sequence[str] = ()
) -> dict[str, str]:
    """``{column: why tensorflow-io cannot carry it}`` (empty when all can)."""
    out = {}
    for s in specs:
        t = schema.field(s.name).type
        if s.name in partition_columns:
            out[s.name] = (
                "a partition column (its values are in key=value directory names), which "
                "tensorflow-io's Parquet reader does not read"
            )
        elif s.shape:
            out[s.name] = f"tensorflow-io's Parquet reader only reads flat columns, not {t}"
        elif pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_dictionary(t):
            out[s.name] = f"tensorflow-io's Parquet reader has no mapping for {t}"
    return out


def _files_and_window(plan: Any) -> tuple[list[str], int, int | None]:
    """The whole files a tensorflow-io shard reads, the rows to skip at their start and the
    rows to take (None: all): the plan's row window, moved from its first row group to the
    start of that group's file. A shard without rows reads the first file and takes none
    (the dataset keeps its element structure)."""
    if plan.window is None:
        return list(plan.files), 0, None
    skip, take = plan.window
    files = list(dict.fromkeys(path for path, _ in plan.units))
    if not files:
        return [plan.files[0]], 0, 0
    first, groups = plan.units[0]
    if groups:
        meta = plan.metadata[plan.files.index(first)]
        skip += sum(meta.row_group(g).num_rows for g in range(groups[0]))
    return files, skip, take


def tfio_parquet_dataset(
    path: str | os.PathLike,
    *,
    batch_size: int = 1024,
    columns: Sequence[str] | None = None,
    label: str | None = None,
    shard: Any = None,
    **kw: Any,
):
    """A ``tf.data.Dataset`` of batches read by ``tensorflow_io.IODataset.from_parquet``.

    Args:
        path: a local Parquet file or directory.
        batch_size: rows per batch (the last may be short).
        columns: columns to read (default: all); list columns cannot be read (module doc).
        label: a column to yield apart: ``(features, label)``.
        shard: ``None``, ``(index, count)`` or a node ctx: shard ``i`` of ``n`` reads rows
            ``[i * N // n, (i + 1) * N // n)`` of the ``N`` in file order, as
            :func:`feeders.parquet_dataset` does (tensorflow-io reads whole files, so a
            shard decodes the rows before its window in its first file and drops them).
        **kw: passed to ``IODataset.from_parquet``.

    Raises:
        StackError: tensorflow-io cannot run on this stack (names the compat stack).
        SchemaError: a selected column tensorflow-io cannot carry (names it and why).
    """
    tfio = require_tfio()
    import tensorflow as tf

    validate_reader_args(batch_size, label, columns)
    plan = plan_parquet(path, columns=columns, shard=shard)
    wanted = list(columns) if columns is not None else list(plan.columns)
    if label is not None and label not in wanted:
        wanted.append(label)
    specs = column_specs(plan.schema, columns=wanted)
    bad = tfio_unsupported(plan.schema, specs, plan.hive.names)
    if bad:
        raise SchemaError(
            f"tfio_parquet_dataset({plan.location.url}): "
            + "; ".join(f"column {k!r}: {v}" for k, v in bad.items())
            + ". Leave these out (columns=...) or read with feeders.parquet_dataset, which "
            "carries every type."
        )
    # tensorflow-io skips a null and slides the column's later values up (rows no longer
    # match), or aborts the process on Spark-written files: refused from the footers
    check_nulls(plan.location, plan.files, plan.metadata, specs, plan.hive, reader="tfio_parquet_dataset")
    if plan.location.scheme != "file":
        raise StorageError(
            f"tfio_parquet_dataset({plan.location.url}): only local files are supported. "
            f"tensorflow-io 0.37.1's Parquet reader aborts the whole process (an uncaught "
            f"parquet::ParquetException) when reading through its S3 plugin. Copy the files "
            f"locally or read them with feeders.parquet_dataset."
        )
    files, skip, take = _files_and_window(plan)
    names = [plan.location.display(f) for f in files]
    parts = [tfio.IODataset.from_parquet(n, columns=wanted, **kw) for n in names]
    rows = parts[0]
    for p in parts[1:]:
        rows = rows.concatenate(p)
    if take is not None:
        rows = rows.skip(skip).take(take)
    targets = {s.name: tf.string if s.dtype == "string" else tf.as_dtype(s.dtype) for s in specs}

    def shape(batch):
        out = {}
        for name in wanted:
            t = batch[name]
            out[name] = t if t.dtype == targets[name] else tf.cast(t, targets[name])
        if label is None:
            return out
        y = out.pop(label)
        return out, y

    ds = rows.batch(int(batch_size)).map(shape, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)
