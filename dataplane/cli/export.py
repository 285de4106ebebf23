"""``dataplane export SRC DST --to tfrecord|parquet``: convert a dataset as a Spark job.

Runs on an embedded local Spark (``local[*]``, UI off, binding ``SPARK_LOCAL_IP`` when set) or on
``--master``. A progress bar goes to stderr when it is a terminal (else a line every 30 s); a
one-line summary (rows, files, bytes, seconds, rows/s) goes to stdout. A bad SRC (missing, empty, a column type TF cannot
hold) is reported on stderr with a non-zero exit, and no output is left behind.

Parquet -> TFRecord uses :func:`formats.parquet_to_tfrecords` (the tasks read the Parquet files
with pyarrow, Hive-style ``key=value`` directories included; no rows pass through the JVM), and a
TFRecord SRC is read by :func:`formats.read_tfrecords`' tasks, so those reach every storage
``pyarrow.fs`` reaches. ``--to parquet`` writes with Spark's own Parquet writer (and reads a
Parquet SRC with ``spark.read.parquet``): a remote URL there needs the Hadoop connector for its
scheme in Spark's JVM, which is checked before the job starts.

Nothing heavy is imported at module import: Spark loads in :func:`run`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

__all__ = ["add_arguments", "run"]

_EXIT_USAGE = 2
_EXIT_FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``dataplane export``'s options on ``parser``."""
    parser.description = (
        "Convert SRC (a Parquet dataset, or TFRecords written by this tool) to DST as TFRecord "
        "files of tf.train.Example plus a _tf_schema.json, or as Parquet. Paths may be local, "
        "file://, s3:// or hdfs:// URLs; --to parquet writes with Spark's own Parquet writer, "
        "so a remote URL there needs Spark's Hadoop connector for it (s3a:// with hadoop-aws)."
    )
    parser.add_argument("src", metavar="SRC", help="source dataset: a file, a directory or a "
                        "quoted glob pattern ('data/day=*/part-*')")
    parser.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    parser.add_argument("--to", choices=["tfrecord", "parquet"], required=True, help="output format")
    parser.add_argument("--from", dest="source_format", choices=["auto", "parquet", "tfrecord"],
                        default="auto",
                        help="SRC format (default auto: TFRecord when SRC holds a _tf_schema.json "
                             "or *.tfrecord* files, else Parquet)")
    parser.add_argument("--compression", default=None,
                        help="tfrecord: gzip or zlib (default none); parquet: snappy (default), "
                             "gzip, zstd or none")
    parser.add_argument("--src-compression", default=None, choices=["gzip", "zlib"],
                        help="TFRecord SRC only: how its files are compressed (default: from its "
                             "_tf_schema.json or each file's suffix, .gz / .zlib)")
    parser.add_argument("--sample", type=int, default=1000, metavar="N",
                        help="TFRecord SRC without a _tf_schema.json: records to infer the "
                             "schema from (default 1000); a feature none of them has fails "
                             "the export rather than being dropped")
    parser.add_argument("--num-files", type=int, default=None, metavar="N",
                        help="write N files (repartitions; default one per partition)")
    parser.add_argument("--master", default=None, metavar="URL",
                        help="Spark master (default: embedded local[*]); sc://host:port uses "
                             "Spark Connect")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty DST (--to tfrecord: once the job has "
                             "succeeded; --to parquet: Spark's writer empties it first)")
    parser.add_argument("--flatten-structs", action="store_true",
                        help="write struct columns as 'parent.child' features")


def _fail(message: str, code: int = _EXIT_USAGE, *, verbose: int = 0) -> int:
    """A one-line error on stderr (with ``verbose`` (-v), the traceback of the exception being
    handled first)."""
    if verbose and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"dataplane export: error: {' '.join(str(message).split())}", file=sys.stderr)
    return code


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover


class _Bar:
    """A one-line progress bar on stderr when it is a terminal; otherwise (a log file, CI) a
    line every ``every`` seconds, once the export has run that long."""

    def __init__(self, label: str, every: float = 30.0) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()
        self.drawn = False
        self.started = time.perf_counter()
        self.every = every
        self.next_line = self.started + every

    def __call__(self, done: int, total: int) -> None:
        if total <= 0:
            return
        now = time.perf_counter()
        secs = now - self.started
        if not self.tty:
            if now >= self.next_line:
                sys.stderr.write(f"{self.label}: {done}/{total} tasks, {secs:.0f} s\n")
                sys.stderr.flush()
                self.next_line = now + self.every
            return
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tasks {secs:5.1f}s"
        )
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _spark(master: str | None, verbose: int = 0) -> Any:
    from pyspark.sql import SparkSession

    from dataplane.cli.console import spark_log_level

    builder = SparkSession.builder.appName("dataplane-export")
    if master and master.startswith("sc://"):
        return builder.remote(master).getOrCreate()
    # Executors' Python must be this interpreter (the one with pyarrow and this package); the
    # CLI owns its process, so setting the variable PySpark reads is fine here.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = builder.master(master or "local[*]").config("spark.ui.enabled", "false")
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    local_ip = os.environ.get("SPARK_LOCAL_IP")
    if local_ip:
        builder = builder.config("spark.driver.host", local_ip).config(
            "spark.driver.bindAddress", local_ip
        )
    spark = builder.getOrCreate()
    if threading.current_thread() is threading.main_thread():
        # PySpark's SIGINT handler calls into the JVM from inside the signal, in the middle of
        # the py4j call this thread waits in: it fails, with tracebacks. The CLI owns its
        # process: Ctrl-C ends it, and the JVM's jobs with it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Not ERROR: a failed task's traceback is an ERROR line, and the one-line message says it.
    spark.sparkContext.setLogLevel(spark_log_level(verbose))
    return spark


def _is_tfrecord_source(loc: Any) -> bool:
    from pyarrow import fs as pafs

    from formats.schemafile import SCHEMA_FILE_NAME

    info = loc.filesystem.get_file_info(loc.path)
    if info.type == pafs.FileType.File:
        return ".tfrecord" in os.path.basename(loc.path)
    if info.type == pafs.FileType.NotFound:  # a glob pattern
        from formats.fs import list_files

        return any(".tfrecord" in os.path.basename(p) for p in list_files(loc))
    if loc.filesystem.get_file_info(f"{loc.path.rstrip('/')}/{SCHEMA_FILE_NAME}").type == pafs.FileType.File:
        return True
    entries = loc.filesystem.get_file_info(pafs.FileSelector(loc.path))
    return any(".tfrecord" in os.path.basename(e.path) for e in entries)


def _jvm_cannot_reach(spark: Any, urls: list[str]) -> str | None:
    """Why Spark's JVM cannot open one of ``urls`` (no Hadoop filesystem for its scheme), or None.

    ``--to parquet`` goes through Spark's own Parquet reader and writer, which reach remote
    storage through Hadoop connectors (``s3a://`` needs hadoop-aws); our readers and the
    TFRecord export use ``pyarrow.fs`` instead. Not checked under Spark Connect (no JVM here).
    """
    from urllib.parse import urlsplit

    try:
        jsc = spark.sparkContext._jsc
    except Exception:  # noqa: BLE001 - Spark Connect: the server's JVM decides
        return None
    for url in urls:
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("", "file") or len(scheme) == 1:  # a local path (or a Windows drive)
            continue
        try:
            spark.sparkContext._jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(
                scheme, jsc.hadoopConfiguration())
        except Exception as exc:  # noqa: BLE001 - py4j's error carries the Java one
            why = _spark_error_text(exc)
            fix = ("for S3, put hadoop-aws on Spark's classpath (spark.jars.packages="
                   "org.apache.hadoop:hadoop-aws:<its Hadoop version> in spark-defaults.conf) "
                   "and use s3a:// URLs" if scheme.startswith("s3") else
                   f"put the Hadoop connector for {scheme}:// on Spark's classpath")
            return (f"--to parquet writes with Spark's own Parquet writer (and reads a Parquet "
                    f"SRC with spark.read.parquet), and this Spark cannot open {url}: {why}. "
                    f"Either {fix}, or export --to tfrecord, whose tasks reach {scheme}:// "
                    f"through pyarrow.")
    return None


