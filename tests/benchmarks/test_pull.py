"""The pull scenarios' paths: each available one reads every row; peers off-stack say why."""

from __future__ import annotations

import pyarrow as pa
import pytest

from benchmarks import pull_parquet, pull_tfrecord
from benchmarks.harness import BenchEnv

ROWS = 3000


def _on_compat() -> bool:
    return int(pa.__version__.split(".")[0]) < 16


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("module", [pull_parquet, pull_tfrecord], ids=["parquet", "tfrecord"])
@pytest.mark.parametrize("table", ["numeric", "mnist"])
def test_paths_read_every_row(module, table, tmp_path):
    env = BenchEnv(None, rows=ROWS, mnist_rows=ROWS, workdir=tmp_path, quick=True, table_name=table)
    paths = {p.name: p for p in module.build(env)}
    expected = {"parquet": ["parquet", "pyarrow-raw", "pyarrow-raw-thread", "pyarrow-scan", "petastorm",
                            "tfio"],
                "tfrecord": ["tfrecord", "tfdata-tuned", "tfdata-sequential"]}[module.__name__.rsplit("_", 1)[1]]
    assert sorted(paths) == sorted(expected)
    for p in paths.values():
        if p.unavailable:
            assert p.kind == "peer"
            if _on_compat():
                assert p.name == "tfio" and table == "mnist" and "list columns" in p.unavailable
            else:
                assert "compat stack" in p.unavailable
            continue
        assert p.nbytes == ROWS * env.row_bytes()
        assert p.run() == ROWS, p.name
        assert p.run() == ROWS, p.name  # repeatable: every repetition reads everything again
