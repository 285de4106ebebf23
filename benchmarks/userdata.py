"""``dataplane bench SCENARIO --data URL``: every path that applies, on the user's own data.

:func:`describe` checks the data set before anything is timed (it exists, the format is the one
the scenario reads, the columns exist, ``--shapes`` fit the rows: ours' reader produces its
first batch) and says what it found: format, files, rows, and the schema as TF will see it.
Anything wrong is a :class:`DataError` with a one-line message.

:func:`run_on_data` then runs the scenario through the harness like a synthetic one (warm-up,
alternating repetitions, medians, ratios) with the paths of :mod:`benchmarks.userdata_pull` or
:mod:`benchmarks.userdata_push`, plus the ``stage`` paths that say where ours' time goes
(:mod:`benchmarks.breakdown`). Spark starts only for ``push``.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["DATA_SCENARIOS", "DATA_PATH_NAMES", "DataError", "DataSpec", "Described", "parse_shapes", "parse_fill", "describe", "run_on_data"]

DATA_SCENARIOS = ("pull-parquet", "pull-tfrecord", "push")
# scenario -> every path name its --data build may return (what `--peers` is checked against)
DATA_PATH_NAMES: dict[str, frozenset[str]] = {
    "pull-parquet": frozenset({"parquet", "pyarrow-raw", "petastorm", "tfio", "read", "decode"}),
    "pull-tfrecord": frozenset({"tfrecord", "tfdata-tuned", "tfdata-sequential", "read", "decode"}),
    "push": frozenset({"flight-push", "spark-mapinarrow", "flight-raw", "node-buffer"}),
}
BATCH_SIZE = 1024


class DataError(ValueError):
    """The data set or the options given for it cannot be benchmarked (one-line message)."""


@dataclass
class DataSpec:
    """What the user asked for.

    Attributes:
        url: local path, ``file://``, ``s3://`` or ``hdfs://`` URL of a file or directory.
        columns: the columns to read (default: all).
        shapes: declared per-row shapes of list columns (dense tensors instead of ragged).
        label: a column yielded apart as the label (read in any case).
        limit: read only the first ``limit`` rows (default: all).
        batch_size: rows per batch on every path.
        fill: per-column value for nulls (absent features), as the readers' ``fill_values``:
            text from ``--fill`` until :func:`describe` types it by the column's dtype.
    """

    url: str
    columns: list[str] | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    label: str | None = None
    limit: int | None = None
    batch_size: int = BATCH_SIZE
    fill: dict[str, Any] = field(default_factory=dict)

    def wanted(self, names: Sequence[str]) -> list[str]:
        """The columns read, in order: ``columns`` (default all of ``names``), then the label."""
        out = list(self.columns) if self.columns else list(names)
        if self.label is not None and self.label not in out:
            out.append(self.label)
        return out


def parse_shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """``"image=784,mask=28x28"`` -> ``{"image": (784,), "mask": (28, 28)}``."""
    out: dict[str, tuple[int, ...]] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, eq, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not eq or not name.strip() or not shape or any(d < 1 for d in shape):
            raise DataError(
                f"--shapes: {item!r} is not COLUMN=DIMS; write e.g. image=784 or image=28x28 "
                f"(positive sizes, 'x' between dimensions, ',' between columns)"
            )
        out[name.strip()] = shape
    return out


def parse_fill(text: str | None) -> dict[str, str]:
    """``"rating=0,comment="`` -> ``{"rating": "0", "comment": ""}`` (typed later, by column)."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise DataError(
                f"--fill: {item!r} is not COLUMN=VALUE; write e.g. rating=0 or rating=0,comment= "
                f"(',' between columns; an empty VALUE fills a string column with '')"
            )
        if name.strip() in out:
            raise DataError(f"--fill names column {name.strip()!r} twice")
        out[name.strip()] = value.strip()
    return out


def _typed_fill(name: str, dtype: str, text: Any) -> Any:
    """``--fill``'s text for column ``name`` as the value its ``dtype`` takes."""
    if not isinstance(text, str):  # given typed (the Python API)
        return text
    try:
        if dtype == "string":
            return text
        if dtype == "bool":
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        if dtype.startswith(("int", "uint")):
            return int(text)
        return float(text)
    except (KeyError, ValueError):
        want = {"bool": "true or false"}.get(dtype, "an integer" if dtype.startswith(("int", "uint"))
                                             else "a number")
        raise DataError(
            f"--fill {name}={text}: column {name!r} is {dtype}, so its fill value must be {want}"
        ) from None


