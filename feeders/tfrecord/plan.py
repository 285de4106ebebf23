"""What a TFRecord pull reader will read: the files listed, their compression settled, the
column specs (given, from the schema file beside the data, or inferred), the columns selected,
and the first records checked against them when the dataset is built."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from feeders.shard import agreed, balanced_shards, left_out
from feeders.tfrecord.files import open_record_batches, sample_records
from formats.errors import SchemaError, StorageError
from formats.fs import Location, list_files, resolve, storage_error
from formats.schema import ColumnSpec, check_fill_value, column_specs, fill_example, mapping_arg
from formats.schemafile import SCHEMA_FILE_NAME, TFRecordSchema, empty_export, find_schema_file
from formats.tfrecord import normalize_compression

__all__ = ["TFRecordPlan", "plan_tfrecord", "select_columns", "check_records", "shard_files", "agreed_files"]

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
    skipped: list[str] = []

    def is_data(path: str) -> bool:
        if path.endswith(_NOT_DATA):
            skipped.append(path)
            return False
        return True

    try:
        files = list_files(loc, accept=is_data)
    except StorageError as exc:
        parquet = sorted(p for p in skipped if p.endswith(".parquet"))
        if parquet:  # the usual mix-up: a Parquet data set given to the TFRecord reader
            raise StorageError(
                f"{loc.url} holds Parquet files ({loc.display(parquet[0])}"
                f"{f' and {len(parquet) - 1} more' if len(parquet) > 1 else ''}), no TFRecord "
                f"files; read it with feeders.parquet_dataset."
            ) from exc
        empty = empty_export(loc.path, filesystem=loc.filesystem)
        if empty is None:
            raise
        # the export of an empty DataFrame: its schema file and no data file; no rows
        specs = _specs_from(schema, loc.url) if schema is not None else list(empty.specs)
        return TFRecordPlan(loc, [], empty.compression, specs, "schema file", empty)
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


def select_columns(
    specs: Sequence[ColumnSpec],
    columns: Sequence[str] | None,
    label: str | None,
    fill_values: Mapping[str, Any] | None,
    where: str,
) -> list[ColumnSpec]:
    """The specs to read: ``columns`` (default: all) and then ``label`` if not among them,
    each with its fill value from ``fill_values``.

    Raises:
        SchemaError: a column or fill value names no column of ``specs``, a fill value does not
            fit its column's type, or there is nothing to read.
        ValueError: ``fill_values`` is not a mapping.
    """
    by_name = {s.name: s for s in specs}
    fills = mapping_arg("fill_values", fill_values)
    wanted = list(columns) if columns is not None else [s.name for s in specs]
    if label is not None and label not in wanted:
        wanted.append(label)
    for name in list(wanted) + list(fills):
        if name not in by_name:
            raise SchemaError(
                f"{where}: column {name!r} is not in the records; the columns are "
                f"{sorted(by_name)}."
            )
    if not wanted:
        raise SchemaError(
            f"{where}: the schema has no columns, so there is nothing to read. Pass a schema "
            f"with at least one column (a DataFrame with no columns exports such a schema)."
        )
    for name, value in fills.items():
        check_fill_value(name, by_name[name].dtype, value)
    return [
        dataclasses.replace(by_name[n], fill=fills[n]) if n in fills else by_name[n] for n in wanted
    ]


_CHECK_RECORDS = 256
"""Records decoded with the chosen specs when the dataset is built (see :func:`check_records`)."""


def check_records(loc: Location, files: Sequence[str], compression: str | None,
                  specs: Sequence[ColumnSpec], n: int | None = None) -> None:
    """Decode the first ``n`` records with ``specs``, so that a schema the records do not fit
    fails the call that was given it (naming the file, record, column and the fix) instead of
    the first ``next()`` deep inside TensorFlow: a dense or scalar column absent from a record
    without a fill value, a feature of another kind (int64/float/bytes), or a dense column with
    another number of values. Later records are checked as they are parsed.
    """
    from formats.example_decode import decode_examples, parse_record

    left = _CHECK_RECORDS if n is None else n
    for path in files:
        if left <= 0:
            return
        batches = open_record_batches(loc, path, compression, left)
        with contextlib.closing(batches):
            records = next(batches, [])
        if not records:
            continue
        where = loc.display(path)
        table = decode_examples(records, specs, name=where)
        for spec in specs:
            if spec.is_ragged or spec.fill is not None:
                continue
            col = table.column(spec.name)
            if not col.null_count:
                continue
            first = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
            kind = f"dense shape {spec.shape}" if spec.shape else "a scalar"
            if col.null_count == len(records):
                raise SchemaError(
                    f"{where}: column {spec.name!r} is in the schema but absent from all of the "
                    f"first {len(records)} record(s), whose features are "
                    f"{sorted(parse_record(records[0]))}. Check the schema's column names, leave the column out (columns=...), "
                    f"or give fill_values={{{spec.name!r}: {_fill_hint(spec)}}}."
                )
            raise SchemaError(
                f"{where}: record {first} has no feature {spec.name!r} (a null when it was "
                f"written; {col.null_count} of the first {len(records)} records lack it), but it "
                f"is read as {kind} without a fill value. Pass fill_values={{{spec.name!r}: {_fill_hint(spec)}}} "
                f"(any value of its type), or rewrite the records without nulls."
            )
        left -= len(records)


def _fill_hint(spec: ColumnSpec) -> str:
    """A fill value of the column's type to show in a fix: ``''`` for text, ``0`` for numbers."""
    if spec.arrow_type is not None:
        return fill_example(spec.arrow_type)
    return "''" if spec.dtype == "string" else "0"


