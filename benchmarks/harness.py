"""The benchmark runner: one SparkSession, the same data for every path, alternating repetitions.

A scenario is a module with ``build(env) -> list[BenchPath]`` (see :mod:`benchmarks.paths`).
Optionally it also defines ``TABLES`` (the table kinds it runs on by default),
``extra(env, results) -> dict`` (scenario-specific measurements merged into its JSON object,
e.g. push's memory-under-backpressure check) and ``breakdown(env, out) -> dict`` (where ours'
time goes, from the ``stage`` paths' timings: see :mod:`benchmarks.breakdown`).

Paths of kind ``stage`` (the partial pipelines a breakdown is computed from) are timed in the
same alternating rounds as the others but are kept out of ``results`` and the ratios: their
timings go to the scenario's ``stages`` object.

For each (scenario, table) the runner builds the paths, runs the scenario's ``warm(env)`` if it
has one (a path-neutral warm-up, e.g. Spark's JIT: it returns one line saying what it did), runs
each path once untimed (warm-up), then ``reps`` timed rounds that alternate the paths (A1 B1 C1 A2 B2 C2 ...) so machine drift hits
every side, and reports medians. A path whose ``run`` raises is reported ``ok: false`` with the
error text; the other paths go on.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa

from benchmarks import data
from benchmarks.paths import BenchPath

__all__ = [
    "SCENARIOS",
    "PATH_NAMES",
    "BenchEnv",
    "machine_info",
    "stack_info",
    "spark_session",
    "run_scenario",
    "run_bench",
    "wait_until_idle",
    "cpu_times",
    "UNSTEADY_SPREAD",
    "unsteady_line",
]

# A path whose slowest repetition took this many times its fastest ran on a machine that was
# not steady: ratios against its median are flagged as unreliable (seen: an in-memory fit at
# 2.62, 3.93 and 3.91 s in one compat run, which turned 0.68x into a "meeting" 0.98x).
UNSTEADY_SPREAD = 1.25

logger = logging.getLogger(__name__)

# scenario name -> module holding build(env)
SCENARIOS: dict[str, str] = {
    "push": "benchmarks.push",
    "pull-parquet": "benchmarks.pull_parquet",
    "pull-tfrecord": "benchmarks.pull_tfrecord",
    "pull-s3": "benchmarks.pull_s3",
    "export": "benchmarks.export",
    "train": "benchmarks.train",
}

# scenario -> every path name its build(env) may return (the quick-run test keeps this true):
# what `--peers` is checked against before anything starts
PATH_NAMES: dict[str, frozenset[str]] = {
    "push": frozenset({"flight-push", "spark-mapinarrow", "flight-raw", "tfos"}),
    "pull-parquet": frozenset({"parquet", "pyarrow-raw", "pyarrow-raw-thread", "pyarrow-scan",
                               "petastorm", "tfio"}),
    "pull-tfrecord": frozenset({"tfrecord", "tfdata-tuned", "tfdata-sequential"}),
    "pull-s3": frozenset({"tfrecord", "pyarrow-stream"}),
    "export": frozenset({"export", "export-parquet", "export-per-row", "export-parquet-per-row"}),
    "train": frozenset({"flight-push-cache", "flight-push", "in-memory", "petastorm-converter", "tfos"}),
}

Progress = Callable[[str], None]


def _no_progress(message: str) -> None:
    del message


class BenchEnv:
    """What a scenario's ``build(env)`` gets: the session, the data and a scratch directory.

    Attributes:
        spark: the bench process's one SparkSession.
        rows: rows in the ``numeric`` table (``mnist`` has ``mnist_rows``, ``image``
            ``image_rows``).
        mnist_rows: rows in the ``mnist`` table.
        image_rows: rows in the ``image`` table (48 KiB rows).
        workdir: scratch directory for this (scenario, table), removed afterwards.
        quick: True for the smoke run (tiny data, one repetition): skip optional extras.
        table_name: the table kind this run is about (``numeric``, ``mnist`` or ``image``).
        seed: the data seed.
        epochs: ``--epochs``: epochs per repetition for scenarios that train several
            (``train``); None: the scenario's own default.
    """

    def __init__(
        self,
        spark: Any,
        *,
        rows: int,
        mnist_rows: int,
        workdir: Path,
        quick: bool = False,
        table_name: str = "numeric",
        seed: int = 0,
        image_rows: int | None = None,
        epochs: int | None = None,
    ) -> None:
        self.spark = spark
        self.epochs = epochs
        self.rows = rows
        self.mnist_rows = mnist_rows
        self.image_rows = image_rows if image_rows is not None else max(1, rows // 100)
        self.workdir = Path(workdir)
        self.quick = quick
        self.table_name = table_name
        self.seed = seed
        self._tables: dict[tuple[str, int], pa.Table] = {}
        self._frames: dict[tuple[str, int], Any] = {}

    def rows_of(self, kind: str | None = None) -> int:
        """Rows the ``kind`` table has (default: this run's table)."""
        kind = kind or self.table_name
        return {"mnist": self.mnist_rows, "image": self.image_rows}.get(kind, self.rows)

    def row_bytes(self, kind: str | None = None) -> int:
        """Payload bytes per row of ``kind`` (default: this run's table)."""
        return data.row_bytes(kind or self.table_name)

    def table(self, kind: str | None = None, *, rows: int | None = None) -> pa.Table:
        """The deterministic ``kind`` table (default: this run's), optionally its first ``rows``."""
        kind = kind or self.table_name
        n = min(rows, self.rows_of(kind)) if rows is not None else self.rows_of(kind)
        key = (kind, n)
        if key not in self._tables:
            self._tables[key] = data.make_table(kind, n, seed=self.seed)
        return self._tables[key]

    def dataframe(self, kind: str | None = None, *, rows: int | None = None) -> Any:
        """The same data as :meth:`table` as a cached, materialised Spark DataFrame.

        Built once per (kind, rows) and kept for the whole bench process, so every path and
        every repetition reads the same cached partitions. It has as many partitions as a
        push reads a frame in (``TASKS_PER_SLOT`` per task slot), so the push's ``coalesce``
        changes nothing and every path runs the same tasks. ``createDataFrame`` alone makes
        one partition per 10,000 rows: 100 for a million numeric rows, where the push
        coalesced to 8 and the ceilings ran 100 tasks (our push then looked 2.4x faster
        than bare ``mapInArrow``), and one 480 MB partition for 10,000 image rows.
        """
        from dataplane.driver.pushjob import TASKS_PER_SLOT

        kind = kind or self.table_name
        n = min(rows, self.rows_of(kind)) if rows is not None else self.rows_of(kind)
        key = (kind, n)
        if key not in self._frames:
            pdf = self.table(kind, rows=n).to_pandas()
            parts = TASKS_PER_SLOT * max(1, int(self.spark.sparkContext.defaultParallelism))
            df = self.spark.createDataFrame(pdf, schema=data.spark_schema_ddl(kind))
            df = df.repartition(parts).cache()
            df.count()
            self._frames[key] = df
        return self._frames[key]

    def release(self) -> None:
        """Unpersist the cached DataFrames and forget the tables."""
        for df in self._frames.values():
            try:
                df.unpersist()
            except Exception:  # noqa: BLE001 - best effort on teardown
                logger.debug("unpersist failed", exc_info=True)
        self._frames.clear()
        self._tables.clear()


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def stack_info() -> dict[str, Any]:
    """Versions of the stack this process runs (read from package metadata; imports nothing)."""
    return {
        "name": Path(sys.prefix).name,  # the venv's name: "current" or "compat" here
        "python": platform.python_version(),
        "pyspark": _version("pyspark"),
        "tensorflow": _version("tensorflow-cpu", "tensorflow", "tf-nightly"),
        "pyarrow": _version("pyarrow"),
        "numpy": _version("numpy"),
        "tensorflowonspark": _version("tensorflowonspark"),
        "petastorm": _version("petastorm"),
        "tensorflow-io": _version("tensorflow-io"),
    }


def machine_info() -> dict[str, Any]:
    """Cores, memory and OS of this machine."""
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "platform": platform.platform(),
        "processor": platform.machine(),
    }


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_idle(*, busy_below: float = 0.15, window: float = 0.2, timeout: float = 10.0) -> float:
    """Wait until the machine's CPUs are less than ``busy_below`` busy over ``window`` seconds.

    Run before every timed repetition, so no path pays for what the previous one left running.
    Measured: the push path timed right after a TFoS repetition ran at 211-339k rows/s, and at
    396-452k when timed again straight after (TFoS's processes keep working for a few seconds
    after its ``train`` returns). Returns the seconds waited (at most ``timeout``; without
    /proc/stat it returns at once).
    """
    start = time.monotonic()
    before = cpu_times()
    if before is None:
        return 0.0
    while time.monotonic() - start < timeout:
        time.sleep(window)
        after = cpu_times()
        if after is None:
            break
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < busy_below:
            break
        before = after
    return time.monotonic() - start