def _with_fills(spec: DataSpec, specs: list[Any]) -> list[Any]:
    """``specs`` with ``spec.fill`` typed and set on them (``spec.fill`` typed in place)."""
    import dataclasses

    from formats.schema import check_fill_value

    by_name = {s.name: s for s in specs}
    for name in spec.fill:
        if name not in by_name:
            raise DataError(f"--fill: column {name!r} is not among the columns read "
                            f"({', '.join(by_name)})")
    typed = {n: _typed_fill(n, by_name[n].dtype, v) for n, v in spec.fill.items()}
    for name, value in typed.items():
        try:
            check_fill_value(name, by_name[name].dtype, value)
        except ValueError as exc:
            raise DataError(f"--fill: {one_line(exc)}") from exc
    spec.fill = typed
    return [dataclasses.replace(s, fill=typed[s.name]) if s.name in typed else s for s in specs]


def _unfilled_nulls(spec: DataSpec, plan: Any, specs: list[Any]) -> None:
    """Refuse, naming every one of them, the scalar columns read whose footers count nulls
    and that ``--fill`` does not cover (the readers stop at the first)."""
    from feeders.parquet.plan import null_counts
    from formats.schema import fill_example

    counts = null_counts(plan.metadata)
    bad = [s for s in specs if not s.shape and s.fill is None and counts.get(s.name)]
    if not bad:
        return
    listed = ", ".join(f"{s.name!r} ({counts[s.name]:,})" for s in bad)
    example = ",".join(f"{s.name}={'' if s.dtype == 'string' else fill_example(s.arrow_type)}"
                       for s in bad)
    raise DataError(
        f"{spec.url}: column(s) with nulls, which TensorFlow tensors cannot hold: {listed}; "
        f"give each a value with --fill {example}, or leave them out with --columns"
    )


@dataclass
class Described:
    """What :func:`describe` found.

    Attributes:
        spec: the request.
        format: ``parquet`` or ``tfrecord``.
        location: the resolved location (``feeders.fs.Location``).
        files: the data files (paths on ``location.filesystem``).
        total_rows: rows in the whole data set.
        rows: rows a pass reads (``total_rows``, or ``limit`` when smaller).
        row_bytes: bytes per row of the tensors ours yields (from its first batch).
        schema_lines: the schema as printed (one line per column).
        columns: the columns read, in order (the label included).
        plan: the reader's plan (``ParquetPlan`` / ``TFRecordPlan``).
        specs: the columns' ``formats.ColumnSpec``, ``--shapes`` applied.
    """

    spec: DataSpec
    format: str
    location: Any
    files: list[str]
    total_rows: int
    rows: int
    row_bytes: int
    schema_lines: list[str]
    columns: list[str]
    plan: Any
    specs: list[Any]

    def as_json(self) -> dict[str, Any]:
        """The ``data`` object of the JSON."""
        return {
            "url": self.spec.url,
            "format": self.format,
            "files": len(self.files),
            "total_rows": self.total_rows,
            "rows": self.rows,
            "limit": self.spec.limit,
            "columns": self.columns,
            "label": self.spec.label,
            "shapes": {k: list(v) for k, v in self.spec.shapes.items()},
            "row_bytes": self.row_bytes,
            "batch_size": self.spec.batch_size,
            "fill": dict(self.spec.fill),
            "schema": self.schema_lines,
        }


def one_line(exc: BaseException) -> str:
    """An exception as one line: TensorFlow's multi-line errors cut to their first line."""
    text = str(exc).strip() or type(exc).__name__
    if type(exc).__module__.startswith("tensorflow"):
        first = _TF_FUNCTION_NODE.sub("", text.splitlines()[0]).strip()
        # an error our reader raised inside tf.data: its own text is the message
        ours = re.match(r"(?:\w+\.)*(\w+Error): (.*)", first)
        text = f"{ours.group(1)}: {ours.group(2)}" if ours else f"{type(exc).__name__}: {first}"
    return " ".join(text.split())


#: TensorFlow's prefix on an error raised inside a dataset function, e.g.
#: ``{{function_node __wrapped__IteratorGetNext_output_types_2_device_/job:localhost/...}}``
_TF_FUNCTION_NODE = re.compile(r"\{\{function_node [^}]*\}\}")


