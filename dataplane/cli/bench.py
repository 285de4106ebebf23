"""``dataplane bench``: time every data path of a scenario against its peers and ceilings.

Two modes: the project's synthetic tables (``--rows``, ``--table``), or the user's own data
set (``--data URL`` with ``pull-parquet``, ``pull-tfrecord`` or ``push``; see
:mod:`benchmarks.userdata`), which also says where ours' time goes.

Imports nothing heavy at module import: Spark, TensorFlow and the scenario modules load in
:func:`run`, so ``dataplane bench --help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

__all__ = ["add_arguments", "run"]

_SCENARIOS = ["push", "pull-parquet", "pull-tfrecord", "pull-s3", "export", "train"]
QUICK_ROWS = 2000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``dataplane bench``'s options on ``parser``."""
    parser.description = (
        "Run every path of a scenario on the same deterministic data, alternating repetitions, "
        "and report median rows/s, MB/s and the ratio of ours to each peer and ceiling. "
        "Progress goes to stderr, a markdown table to stdout, the full results to --json."
    )
    parser.add_argument("scenario", choices=_SCENARIOS + ["all"], help="what to measure")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows in the numeric table (default 200000; --quick: 2000)")
    parser.add_argument("--mnist-rows", type=int, default=None,
                        help="rows in the MNIST-shaped table (default rows/10: its rows are "
                             "46x wider)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the full results here as JSON (the table goes to stdout)")
    parser.add_argument("--peers", default=None,
                        help="comma-separated non-ours paths to run (default: all), "
                             "e.g. tfos,spark-mapinarrow")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="render a bar chart (rows/s per path on a linear axis from zero, so "
                             "heights compare as the ratios do) from the JSON")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small data, one repetition, no optional extras")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per path (default 3; --quick: 1)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per repetition for the train scenario (default 5)")
    parser.add_argument("--table", choices=["numeric", "mnist", "image", "both", "all"], default=None,
                        help="table(s) to run on: both = numeric and mnist, all = also image "
                             "(48 KiB rows) (default: each scenario's own choice; push runs all "
                             "three)")
    parser.add_argument("--image-rows", type=int, default=None,
                        help="rows in the image table (default rows/100: its rows are 723x "
                             "wider than numeric's)")
    data = parser.add_argument_group(
        "your own data (pull-parquet, pull-tfrecord, push)",
        "Run every path that applies on a data set instead of the synthetic tables, and show "
        "where ours' time goes. The schema found is printed first.",
    )
    data.add_argument("--data", metavar="URL", default=None,
                      help="a file or directory: local path, file://, s3:// (endpoint and keys "
                           "from the AWS variables) or hdfs://")
    data.add_argument("--columns", default=None, help="comma-separated columns to read (default all)")
    data.add_argument("--shapes", default=None,
                      help="per-row shapes of list columns, e.g. image=784 or image=28x28,mask=4 "
                           "(dense tensors instead of ragged)")
    data.add_argument("--label", default=None, help="a column yielded apart as the label")
    data.add_argument("--fill", default=None, metavar="COL=VALUE,...",
                      help="a value for each null of these columns, e.g. rating=0,comment= "
                           "(TF tensors cannot hold nulls; the readers' fill_values)")
    data.add_argument("--limit", type=int, default=None, metavar="ROWS",
                      help="read only the first ROWS rows (default all)")
    data.add_argument("--batch-size", type=int, default=1024, help="rows per batch (default 1024)")
    parser.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    parser.add_argument("--idle-wait", type=float, default=None, metavar="SECONDS",
                        help="before each pass wait up to this long for the CPUs to go idle "
                             "(default 10, --quick 0; 0 never waits: on a machine others share "
                             "it would wait the whole time every pass)")
    parser.add_argument("--driver-memory", default="4g", help="Spark driver memory (default 4g)")


def _checkout_on_path() -> str | None:
    """``benchmarks/`` is not installed: find it beside the (editable) ``dataplane`` package.

    Returns:
        None when ``benchmarks`` is importable, else what is wrong and how to fix it.
    """
    try:
        import benchmarks  # noqa: F401

        return None
    except ImportError:
        pass
    import dataplane

    checkout = Path(dataplane.__file__).resolve().parents[1]
    if not (checkout / "benchmarks" / "harness.py").is_file():
        return (
            f"dataplane bench needs a source checkout: no benchmarks/ beside "
            f"{checkout / 'dataplane'}; run it from a clone of the repository installed with "
            f"`pip install -e .`"
        )
    sys.path.insert(0, str(checkout))
    return None


class _Progress:
    """Progress on stderr: the lines as they come, and on a terminal a bar of passes below them."""

    WIDTH = 30

    def __init__(self, stream: TextIO, *, bar: bool) -> None:
        self.stream = stream
        self.bar = bar
        self.state: tuple[int, int] | None = None

    def _draw(self) -> None:
        if self.bar and self.state is not None:
            done, total = self.state
            filled = int(self.WIDTH * done / total) if total else self.WIDTH
            self.stream.write(f"\r\033[K[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{total} passes")
            self.stream.flush()

    def line(self, text: str) -> None:
        if self.bar and self.state is not None:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self._draw()
        self.stream.flush()

    def tick(self, done: int, total: int) -> None:
        self.state = (done, total)
        self._draw()

    def close(self) -> None:
        if self.bar and self.state is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()
        self.state = None


def _fail(args: argparse.Namespace, message: str) -> int:
    """A one-line error (the traceback too with -v); exit status 2."""
    if getattr(args, "verbose", 0) and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"dataplane bench: error: {message}", file=sys.stderr)
    return 2


