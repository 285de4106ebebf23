"""``dataplane inspect PATH``: a Parquet or TFRecord dataset's schema, TF spec, rows and files.

Works on local paths and ``file://``, ``s3://`` (AWS variables) and ``hdfs://`` URLs, through
the same listing and planning code as the pull readers (``feeders.parquet`` /
``feeders.tfrecord``), so what it prints is what they would read. The TF spec is rendered from
:func:`formats.schema.column_specs` (the mapping ``formats.tf_spec`` builds its specs from),
so TensorFlow is never imported; neither is Spark.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

__all__ = ["add_arguments", "run", "describe"]

_EXIT_FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``dataplane inspect``'s options on ``parser``."""
    parser.description = (
        "Show a Parquet or TFRecord dataset's columns (Arrow type and the TensorFlow spec each "
        "maps to), its row count and its files. PATH may be a file or directory, local or a "
        "file://, s3:// or hdfs:// URL (s3 endpoint and keys from the AWS_* variables)."
    )
    parser.add_argument("path", metavar="PATH", help="dataset file or directory")
    parser.add_argument("--format", dest="fmt", choices=["auto", "parquet", "tfrecord"],
                        default="auto",
                        help="dataset format (default auto: by suffix, schema file or magic bytes)")
    parser.add_argument("--compression", default=None,
                        help="TFRecord compression (default: schema file, else file suffix)")
    parser.add_argument("--sample", type=int, default=1000, metavar="N",
                        help="TFRecord without a schema file: records to infer the schema from")
    parser.add_argument("--no-count", action="store_true",
                        help="TFRecord: do not read every record to count rows")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


# neither a Parquet file nor named or described as TFRecords: read as TFRecords, and a first
# record that does not check out then means "not a format inspect reads" (a CSV, say)
_GUESSED_TFRECORD = "tfrecord?"


def _detect(path: str) -> str:
    from formats.errors import StorageError
    from formats.fs import PARQUET_SUFFIXES, list_files, resolve
    from formats.schemafile import SCHEMA_FILE_NAME

    loc = resolve(path)
    try:
        files = list_files(loc)
    except StorageError:
        from formats.schemafile import empty_export

        if empty_export(loc.path, filesystem=loc.filesystem) is not None:
            return "tfrecord"  # the export of an empty DataFrame: only its schema file
        raise
    if any(f.endswith(PARQUET_SUFFIXES) for f in files):
        return "parquet"
    if any(".tfrecord" in f.rsplit("/", 1)[-1] for f in files):
        return "tfrecord"
    directory = loc.path if len(files) != 1 or files[0] != loc.path else loc.path.rsplit("/", 1)[0]
    from pyarrow import fs

    if loc.filesystem.get_file_info(f"{directory}/{SCHEMA_FILE_NAME}").type == fs.FileType.File:
        return "tfrecord"
    with loc.filesystem.open_input_stream(files[0], compression=None) as f:
        return "parquet" if f.read(4) == b"PAR1" else _GUESSED_TFRECORD


def _tf_text(spec: Any) -> str:
    dtype = "tf.string" if spec.dtype == "string" else f"tf.{spec.dtype}"
    shape = "(" + ", ".join("None" if d is None else str(d) for d in (None, *spec.shape)) + (
        ",)" if not spec.shape else ")"
    )
    if spec.is_ragged:
        return f"RaggedTensorSpec(shape={shape}, dtype={dtype}, ragged_rank={spec.ragged_rank})"
    return f"TensorSpec(shape={shape}, dtype={dtype})"


def _columns_from_arrow(schema: Any) -> list[dict[str, Any]]:
    from dataplane.errors import SchemaError
    from formats.schema import column_specs

    out = []
    for field in schema:
        entry: dict[str, Any] = {"name": field.name, "arrow_type": str(field.type)}
        try:
            (spec,) = column_specs(schema, columns=[field.name])
            entry["tf"] = _tf_text(spec)
        except SchemaError as exc:
            entry["tf"] = None
            entry["problem"] = str(exc)
        out.append(entry)
    return out