def _spark_error_text(exc: BaseException) -> str:
    """The useful line of a Spark/py4j error (:func:`dataplane.errors.spark_job_error`), our
    own errors raised in a task shown from their class name on."""
    from dataplane.errors import spark_job_error

    text = _cli_words(spark_job_error(exc, max_lines=1))
    for marker in ("NotTextError: ", "SchemaError: ", "RecordError: ", "StorageError: ", "FeedError: "):
        if marker in text:
            return ("SchemaError: " if marker == "NotTextError: " else marker) + text.split(marker, 1)[1].strip()
    return text


def _cli_words(text: str) -> str:
    """Our errors' fixes in the Python API's words, said as this command's options."""
    text = text.replace(
        "pass a schema with a binary type",
        "a larger --sample N, whose records then hold such a value: the column is inferred "
        "as binary")
    if "compression='GZIP'" in text and "--src-compression" not in text:
        text += " (here: --src-compression gzip or zlib)"
    return text


def _remove_output(loc: Any, created: bool) -> None:
    try:
        if created:
            loc.filesystem.delete_dir(loc.path)
    except (OSError, FileNotFoundError):
        pass


def run(args: argparse.Namespace) -> int:
    """Run the export; returns the process exit code."""
    from pyarrow import fs as pafs

    from dataplane.errors import DataplaneError
    from formats.fs import resolve, storage_error

    if args.sample < 1:
        return _fail(f"--sample must be at least 1, got {args.sample}.")
    if args.num_files is not None and args.num_files < 1:
        return _fail(f"--num-files must be at least 1, got {args.num_files}.")
    try:
        src = resolve(args.src)
        dst = resolve(args.dst)
        if src.filesystem.get_file_info(src.path).type == pafs.FileType.NotFound:
            if not any(c in src.path for c in "*?["):
                return _fail(f"SRC {args.src} does not exist; check the path.")
            from formats.fs import list_files

            list_files(src)  # a glob pattern (data/day=*/part-*): it must match data files
        dst_info = dst.filesystem.get_file_info(dst.path)
        if dst_info.type == pafs.FileType.File:
            return _fail(f"DST {args.dst} is a file; give a directory path.")
        dst_created = dst_info.type == pafs.FileType.NotFound
        dst_empty = dst_created or not dst.filesystem.get_file_info(pafs.FileSelector(dst.path))
        if not dst_empty and not args.overwrite:
            return _fail(f"DST {args.dst} exists and is not empty; choose a new path or pass --overwrite.")
        if not dst_empty:
            from formats.staging import check_not_reading_from

            check_not_reading_from(args.dst, [args.src])
        source_format = args.source_format
        if source_format == "auto":
            source_format = "tfrecord" if _is_tfrecord_source(src) else "parquet"
        if args.to == "tfrecord":
            from formats.tfrecord import normalize_compression

            try:
                compression = normalize_compression(args.compression)
            except ValueError:
                return _fail(f"--compression {args.compression!r} is not a TFRecord compression; "
                             f"use gzip or zlib (TFRecord's GZIP / ZLIB), or leave it out.")
        else:
            compression = (args.compression or "snappy").lower()
            if compression not in ("snappy", "gzip", "zstd", "none", "uncompressed", "lz4"):
                return _fail(f"--compression {args.compression!r} is not a Parquet codec; use "
                             f"snappy, gzip, zstd or none.")
        if source_format == "parquet":
            problem = _check_parquet(src, flatten_structs=args.flatten_structs)
            if problem:
                return _fail(problem)
    except (DataplaneError, ValueError) as exc:
        return _fail(str(exc), verbose=getattr(args, "verbose", 0))
    except OSError as exc:  # listing SRC or DST: credentials, a missing bucket, the endpoint
        return _fail(str(storage_error(exc, "reach", f"{args.src} or {args.dst}")),
                     verbose=getattr(args, "verbose", 0))

    started = time.perf_counter()
    spark = _spark(args.master, getattr(args, "verbose", 0))
    try:
        if args.to == "parquet":  # Spark's own Parquet writer (and reader, for a Parquet SRC)
            jvm_urls = [args.src, args.dst] if source_format == "parquet" else [args.dst]
            problem = _jvm_cannot_reach(spark, jvm_urls)
            if problem:
                _remove_output(dst, dst_created)
                return _fail(problem)
        return _export(spark, args, src, dst, dst_created, source_format, compression, started)
    except KeyboardInterrupt:
        _remove_output(dst, dst_created)
        raise
    finally:
        from dataplane.cli.console import jvm_exited_line

        if not (args.master or "").startswith("sc://") and jvm_exited_line(spark) is None:
            spark.stop()  # (a JVM that has exited cannot be stopped: py4j's error would follow ours)


