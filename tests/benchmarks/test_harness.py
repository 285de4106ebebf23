"""The harness's wait for an idle machine before each timed repetition, its path-neutral
warm-up, and the train scenario's bound arithmetic and report lines."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import wait_until_idle

_SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_waits_while_every_core_is_busy():
    seconds = 1.5
    spinners = [
        subprocess.Popen([sys.executable, "-c", _SPIN.format(s=seconds)])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        time.sleep(0.3)  # let them start spinning
        waited = wait_until_idle(timeout=8.0)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    # it cannot call the machine idle before the spinners end (~1.2 s after it started)
    assert waited >= 1.0, waited
    assert waited <= 8.5, waited


def test_train_bound_arithmetic():
    from benchmarks.train import bound

    # 2 cores; Spark hands the rows over in 0.62 s using 1.16 core-s; an in-memory epoch takes
    # 0.56 s and 0.765 CPU-s: the first epoch needs (1.16 + 0.765) / 2 = 0.9625 s at least,
    # so 5 epochs take 0.9625 + 4 * 0.56 s against 5 * 0.56 s in memory
    b = bound(5, 2, (0.62, 1.16), (0.56, 0.765))
    assert b["first_epoch_min_seconds"] == pytest.approx(0.9625)
    assert b["best_ratio"] == pytest.approx(2.8 / 3.2025)
    # Spark's wall time dominates when it cannot use the cores (one core, a slow handoff)
    b = bound(10, 1, (2.0, 1.0), (0.5, 0.5))
    assert b["first_epoch_min_seconds"] == pytest.approx(2.0)
    assert b["best_ratio"] == pytest.approx(5.0 / 6.5)


def test_train_report_states_both_bounds():
    from benchmarks.report import _train_lines

    sc = {"scenario": "train", "table": "mnist", "epochs": 5, "bound": {
        "cores": 2, "spark_handoff_seconds": 0.6, "spark_handoff_core_seconds": 1.1,
        "best_cache_vs_in_memory": 0.87, "ours_of_best": 0.8,
        "flight_handoff_seconds": 0.9, "flight_handoff_core_seconds": 1.7,
        "best_flight_fed_vs_in_memory": 0.78, "ours_of_flight_best": 0.9,
    }}
    targets = {"cache_vs_in_memory": {"ratio": 0.70, "target": 0.9, "within_target": False}}
    lines = _train_lines(sc, targets)
    assert "runs at 0.70x in-memory (target >= 0.9x: MISSES)" in lines[0]
    assert any("no feed passes 0.87x in-memory at 5 epochs; flight-push-cache is at 80% of it" in l
               for l in lines), lines
    assert any("bound over Flight" in l and "(0.90 s, 1.70 core-s)" in l
               and "no Flight-fed fit passes 0.78x in-memory; flight-push-cache is at 90% of it" in l
               for l in lines), lines
    # a run without the Flight measurement prints only Spark's bound
    del sc["bound"]["best_flight_fed_vs_in_memory"]
    assert not any("bound over Flight" in l for l in _train_lines(sc, targets))


_CLOCK = [0.0]  # the fake time.perf_counter's reading


class _Timed:
    """Stands in for a DataFrame: each ``mapInArrow(...).collect()`` takes the next duration
    on a fake clock (real sleeps of 10-20 ms were measured 50 ms longer on a busy machine)."""

    def __init__(self, durations):  # type: ignore[no-untyped-def]
        self.durations = list(durations)
        self.calls = 0

    def mapInArrow(self, fn, schema):  # type: ignore[no-untyped-def]
        return self

    def collect(self):  # type: ignore[no-untyped-def]
        _CLOCK[0] += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1
        return []


def test_jvm_warm_up_runs_until_the_passes_stop_getting_faster(monkeypatch):
    from benchmarks.paths import warm_jvm

    monkeypatch.setattr(time, "perf_counter", lambda: _CLOCK[0])

    # getting faster, then flat: the eighth pass is the first no faster than the median of
    # the three before it (0.07 s)
    df = _Timed([0.20, 0.16, 0.13, 0.11, 0.09, 0.07, 0.07, 0.08, 0.07])
    s = warm_jvm(df)
    assert df.calls == 8 and len(s) == 8, s
    assert s[0] == pytest.approx(0.20) and s[-1] == pytest.approx(0.08)
    # never fewer than min_passes, never more than max_passes
    slower = [0.010 + 0.002 * i for i in range(12)]  # never faster: stops at min_passes
    for least in (4, 8):
        df = _Timed(slower)
        assert len(warm_jvm(df, min_passes=least)) == least and df.calls == least
    assert len(warm_jvm(_Timed(slower))) == 8  # the default
    faster = _Timed([0.05 - 0.004 * i for i in range(12)])
    assert len(warm_jvm(faster, max_passes=6)) == 6


def test_harness_runs_a_scenarios_warm_before_the_paths():
    import types

    from benchmarks.harness import run_scenario
    from benchmarks.paths import BenchPath

    order = []
    module = types.SimpleNamespace(
        build=lambda env: [BenchPath("flight-push", lambda: order.append("run") or 10, nbytes=80)],
        warm=lambda env: order.append("warm") or "JVM warm-up: 3 passes",
    )
    env = types.SimpleNamespace(table_name="numeric", rows_of=lambda: 10, row_bytes=lambda: 8)
    lines = []
    out = run_scenario(env, "push", reps=2, module=module, progress=lines.append, idle_wait=0)
    assert order == ["warm", "run", "run", "run"]  # warm, the path's warm-up, two repetitions
    assert "[push/numeric] JVM warm-up: 3 passes" in lines
    assert out["results"][0]["rep_rows"] == [10, 10]
    order.clear()
    run_scenario(env, "push", reps=1, warmup=False, module=module, progress=lines.append, idle_wait=0)
    assert order == ["run"]  # a quick run warms nothing


def test_spread_repetitions_are_flagged_and_taint_the_train_verdict():
    from benchmarks.harness import unsteady_line
    from benchmarks.report import _notes, _train_lines
    from benchmarks.train import _target

    # the compat run of 2026-11-25 23:35: in-memory at 2.62, 3.93, 3.91 s
    mem = {"path": "in-memory", "ok": True, "rep_seconds": [2.62, 3.93, 3.91], "spread": 3.93 / 2.62,
           "rows_per_s": 76_700.0}
    ours = {"path": "flight-push-cache", "ok": True, "rep_seconds": [3.84, 3.99, 4.29],
            "spread": 4.29 / 3.84, "rows_per_s": 75_200.0, "ratio_vs": {"in-memory": 0.98}}
    line = unsteady_line(mem)
    assert line is not None and line.startswith("in-memory: repetitions took 2.62-3.93 s (1.50x apart)")
    assert unsteady_line(ours) is None  # 1.12x apart: steady enough
    assert unsteady_line({**mem, "rep_seconds": [2.62], "spread": 1.0}) is None

    t = _target([ours, mem], "in-memory", 0.9)
    assert t["within_target"] is True and t["unsteady"] == ["in-memory"]
    sc = {"scenario": "train", "table": "mnist", "epochs": 5, "results": [ours, mem]}
    lines = _train_lines(sc, {"cache_vs_in_memory": t})
    assert "(target >= 0.9x: meets (unsteady: in-memory; not a result))" in lines[0], lines
    assert any("in-memory: repetitions took 2.62-3.93 s" in n for n in _notes([sc])), _notes([sc])
    # steady on both sides: a plain verdict
    steady = _target([ours, {**mem, "rep_seconds": [3.9, 3.91, 3.93], "spread": 3.93 / 3.9}], "in-memory", 0.9)
    assert "unsteady" not in steady


def test_every_bench_path_name_is_in_the_api_doc():
    # --peers takes these names and the JSON reports them: a user must be able to look each up
    from pathlib import Path

    from benchmarks import harness, userdata

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    names = set().union(*harness.PATH_NAMES.values(), *userdata.DATA_PATH_NAMES.values())
    assert len(names) > 20
    assert sorted(n for n in names if f"`{n}`" not in text) == []