def _shape_hints(table: Any, specs: Any, columns: list[dict[str, Any]], seen_in: str) -> None:
    """For each ragged list column, the shape every row of ``table`` (a first row group, or
    the sampled records) has, if one: a Spark ``array<float>`` image reads ragged from Parquet
    (no list lengths there) or from foreign TFRecords unless its shape is declared, and this
    is the declaration to make."""
    from formats.schema import fill_example, list_lengths, uniform_shape

    by_name = {s.name: s for s in specs}
    for c in columns:
        spec = by_name.get(c["name"])
        if spec is None or not spec.is_ragged or c["name"] not in table.column_names:
            continue
        column = table.column(c["name"]).combine_chunks()
        shape = uniform_shape(list_lengths(column, spec))
        if shape is None:
            continue
        shape = list(shape)
        c["dense_in_sample"] = shape
        shapes = f"shapes={{{c['name']!r}: {shape}}}"
        if not column.null_count:
            c["hint"] = f"every row of {seen_in} holds {shape}: {shapes} reads it dense"
            continue
        # a dense column with null rows is refused unless they are filled: say both
        c["null_rows_in_sample"] = int(column.null_count)
        fill = fill_example(column.type)
        c["hint"] = (f"every non-null row of {seen_in} holds {shape}, and {column.null_count:,} "
                     f"row(s) are null: {shapes} with fill_values={{{c['name']!r}: {fill}}} reads "
                     f"it dense (a null row as shape {shape} filled with {fill})")


def _parquet_shape_hints(plan: Any, columns: list[dict[str, Any]]) -> None:
    import pyarrow.parquet as pq

    from formats.schema import INT96_UNIT, column_specs

    in_files = [c["name"] for c in columns if c.get("tf") and c["name"] in plan.file_schema.names]
    ragged = [s for s in column_specs(plan.schema, columns=in_files) if s.is_ragged] if in_files else []
    if not ragged or not plan.files or not plan.metadata[0].num_row_groups:
        return
    with plan.location.filesystem.open_input_file(plan.files[0]) as f:
        table = pq.ParquetFile(f, coerce_int96_timestamp_unit=INT96_UNIT).read_row_group(
            0, columns=[s.name for s in ragged])
    _shape_hints(table, ragged, columns, "the first row group")


def _parquet_nulls(plan: Any, columns: list[dict[str, Any]]) -> None:
    """Each column's null count: from the footers' statistics; for a partition column, the rows
    of files in its null directory. Where the footers cannot tell (no statistics, or a list
    column whose leaves count empty lists too), ``nulls`` is None: unknown, not zero."""
    from feeders.parquet.plan import null_counts

    counts = null_counts(plan.metadata)
    leaves = [plan.metadata[0].schema.column(i).path for i in range(len(plan.metadata[0].schema))]
    partition = set(plan.hive.names) if plan.hive else set()
    for c in columns:
        name = c["name"]
        if name in partition:
            c["nulls"] = sum(int(m.num_rows) for f, m in zip(plan.files, plan.metadata)
                             if not plan.hive.values[f][name].is_valid)
        elif name in counts:
            c["nulls"] = counts[name]
        else:
            mine = [p for p in leaves if p.startswith(name + ".")]
            known_none = bool(mine) and all(counts.get(p) == 0 for p in mine)
            c["nulls"] = 0 if known_none else None


def _null_note(c: dict[str, Any]) -> str:
    from formats.schema import fill_example

    try:
        import pyarrow as pa

        example = fill_example(pa.type_for_alias(c["arrow_type"]))
    except (ValueError, TypeError, KeyError):
        example = "..."
    if c.get("nulls_read_as"):
        return (f"{c['nulls']:,} null value(s) (absent features): the TFRecord reader reads them "
                f"as {c['nulls_read_as']}, as tf.io.VarLenFeature does")
    counted = (f"at least {c['nulls']:,} null value(s) (absent features) in the first "
               f"{c['nulls_in_first']:,} records, without a _tf_schema.json to count them all"
               if c.get("nulls_in_first") else f"{c['nulls']:,} null value(s)")
    return (f"{counted}: the readers refuse them unless given "
            f"fill_values={{{c['name']!r}: {example}}} (or leave the column out)")


def _file_sizes(loc: Any, files: list[str]) -> list[int]:
    infos = loc.filesystem.get_file_info(files)
    return [int(i.size or 0) for i in infos]