def _write_outputs(doc: dict[str, Any], args: argparse.Namespace, progress: Any) -> None:
    from benchmarks import report

    json_path = Path(args.json).resolve() if args.json else None
    plot_path = Path(args.plot).resolve() if args.plot else None
    if json_path is not None:
        # A single (scenario, table) run writes the bare scenario object (the documented
        # shape); anything more writes {"scenarios": [...]} with the stack and machine on top.
        out = doc["scenarios"][0] if len(doc["scenarios"]) == 1 else doc
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    sys.stdout.write(report.markdown(doc))
    if plot_path is not None:
        report.plot(doc, plot_path)
        progress(f"plot written to {plot_path}")
    if json_path is not None:
        progress(f"results written to {json_path}")


def _idle_wait(args: argparse.Namespace) -> float:
    """--idle-wait, else 10 s (0 for --quick, whose numbers mean nothing anyway)."""
    if args.idle_wait is not None:
        return max(0.0, float(args.idle_wait))
    return 0.0 if args.quick else 10.0


def _failed(doc: dict[str, Any]) -> list[str]:
    return [
        f"{sc['scenario']}/{sc.get('table')}" + (f" {r['path']}" if r else "")
        for sc in doc["scenarios"]
        for r in (sc["results"] or [None])
        if (r is None and sc.get("error")) or (r is not None and not r["ok"] and r["kind"] == "ours")
    ]


def _run_on_data(args: argparse.Namespace) -> int:
    """``--data URL``: describe the data set (one-line errors), then time every path on it."""
    from benchmarks import userdata

    given = [f"--{n.replace('_', '-')}" for n in ("rows", "mnist_rows", "image_rows", "table", "epochs")
             if getattr(args, n) is not None]
    if given:
        return _fail(args, f"{', '.join(given)} choose synthetic tables; with --data the data is yours")
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if reps < 1 or args.batch_size < 1:
        return _fail(args, f"--reps and --batch-size must be >= 1 (got {reps}, {args.batch_size})")
    peers = _peer_list(args)
    unknown = _unknown_peers(peers, userdata.DATA_PATH_NAMES.get(args.scenario, frozenset()))
    if unknown:
        return _fail(args, unknown)
    progress = _Progress(sys.stderr, bar=sys.stderr.isatty())
    try:
        spec = userdata.DataSpec(
            url=args.data,
            columns=[c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None,
            shapes=userdata.parse_shapes(args.shapes),
            label=args.label,
            limit=args.limit,
            batch_size=args.batch_size,
            fill=userdata.parse_fill(args.fill),
        )
        with contextlib.redirect_stdout(sys.stderr):
            described = userdata.describe(spec, args.scenario, progress=progress.line)
    except userdata.DataError as exc:
        return _fail(args, str(exc))
    progress.line(userdata.header(described))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            doc = userdata.run_on_data(
                args.scenario, described, reps=reps, peers=peers, master=args.master,
                driver_memory=args.driver_memory, progress=progress.line, tick=progress.tick,
                idle_wait=_idle_wait(args),
            )
    finally:
        progress.close()
    _write_outputs(doc, args, progress.line)
    failed = _failed(doc)
    if failed:
        progress.line("failed: " + ", ".join(failed))
        return 1
    return 0


def _peer_list(args: argparse.Namespace) -> list[str] | None:
    return [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else None


def _unknown_peers(peers: list[str] | None, names: frozenset[str]) -> str | None:
    """The error for --peers names that no path of the run's scenarios has (a typo would run
    only our paths), checked before anything starts."""
    unknown = [p for p in peers or () if p not in names]
    if not unknown or not names:
        return None
    return (f"--peers names no path of this run: {', '.join(unknown)}; "
            f"the paths are: {', '.join(sorted(names))}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0 when every path that could run ran ok, else 1."""
    problem = _checkout_on_path()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.data is not None:
        return _run_on_data(args)
    if any(getattr(args, n) is not None for n in ("columns", "shapes", "label", "limit", "fill")):
        return _fail(args, "--columns, --shapes, --label, --fill and --limit need --data URL")
    from benchmarks import harness

    rows = args.rows if args.rows is not None else (QUICK_ROWS if args.quick else 200_000)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if rows < 1 or reps < 1 or (args.epochs is not None and args.epochs < 1):
        print(f"dataplane bench: --rows, --reps and --epochs must be >= 1 "
              f"(got {rows}, {reps}, {args.epochs})", file=sys.stderr)
        return 2
    peers = _peer_list(args)
    scenarios = _SCENARIOS if args.scenario == "all" else [args.scenario]
    unknown = _unknown_peers(peers, frozenset().union(*(harness.PATH_NAMES.get(s, ()) for s in scenarios)))
    if unknown:
        return _fail(args, unknown)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # stdout carries only the table: anything a peer prints (Petastorm's cache messages) goes
    # to stderr with the progress lines.
    with contextlib.redirect_stdout(sys.stderr):
        doc = harness.run_bench(
            scenarios, rows=rows, mnist_rows=args.mnist_rows, image_rows=args.image_rows,
            reps=reps, quick=args.quick,
            peers=peers, table=args.table, master=args.master, driver_memory=args.driver_memory,
            progress=progress, idle_wait=_idle_wait(args), epochs=args.epochs,
        )
    _write_outputs(doc, args, progress)
    failed = _failed(doc)
    if failed:
        progress("failed: " + ", ".join(failed))
        return 1
    return 0