def _sniff_parquet(loc: Any, path: str) -> bool:
    """Whether ``path`` starts with Parquet's magic bytes."""
    try:
        with loc.filesystem.open_input_file(path) as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def _locate(spec: DataSpec) -> tuple[Any, list[str], str]:
    """Resolve the URL and list its data files; returns (location, files, format seen)."""
    from feeders.fs import list_files, resolve

    try:
        loc = resolve(spec.url)
        files = list_files(loc, accept=lambda p: not p.endswith((".json", ".crc", ".txt", ".md")))
    except (OSError, ValueError) as exc:  # StorageError is an OSError; bad URLs ValueErrors
        raise DataError(f"--data {spec.url}: {one_line(exc)}") from exc
    if not files:
        raise DataError(f"--data {spec.url}: no data files there")
    try:
        empty = loc.filesystem.get_file_info(files[0]).size == 0
    except OSError:
        empty = False
    if empty:  # (sniffed, it read as "not Parquet", with advice to use another scenario)
        raise DataError(f"--data {spec.url}: {loc.display(files[0])} is empty (0 bytes); remove "
                        f"it or write it again")
    return loc, files, "parquet" if _sniff_parquet(loc, files[0]) else "tfrecord"


def _check_names(spec: DataSpec, names: Sequence[str]) -> None:
    known = set(names)
    for what, wanted in (("--columns", spec.columns or []), ("--label", [spec.label] if spec.label else []),
                         ("--shapes", list(spec.shapes))):
        for name in wanted:
            if name not in known:
                raise DataError(
                    f"{what}: column {name!r} is not in {spec.url}; its columns are "
                    f"{', '.join(names)}"
                )


def _spec_line(s: Any, arrow: Any = None, spec: DataSpec | None = None) -> str:
    if s.is_ragged:
        shape = "[" + ", ".join("None" if d is None else str(d) for d in s.shape) + "] (ragged)"
    else:
        shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
    notes = []
    if spec is not None and s.name in spec.shapes:
        notes.append("--shapes")
    if spec is not None and s.name == spec.label:
        notes.append("label")
    if spec is not None and s.name in spec.fill:
        notes.append(f"nulls -> {spec.fill[s.name]!r}")
    source = f"{arrow} -> " if arrow is not None else ""
    return f"{s.name}: {source}tf.{s.dtype} {shape}" + (f" ({', '.join(notes)})" if notes else "")


def _parquet(spec: DataSpec, loc: Any, progress: Callable[[str], None]) -> tuple[Any, list[Any], list[str], int]:
    from dataplane.cli.console import SlowStep
    from feeders.parquet import plan_parquet
    from formats.schema import column_specs

    shown = SlowStep(progress)

    def on_footer(done: int, files: int) -> None:
        shown.tick(done, files, f"reading the footers of {files:,} Parquet files (schema, rows, null counts)",
                   lambda took: f"  read {done:,}/{files:,} footers in {took:.0f} s")

    try:
        plan = plan_parquet(spec.url, on_footer=on_footer)
    except (OSError, ValueError) as exc:
        raise DataError(f"--data {spec.url}: {one_line(exc)}") from exc
    names = list(plan.schema.names)
    _check_names(spec, names)
    wanted = spec.wanted(names)
    try:
        specs = column_specs(plan.schema, columns=wanted, shapes=spec.shapes or None)
    except (ValueError, TypeError) as exc:
        raise DataError(f"{spec.url}: {one_line(exc)}") from exc
    specs = _with_fills(spec, specs)
    _unfilled_nulls(spec, plan, specs)
    lines = [_spec_line(s, plan.schema.field(s.name).type, spec) for s in specs]
    return plan, specs, lines, plan.num_rows


def _count_records(loc: Any, plan: Any, progress: Callable[[str], None]) -> int:
    """Records in all of ``plan``'s files, every one read to its end (CRC-checked): silent for
    a data set that counts quickly, otherwise lines on how far it is (``SlowStep``)."""
    from dataplane.cli.console import SlowStep
    from feeders.tfrecord import count_records

    files = list(plan.files)
    shown = SlowStep(progress)
    total = 0
    for i, path in enumerate(files, 1):
        total += count_records(loc, path, plan.compression)
        shown.tick(i, len(files), f"counting the records of {len(files):,} TFRecord files: the whole data set "
                   f"is read once (a _tf_schema.json giving num_rows, as `dataplane export` writes, skips this)",
                   lambda took: f"  counted {i:,}/{len(files):,} files, {total:,} records, in {took:.0f} s")
    return total


