"""Adapter: read Parquet with Petastorm's ``make_batch_reader``, yield this project's batches.

Petastorm 0.13.1 only runs on the compat stack (it needs pyarrow < 16); on any other stack
:func:`petastorm_dataset` raises :class:`~dataplane.errors.StackError` naming that stack.

Petastorm does the reading (its reader pool, row-group sharding); the batches it returns (numpy
arrays per column, one row group at a time) are typed with :mod:`formats.schema` and cut into
exactly ``batch_size`` rows, so the tensors match :func:`feeders.parquet_dataset`'s.

What Petastorm cannot carry, and so is refused up front with a :class:`SchemaError`:

* ``fixed_size_list`` columns: its schema inference drops them ("unsupported field");
* variable-length lists: it ``np.vstack``s list cells, so every row must have the same length.
  A list column works when its shape is declared (``shapes={"image": (784,)}``);
* timestamps and dates: it converts through pandas (nanosecond datetimes), not Arrow's units.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import SchemaError, StackError
from formats.fs import resolve
from feeders.generator import generator_dataset
from feeders.elements import validate_reader_args
from feeders.parquet import plan_parquet
from feeders.parquet.plan import check_nulls
from feeders.shard import normalize_shard
from formats.schema import ColumnSpec, column_specs, tf_spec

__all__ = ["petastorm_dataset", "require_petastorm", "petastorm_unsupported"]

COMPAT_HINT = (
    "it needs the compat stack (TensorFlow 2.16, pyarrow 14, petastorm 0.13.1): run "
    "`bash .ci/setup compat` and use .venvs/compat/bin/python, or pip install "
    "'spark-tf-dataplane[petastorm]' into an environment with pyarrow<16"
)


def require_petastorm() -> Any:
    """Import and return the ``petastorm`` module, or raise StackError naming the compat stack."""
    major = int(pa.__version__.split(".")[0])
    if major >= 16:
        raise StackError(
            f"feeders.petastorm_dataset cannot run with pyarrow {pa.__version__} (Petastorm "
            f"0.13.1 uses pyarrow APIs removed in 16): {COMPAT_HINT}."
        )
    try:
        import petastorm
    except ImportError as exc:
        raise StackError(f"feeders.petastorm_dataset: petastorm is not installed; {COMPAT_HINT}.") from exc
    return petastorm


def petastorm_unsupported(schema: pa.Schema, specs: Sequence[ColumnSpec]) -> dict[str, str]:
    """``{column: why Petastorm cannot carry it}`` for the given specs (empty when all can)."""
    out = {}
    for s in specs:
        t = schema.field(s.name).type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_fixed_size_list(t):
            out[s.name] = (
                f"Petastorm 0.13.1 drops fixed_size_list columns ({t}) when it infers the schema"
            )
        elif s.is_ragged:
            out[s.name] = (
                f"Petastorm stacks list cells with np.vstack, so a variable-length list ({t}) "
                f"fails; declare its shape (shapes={{{s.name!r}: (n,)}}) if every row has n values"
            )
        elif pa.types.is_list(t) and pa.types.is_list(t.value_type):
            out[s.name] = f"Petastorm cannot stack nested lists ({t})"
        elif pa.types.is_timestamp(t) or pa.types.is_date(t):
            out[s.name] = f"Petastorm converts {t} through pandas datetimes, not Arrow's units"
    return out


def _has_nulls(v: np.ndarray, spec: ColumnSpec) -> bool:
    """Nulls in a column Petastorm returned: None in an object array, or NaN in a float array
    standing for a column that is not float (a float column's own NaN is a value)."""
    if v.dtype == object:
        return any(x is None for x in v.ravel())
    return v.dtype.kind == "f" and not spec.dtype.startswith("float") and bool(np.isnan(v).any())


class _PetastormBatches:
    """Opens a Petastorm batch reader per iteration; yields dicts of numpy arrays (picklable)."""

    def __init__(
        self,
        url: str,
        specs: list[ColumnSpec],
        shard: tuple[int, int] | None,
        filesystem: Any,
        reader_kw: dict[str, Any],
    ) -> None:
        self.url = url
        self.specs = specs
        self.shard = shard
        self.filesystem = filesystem
        self.reader_kw = reader_kw

    def _convert(self, batch: Any) -> dict[str, np.ndarray]:
        cols = batch._asdict()
        out = {}
        for s in self.specs:
            v = np.asarray(cols[s.name])
            if _has_nulls(v, s):
                raise SchemaError(
                    f"petastorm_dataset({self.url}): column {s.name!r} has null value(s), which "
                    f"Petastorm hands over as NaN or None (an int column would read as "
                    f"{np.iinfo(np.int64).min}, a string one as 'None'). Filter or fill the "
                    f"nulls when writing, or read with feeders.parquet_dataset(fill_values="
                    f"{{{s.name!r}: 0}})."
                )
            if s.dtype == "string":
                out[s.name] = v.astype(object) if v.dtype.kind == "U" else v
            else:
                out[s.name] = v.astype(s.dtype, copy=False).reshape((len(v), *s.shape))
        return out

    def __call__(self) -> Iterator[dict[str, np.ndarray]]:
        import petastorm

        kw = dict(
            schema_fields=[s.name for s in self.specs],
            num_epochs=1,
            shuffle_row_groups=False,
            workers_count=4,
        )
        kw.update(self.reader_kw)
        if self.shard is not None:
            kw["cur_shard"], kw["shard_count"] = self.shard
        if self.filesystem is not None:
            kw["filesystem"] = self.filesystem
        with petastorm.make_batch_reader(self.url, **kw) as reader:
            for batch in reader:
                yield self._convert(batch)


def _reader_location(loc: Any, filesystem: Any) -> tuple[str, Any]:
    """The URL (and filesystem) to hand Petastorm for a resolved location."""
    if loc.scheme == "file":
        return "file://" + loc.path, None
    if filesystem is not None:
        # Petastorm 0.13.1 only drives legacy pyarrow.filesystem / fsspec objects.
        return f"file:///{loc.path.lstrip('/')}", filesystem
    if loc.scheme == "s3":
        try:
            import s3fs  # noqa: F401 - Petastorm opens s3:// through s3fs
        except ImportError as exc:
            raise StackError(
                f"petastorm_dataset({loc.url}): Petastorm reads s3:// only through s3fs, which "
                f"is not installed (Petastorm 0.13.1 cannot use pyarrow.fs.S3FileSystem). "
                f"pip install s3fs into the compat environment, or read the data with "
                f"feeders.parquet_dataset."
            ) from exc
        return loc.url, None
    return loc.url, None  # hdfs://: Petastorm's own HDFS resolver


def _check_reader_kw(kw: Mapping[str, Any]) -> None:
    """Keywords ``make_batch_reader`` does not take fail here, not at the first batch."""
    import inspect

    import petastorm

    known = set(inspect.signature(petastorm.make_batch_reader).parameters)
    unknown = sorted(set(kw) - known)
    if unknown:
        raise TypeError(
            f"petastorm_dataset: petastorm.make_batch_reader takes no argument(s) {unknown}; "
            f"see help(petastorm.make_batch_reader)."
        )


def petastorm_dataset(
    url: str | os.PathLike,
    *,
    batch_size: int = 1024,
    columns: Sequence[str] | None = None,
    label: str | None = None,
    shard: Any = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    filesystem: Any = None,
    **kw: Any,
):
    """A ``tf.data.Dataset`` of batches read by Petastorm's ``make_batch_reader`` (compat stack).

    Args:
        url: a Parquet file or directory: local path or ``file://``; ``s3://`` and
            ``hdfs://`` go through Petastorm's own resolvers (s3fs, libhdfs3), so s3fs must be
            installed for ``s3://`` (it is not on the compat stack).
        batch_size: rows per batch (exact; the last may be short).
        columns: columns to read (default: all). See the module doc for what Petastorm cannot
            carry.
        label: a column to yield apart: ``(features, label)``.
        shard: ``None``, ``(index, count)`` or a node ctx; Petastorm shards by row group.
        shapes: per-row shapes for list columns (Petastorm needs them for any list).
        filesystem: an fsspec filesystem for Petastorm to read with.
        **kw: passed to ``petastorm.make_batch_reader`` (``workers_count``, ``reader_pool_type``,
            ``shuffle_row_groups``...).

    Raises:
        StackError: Petastorm cannot run on this stack (names the compat stack).
        SchemaError: a selected column Petastorm cannot carry (names it and why).
    """
    require_petastorm()
    import tensorflow as tf

    validate_reader_args(batch_size, label, columns)
    shard_t = normalize_shard(shard)
    plan = plan_parquet(url, columns=columns, filesystem=filesystem)
    wanted = list(columns) if columns is not None else list(plan.columns)
    if label is not None and label not in wanted:
        wanted.append(label)
    specs = column_specs(plan.schema, columns=wanted, shapes=shapes)
    bad = petastorm_unsupported(plan.schema, specs)
    if bad:
        raise SchemaError(
            f"petastorm_dataset({plan.location.url}): "
            + "; ".join(f"column {k!r}: {v}" for k, v in bad.items())
            + ". Leave these out (columns=...) or read with feeders.parquet_dataset, which "
            "carries every type."
        )
    check_nulls(plan.location, plan.files, plan.metadata, specs, plan.hive, reader="petastorm_dataset")
    _check_reader_kw(kw)
    loc = resolve(url, filesystem=filesystem)
    reader_url, fs = _reader_location(loc, filesystem)
    stream = _PetastormBatches(reader_url, specs, shard_t, fs, dict(kw))
    signature = tf_spec(plan.schema, columns=wanted, shapes=shapes)
    ds = generator_dataset(stream, signature)
    ds = ds.rebatch(int(batch_size))
    if label is not None:
        ds = ds.map(lambda d: ({k: v for k, v in d.items() if k != label}, d[label]))
    return ds.prefetch(tf.data.AUTOTUNE)
