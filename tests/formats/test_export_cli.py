"""``dataplane export`` run as a user runs it: a subprocess, small data."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.builders import numeric_table


def _cli(*args, timeout=240):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    return subprocess.run(
        [sys.executable, "-m", "dataplane.cli", "export", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


def test_help_starts_neither_spark_nor_tensorflow():
    code = (
        "import sys\nfrom dataplane.cli import main\n"
        "try:\n    main(['export', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in ('pyspark', 'tensorflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--to {tfrecord,parquet}" in out.stdout and "--num-files N" in out.stdout
    assert out.stdout.strip().endswith("[]")


def test_export_parquet_to_tfrecord_prints_a_summary(tmp_path):
    src = tmp_path / "src.parquet"
    pq.write_table(numeric_table(300), src)
    dst = tmp_path / "out"
    res = _cli(src, dst, "--to", "tfrecord", "--compression", "gzip", "--num-files", "2")
    assert res.returncode == 0, res.stderr
    m = re.search(r"exported 300 rows .* \(tfrecord\): 2 files, [\d.]+ [KM]?B in [\d.]+ s "
                  r"\([\d,]+ rows/s\)", res.stdout)
    assert m, res.stdout
    assert sorted(os.listdir(dst)) == ["_tf_schema.json", "part-00000.tfrecord.gz",
                                       "part-00001.tfrecord.gz"]
    assert "tasks" not in res.stderr  # no progress bar when stderr is not a terminal


@pytest.mark.parametrize(
    "make, message",
    [
        (None, "does not exist"),
        (lambda p: pq.write_table(pa.table({"m": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64()))}), p),
         "column 'm' is a map"),
        (lambda p: pq.write_table(numeric_table(0), p), "has no rows"),
    ],
    ids=["missing", "map-column", "empty"],
)
def test_bad_source_is_a_clear_error_and_leaves_nothing(tmp_path, make, message):
    src = tmp_path / "src.parquet"
    if make is not None:
        make(src)
    dst = tmp_path / "out"
    res = _cli(src, dst, "--to", "tfrecord")
    assert res.returncode != 0
    assert "dataplane export: error:" in res.stderr and message in res.stderr
    assert not dst.exists()