def _tfrecord(spec: DataSpec, loc: Any, progress: Callable[[str], None]) -> tuple[Any, list[Any], list[str], int]:
    import dataclasses

    from feeders.tfrecord import plan_tfrecord

    try:
        plan = plan_tfrecord(spec.url)
    except (OSError, ValueError) as exc:
        raise DataError(f"--data {spec.url}: {one_line(exc)}") from exc
    names = [s.name for s in plan.specs]
    _check_names(spec, names)
    by_name = {s.name: s for s in plan.specs}
    specs = []
    for name in spec.wanted(names):
        s = by_name[name]
        if name in spec.shapes:
            s = dataclasses.replace(s, shape=tuple(spec.shapes[name]), ragged_rank=0)
        specs.append(s)
    specs = _with_fills(spec, specs)
    plan.specs = [next((t for t in specs if t.name == s.name), s) for s in plan.specs]
    lines = [_spec_line(s, None, spec) for s in specs]
    if plan.schema_file is not None and plan.schema_file.num_rows is not None:
        total = int(plan.schema_file.num_rows)
    else:
        try:
            total = _count_records(loc, plan, progress)
        except (OSError, ValueError) as exc:
            raise DataError(f"--data {spec.url}: {one_line(exc)}") from exc
    return plan, specs, lines, total


def ours_dataset(d: Described, *, filesystem: Any = None) -> Any:
    """Ours' reader on the data set, as the scenario times it."""
    import feeders

    spec = d.spec
    cols = [c for c in d.columns if c != spec.label] if spec.label else d.columns
    if d.format == "parquet":
        return feeders.parquet_dataset(
            spec.url, columns=cols, batch_size=spec.batch_size, label=spec.label,
            shapes=spec.shapes or None, fill_values=spec.fill or None, filesystem=filesystem,
        )
    return feeders.tfrecord_dataset(
        spec.url, schema=d.plan.specs, columns=cols, batch_size=spec.batch_size, label=spec.label,
        fill_values=spec.fill or None, filesystem=filesystem,
    )


def _tensor_bytes(batch: Any) -> tuple[int, int]:
    """(rows, bytes) of one batch of ours (a dict, or (features, label))."""
    parts = list(batch[0].values()) + [batch[1]] if isinstance(batch, tuple) else list(batch.values())
    rows = int(parts[0].shape[0])
    nbytes = 0
    for t in parts:
        flat = getattr(t, "flat_values", t)
        if flat.dtype.name == "string":
            nbytes += sum(len(v) for v in flat.numpy().ravel())
        else:
            nbytes += int(flat.numpy().nbytes)
    return rows, nbytes


def describe(spec: DataSpec, scenario: str, *, progress: Callable[[str], None] = lambda line: None) -> Described:
    """Check ``spec`` for ``scenario`` and say what the data set is (see the module doc).
    ``progress`` gets a line now and then while a long step runs (many Parquet footers read;
    TFRecord files that no schema file counts read to their ends).

    Raises:
        DataError: a bad URL, an unknown column, a shape that does not fit the rows, or data
            in a format the scenario cannot read (a one-line message).
    """
    if scenario not in DATA_SCENARIOS:
        raise DataError(
            f"--data works with {', '.join(DATA_SCENARIOS)}, not {scenario!r} (the other scenarios "
            f"measure synthetic tables only)"
        )
    if spec.limit is not None and spec.limit < 1:
        raise DataError(f"--limit must be >= 1, got {spec.limit}")
    if "://" not in spec.url:  # the run changes directory: a relative path must not move
        spec.url = str(Path(spec.url).expanduser().resolve())
    loc, files, seen = _locate(spec)
    wanted = {"pull-parquet": "parquet", "pull-tfrecord": "tfrecord"}.get(scenario, seen)
    if wanted != seen:
        other = "pull-parquet" if seen == "parquet" else "pull-tfrecord"
        raise DataError(
            f"{scenario} reads {wanted} files but {loc.display(files[0])} "
            + ("is Parquet (it starts with PAR1)" if seen == "parquet" else "is not Parquet")
            + f"; use `dataplane bench {other}` or `push` for this data"
        )
    plan, specs, lines, total = _parquet(spec, loc, progress) if seen == "parquet" else _tfrecord(spec, loc, progress)
    rows = min(total, spec.limit) if spec.limit else total
    if rows < 1:
        raise DataError(f"--data {spec.url}: the data set has no rows")
    d = Described(spec, seen, loc, list(plan.files), total, rows, 0, lines, spec.wanted([s.name for s in specs]), plan, specs)
    # The first batch proves the shapes fit and the format reads, and gives bytes per row.
    try:
        first = next(iter(ours_dataset(d).take(1)))
        n, nbytes = _tensor_bytes(first)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises becomes one line
        hint = ""
        if spec.shapes:
            shown = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in spec.shapes.items())
            hint = f" (does --shapes {shown} fit every row?)"
        text = one_line(exc)
        fix = re.search(r"fill_values=\{'([^']+)': ([^}]*)\}", text)
        if fix:  # the readers' fix, as bench spells it
            value = fix.group(2).strip("'\"")
            text += f" (here: --fill {fix.group(1)}={value}, or leave the column out with --columns)"
        raise DataError(f"{spec.url}: the first batch cannot be read{hint}: {text}") from exc
    d.row_bytes = max(1, math.ceil(nbytes / max(1, n)))
    return d