def spark_session(master: str = "local[*]", *, driver_memory: str = "4g") -> Any:
    """The bench process's SparkSession: loopback only, UI off, executors on this Python.

    Sets ``SPARK_LOCAL_IP``/``PYSPARK_PYTHON`` only where unset (the CLI owns this process).
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName("dataplane-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _result(path: BenchPath, row_bytes: int) -> dict[str, Any]:
    return {
        "path": path.name,
        "rows_per_s": 0.0,
        "mb_per_s": 0.0,
        "seconds": 0.0,
        "ok": path.unavailable is None,
        "error": path.unavailable,
        "kind": path.kind,
        "rows": 0,
        "nbytes": 0,
        "rep_seconds": [],
        "rep_rows": [],
    }


def _finish(res: dict[str, Any], path: BenchPath, row_bytes: int) -> None:
    if not res["ok"] or not res["rep_seconds"]:
        return
    secs = res["rep_seconds"]
    rows = res["rep_rows"]
    rates = [r / s if s > 0 else 0.0 for r, s in zip(rows, secs)]
    res["seconds"] = statistics.median(secs)
    res["spread"] = max(secs) / min(secs) if min(secs) > 0 else 1.0
    res["rows"] = int(statistics.median(rows))
    res["rows_per_s"] = statistics.median(rates)
    per_row = (path.nbytes / res["rows"]) if (path.nbytes and res["rows"]) else row_bytes
    res["nbytes"] = int(per_row * res["rows"])
    res["mb_per_s"] = res["rows_per_s"] * per_row / 1e6


def verdict(within: bool | None, *, quick: bool = False, unsteady: list[str] | None = None) -> str:
    """What a run says of a target: "meets" or "MISSES" (with the paths whose repetitions were
    too spread to trust). A ``--quick`` run judges nothing: its one repetition on tiny data is
    mostly start-up, with no warm-up."""
    if quick:
        return "not judged: --quick times start-up, not the data plane"
    out = "meets" if within else "MISSES"
    if unsteady:
        out += f" (unsteady: {', '.join(unsteady)}; not a result)"
    return out


def unsteady_line(res: dict[str, Any]) -> str | None:
    """One line saying a path's repetitions were too spread to trust ratios against its median
    (:data:`UNSTEADY_SPREAD`), or None."""
    secs = res.get("rep_seconds") or []
    if not res.get("ok") or len(secs) < 2 or (res.get("spread") or 1.0) < UNSTEADY_SPREAD:
        return None
    return (f"{res['path']}: repetitions took {min(secs):.2f}-{max(secs):.2f} s "
            f"({res['spread']:.2f}x apart): the machine was not steady, so ratios against this "
            f"path are unreliable in this run; rerun on a quiet machine or with more --reps")


def _stages(paths: list[BenchPath], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The stage paths' timings: per stage its rep seconds and rows, median seconds, ok/error."""
    out = {}
    for p in paths:
        if p.kind != "stage":
            continue
        res = results.pop(p.name)
        secs = res["rep_seconds"]
        out[p.name] = {
            "ok": res["ok"] and bool(secs),
            "error": res["error"],
            "seconds": statistics.median(secs) if secs else 0.0,
            "rep_seconds": secs,
            "rep_rows": res["rep_rows"],
        }
    return out