def _export(spark: Any, args: argparse.Namespace, src: Any, dst: Any, dst_created: bool,
            source_format: str, compression: Any, started: float) -> int:
    import formats
    from dataplane.errors import DataplaneError
    from formats.export import job_progress

    if source_format == "parquet" and args.to == "tfrecord":
        return _parquet_to_tfrecord(spark, args, dst, dst_created, compression, started)
    try:
        if source_format == "tfrecord":
            df = formats.read_tfrecords(spark, args.src, compression=args.src_compression,
                                        sample=args.sample)
        else:
            from formats.sparkframe import read_parquet

            df = read_parquet(spark, args.src)
        if not df.columns:
            return _fail(f"SRC {args.src} has no columns.")
        if df.isEmpty():
            return _fail(f"SRC {args.src} has no rows; there is nothing to export.")
    except DataplaneError as exc:
        hint = " (here: --src-compression gzip or zlib)" if getattr(exc, "maybe_compressed", False) else ""
        return _fail(f"cannot read SRC {args.src}: {_cli_words(str(exc) + hint)}", verbose=getattr(args, "verbose", 0))
    except Exception as exc:  # noqa: BLE001 - Spark's AnalysisException and friends
        return _fail(f"cannot read SRC {args.src} as {source_format}: {_spark_error_text(exc)}",
                     verbose=getattr(args, "verbose", 0))

    bar = _Bar(f"export -> {args.to}")
    try:
        if args.to == "tfrecord":
            res = formats.write_tfrecords(
                df, args.dst, compression=compression, num_files=args.num_files,
                mode="overwrite" if args.overwrite else "error",
                flatten_structs=args.flatten_structs, progress=bar,
            )
            rows, files, nbytes = res.rows, res.files, res.bytes
        else:
            out = df.repartition(args.num_files) if args.num_files else df
            with job_progress(spark, bar):
                # (an existing DST is empty here unless --overwrite: Spark refuses any that exists)
                out.write.mode("errorifexists" if dst_created else "overwrite").option(
                    "compression", "none" if compression == "uncompressed" else compression
                ).parquet(args.dst)
            rows, files, nbytes = _parquet_stats(dst)
    except Exception as exc:  # noqa: BLE001 - ours (DataplaneError) or a failed Spark job
        return _failed(spark, exc, bar, dst, dst_created, getattr(args, "verbose", 0))
    bar.close()
    return _summary(args, rows, files, nbytes, started)


def _parquet_to_tfrecord(spark: Any, args: argparse.Namespace, dst: Any, dst_created: bool,
                         compression: Any, started: float) -> int:
    """Parquet -> TFRecord with the tasks reading the Parquet files themselves (no JVM rows)."""
    import formats

    bar = _Bar("export -> tfrecord")
    try:
        res = formats.parquet_to_tfrecords(
            spark, args.src, args.dst, compression=compression, num_files=args.num_files,
            mode="overwrite" if args.overwrite else "error",
            flatten_structs=args.flatten_structs, progress=bar,
        )
    except Exception as exc:  # noqa: BLE001 - ours (DataplaneError) or a failed Spark job
        return _failed(spark, exc, bar, dst, dst_created, getattr(args, "verbose", 0))
    bar.close()
    return _summary(args, res.rows, res.files, res.bytes, started)


