"""Every example, run at small size in this process (sharing the session's Spark), asserting
the numbers it reports; plus the two migrations' diffs counted line by line."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: digits with a 64-unit MLP reaches ~0.95; at test size (few epochs) 0.85 is a safe floor
FLOOR = 0.85
MAX_CHANGED_LINES = 10


@pytest.fixture(autouse=True, scope="module")
def _executors_with_every_package(spark):
    """The examples' chiefs evaluate on scikit-learn's digits: see tests/executor_python.py."""
    from tests.executor_python import full_python

    with full_python(spark.sparkContext):
        yield


def changed_lines(before: Path, after: Path) -> int:
    """Lines changed between two files: a replaced block counts its longer side once."""
    a = before.read_text().splitlines()
    b = after.read_text().splitlines()
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def unified(before: Path, after: Path) -> list[str]:
    return list(difflib.unified_diff(before.read_text().splitlines(),
                                     after.read_text().splitlines(), lineterm="", n=0))


@pytest.mark.parametrize("folder, before, after", [
    ("tfos_migration", "original_tfos.py", "migrated.py"),
    ("keras_migration", "keras_local.py", "keras_on_spark.py"),
])
def test_migration_diff_is_small_and_documented(folder, before, after):
    a, b = EXAMPLES / folder / before, EXAMPLES / folder / after
    n = changed_lines(a, b)
    assert 0 < n <= MAX_CHANGED_LINES, f"{after} changes {n} lines of {before}"
    readme = (EXAMPLES / folder / "README.md").read_text()
    body = [ln for ln in unified(a, b)[2:] if not ln.startswith("@@")]
    assert all(ln in readme for ln in body), "the README's diff is out of date"
    assert f"{n} changed lines" in readme




def test_digits_frame_builds_without_arrow(spark):
    # the session here enables Arrow; a user's pyspark 3.5 session does not, and there
    # createDataFrame refused the numpy float32 pixels ("can not accept object 0.0 in type
    # float32"), so every example failed on the compat stack
    from examples._common import digits_arrays, digits_frame

    key = "spark.sql.execution.arrow.pyspark.enabled"
    before = spark.conf.get(key)
    spark.conf.set(key, "false")
    try:
        rows = sorted(digits_frame(spark, 30, partitions=2).collect(), key=lambda r: r["id"])
    finally:
        spark.conf.set(key, before)
    ids, x, y = digits_arrays(30)
    assert [r["id"] for r in rows] == ids.tolist()
    assert [r["label"] for r in rows] == y.tolist()
    assert np.array_equal(np.array([r["pixels"] for r in rows], dtype=np.float32), x)


def test_an_example_under_spark_submit_keeps_its_master(tmp_path):
    # SparkConf() could not see spark-submit's --master before the JVM was attached, so the
    # examples always forced local[2]: --nodes 3 then failed asking for .master('local[3]')
    script = tmp_path / "which_master.py"
    script.write_text("from examples._common import spark_session\n"
                      "s = spark_session('which-master', 'local[2]')\n"
                      "print('MASTER=' + s.sparkContext.master)\n"
                      "s.stop()\n")
    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    proc = subprocess.run(
        [submit, "--master", "local[3]", str(script)], capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=str(EXAMPLES.parent), PYSPARK_PYTHON=sys.executable,
                 PYSPARK_DRIVER_PYTHON=sys.executable),
    )
    assert "MASTER=local[3]" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("argv, option", [
    (["--epochs", "-2"], "--epochs"), (["--hidden", "8", "0"], "--hidden"),
])
def test_examples_refuse_numbers_below_one_before_starting(argv, option, capsys):
    # tune_digits --epochs -2 ran every trial untrained and reported each as "ok"
    from examples import tune_digits

    with pytest.raises(SystemExit) as info:
        tune_digits.run(argv)
    assert info.value.code == 2
    assert f"argument {option}: expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.cluster
@pytest.mark.slow
def test_digits_push_two_nodes_mwms(spark):
    from examples import digits_push

    m = digits_push.run(["--nodes", "2", "--epochs", "6"])
    assert m["accuracy"] > FLOOR
    assert m["rows_pushed"] == 1437 * 6
    assert sorted(m["rows_per_node"]) == [0, 1] and min(m["rows_per_node"].values()) > 0


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "tfrecord"])
def test_pull_training(spark, fmt):
    from examples import pull_training

    m = pull_training.run(["--format", fmt, "--epochs", "6", "--files", "3"])
    assert m["accuracy"] > FLOOR and m["files"] == 3 and m["format"] == fmt


@pytest.mark.cluster
@pytest.mark.slow
def test_distributed_inference(spark):
    from examples import distributed_inference

    m = distributed_inference.run(["--nodes", "1", "--epochs", "10"])
    assert m["rows"] == 360 and m["columns"] == ["id", "label", "prediction", "confidence"]
    assert m["accuracy"] > FLOOR


@pytest.mark.slow
def test_tune(spark):
    from examples import tune_digits

    m = tune_digits.run(["--hidden", "8", "32", "--lr", "0.0003", "0.01", "--epochs", "6"])
    trials = m["trials"]
    assert len(trials) == 4 and all(t["status"] == "ok" for t in trials)
    assert {(t["hidden"], t["lr"]) for t in trials} == {(h, lr) for h in (8, 32)
                                                         for lr in (0.0003, 0.01)}
    accs = [t["val_accuracy"] for t in trials]
    assert accs == sorted(accs, reverse=True) and accs[0] > FLOOR
    assert m["best"]["lr"] == 0.01  # 0.0003 cannot converge in 6 epochs


@pytest.mark.slow
def test_predict(spark):
    from examples import predict_digits

    # --layer '' skips the second pass (hidden-layer features): it doubles the executor
    # processes importing TF, and tests/dataplane/test_predict.py covers layer extraction
    m = predict_digits.run(["--epochs", "10", "--layer", ""])
    assert m["rows"] == 360 and m["accuracy"] > FLOOR and m["feature_width"] == 0
    assert m["columns"] == ["id", "pixels", "label", "probs"]


@pytest.mark.cluster
@pytest.mark.slow
def test_ml_pipeline(spark, tmp_path):
    from examples import ml_pipeline

    m = ml_pipeline.run(["--epochs", "10", "--work-dir", str(tmp_path)])
    assert m["rows"] == 360 and m["accuracy"] > FLOOR
    assert m["model_path"].startswith(str(tmp_path / "model")) and (tmp_path / "pipeline").is_dir()
    assert m["columns"] == ["id", "raw", "label", "centered", "probs"]


@pytest.mark.cluster
@pytest.mark.slow
def test_streaming(spark):
    from examples import streaming_digits

    m = streaming_digits.run(["--passes", "4", "--files-per-pass", "2"])
    assert m["micro_batches"] == m["micro_batches_fed"] == 8
    assert m["rows"] == m["rows_fed"] == 1437 * 4
    assert m["accuracy"] > 0.8


@pytest.mark.cluster
@pytest.mark.slow
def test_tfos_migrated_program(spark, tmp_path):
    from examples.tfos_migration import migrated

    m = migrated.main(["--epochs", "6", "--model_dir", str(tmp_path)])
    assert m["results"] == 360 and m["accuracy"] > FLOOR
    assert (tmp_path / "digits.keras").exists()


@pytest.mark.cluster
@pytest.mark.slow
def test_keras_on_spark_program(spark, tmp_path):
    from examples.keras_migration import keras_on_spark

    keras_on_spark.main(["--epochs", "6", "--metrics", str(tmp_path / "m.json")])
    assert json.loads((tmp_path / "m.json").read_text())["accuracy"] > FLOOR
