"""The bad-input catalogue (issue #22): one table row per (entry point, bad input).

Each row is a :class:`Case`: the entry point's name, a case id, a builder that makes the bad
input under a fresh directory and returns the call to make with it, the exception type that
call must raise, and substrings its message must hold (the culprit: column / file / argument
and the value; and the fix). :func:`check` runs one row and asserts, besides type and text:

- *where* it surfaces: ``stage="call"`` (the default) means the call given the input raises;
  ``"iterate"`` the first pass over the dataset it returned, ``"action"`` the first Spark
  action on the DataFrame it returned (for what only the data can tell: a ragged row deep in
  a file). For the later stages the call itself must *not* raise;
- *when*: within ``within`` seconds of the call. The bounds are generous on purpose (a
  loaded CI machine, Spark retrying a task three times, Keras imported on the driver): they
  catch an error that waits for a feed timeout, a shutdown or a hang, not a slow one;
- *after*: the row's ``after(env)`` runs once the error is seen: that the workload is still
  usable (the SparkSession runs jobs, no cluster or job was left behind) or that the fix the
  message names works.

Every test module under ``tests/badinput/`` holds its entry points' table and one test
parametrised over it. Adding an entry point (``cluster.train``, ``cluster.inference``) is a
new table of rows built the same way, checked with :func:`check`, e.g.::

    def _train(sql):
        def build(env):
            cluster, df = <a running cluster>, env.spark.sql(sql)
            return lambda: cluster.train(df, num_epochs=1)
        return build

    CASES = [Case("cluster.train", "null-without-fill", _train("SELECT CAST(NULL AS FLOAT) AS f"),
                  SchemaError, ("'f'", "partition", "fill"), within=30, after=<cluster still trains>)]

    @pytest.mark.parametrize("case", params(CASES))
    def test_bad_input(case, request, tmp_path):
        check(case, Env(request, tmp_path))
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

__all__ = ["Case", "Env", "CliError", "check", "params", "cli", "spark_usable", "bad"]


class Env:
    """What a builder gets: a fresh directory, and Spark only when the row asks for it."""

    def __init__(self, request: Any, tmp_path: Path) -> None:
        self.request = request
        self.tmp = tmp_path

    @property
    def spark(self) -> Any:
        return self.request.getfixturevalue("spark")

    def dir(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass(frozen=True)
class Case:
    """One bad input to one entry point (see the module docstring)."""

    entry: str
    id: str
    build: Callable[[Env], Callable[[], Any]]
    error: type[BaseException] | tuple[type[BaseException], ...]
    says: tuple[str, ...]
    stage: str = "call"
    within: float = 60.0
    after: Callable[[Env], None] | None = None
    marks: tuple[Any, ...] = field(default=())


def params(cases: list[Case]) -> list[Any]:
    """``pytest.param`` per row, with ids ``entry:case``."""
    return [pytest.param(c, id=f"{c.entry}:{c.id}", marks=c.marks) for c in cases]


def check(case: Case, env: Env) -> BaseException:
    """Run one row: the right error, from the right place, soon enough, naming what it must."""
    call = case.build(env)
    started = time.monotonic()
    if case.stage == "call":
        with pytest.raises(case.error) as info:
            call()
    else:
        result = call()  # the call itself must accept the input...
        with pytest.raises(case.error) as info:  # ...and its first use report it
            if case.stage == "iterate":
                for _ in result:
                    pass
            elif case.stage == "action":
                result.collect()
            else:  # pragma: no cover - a typo in a table
                raise AssertionError(f"unknown stage {case.stage!r}")
    elapsed = time.monotonic() - started
    assert elapsed < case.within, f"{case.entry}:{case.id} took {elapsed:.1f} s to fail"
    message = str(info.value)
    missing = [s for s in case.says if s not in message]
    assert not missing, f"message lacks {missing}: {message}"
    assert "gRPC client debug context" not in message, f"gRPC's noise repeats the message: {message}"
    if case.after is not None:
        case.after(env)
    return info.value


def spark_usable(env: Env) -> None:
    """The session still runs jobs and nothing was left running (no node job, no stuck job)."""
    spark = env.spark
    assert spark.range(5).count() == 5
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + 10  # the tracker hears of finished jobs a moment later
    while list(tracker.getActiveJobsIds()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tracker.getActiveJobsIds()) == []


# ------------------------------------------------------------------------------------- the CLI


class CliError(Exception):
    """A CLI run that exited non-zero; the message is what it printed on stderr."""

    def __init__(self, code: int, stderr: str) -> None:
        super().__init__(stderr)
        self.code = code
        self.stderr = stderr


def cli(env: Env, *argv: Any) -> Callable[[], str]:
    """The call: ``dataplane <argv>`` in this process (for failures found before Spark starts;
    one that gets as far as starting Spark would take over the tests' session)."""
    from dataplane.cli import main

    def call() -> str:
        capsys = env.request.getfixturevalue("capsys")
        monkeypatch = env.request.getfixturevalue("monkeypatch")
        # quiet_spark() edits SPARK_SUBMIT_OPTS; monkeypatch puts it back after the test.
        monkeypatch.setenv("SPARK_SUBMIT_OPTS", os.environ.get("SPARK_SUBMIT_OPTS", ""))
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        if code != 0:
            raise CliError(code, err)
        return out

    return call


# ----------------------------------------------------------------------------- bad-data makers


class bad:
    """Bad files and directories: each takes a directory to fill and returns the path to pass."""

    @staticmethod
    def parquet(d: Path, table: pa.Table, name: str = "a.parquet") -> Path:
        pq.write_table(table, d / name)
        return d

    @staticmethod
    def not_parquet(d: Path) -> Path:
        (d / "a.parquet").write_bytes(b"id,x\n1,2\n")  # a CSV someone named .parquet
        return d

    @staticmethod
    def empty_file(d: Path, name: str) -> Path:
        (d / name).write_bytes(b"")
        return d

    @staticmethod
    def cut_short(d: Path, table: pa.Table) -> Path:
        """A Parquet file whose writer stopped before the footer (a job killed mid-write)."""
        pq.write_table(table, d / "a.parquet")
        data = (d / "a.parquet").read_bytes()
        (d / "a.parquet").write_bytes(data[: len(data) // 2])
        return d

    @staticmethod
    def drift(d: Path) -> Path:
        pq.write_table(pa.table({"id": [1, 2], "x": [1, 2]}), d / "part-0.parquet")
        pq.write_table(pa.table({"id": [3], "x": ["a"]}), d / "part-1.parquet")
        return d

    @staticmethod
    def tfrecords(d: Path, table: pa.Table) -> Path:
        """``table`` as one TFRecord file of Examples (a null is an absent feature), written
        with this package's encoder: no TensorFlow import, so CLI rows stay light."""
        from formats.example import encode_examples
        from formats.schema import column_specs
        from formats.tfrecord import write_records

        specs = [replace(s, fill=None) for s in column_specs(table.schema)]
        with open(d / "part-00000.tfrecord", "wb") as f:
            write_records(f, _encode_with_nulls(table, specs, encode_examples))
        return d

    @staticmethod
    def corrupt_tfrecord(d: Path, *, truncate: bool = False) -> Path:
        from tests.builders import numeric_table

        path = bad.tfrecords(d, numeric_table(20).select(["id", "f0"])) / "part-00000.tfrecord"
        raw = bytearray(path.read_bytes())
        (length,) = struct.unpack_from("<Q", raw, 0)
        if truncate:
            raw = raw[: 16 + length + 20]  # record 1 cut inside its data
        else:
            raw[14] ^= 0xFF  # a data byte of record 0: its CRC no longer matches
        path.write_bytes(bytes(raw))
        return d


def _encode_with_nulls(table: pa.Table, specs: list, encode: Callable) -> list[bytes]:
    """Examples for ``table``; a null scalar becomes an absent feature (as Spark's exporters
    and TensorFlow's writers do), row by row so the encoder never sees the null."""
    out = []
    for i in range(table.num_rows):
        row = table.slice(i, 1)
        keep = [s for s in specs if row.column(s.name).null_count == 0]
        out.extend(encode(row.select([s.name for s in keep]), keep))
    return out