def _failed(spark: Any, exc: Exception, bar: "_Bar", dst: Any, dst_created: bool, verbose: int) -> int:
    """End a failed export: close the bar, remove partial output, report on stderr."""
    from dataplane.cli.console import jvm_exited_line
    from dataplane.errors import DataplaneError

    bar.close()
    _remove_output(dst, dst_created)
    gone = jvm_exited_line(spark)
    if gone is not None:
        return _fail(gone, _EXIT_FAILED, verbose=verbose)
    if isinstance(exc, DataplaneError):
        return _fail(_cli_words(str(exc)), verbose=verbose)
    return _fail(f"the export job failed: {_spark_error_text(exc)}", _EXIT_FAILED, verbose=verbose)


def _summary(args: argparse.Namespace, rows: int, files: int, nbytes: int, started: float) -> int:
    secs = time.perf_counter() - started
    print(
        f"exported {rows:,} rows from {args.src} to {args.dst} ({args.to}): {files} files, "
        f"{_human_bytes(nbytes)} in {secs:.1f} s ({rows / secs if secs else 0:,.0f} rows/s)"
    )
    if args.to == "tfrecord":
        note = _nulls_note(args.dst)
        if note:
            print(note)
    return 0


def _nulls_note(dst: str) -> str | None:
    """Columns whose nulls became absent features: a reader refuses them without a fill."""
    from formats.schemafile import find_schema_file

    try:
        schema = find_schema_file(dst)
    except Exception:  # noqa: BLE001 - the export succeeded; this note is a courtesy
        return None
    nulls = {k: v for k, v in (schema.null_counts if schema else {}).items() if v}
    if not nulls:
        return None
    listed = ", ".join(f"{k!r} ({v:,})" for k, v in sorted(nulls.items()))
    fills = ", ".join(f"{k!r}: ..." for k in sorted(nulls))
    return (f"note: null values were written as absent features in {listed}; reading them back "
            f"needs fill_values={{{fills}}} (or leave those columns out)")


def _check_parquet(src: Any, *, flatten_structs: bool) -> str | None:
    """Why a Parquet SRC cannot be exported (unreadable, a column TF cannot hold, no rows), or None.

    Reads only the footers, on this machine, so these mistakes cost no Spark start-up.
    """
    from dataplane.errors import SchemaError, StorageError
    from feeders.parquet import plan_parquet
    from formats.schema import column_specs

    # Every file's footer, as the pull reader reads them: a file that is not Parquet and
    # columns whose type differs between files are named here, before Spark starts.
    try:
        plan = plan_parquet(src.url, filesystem=src.filesystem)
    except StorageError as exc:
        return f"cannot read SRC {src.url} as Parquet: {exc}"
    except SchemaError as exc:
        return f"SRC {src.url} cannot be exported: {exc}"
    if not plan.schema.names:
        return (f"SRC {src.url} has no columns ({src.display(plan.files[0])} and the rest); "
                f"write it from a DataFrame with at least one column.")
    try:
        column_specs(plan.schema, flatten_structs=flatten_structs)
    except SchemaError as exc:
        return f"SRC {src.url} cannot be exported: {exc}"
    if plan.num_rows == 0:
        return f"SRC {src.url} has no rows; there is nothing to export."
    return None


def _parquet_stats(loc: Any) -> tuple[int, int, int]:
    """(rows, files, bytes) of the Parquet files just written, from their footers."""
    import pyarrow.parquet as pq
    from pyarrow import fs as pafs

    rows = files = nbytes = 0
    for entry in loc.filesystem.get_file_info(pafs.FileSelector(loc.path, recursive=True)):
        name = os.path.basename(entry.path)
        if entry.type != pafs.FileType.File or name.startswith(("_", ".")):
            continue
        with loc.filesystem.open_input_file(entry.path) as f:
            rows += pq.ParquetFile(f).metadata.num_rows
        files += 1
        nbytes += entry.size or 0
    return rows, files, nbytes