def _ratios(results: list[dict[str, Any]]) -> None:
    others = [r for r in results if r["kind"] != "ours" and r["ok"] and r["rows_per_s"] > 0]
    for r in results:
        if r["kind"] == "ours" and r["ok"] and r["rows_per_s"] > 0:
            r["ratio_vs"] = {o["path"]: r["rows_per_s"] / o["rows_per_s"] for o in others}


def run_scenario(
    env: BenchEnv,
    scenario: str,
    *,
    reps: int = 3,
    warmup: bool = True,
    peers: Sequence[str] | None = None,
    progress: Progress = _no_progress,
    module: Any = None,
    tick: Callable[[int, int], None] | None = None,
    idle_wait: float = 10.0,
) -> dict[str, Any]:
    """Build and time one scenario on ``env.table_name``; returns its JSON object.

    Args:
        env: the bench environment (its ``table_name`` picks the table).
        scenario: a key of :data:`SCENARIOS`.
        reps: timed repetitions per path (>= 1), alternated across paths.
        warmup: run every path once untimed first (default True: JIT, worker start-up and
            caches are not what we measure).
        peers: if given, only these non-``ours`` paths run (``ours`` paths always run).
        progress: called with one line per step (the CLI prints it on stderr).
        module: the scenario module to use instead of ``SCENARIOS[scenario]`` (the
            ``--data`` mode's, :mod:`benchmarks.userdata`).
        tick: called with (passes done, passes in all) after every pass (a progress bar).
        idle_wait: the most seconds to wait for an idle machine before each pass (0: never).
    """
    if module is None and scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {sorted(SCENARIOS)}, got {scenario!r}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    label = f"{scenario}/{env.table_name}"
    row_bytes = env.row_bytes()
    out: dict[str, Any] = {
        "scenario": scenario,
        "table": env.table_name,
        "rows": env.rows_of(),
        "row_bytes": row_bytes,
        "reps": reps,
        "results": [],
    }
    try:
        if module is None:
            module = importlib.import_module(SCENARIOS[scenario])
        progress(f"[{label}] preparing {env.rows_of():,} rows and the paths")
        paths = list(module.build(env))
    except Exception as exc:  # noqa: BLE001 - a scenario that cannot start is reported, not fatal
        logger.debug("scenario %s failed to build", scenario, exc_info=True)
        out["error"] = _error_text(exc)
        progress(f"[{label}] cannot run: {out['error']}")
        return out
    out["path_names"] = sorted({p.name for p in paths})  # what --peers may name
    if peers is not None:
        wanted = set(peers)
        paths = [p for p in paths if p.kind in ("ours", "stage") or p.name in wanted]
    results = {p.name: _result(p, row_bytes) for p in paths}
    live = [p for p in paths if p.unavailable is None]
    for p in paths:
        if p.unavailable is not None:
            progress(f"[{label}] {p.name}: not run: {p.unavailable}")

    total = len(live) * (reps + (1 if warmup else 0))
    done = 0

    def _once(p: BenchPath, what: str) -> tuple[int, float] | None:
        nonlocal done
        try:
            return _timed(p, what)
        finally:
            done += 1
            if tick is not None:
                tick(done, total)

    def _timed(p: BenchPath, what: str) -> tuple[int, float] | None:
        res = results[p.name]
        settled = wait_until_idle(timeout=idle_wait) if idle_wait > 0 else 0.0
        if settled > 1.0:
            progress(f"[{label}] waited {settled:.1f} s for the machine to go idle")
        t0 = time.perf_counter()
        try:
            n = int(p.run())
        except Exception as exc:  # noqa: BLE001 - one failing path must not stop the others
            res["ok"] = False
            res["error"] = _error_text(exc)
            res["traceback"] = traceback.format_exc()[-4000:]
            progress(f"[{label}] {p.name} {what}: FAILED: {res['error']}")
            return None
        dt = time.perf_counter() - t0
        rate = n / dt if dt > 0 else 0.0
        progress(f"[{label}] {p.name} {what}: {n:,} rows in {dt:.2f} s ({rate:,.0f} rows/s)")
        return n, dt

    try:
        if warmup:
            warm = getattr(module, "warm", None)
            if warm is not None:
                progress(f"[{label}] {warm(env)}")
            for p in live:
                _once(p, "warm-up")
        for rep in range(reps):
            for p in live:
                if not results[p.name]["ok"]:
                    done += 1
                    continue
                got = _once(p, f"rep {rep + 1}/{reps}")
                if got is not None:
                    results[p.name]["rep_rows"].append(got[0])
                    results[p.name]["rep_seconds"].append(got[1])
    finally:
        for p in paths:
            if p.close is not None:
                try:
                    p.close()
                except Exception as exc:  # noqa: BLE001 - report, keep closing the rest
                    progress(f"[{label}] {p.name}: close failed: {_error_text(exc)}")
                    # close() verifies what the repetitions could not (e.g. final row counts)
                    res = results[p.name]
                    if res["ok"]:
                        res["ok"] = False
                        res["error"] = "on close: " + _error_text(exc)
    stages = _stages(paths, results)
    for p in paths:
        if p.kind != "stage":
            _finish(results[p.name], p, row_bytes)
    out["results"] = list(results.values())
    _ratios(out["results"])
    for res in out["results"]:
        line = unsteady_line(res)
        if line:
            progress(f"[{label}] {line}")
    if stages:
        out["stages"] = stages
    breakdown = getattr(module, "breakdown", None)
    if breakdown is not None:
        try:
            got = breakdown(env, out)
            if got:
                out["breakdown"] = got
        except Exception as exc:  # noqa: BLE001 - reported, never fatal
            out["breakdown_error"] = _error_text(exc)
            progress(f"[{label}] breakdown failed: {out['breakdown_error']}")
    extra = getattr(module, "extra", None)
    if extra is not None:
        try:
            out.update(extra(env, out["results"], progress=progress) or {})
        except Exception as exc:  # noqa: BLE001 - extras are reported, never fatal
            out["extra_error"] = _error_text(exc)
            progress(f"[{label}] extra measurements failed: {out['extra_error']}")
    return out