def describe(path: str, *, fmt: str = "auto", compression: str | None = None,
             sample: int = 1000, count: bool = True,
             progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Everything ``inspect`` prints, as a dict (the ``--json`` output). ``progress`` gets a
    line now and then while a long step runs (many Parquet footers read; TFRecord files
    counted to their ends)."""
    from dataplane.cli.console import SlowStep

    shown = SlowStep(progress)
    if fmt == "auto":
        fmt = _detect(path)
    if fmt == "parquet":
        from feeders.parquet import plan_parquet

        def on_footer(done: int, files: int) -> None:
            shown.tick(done, files, f"reading the footers of {files:,} Parquet files",
                       lambda took: f"  read {done:,}/{files:,} footers in {took:.0f} s")

        plan = plan_parquet(path, on_footer=on_footer)
        loc = plan.location
        sizes = _file_sizes(loc, plan.files)
        files = [
            {"path": loc.display(f), "rows": int(m.num_rows), "row_groups": int(m.num_row_groups),
             "bytes": b}
            for f, m, b in zip(plan.files, plan.metadata, sizes)
        ]
        columns = _columns_from_arrow(plan.schema)
        _parquet_shape_hints(plan, columns)
        _parquet_nulls(plan, columns)
        for c in columns:
            if c["name"] not in plan.columns:
                c["hint"] = ("the index pandas wrote (row numbers, no feature): the readers leave "
                             "it out unless columns= names it")
        return {"url": loc.url, "format": "parquet", "rows": plan.num_rows,
                "bytes": sum(sizes), "schema_source": "parquet footer",
                "columns": columns, "files": files}

    from dataplane.errors import RecordError
    from feeders.tfrecord import count_records, plan_tfrecord

    try:
        plan = plan_tfrecord(path, compression=compression, sample=sample)
    except RecordError as exc:
        if fmt != _GUESSED_TFRECORD or exc.offset != 0:
            raise
        raise RecordError(
            f"{path} is neither Parquet (no PAR1 magic bytes) nor TFRecords (its first record's "
            f"header does not check out); inspect reads those two formats only. If it is one of "
            f"them, pass --format parquet or --format tfrecord to see why it does not read."
        ) from None
    loc = plan.location
    sizes = _file_sizes(loc, plan.files)
    rows_per_file: list[int | None] = [None] * len(plan.files)
    if count:
        rows_per_file = []
        for f in plan.files:
            rows_per_file.append(count_records(loc, f, plan.compression))
            done, n = len(rows_per_file), len(plan.files)
            shown.tick(done, n, f"counting the records of {n:,} TFRecord files to their ends (--no-count skips it)",
                       lambda took: f"  counted {done:,}/{n:,} files, {sum(rows_per_file):,} records, in {took:.0f} s")
    elif plan.schema_file is not None and plan.schema_file.files:
        known = {e.get("path"): e.get("rows") for e in plan.schema_file.files}
        rows_per_file = [known.get(f.rsplit("/", 1)[-1]) for f in plan.files]
    columns = []
    for spec in plan.specs:
        arrow = str(spec.arrow_type) if spec.arrow_type is not None else None
        columns.append({"name": spec.name, "arrow_type": arrow, "tf": _tf_text(spec)})
        if plan.schema_file is not None and spec.name in plan.schema_file.null_counts:
            columns[-1]["nulls"] = int(plan.schema_file.null_counts[spec.name])
            if spec.is_ragged:  # an absent list feature, as tf.io.VarLenFeature reads it
                columns[-1]["nulls_read_as"] = "empty lists"
    uncounted = [c for c, spec in zip(columns, plan.specs) if "nulls" not in c and not spec.is_ragged]
    if (plan.schema_source == "inferred" and any(s.is_ragged for s in plan.specs)) or uncounted:
        from feeders.tfrecord.files import sample_records
        from formats.example import decode_examples

        records = sample_records(loc, plan.files, plan.compression, sample)
        table = decode_examples(records, plan.specs)
        if plan.schema_source == "inferred" and any(s.is_ragged for s in plan.specs):
            _shape_hints(table, plan.specs, columns, f"the {len(records)} sampled records")
        for c in uncounted:  # a dense or scalar feature absent from a record is a null there
            nulls = table.column(c["name"]).null_count
            if nulls:
                c["nulls"], c["nulls_in_first"] = int(nulls), len(records)
    total = None if any(r is None for r in rows_per_file) else int(sum(rows_per_file))  # type: ignore[arg-type]
    out = {
        "url": loc.url, "format": "tfrecord", "compression": plan.compression, "rows": total,
        "bytes": sum(sizes), "schema_source": plan.schema_source, "columns": columns,
        "files": [{"path": loc.display(f), "rows": r, "bytes": b}
                  for f, r, b in zip(plan.files, rows_per_file, sizes)],
    }
    if not columns:
        where = ("its _tf_schema.json lists no column" if plan.schema_source == "schema file"
                 else f"every record sampled (up to {sample}) is an empty tf.train.Example (no feature)")
        out["warning"] = (f"no column: {where}, so a reader has nothing to read; check how the "
                          f"files were written.")
    return out


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def _render(info: dict[str, Any]) -> str:
    lines = []
    extra = f", {info['compression']}" if info.get("compression") else ""
    lines.append(f"dataset: {info['url']}")
    lines.append(f"format:  {info['format']}{extra}, {len(info['files'])} file(s), "
                 f"{_human(info['bytes'])}")
    rows = info["rows"]
    lines.append(f"rows:    {rows if rows is not None else 'unknown (--no-count)'}")
    source = {"inferred": "inferred from the first records (no _tf_schema.json)",
              "schema file": "_tf_schema.json beside the data"}.get(info["schema_source"],
                                                                    info["schema_source"])
    lines.append(f"schema:  {source}")
    if info.get("warning"):
        lines.append(f"warning: {info['warning']}")
    lines.append("")
    width = max([len("column")] + [len(c["name"]) for c in info["columns"]])
    awidth = max([len("arrow type")] + [len(c["arrow_type"] or "-") for c in info["columns"]])
    lines.append(f"  {'column'.ljust(width)}  {'arrow type'.ljust(awidth)}  tf spec")
    for c in info["columns"]:
        tf = c["tf"] if c["tf"] is not None else "NOT CARRIED: " + c.get("problem", "")
        lines.append(f"  {c['name'].ljust(width)}  {(c['arrow_type'] or '-').ljust(awidth)}  {tf}")
    hints = [c for c in info["columns"] if c.get("hint")]
    for c in hints:
        lines.append(f"  {c['name']}: {c['hint']}")
    for c in info["columns"]:
        if c.get("nulls"):
            lines.append(f"  {c['name']}: {_null_note(c)}")
        elif "nulls" in c and c["nulls"] is None and c.get("null_rows_in_sample"):
            lines.append(f"  {c['name']}: at least {c['null_rows_in_sample']:,} null row(s) in the "
                         f"first row group (the footers keep no count for a list column); a null "
                         f"stops the readers unless fill_values= names the column")
        elif "nulls" in c and c["nulls"] is None:
            lines.append(f"  {c['name']}: null count unknown (the footers keep none for it: files "
                         f"written without statistics, or a list column with empty lists); a null "
                         f"stops the readers unless fill_values= names the column")
    lines.append("")
    lines.append("files:")
    for f in info["files"]:
        r = f"{f['rows']} rows" if f["rows"] is not None else "? rows"
        lines.append(f"  {f['path']}  {r}  {_human(f['bytes'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the description of ``args.path``; 1 with a message on stderr when it cannot."""
    from dataplane.errors import DataplaneError

    if args.sample < 1:
        print(f"dataplane inspect: error: --sample must be at least 1 (records to infer the "
              f"schema from), got {args.sample}.", file=sys.stderr)
        return 2
    try:
        info = describe(args.path, fmt=args.fmt, compression=args.compression,
                        sample=args.sample, count=not args.no_count,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (DataplaneError, ValueError, OSError) as exc:
        hint = " (here: --compression gzip or zlib)" if getattr(exc, "maybe_compressed", False) else ""
        if getattr(args, "verbose", 0):
            import traceback

            traceback.print_exc()
        print(f"dataplane inspect: error: {' '.join(str(exc).split())}{hint}", file=sys.stderr)
        return _EXIT_FAILED
    print(json.dumps(info, indent=1) if args.json else _render(info))
    return 0
