"""Arrow's own decoding of a shard's units: a threaded ``pyarrow.dataset`` scan with read-ahead,
its batches re-cut to an exact size, and Arrow batches converted to numpy."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import pyarrow as pa

from feeders.parquet.plan import check_file
from formats.errors import SchemaError, StorageError
from formats.fs import Location, storage_error
from formats.hive import HiveColumns, add_constant_columns
from formats.schema import INT96_UNIT, ColumnSpec, to_numpy

__all__ = ["scan_batches", "exact_batches", "to_arrays"]

# Scan read-ahead: files decoded ahead of the consumer, and chunks buffered per file. Memory
# stays within a few row groups plus (batch read-ahead x chunk size).
_FRAGMENT_READAHEAD = 2
_BATCH_READAHEAD = 2


def scan_batches(
    loc: Location,
    units: Sequence[tuple[str, list[int] | None]],
    schema: pa.Schema,
    names: list[str],
    chunk_rows: int,
    hive: HiveColumns = HiveColumns(),
    planned_rows: Mapping[str, int] | None = None,
) -> Iterator[tuple[str, pa.RecordBatch]]:
    """The units' record batches of (up to) ``chunk_rows`` rows of ``names``, in unit order,
    each with its file (as :meth:`Location.display` writes it, for errors).

    A ``pyarrow.dataset`` scan over the units: row groups are decoded by Arrow's own threads,
    :data:`_FRAGMENT_READAHEAD` files ahead of the consumer, with the GIL released, so decoding
    overlaps with TensorFlow on another core. Batches arrive in unit order (``scan_batches``
    keeps it). Each file is checked against the planned ``schema`` as it arrives
    (:func:`~feeders.parquet.plan.check_file`). Partition columns (``hive``) are not in the
    files; each batch gets its file's values.
    """
    import pyarrow.dataset as pds

    in_files = hive.in_files(names)
    schema = pa.schema([schema.field(n) for n in hive.in_files(schema.names)])

    remote = loc.scheme != "file"
    fmt = pds.ParquetFileFormat(
        read_options=pds.ParquetReadOptions(coerce_int96_timestamp_unit=INT96_UNIT),
        default_fragment_scan_options=pds.ParquetFragmentScanOptions(pre_buffer=remote),
    )
    fs = loc.filesystem
    frags = []
    for path, groups in units:
        try:
            # a subset of a file's row groups as one fragment per group: one fragment given
            # groups [7, 8, 9] of a 10-group file yielded them as 8, 9, 7 (pyarrow 26)
            frags.extend([fmt.make_fragment(path, filesystem=fs)] if groups is None else
                         [fmt.make_fragment(path, filesystem=fs, row_groups=[g]) for g in groups])
        except OSError as exc:
            raise storage_error(exc, "open", loc.display(path)) from exc
    dataset = pds.FileSystemDataset(frags, schema=schema, format=fmt, filesystem=fs)
    scanner = dataset.scanner(
        columns=in_files,
        batch_size=chunk_rows,
        batch_readahead=_BATCH_READAHEAD,
        fragment_readahead=_FRAGMENT_READAHEAD,
        use_threads=True,
    )
    checked: set[str] = set()
    tagged = iter(scanner.scan_batches())
    while True:
        try:
            item = next(tagged)
        except StopIteration:
            return
        except (OSError, pa.ArrowInvalid) as exc:
            # The scanner reads files ahead and does not say which one failed.
            files = sorted({p for p, _ in units})
            named = [f for f in files if f in str(exc)]  # pyarrow's text may name it, bare
            if len(files) == 1 or named:
                where = loc.display(max(named, key=len) if named else files[0])
            else:
                where = f"{loc.url} (one of its {len(files)} files)"
            err = storage_error(exc, "read the Parquet data of", where)
            if isinstance(exc, pa.ArrowInvalid) or "orrupt" in str(exc):
                err = StorageError(
                    f"{err} A file whose footer reads but whose pages do not is damaged (or "
                    f"was changed while being read); rewrite it."
                )
            raise err from exc
        path = item.fragment.path
        if path not in checked:
            planned = None if planned_rows is None else planned_rows.get(path)
            check_file(loc, path, item.fragment.physical_schema, schema, in_files,
                       None if planned is None else (planned, item.fragment.metadata.num_rows))
            checked.add(path)
        batch = item.record_batch
        if batch.num_rows:
            yield loc.display(path), (add_constant_columns(batch, hive.values[path], names) if hive else batch)


def exact_batches(batches: Iterator[tuple[str, pa.RecordBatch]], size: int) -> Iterator[tuple[str, pa.RecordBatch | pa.Table]]:
    """``batches`` (with their files) re-cut to exactly ``size`` rows across files (the last may
    be short); each with the file, or files, its rows come from."""
    pending: list[pa.RecordBatch] = []
    sources: list[tuple[str, int]] = []  # (file, rows) of the pending rows, in order
    have = 0
    for where, b in batches:
        if have == 0 and b.num_rows == size:
            yield where, b
            continue
        pending.append(b)
        sources.append((where, b.num_rows))
        have += b.num_rows
        while have >= size:
            table = pa.Table.from_batches(pending)
            yield _files_of(sources, size), table.slice(0, size)
            have -= size
            pending = table.slice(size).to_batches() if have else []
            sources = _drop_rows(sources, size)
    if have:
        yield _files_of(sources, have), pa.Table.from_batches(pending)


def _files_of(sources: list[tuple[str, int]], rows: int) -> str:
    names: list[str] = []
    for where, n in sources:
        if rows <= 0:
            break
        if where not in names:
            names.append(where)
        rows -= n
    return names[0] if len(names) == 1 else "the rows of " + " and ".join(names)


def _drop_rows(sources: list[tuple[str, int]], rows: int) -> list[tuple[str, int]]:
    out = []
    for where, n in sources:
        if rows >= n:
            rows -= n
            continue
        out.append((where, n - rows))
        rows = 0
    return out


def to_arrays(where: str, batch: pa.RecordBatch | pa.Table, specs: Sequence[ColumnSpec]) -> dict[str, Any]:
    """The columns of ``specs`` as numpy arrays (:func:`formats.schema.to_numpy`); errors name
    ``where``, the file (or files) the rows come from."""
    try:
        return to_numpy(batch, specs)
    except SchemaError as exc:
        raise SchemaError(f"reading {where}: {exc}") from exc