def _sizes(loc: Any, files: list[str]) -> list[int]:
    return [max(0, int(i.size or 0)) for i in loc.filesystem.get_file_info(files)] if files else []


def agreed_files(plan: TFRecordPlan, shard: Any) -> tuple[TFRecordPlan, list[int]]:
    """The files and sizes every node of a cluster shards: the first node's listing (see
    :func:`feeders.shard.agreed`), so a file written while the nodes list the path is read by
    all of them or none; this node's own listing when ``shard`` has no cluster."""
    loc = plan.location
    sizes = _sizes(loc, plan.files)
    first, listing = agreed(shard, f"tfrecord files {loc.url}", [[f, n] for f, n in zip(plan.files, sizes)])
    if first is None:
        return plan, sizes
    files, settled = [str(f) for f, _ in listing], [int(n) for _, n in listing]
    if files != plan.files:
        logger.warning(
            "%s: this node listed %d file(s), node %d, the first to plan this dataset, %d; every "
            "node shards node %d's listing, so no record is read twice or skipped.%s", loc.url,
            len(plan.files), first, len(files), first, left_out(loc.display, plan.files, files),
        )
    return dataclasses.replace(plan, files=files), settled


def shard_files(loc: Any, files: list[str], shard: tuple[int, int], sizes: list[int]) -> list[str]:
    """This shard's files: contiguous runs holding about ``1/count`` of the bytes (records
    are not counted without reading them; bytes stand in for rows; ``sizes`` as every node
    listed them, see :func:`agreed_files`). Warns when the shards still differ much."""
    index, count = shard
    owner = balanced_shards(sizes, count)
    held = [0] * count
    for n, o in zip(sizes, owner):
        held[o] += n
    if sum(sizes) and min(held) < 0.8 * max(held):
        logger.warning(
            "%s: the %d shards hold %s bytes of TFRecords (a file is never split; this shard: "
            "%d). Under MultiWorkerMirroredStrategy Keras fit and strategy.experimental_"
            "distribute_dataset cope with shards of different sizes, but a loop that runs a "
            "collective every step over the dataset itself hangs once one worker runs out of "
            "batches. Write more files of even size (formats.write_tfrecords(num_files=...)).",
            loc.url, count, "/".join(str(h) for h in held), held[index],
        )
    return [f for f, o in zip(files, owner) if o == index]
