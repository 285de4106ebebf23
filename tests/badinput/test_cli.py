"""Bad input to the console script: ``dataplane inspect`` and ``dataplane export``.

Every row checks what a terminal user sees: exit status non-zero, exactly one line on stderr
(``dataplane <cmd>: error: ...``) naming the path / column / option and the fix, and no
traceback. Rows run ``dataplane.cli.main`` in this process (they fail before Spark starts);
the one case that fails inside the Spark job runs as a subprocess, and also shows that Spark's
start-up chatter stays off the terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from dataplane.cli import console
from tests.badinput.catalogue import Case, CliError, Env, bad, check, cli, params
from tests.builders import numeric_table

ROOT = Path(__file__).resolve().parents[2]
IN, EX = "dataplane inspect", "dataplane export"

MAP = pa.table({"id": [1], "m": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64()))})


def _run(command: str, make, *extra: str):
    """``dataplane <command> <made path> <extra...>`` (``{tmp}`` in extra is the row's dir)."""

    def build(env: Env):
        path = make(env)
        argv = [command, str(path), *(a.replace("{tmp}", str(env.tmp)) for a in extra)]
        return cli(env, *argv)

    return build


def _csv(d: Path, text: str = "id,x\n1,2.5\n2,3.5\n") -> Path:
    # read as a TFRecord, it failed on a "length read: 2482365392562186530" CRC mismatch (or,
    # under 12 bytes, a "truncated record header")
    f = d / "data.csv"
    f.write_text(text)
    return f


def _gzipped(d: Path) -> Path:
    """The TFRecord file in ``d`` GZIP-compressed under the same name (no .gz suffix), as
    tf.io.TFRecordWriter(path, 'GZIP') writes it."""
    import gzip

    f = d / "part-00000.tfrecord"
    f.write_bytes(gzip.compress(f.read_bytes()))
    return d


def _nonempty_dst(env: Env) -> Path:
    (env.dir("dst") / "keep.txt").write_text("x")
    return bad.parquet(env.dir("src"), numeric_table(3))


CASES = [
    # ------------------------------------------------------------------ inspect
    Case(IN, "missing-path", _run("inspect", lambda env: env.tmp / "nope"), CliError,
         ("dataplane inspect: error:", "nope does not exist", "check the path")),
    Case(IN, "corrupt-tfrecord", _run("inspect", lambda env: bad.corrupt_tfrecord(env.dir("d"))), CliError,
         ("part-00000.tfrecord", "corrupt record at byte offset 0", "rewrite it")),
    Case(IN, "gzip-tfrecord-without-suffix", _run("inspect", lambda env: _gzipped(bad.tfrecords(env.dir("d"), numeric_table(3)))),
         CliError, ("part-00000.tfrecord", "it starts with GZIP's magic bytes", "--compression gzip")),
    Case(IN, "csv-file", _run("inspect", lambda env: _csv(env.dir("d"))), CliError,
         ("data.csv is neither Parquet (no PAR1 magic bytes) nor TFRecords", "--format parquet")),
    Case(IN, "tiny-text-file", _run("inspect", lambda env: _csv(env.dir("d"), "a,b\n1,2\n")), CliError,
         ("data.csv is neither Parquet (no PAR1 magic bytes) nor TFRecords",)),
    Case(IN, "empty-tfrecord-file", _run("inspect", lambda env: bad.empty_file(env.dir("d"), "part-0.tfrecord"),
                                         "--format", "tfrecord"),
         CliError, ("part-0.tfrecord", "every file is empty")),
    Case(IN, "not-a-parquet-file", _run("inspect", lambda env: bad.not_parquet(env.dir("d"))), CliError,
         ("a.parquet", "not a readable Parquet file")),
    Case(IN, "parquet-drift-between-files", _run("inspect", lambda env: bad.drift(env.dir("d"))), CliError,
         ("'x'", "part-0.parquet", "part-1.parquet", "cast the column")),
    Case(IN, "sample-zero", _run("inspect", lambda env: bad.tfrecords(env.dir("d"), numeric_table(3)),
                                 "--sample", "0"),
         CliError, ("--sample must be at least 1", "got 0")),
    Case(IN, "unknown-compression", _run("inspect", lambda env: bad.tfrecords(env.dir("d"), numeric_table(3)),
                                         "--compression", "lz4"),
         CliError, ("'lz4'", "GZIP")),
    # ------------------------------------------------------------------ export (before Spark)
    Case(EX, "missing-source", _run("export", lambda env: env.tmp / "nope", "{tmp}/dst", "--to", "tfrecord"),
         CliError, ("dataplane export: error:", "nope does not exist", "check the path")),
    Case(EX, "num-files-zero", _run("export", lambda env: bad.parquet(env.dir("src"), numeric_table(3)),
                                    "{tmp}/dst", "--to", "tfrecord", "--num-files", "0"),
         CliError, ("--num-files must be at least 1", "got 0")),
    Case(EX, "unknown-tfrecord-compression", _run("export", lambda env: bad.parquet(env.dir("src"), numeric_table(3)),
                                                  "{tmp}/dst", "--to", "tfrecord", "--compression", "lz4"),
         CliError, ("'lz4'", "GZIP")),
    Case(EX, "unknown-parquet-compression", _run("export", lambda env: bad.parquet(env.dir("src"), numeric_table(3)),
                                                 "{tmp}/dst", "--to", "parquet", "--compression", "brotli2"),
         CliError, ("'brotli2'", "snappy, gzip, zstd or none")),
    Case(EX, "destination-not-empty", _run("export", _nonempty_dst, "{tmp}/dst", "--to", "tfrecord"),
         CliError, ("dst exists and is not empty", "--overwrite")),
    Case(EX, "map-column", _run("export", lambda env: bad.parquet(env.dir("src"), MAP), "{tmp}/dst", "--to", "tfrecord"),
         CliError, ("column 'm' is a map", "map_keys()")),
    Case(EX, "no-rows", _run("export", lambda env: bad.parquet(env.dir("src"), numeric_table(0)), "{tmp}/dst",
                             "--to", "tfrecord"),
         CliError, ("has no rows", "nothing to export")),
    Case(EX, "zero-column-files", _run("export", lambda env: bad.parquet(env.dir("src"), pa.table({})), "{tmp}/dst",
                                       "--to", "tfrecord"),
         CliError, ("has no columns", "a.parquet", "at least one column")),
    Case(EX, "drift-between-files", _run("export", lambda env: bad.drift(env.dir("src")), "{tmp}/dst", "--to", "tfrecord"),
         CliError, ("'x'", "part-0.parquet", "part-1.parquet", "cast the column")),
    Case(EX, "not-a-parquet-file", _run("export", lambda env: bad.not_parquet(env.dir("src")), "{tmp}/dst",
                                        "--to", "tfrecord", "--from", "parquet"),
         CliError, ("a.parquet", "not a readable Parquet file")),
]


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case: Case, request, tmp_path):
    err = check(case, Env(request, tmp_path))
    text = err.stderr
    assert err.code != 0
    assert text.count("\n") == 1 and text.endswith("\n"), f"not one line: {text!r}"
    assert text.startswith(f"{case.entry}: error: ") and "Traceback" not in text
    assert not (tmp_path / "dst").exists() or case.id == "destination-not-empty"


