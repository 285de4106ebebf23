"""`dataplane bench` end to end: a real quick run of every scenario, checked for structure and
row counts (never timings), plus the cheap checks on --help and on rendering from JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks import harness, report

REPO = Path(__file__).resolve().parents[2]
ROWS = 600
SCENARIO_PATHS = {
    "push": {"flight-push", "spark-mapinarrow", "flight-raw", "tfos"},
    "train": {"flight-push-cache", "flight-push", "in-memory", "petastorm-converter", "tfos"},
    "pull-s3": {"tfrecord", "pyarrow-stream"},
}
RESULT_KEYS = {"path", "rows_per_s", "mb_per_s", "seconds", "ok", "error"}
STACK_KEYS = {"python", "pyspark", "tensorflow", "pyarrow"}


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _compat_stack() -> bool:
    """The compat stack is the one where tensorflow-io and Petastorm are installed and usable."""
    return _installed("tensorflow-io") and _installed("petastorm")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `dataplane bench all --quick` in a subprocess (its own SparkSession and TF nodes)."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable, "-m", "dataplane.cli", "bench", "all", "--quick",
        "--rows", str(ROWS), "--mnist-rows", str(ROWS // 4),
        "--json", str(out / "bench.json"), "--plot", str(out / "bench.png"),
    ]
    # a temp folder of its own, so that another suite running beside this one (.ci/test runs
    # both stacks at once) cannot put its folders where this run's leftovers are looked for
    tmp = out / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        cmd, cwd=out, env={**_env(), "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=900,
    )
    return proc, out, _left_behind(tmp)


def _left_behind(tmp: Path) -> set[str]:
    """multiprocessing's temp folders (TFoS's managers listen on Unix sockets in them) and the
    CLI's quiet log4j2 configuration."""
    return {p.name for p in [*tmp.glob("pymp-*"), *tmp.glob("dataplane-log4j2-*")]}


