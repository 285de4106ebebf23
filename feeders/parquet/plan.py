"""What a Parquet pull reader will read: the files listed, their footers read and checked, this
shard's units (the row groups holding its even share of the rows), and the rows per
generator chunk.

The footers give the schema every file must share, the row groups for sharding, and null
counts, so a missing column, a schema that differs between files or a null in a dense column is
a typed error when the dataset is built, not in the middle of training. :func:`check_file`
checks a file again when a pass opens it (it may have been rewritten since).
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import pyarrow as pa

from feeders.shard import agreed, left_out, normalize_shard
from formats.errors import SchemaError, StorageError
from formats.fs import Location, list_files, listing_root, parquet_files, resolve, storage_error
from formats.hive import HIVE_NULL, HiveColumns, hive_columns
from formats.schema import ColumnSpec, fill_example, parquet_arrow_schema

__all__ = ["ParquetPlan", "plan_parquet", "plain_schema", "check_nulls", "null_counts", "check_file", "chunk_rows_for"]

logger = logging.getLogger(__name__)

# Generator chunks: big enough that the per-call cost of the Python source vanishes,
# small enough to keep memory and first-batch latency low.
_CHUNK_BYTES = 8 << 20
_MAX_CHUNK_ROWS = 1 << 20


class ParquetPlan:
    """What one reader will read: resolved files, their common schema and the shard's units.

    Attributes:
        location: the resolved path/URL.
        files: every data file, sorted.
        schema: the Arrow schema every file shares (without pandas/Spark metadata), then the
            partition columns of Hive-style ``key=value`` directories (``df.write.partitionBy``).
        file_schema: ``schema`` without the partition columns: what the files hold.
        hive: the partition columns and each file's values (:mod:`formats.hive`).
        row_counts: rows per file.
        units: this shard's ``(file, row_groups or None)`` pairs, in read order.
        window: ``(skip, take)``: of the units' rows, the shard skips the first ``skip`` and
            reads the next ``take``; ``None``: every row of the units.
        columns: what a reader reads when not told which columns: ``schema``'s names but the
            columns pandas wrote for an unnamed index (``__index_level_0__``: a DataFrame
            filtered before ``to_parquet`` keeps its row numbers there, which are no feature).
    """

    def __init__(
        self,
        location: Location,
        files: list[str],
        schema: pa.Schema,
        metadata: list[Any],
        units: list[tuple[str, list[int] | None]],
        hive: HiveColumns = HiveColumns(),
        skipped: Sequence[str] = (),
        window: tuple[int, int] | None = None,
    ) -> None:
        self.location = location
        self.window = window
        self.files = files
        self.file_schema = schema
        self.schema = pa.schema(list(schema) + list(hive.fields))
        self.hive = hive
        self.metadata = metadata
        self.row_counts = [m.num_rows for m in metadata]
        self.units = units
        self.columns = [n for n in self.schema.names if n not in set(skipped)]

    @property
    def num_rows(self) -> int:
        """Rows in the whole data set (all shards)."""
        return int(sum(self.row_counts))


def _read_footer(loc: Location, path: str) -> Any:
    import pyarrow.parquet as pq

    where = loc.display(path)
    try:
        with loc.filesystem.open_input_file(path) as f:
            return pq.ParquetFile(f).metadata
    except pa.ArrowInvalid as exc:
        raise StorageError(
            f"{where} is not a readable Parquet file ({exc}). {_what_it_is(loc, path)}"
        ) from exc
    except OSError as exc:
        raise storage_error(exc, "read the Parquet footer of", where) from exc


def _what_it_is(loc: Location, path: str) -> str:
    """What a file without a Parquet footer looks like from its first bytes, and the fix."""
    import struct

    from formats.tfrecord import masked_crc32c

    try:
        with loc.filesystem.open_input_file(path) as f:
            size = f.size()
            head = f.read(12)
    except OSError:
        head, size = b"", -1
    if size == 0:
        return "It is empty. Remove it from the directory or rewrite it."
    if head[:4] == b"PAR1":
        return ("It begins like Parquet but has no footer: it was partially written (a job "
                "still writing, or one that failed). Remove it or rewrite it.")
    if len(head) == 12 and struct.unpack("<I", head[8:])[0] == masked_crc32c(head[:8]):
        return ("It is a TFRecord file: read TFRecords with feeders.tfrecord_dataset, or point "
                "parquet_dataset at the Parquet files only.")
    return ("Remove it from the directory or rewrite it; empty and partially written files are "
            "the usual cause.")


def pandas_index_columns(schema: pa.Schema) -> list[str]:
    """The columns pandas' ``to_parquet`` wrote for an unnamed index (``__index_level_N__``)."""
    try:
        listed = (schema.pandas_metadata or {}).get("index_columns", [])
    except (ValueError, TypeError, AttributeError):  # metadata that is not pandas' JSON
        return []
    return [c for c in listed if isinstance(c, str) and re.fullmatch(r"__index_level_\d+__", c)]


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` without the pandas/Spark metadata, which may differ between files."""
    return schema.remove_metadata()


def _check_first_has(loc: Location, files: list[str], metas: list[Any], missing: Sequence[str]) -> None:
    """A wanted column the first file lacks but a later file has: name both files (the
    column is not simply absent from the data, as the first file's columns would say)."""
    for name in missing:
        has = next((p for p, m in zip(files[1:], metas[1:]) if name in parquet_arrow_schema(m).names), None)
        if has is not None:
            raise SchemaError(
                f"column {name!r} is in {loc.display(has)} but missing from "
                f"{loc.display(files[0])}; every file of a data set must have the same columns. "
                f"Rewrite the odd file or select columns present in all files (columns=...)."
            )


def _check_same_schema(loc: Location, files: list[str], metas: list[Any], names: Sequence[str]) -> None:
    first = plain_schema(parquet_arrow_schema(metas[0]))
    for path, meta in zip(files[1:], metas[1:]):
        other = plain_schema(parquet_arrow_schema(meta))
        for name in names:
            i, j = first.get_field_index(name), other.get_field_index(name)
            if j < 0:
                raise SchemaError(
                    f"column {name!r} is in {loc.display(files[0])} but missing from "
                    f"{loc.display(path)}; every file of a data set must have the same columns. "
                    f"Rewrite the odd file or select columns present in all files (columns=...)."
                )
            if not first.field(i).type.equals(other.field(j).type):
                raise SchemaError(
                    f"column {name!r} has type {first.field(i).type} in "
                    f"{loc.display(files[0])} but {other.field(j).type} in {loc.display(path)}; "
                    f"every file of a data set must share one schema. Rewrite the files with "
                    f"one schema (cast the column)."
                )


def _check_no_extra_columns(loc: Location, files: list[str], metas: list[Any], schema: pa.Schema) -> None:
    """With every column wanted (``columns=None``), a column only some files have would be
    dropped without a word: the columns come from the first file's footer."""
    known = set(schema.names)
    for path, meta in zip(files[1:], metas[1:]):
        extra = [n for n in parquet_arrow_schema(meta).names
                 if n not in known and not re.fullmatch(r"__index_level_\d+__", n)]
        if extra:
            names = [set(parquet_arrow_schema(m).names) for m in metas]
            common = sorted(n for n in known if all(n in have for have in names)
                            and not re.fullmatch(r"__index_level_\d+__", n))
            raise SchemaError(
                f"{loc.display(path)} has column(s) {extra} that {loc.display(files[0])} does not "
                f"have; every file of a data set must have the same columns. Rewrite the odd "
                f"file, or pass columns= naming the columns to read (those every file has: "
                f"{common[:10]}{' ...' if len(common) > 10 else ''})."
            )


def null_counts(metas: Sequence[Any]) -> dict[str, int]:
    """Each column's nulls over all files, from the footers' statistics; a column some row
    group keeps no null count for is left out (its count is unknown)."""
    totals: dict[str, int] = {}
    unknown: set[str] = set()
    for meta in metas:
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for c in range(rg.num_columns):
                col = rg.column(c)
                stats = col.statistics if col.is_stats_set else None
                if stats is None or not stats.has_null_count:
                    unknown.add(col.path_in_schema)
                else:
                    totals[col.path_in_schema] = totals.get(col.path_in_schema, 0) + int(stats.null_count)
    return {name: n for name, n in totals.items() if name not in unknown}


def check_nulls(
    loc: Location,
    files: list[str],
    metas: list[Any],
    specs: Sequence[ColumnSpec],
    hive: HiveColumns = HiveColumns(),
    *,
    reader: str | None = None,
) -> None:
    """A null in a scalar column without a fill value is an error; find it from the footers
    (and, for partition columns, from the directory names). ``reader`` names a reader that takes
    no ``fill_values`` (the compat adapters): its message then points to one that does."""
    wanted = {s.name for s in specs if not s.shape and s.fill is None}
    if not wanted:
        return

    def refuse(problem: str, name: str, example: str, otherwise: str) -> SchemaError:
        if reader is None:
            return SchemaError(f"{problem}; TensorFlow tensors cannot hold nulls. Pass "
                               f"fill_values={{{name!r}: {example}}} or {otherwise}.")
        return SchemaError(
            f"{reader}: {problem}; TensorFlow tensors cannot hold nulls. This reader cannot "
            f"fill them: filter or impute the nulls when writing, or read with "
            f"feeders.parquet_dataset(fill_values=...)."
        )

    for name in sorted(wanted & set(hive.names)):
        nulls = [path for path in files if not hive.values[path][name].is_valid]
        if nulls:
            raise refuse(
                f"partition column {name!r} is null ({HIVE_NULL}) for {loc.display(nulls[0])} "
                f"and {len(nulls) - 1} other file(s)", name, "...", "leave the column out (columns=...)"
            )
    types = {s.name: s.arrow_type if s.arrow_type is not None else pa.null() for s in specs}
    for path, meta in zip(files, metas):
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for c in range(rg.num_columns):
                col = rg.column(c)
                name = col.path_in_schema
                if name not in wanted or not col.is_stats_set:
                    continue
                stats = col.statistics
                if stats is not None and stats.has_null_count and stats.null_count:
                    raise refuse(
                        f"column {name!r} has {stats.null_count} null value(s) in row group {g} "
                        f"of {loc.display(path)}", name, fill_example(types[name]),
                        "filter/impute the nulls when writing"
                    )


def plan_parquet(
    path_or_url: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
    shard: Any = None,
    filesystem: Any = None,
    on_footer: Callable[[int, int], None] | None = None,
) -> ParquetPlan:
    """List the files, read and check their footers, and choose this shard's units.

    ``on_footer(done, files)`` is called in this thread as the footers arrive (each file's
    one S3 or HDFS round trip or two), for a caller that shows how far planning is.

    Raises:
        StorageError: the path does not exist, cannot be read, or a file is not Parquet.
        SchemaError: the files' schemas differ in a selected column.
        ValueError: a malformed ``shard``.
    """
    shard_t = normalize_shard(shard)
    loc = resolve(path_or_url, filesystem=filesystem)
    files = parquet_files(loc, list_files(loc))
    if len(files) == 1:
        metas = [_read_footer(loc, files[0])]
    else:
        metas = []
        with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
            for meta in pool.map(lambda p: _read_footer(loc, p), files):
                metas.append(meta)
                if on_footer is not None:
                    on_footer(len(metas), len(files))
    if shard_t is not None:
        files, metas = _agreed_listing(loc, files, metas, shard)
    first = parquet_arrow_schema(metas[0])
    schema = plain_schema(first)
    skipped = [c for c in pandas_index_columns(first) if columns is None or c not in columns]
    names = list(columns) if columns is not None else [n for n in schema.names if n not in skipped]
    _check_first_has(loc, files, metas, [n for n in names if n not in schema.names])
    _check_same_schema(loc, files, metas, [n for n in names if n in schema.names])
    if columns is None:
        _check_no_extra_columns(loc, files, metas, schema)
    hive = hive_columns(files, listing_root(loc), schema.names, display=loc.display)

    units: list[tuple[str, list[int] | None]]
    window = None
    if shard_t is None:
        units = [(f, None) for f in files]
    else:
        units, window = _balanced_units(loc, files, metas, shard_t)
    return ParquetPlan(loc, files, schema, metas, units, hive, skipped, window)


def _agreed_listing(loc: Location, files: list[str], metas: list[Any], shard: Any) -> tuple[list[str], list[Any]]:
    """The files and footers every node of a cluster shards: the first node's listing (see
    :func:`feeders.shard.agreed`); this node's own when ``shard`` has no cluster."""
    first, listing = agreed(shard, f"parquet files {loc.url}", [[f, m.num_rows] for f, m in zip(files, metas)])
    if first is None:
        return files, metas
    mine = dict(zip(files, metas))
    out_files, out_metas = [], []
    for path, rows in listing:
        meta = mine.get(path)
        if meta is None:  # written after this node listed the path, or listed by another node only
            try:
                meta = _read_footer(loc, path)
            except StorageError as exc:
                raise StorageError(
                    f"node {first}, the first to plan this dataset, listed {loc.display(path)}, "
                    f"but this node cannot read it: {exc} The files changed while the nodes "
                    f"listed {loc.url}. Build the dataset once the path holds what it should, "
                    f"or write new data to a new path."
                ) from exc
        if meta.num_rows != rows:
            raise StorageError(
                f"{loc.display(path)} holds {meta.num_rows} rows here, but {rows} when node "
                f"{first} planned this dataset: the file was rewritten while the nodes listed "
                f"{loc.url}, and their shards would cut different rows. Build the dataset "
                f"again, or write new data to a new path."
            )
        out_files.append(path)
        out_metas.append(meta)
    if out_files != files:
        logger.warning(
            "%s: this node listed %d file(s) (%d rows), node %d, the first to plan this dataset, "
            "%d (%d rows); every node shards node %d's listing, so no row is read twice or "
            "skipped.%s", loc.url, len(files), sum(m.num_rows for m in metas), first,
            len(out_files), sum(m.num_rows for m in out_metas), first,
            left_out(loc.display, files, out_files),
        )
    return out_files, out_metas


def _balanced_units(loc: Location, files: list[str], metas: list[Any], shard: tuple[int, int]) -> tuple[list[tuple[str, list[int] | None]], tuple[int, int]]:
    """This shard's units and row window: shard ``index`` of ``count`` reads rows
    ``[index * N // count, (index + 1) * N // count)`` of the data set in file order, so shards
    differ by one row at most. Its units are the row groups those rows lie in (a file whose
    groups all do is read whole); the window is (rows to skip in the first unit, rows to
    take), since a row group at a boundary is decoded by both shards and each keeps its part."""
    index, count = shard
    total = sum(m.num_rows for m in metas)
    lo, hi = index * total // count, (index + 1) * total // count
    units: list[tuple[str, list[int] | None]] = []
    start, skip = 0, None
    for f, m in zip(files, metas):
        mine = []
        for g in range(m.num_row_groups):
            n = m.row_group(g).num_rows
            if n and start < hi and start + n > lo:
                mine.append(g)
                if skip is None:
                    skip = lo - start
            start += n
        if mine:
            units.append((f, None if len(mine) == m.num_row_groups else mine))
    if lo == hi:
        logger.warning(
            "%s: shard %d of %d has nothing to read: the data set has %d rows, fewer than the "
            "shards. Use fewer shards.", loc.url, index, count, total,
        )
    return units, (skip or 0, hi - lo)


def check_file(loc: Location, path: str, physical: pa.Schema, schema: pa.Schema, names: Sequence[str],
               rows: tuple[int, int] | None = None) -> None:
    """A file must still have the planned columns, types and rows (it may have been rewritten).

    Args:
        loc: the data set's location.
        path: the file, on ``loc.filesystem``.
        physical: the file's schema as read now.
        schema: the planned schema (:attr:`ParquetPlan.schema`).
        names: the columns read.
        rows: (rows planned, rows now) of the file: the shards' row windows were cut from
            the planned counts, so a file rewritten with other rows would be read short or cut.

    Raises:
        SchemaError: a column is gone or has another type (names the file; the fix is to build
            the dataset again).
        StorageError: the file holds another number of rows than planned.
    """
    if rows is not None and rows[0] != rows[1]:
        raise StorageError(
            f"{loc.display(path)} holds {rows[1]} rows, but it held {rows[0]} when the dataset "
            f"was built: the file was rewritten since, and the shards' rows were planned from "
            f"the old counts, so this pass would read some rows twice or not at all. Build the "
            f"dataset again (each node, at the same time), or write new data to a new path."
        )
    got = plain_schema(physical)
    for name in names:
        j = got.get_field_index(name)
        want = schema.field(name).type
        if j < 0 or not got.field(j).type.equals(want):
            seen = got.field(j).type if j >= 0 else "no such column"
            raise SchemaError(
                f"{loc.display(path)}: column {name!r} is {seen}, but the data set was "
                f"planned with {want}; the file changed after the dataset was built. Build "
                f"the dataset again."
            )


def chunk_rows_for(metadata: Sequence[Any], names: Sequence[str], batch_size: int) -> int:
    """Rows per generator chunk: a multiple of ``batch_size`` holding about ``_CHUNK_BYTES``."""
    wanted = set(names)
    nbytes = rows = 0
    for meta in metadata[:8]:
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            rows += rg.num_rows
            for c in range(rg.num_columns):
                col = rg.column(c)
                if col.path_in_schema.split(".")[0] in wanted:
                    nbytes += col.total_uncompressed_size
    row_bytes = max(1.0, nbytes / rows) if rows else 64.0
    per_chunk = int(_CHUNK_BYTES / row_bytes) // batch_size
    return batch_size * max(1, min(per_chunk, _MAX_CHUNK_ROWS // batch_size))