def header(d: Described) -> str:
    """The schema block printed before anything runs."""
    where = f"{d.format}, {len(d.files)} file{'s' if len(d.files) != 1 else ''}"
    rows = f"{d.total_rows:,} rows" + (f", reading the first {d.rows:,}" if d.rows < d.total_rows else "")
    source = {
        "schema file": "; schema from _tf_schema.json", "inferred": "; schema inferred from the first records",
    }.get(getattr(d.plan, "schema_source", None) or "", "; schema from the Parquet footers")
    lines = [f"data: {d.spec.url} ({where}, {rows}{source}; {d.row_bytes:,} bytes a row as tensors)"]
    lines += [f"  {line}" for line in d.schema_lines]
    return "\n".join(lines)


class DataEnv:
    """The harness's ``env`` for a run on the user's data (see ``harness.BenchEnv``)."""

    def __init__(self, described: Described, *, spark: Any, workdir: Path, quick: bool = False) -> None:
        self.described = described
        self.spark = spark
        self.workdir = Path(workdir)
        self.quick = quick
        self.table_name = "data"
        self.rows = described.rows
        self.ours_path: Any = None  # set by the scenario's build(), read by its breakdown()
        self._frame: Any = None

    def rows_of(self, kind: str | None = None) -> int:
        return self.rows

    def row_bytes(self, kind: str | None = None) -> int:
        return self.described.row_bytes

    def dataframe(self, kind: str | None = None, *, rows: int | None = None) -> Any:
        """The data set as a cached, materialised DataFrame (push only)."""
        if self._frame is None:
            from benchmarks.userdata_push import read_frame

            self._frame = read_frame(self.spark, self.described)
        return self._frame

    def release(self) -> None:
        if self._frame is not None:
            try:
                self._frame.unpersist()
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
            self._frame = None


def run_on_data(
    scenario: str,
    described: Described,
    *,
    reps: int = 3,
    warmup: bool = True,
    peers: Sequence[str] | None = None,
    master: str = "local[*]",
    driver_memory: str = "4g",
    progress: Callable[[str], None] = lambda line: None,
    tick: Callable[[int, int], None] | None = None,
    idle_wait: float = 10.0,
) -> dict[str, Any]:
    """Run ``scenario`` on ``described`` and return the report (as ``harness.run_bench``)."""
    import importlib

    from benchmarks import harness

    module = importlib.import_module(
        "benchmarks.userdata_push" if scenario == "push" else "benchmarks.userdata_pull"
    )
    root = Path(tempfile.mkdtemp(prefix="dataplane-bench-data-"))
    stack, machine = harness.stack_info(), harness.machine_info()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stack": stack, "machine": machine,
        "master": master if scenario == "push" else None, "quick": False, "scenarios": [],
    }
    old_pythonpath = os.environ.get("PYTHONPATH")
    checkout = str(Path(__file__).resolve().parents[1])
    parts = [p for p in (old_pythonpath or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([checkout] + [p for p in parts if p != checkout])
    old_cwd = os.getcwd()
    os.chdir(root)
    spark = None
    env = None
    try:
        if scenario == "push":
            progress(f"starting Spark ({master}) on {machine['cores']} cores")
            spark = harness.spark_session(master, driver_memory=driver_memory)
            report["master"] = spark.sparkContext.master
        env = DataEnv(described, spark=spark, workdir=root / "work")
        env.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        obj = harness.run_scenario(
            env, scenario, reps=reps, warmup=warmup, peers=peers, progress=progress,
            module=module, tick=tick, idle_wait=idle_wait,
        )
        obj["wall_seconds"] = round(time.perf_counter() - t0, 1)
        obj["data"] = described.as_json()
        obj.update(date=report["date"], stack=stack, machine=machine)
        report["scenarios"].append(obj)
    finally:
        if env is not None:
            env.release()
        os.chdir(old_cwd)
        if spark is not None:
            spark.stop()
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
        shutil.rmtree(root, ignore_errors=True)
    return report