@pytest.mark.slow
@pytest.mark.cluster
def test_quick_run_of_every_scenario(quick_run):
    proc, out, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-6000:]
    doc = json.loads((out / "bench.json").read_text())
    scenarios = doc["scenarios"]
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["memory_gb"] > 0
    assert {s["scenario"] for s in scenarios} == {
        "push", "pull-parquet", "pull-tfrecord", "pull-s3", "export", "train"
    }
    # --quick runs each scenario on its first table: push on numeric, train on mnist
    assert {(s["scenario"], s["table"]) for s in scenarios} >= {("push", "numeric"), ("train", "mnist")}
    compat = _compat_stack()
    for sc in scenarios:
        where = f"{sc['scenario']}/{sc['table']}"
        assert "error" not in sc, f"{where} failed to build: {sc.get('error')}"
        assert STACK_KEYS <= set(sc["stack"]) and all(sc["stack"][k] for k in STACK_KEYS)
        assert sc["rows"] == (ROWS if sc["table"] == "numeric" else ROWS // 4)
        assert sc["row_bytes"] == {"numeric": 68, "mnist": 3144}[sc["table"]]
        assert sc["results"], where
        names = {r["path"] for r in sc["results"]}
        assert set(sc["path_names"]) == names, where
        assert names <= harness.PATH_NAMES[sc["scenario"]], where  # what --peers is checked against
        if sc["scenario"] in SCENARIO_PATHS:
            assert names == SCENARIO_PATHS[sc["scenario"]], where
        assert any(r["kind"] == "ours" for r in sc["results"]), where
        for r in sc["results"]:
            assert RESULT_KEYS <= set(r), (where, r)
            if r["ok"]:
                assert r["error"] is None, (where, r)
                # every path delivered every row of its data (quick data is below any cap),
                # once per epoch where the scenario trains several (train: 5 per repetition)
                want = sc["rows"] * (sc["epochs"] if sc["scenario"] == "train" else 1)
                assert r["rows"] == want, (where, r["path"], r["rows"])
                assert r["rep_rows"] == [want], (where, r["path"])
                assert r["rows_per_s"] > 0 and r["seconds"] > 0
            else:
                # only a peer that cannot run on this stack may be missing, and it says why
                assert r["kind"] == "peer" and not compat, (where, r)
                assert r["path"] in {"petastorm", "tfio", "petastorm-converter"}, (where, r)
                assert "compat" in r["error"], (where, r["error"])
        for r in sc["results"]:
            if r["kind"] == "ours" and r["ok"]:
                others = {o["path"] for o in sc["results"] if o["kind"] != "ours" and o["ok"]}
                assert set(r["ratio_vs"]) == others, where
    train = next(s for s in scenarios if s["scenario"] == "train")
    _check_train(train, compat=compat)
    # the table on stdout and the plot come from the same JSON
    assert "| push | numeric | flight-push | ours |" in proc.stdout
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[push/numeric] flight-push" in proc.stderr  # progress went to stderr
    # one repetition of tiny data, start-up included, judges no target
    assert "not judged: --quick" in proc.stderr + proc.stdout
    assert "MISSES" not in proc.stderr + proc.stdout and "x: meets" not in proc.stderr + proc.stdout


@pytest.mark.slow
@pytest.mark.cluster
def test_quick_run_leaves_no_temp_folders_behind(quick_run):
    # the tfos peers (compat) used to leave one pymp-* folder per run: TFoS's manager socket;
    # every CLI run left its dataplane-log4j2-quiet-*.properties
    proc, _, left = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert left == set()


def _check_train(sc, *, compat):
    """bench train: 5 epochs per repetition, both push paths, the peers and the targets."""
    assert sc["epochs"] == 5 and sc["batch_size"] == 256
    by = {r["path"]: r for r in sc["results"]}
    assert by["flight-push-cache"]["kind"] == by["flight-push"]["kind"] == "ours"
    assert by["in-memory"]["kind"] == "ceiling"
    assert by["petastorm-converter"]["kind"] == by["tfos"]["kind"] == "peer"
    assert by["flight-push-cache"]["ok"] and by["flight-push"]["ok"] and by["in-memory"]["ok"]
    # the cache pushes once per repetition, the plain push once per epoch
    assert sc["spark_jobs_per_rep"] == {"flight-push-cache": [1], "flight-push": [5]}
    assert [len(e) for e in sc["node_fit_seconds_per_epoch"]["flight-push-cache"]] == [5]
    targets = sc["targets"]
    assert targets["cache_vs_in_memory"]["target"] == 0.9
    assert targets["cache_vs_in_memory"]["ratio"] > 0
    assert isinstance(targets["cache_vs_in_memory"]["within_target"], bool)
    pc = targets["cache_vs_petastorm_converter"]
    assert pc["target"] == 3.0
    if not compat:
        # a compat-only peer says which stack it needs, and the verdict says why it has none
        peer = by["petastorm-converter"]
        assert not peer["ok"] and "compat stack" in peer["error"], peer
        assert pc["ratio"] is None and "compat stack" in pc["why"]
    else:
        assert by["petastorm-converter"]["ok"], by["petastorm-converter"]["error"]
        assert pc["ratio"] > 0
    # the cached node's memory against its bound, from cluster.metrics()
    nodes = sc["cache_memory"]["nodes"]
    assert len(nodes) == 1
    (node,) = nodes.values()
    assert node["cache_rows"] == sc["rows"]
    assert 0 < node["cache_memory_bytes"] <= node["cache_bytes_limit"]
    assert node["cache_spilled_bytes"] == 0 and node["buffer_peak_bytes"] > 0
    assert sc["cache_memory"]["within_bound"] is True


def test_help_imports_neither_tensorflow_nor_spark():
    code = (
        "import sys\n"
        "from dataplane import cli\n"
        "try:\n"
        "    cli.main(['bench', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('tensorflow', 'pyspark', 'benchmarks.harness') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--peers" in proc.stdout and "--quick" in proc.stdout and "--plot" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def _doc():
    return {
        "date": "2026-01-01T00:00:00",
        "scenarios": [
            {
                "scenario": "push", "table": "numeric", "rows": 1000, "row_bytes": 68,
                "stack": {"python": "3.11", "pyspark": "4", "tensorflow": "2", "pyarrow": "26"},
                "machine": {"cores": 2, "memory_gb": 8},
                "results": [
                    {"path": "flight-push", "kind": "ours", "rows_per_s": 2000.0,
                     "mb_per_s": 0.136, "seconds": 0.5, "ok": True, "error": None,
                     "rows": 1000, "ratio_vs": {"tfos": 4.0}},
                    {"path": "tfos", "kind": "peer", "rows_per_s": 500.0, "mb_per_s": 0.034,
                     "seconds": 2.0, "ok": True, "error": None, "rows": 1000},
                    {"path": "petastorm", "kind": "peer", "rows_per_s": 0.0, "mb_per_s": 0.0,
                     "seconds": 0.0, "ok": False, "error": "needs the compat stack | x",
                     "rows": 0},
                ],
                "memory": {"slow_factor": 10, "limit_bytes": 2 << 20, "peak_bytes": 2 << 20,
                           "peak_over_limit": 1.0, "within_target": True},
            }
        ],
    }


def test_a_peer_name_no_scenario_has_is_an_error_before_anything_runs(capsys):
    # `--peers nosuch` ran only our paths and exited 0; then it was caught only after the run
    from dataplane import cli

    def bench(*args: str) -> tuple[int, str]:
        code = cli.main(["bench", *args, "--json", "/nonexistent/never-written.json"])
        return code, capsys.readouterr().err

    code, err = bench("push", "--peers", "tfos,nosuch")
    assert code == 2 and err == (
        "dataplane bench: error: --peers names no path of this run: nosuch; the paths are: "
        "flight-push, flight-raw, spark-mapinarrow, tfos\n")
    # a peer of another scenario is unknown to this one; `all` knows every scenario's
    code, err = bench("push", "--peers", "in-memory")
    assert code == 2 and "no path of this run: in-memory" in err
    code, err = bench("all", "--peers", "petastorm,in-memory,nosuch,tfdata-tuned")
    assert code == 2 and "no path of this run: nosuch; the paths are: export," in err
    assert "Traceback" not in err


def test_markdown_table_from_json():
    text = report.markdown(_doc())
    assert "| push | numeric | flight-push | ours | 1,000 | 2.0k | 0.136 | - | yes |" in text
    # MB/s in three figures: a slow peer on narrow rows is not 0.0
    assert "| push | numeric | tfos | peer | 1,000 | 500 | 0.034 | 4.00x | yes |" in text
    # a peer that could not run keeps its row, with the reason (pipes escaped for markdown)
    assert "| petastorm | peer |" in text and "no: needs the compat stack / x" in text
    # ... and no rows, as in the JSON (it showed the scenario's rows as if it had read them)
    assert "| push | numeric | petastorm | peer | - | - | - | - | no: " in text
    assert "target <= 1.10x: meets" in text
    # a bare scenario object and a list render the same rows
    single = report.markdown(_doc()["scenarios"][0])
    assert single.splitlines()[-4:] == text.splitlines()[-4:]


def test_plot_from_json(tmp_path):
    png = report.plot(_doc(), tmp_path / "b.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each bar says its rate and its ratio to ours (the log axis alone made 0.88x look like 20x)
    assert report.bar_labels(_doc()["scenarios"][0]) == [
        "2.0k rows/s", "500 rows/s\n0.25x ours", "n/a"]


def test_v_after_the_command_and_no_json_are_accepted():
    # `dataplane bench pull-parquet -v ...` was "unrecognized arguments: -v" though the error
    # lines say "-v shows the traceback"; the README's first --data example has no --json
    from dataplane.cli.script import _parser

    def parse(*argv: str):  # type: ignore[no-untyped-def]
        return _parser(argv[argv.index("bench")] if "bench" in argv else "inspect").parse_args(list(argv))

    assert parse("bench", "push", "-v").verbose == 1
    assert parse("-v", "bench", "push").verbose == 1
    assert parse("bench", "push").verbose == 0 and parse("bench", "push").json is None
    assert parse("inspect", "-v", "/d").verbose == 1


def test_no_json_writes_no_file_and_still_prints_the_table(tmp_path, capsys, monkeypatch):
    import argparse

    from dataplane.cli.bench import _write_outputs

    monkeypatch.chdir(tmp_path)
    said: list[str] = []
    _write_outputs(_doc(), argparse.Namespace(json=None, plot=None), said.append)
    assert "| push | numeric | flight-push | ours | 1,000 |" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [] and not any("results written" in s for s in said)


def test_an_error_raised_inside_tf_data_reads_as_ours():
    # "InvalidArgumentError: {{function_node __wrapped__IteratorGetNext_...}} SchemaError: ..."
    import tensorflow as tf

    from benchmarks.userdata import one_line

    exc = tf.errors.InvalidArgumentError(None, None, (
        "{{function_node __wrapped__IteratorGetNext_output_types_2_device_/job:localhost/replica:0/"
        "task:0/device:CPU:0}} SchemaError: column 'embedding' is fed as dense shape (100,)\n"
        "\t [[{{node PyFunc}}]] [Op:IteratorGetNext]"))
    assert one_line(exc) == "SchemaError: column 'embedding' is fed as dense shape (100,)"
    plain = tf.errors.InvalidArgumentError(None, None, "Input is empty.\n\t [[{{node x}}]]")
    assert one_line(plain) == "InvalidArgumentError: Input is empty."