def _tables_for(module_name: str, requested: str | None, quick: bool) -> list[str]:
    """--table if given; else the scenario's ``TABLES`` (only the first of them when quick)."""
    if requested == "both":
        return ["numeric", "mnist"]
    if requested == "all":
        return ["numeric", "mnist", "image"]
    if requested:
        return [requested]
    try:
        module = importlib.import_module(module_name)
        tables = list(getattr(module, "TABLES", ("numeric",)))
    except Exception:  # noqa: BLE001 - the import error is reported by run_scenario
        tables = ["numeric"]
    return tables[:1] if quick else tables


def run_bench(
    scenarios: Sequence[str],
    *,
    rows: int,
    mnist_rows: int | None = None,
    image_rows: int | None = None,
    reps: int = 3,
    quick: bool = False,
    peers: Sequence[str] | None = None,
    table: str | None = None,
    master: str = "local[*]",
    driver_memory: str = "4g",
    workdir: Path | None = None,
    progress: Progress = _no_progress,
    idle_wait: float = 10.0,
    epochs: int | None = None,
) -> dict[str, Any]:
    """Run ``scenarios`` in this process and return the whole report (JSON-ready).

    The process changes its working directory to a scratch directory while Spark runs
    (TensorFlowOnSpark writes an ``executor_id`` file into the executors' working directory)
    and restores it afterwards.

    Returns:
        ``{"date", "stack", "machine", "master", "scenarios": [scenario objects]}``; every
        scenario object also carries ``stack`` and ``machine`` so it stands alone.
    """
    if rows < 1:
        raise ValueError(f"--rows must be >= 1, got {rows}")
    mnist_rows = mnist_rows or max(1, rows // 10)
    stack = stack_info()
    machine = machine_info()
    root = Path(tempfile.mkdtemp(prefix="dataplane-bench-", dir=workdir))
    old_cwd = os.getcwd()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "stack": stack,
        "machine": machine,
        "master": master,
        "quick": quick,
        "scenarios": [],
    }
    # Executors and TF nodes unpickle benchmark functions by module name: they need the
    # checkout on their path (benchmarks/ is not installed). Restored afterwards.
    old_pythonpath = os.environ.get("PYTHONPATH")
    checkout = str(Path(__file__).resolve().parents[1])
    parts = [p for p in (old_pythonpath or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([checkout] + [p for p in parts if p != checkout])
    os.chdir(root)
    spark = None
    try:
        progress(f"starting Spark ({master}) on {machine['cores']} cores")
        spark = spark_session(master, driver_memory=driver_memory)
        report["master"] = spark.sparkContext.master
        report["parallelism"] = spark.sparkContext.defaultParallelism
        for scenario in scenarios:
            for kind in _tables_for(SCENARIOS.get(scenario, ""), table, quick):
                wd = root / f"{scenario}-{kind}"
                wd.mkdir(parents=True, exist_ok=True)
                env = BenchEnv(
                    spark, rows=rows, mnist_rows=mnist_rows, workdir=wd, quick=quick,
                    table_name=kind, image_rows=image_rows, epochs=epochs,
                )
                t0 = time.perf_counter()
                try:
                    obj = run_scenario(
                        env, scenario, reps=reps, warmup=not quick, peers=peers,
                        progress=progress, idle_wait=idle_wait,
                    )
                finally:
                    env.release()
                    shutil.rmtree(wd, ignore_errors=True)
                obj["wall_seconds"] = round(time.perf_counter() - t0, 1)
                obj["date"] = report["date"]
                obj["stack"] = stack
                obj["machine"] = machine
                report["scenarios"].append(obj)
    finally:
        os.chdir(old_cwd)
        if spark is not None:
            spark.stop()
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
        shutil.rmtree(root, ignore_errors=True)
    return report