def test_failed_export_job_is_one_line_without_spark_chatter(tmp_path):
    """A bad value found by the Spark job itself: one line, non-zero exit, nothing left, none of
    Spark's start-up lines (log4j profile, default log level, NativeCodeLoader, JDK notices)."""
    (tmp_path / "src").mkdir()
    src = bad.parquet(tmp_path / "src",
                      pa.table({"id": [0, 1], "v": pa.array([[1.0], [1.0, None]], pa.list_(pa.float32()))}))
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    res = subprocess.run(
        [sys.executable, "-m", "dataplane.cli", "export", str(src), str(tmp_path / "dst"), "--to", "tfrecord"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )
    assert res.returncode != 0, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("dataplane export: error: ")
    for said in ("a.parquet", "'v'", "1 null element(s)", "coalesce(x, 0)"):
        assert said in lines[0]
    assert not (tmp_path / "dst").exists()


def test_unexpected_error_is_one_line_and_v_shows_the_traceback(monkeypatch, capsys):
    """An error no command anticipated: one line naming its type; -v re-raises it."""
    from dataplane import cli
    from dataplane.cli import inspect

    monkeypatch.setenv("SPARK_SUBMIT_OPTS", "")

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(inspect, "describe", boom)
    assert cli.main(["inspect", "anything"]) == 1
    err = capsys.readouterr().err
    assert err == "dataplane inspect: error: KeyError: 'surprise' (-v shows the traceback)\n"
    with pytest.raises(KeyError, match="surprise"):
        cli.main(["-v", "inspect", "anything"])


@pytest.mark.parametrize("text, line", [
    ("An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
     '  File "x.py", line 1, in f\nformats.errors.SchemaError: column \'v\' is bad\n\n'
     "\tat org.apache.spark.api.python.BasePythonRunner", "SchemaError: column 'v' is bad"),
    ("plain message\nsecond line", "RuntimeError: plain message second line"),
])
def test_problem_line(text, line):
    assert console.problem_line(RuntimeError(text)) == line


def test_chatter_filter_drops_spark_and_tensorflow_start_up_lines_only(tmp_path):
    r, w = os.pipe()
    out = tmp_path / "out"
    with open(out, "wb") as sink:
        f = console._Filter(r, sink.fileno())
        f.start()
        os.write(w, b"WARNING: Using incubator modules: jdk.incubator.vector\n"
                    b"Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties\n"
                    b"26/11/25 13:40:59 WARN NativeCodeLoader: Unable to load native-hadoop library\n"
                    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
                    b"I0000 00:00:1795865717.413392   10389 cudart_stub.cc:31] Could not find cuda "
                    b"drivers on your machine, GPU will not be used.\n"
                    b"a real problem\n[Stage 0:>   (0 + 1) / 1]\rtail without newline")
        os.close(w)
        f.join(5)
    assert out.read_bytes() == b"a real problem\ntail without newline"
