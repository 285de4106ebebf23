"""``dataplane bench``: time every data path of a scenario against its peers and ceilings.

Imports nothing heavy at module import: Spark, TensorFlow and the scenario modules load in
:func:`run`, so ``dataplane bench --help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

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
    parser.add_argument("--json", metavar="PATH", required=True, help="write the results here")
    parser.add_argument("--peers", default=None,
                        help="comma-separated non-ours paths to run (default: all), "
                             "e.g. tfos,spark-mapinarrow")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="render a bar chart (rows/s per path, log scale) from the JSON")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small data, one repetition, no optional extras")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per path (default 3; --quick: 1)")
    parser.add_argument("--table", choices=["numeric", "mnist", "both"], default=None,
                        help="table(s) to run on (default: each scenario's own choice; "
                             "push runs both)")
    parser.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
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


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0 when every path that could run ran ok, else 1."""
    problem = _checkout_on_path()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from benchmarks import harness, report

    rows = args.rows if args.rows is not None else (QUICK_ROWS if args.quick else 200_000)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if rows < 1 or reps < 1:
        print(f"dataplane bench: --rows and --reps must be >= 1 (got {rows}, {reps})",
              file=sys.stderr)
        return 2
    peers = [p.strip() for p in args.peers.split(",") if p.strip()] if args.peers else None
    scenarios = _SCENARIOS if args.scenario == "all" else [args.scenario]
    json_path = Path(args.json).resolve()
    plot_path = Path(args.plot).resolve() if args.plot else None

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # stdout carries only the table: anything a peer prints (Petastorm's cache messages) goes
    # to stderr with the progress lines.
    with contextlib.redirect_stdout(sys.stderr):
        doc = harness.run_bench(
            scenarios, rows=rows, mnist_rows=args.mnist_rows, reps=reps, quick=args.quick,
            peers=peers, table=args.table, master=args.master, driver_memory=args.driver_memory,
            progress=progress,
        )
    # A single (scenario, table) run writes the bare scenario object (the documented shape);
    # anything more writes {"scenarios": [...]} with the stack and machine on top.
    out = doc["scenarios"][0] if len(doc["scenarios"]) == 1 else doc
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    sys.stdout.write(report.markdown(doc))
    if plot_path is not None:
        report.plot(doc, plot_path)
        progress(f"plot written to {plot_path}")
    progress(f"results written to {json_path}")
    failed = [
        f"{sc['scenario']}/{sc.get('table')}" + (f" {r['path']}" if r else "")
        for sc in doc["scenarios"]
        for r in (sc["results"] or [None])
        if (r is None and sc.get("error")) or (r is not None and not r["ok"] and r["kind"] == "ours")
    ]
    if failed:
        progress("failed: " + ", ".join(failed))
        return 1
    return 0
