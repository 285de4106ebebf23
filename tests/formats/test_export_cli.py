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
from tests.s3server import acquire_shared, release_shared


def _cli(*args, timeout=240, env=None, verbose=False):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "dataplane.cli", *(["-v"] if verbose else []), "export", *map(str, args)],
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
    assert "note: null" not in res.stdout


def test_an_export_whose_spark_jvm_dies_says_so_and_how_to_give_it_memory(tmp_path):
    # the OS's out-of-memory killer ends Spark's JVM while the export writes (in local mode an
    # OutOfMemoryError in a task ends it too): the command printed "Py4JNetworkError: Error
    # while sending or receiving", or a traceback when the error's text could not be fetched
    import signal
    import time

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        pq.write_table(numeric_table(500_000, seed=i), src / f"part-{i}.parquet")
    dst = tmp_path / "out"
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataplane.cli", "export", str(src), str(dst), "--to", "tfrecord"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        jvm, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            wrote = any(files for _, _, files in os.walk(dst)) if dst.exists() else False
            if wrote:  # the job's tasks are writing: kill Spark's JVM, a child of the command
                jvm = next(int(d) for d in os.listdir("/proc") if d.isdigit() and _parent(d) == proc.pid
                           and b"java" in _read(f"/proc/{d}/cmdline"))
                os.kill(jvm, signal.SIGKILL)
                break
            time.sleep(0.02)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert jvm is not None, (out, err)
    assert proc.returncode == 1, (out, err)
    assert err.strip() == (  # one line, and no py4j error from stopping a JVM that is gone
        "dataplane export: error: Spark's JVM has exited, most often because it ran out of "
        "memory (java.lang.OutOfMemoryError; with -v its log says): run the command again with "
        "more, e.g. SPARK_DRIVER_MEMORY=4g in front of it (in local mode the tasks run inside "
        "the driver's JVM), or on a cluster more spark.executor.memory"
    ), err
    assert not dst.exists() or not any(files for _, _, files in os.walk(dst))  # partial output removed


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: str) -> int:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return int(stat.rsplit(") ", 1)[1].split()[1]) if ") " in stat else -1


def test_a_glob_source_exports_what_it_matches(tmp_path):
    # export said "SRC data/*.parquet does not exist" where inspect and bench took the glob
    for k in range(3):
        pq.write_table(numeric_table(50), tmp_path / f"part-{k}.parquet")
    (tmp_path / "notes.txt").write_text("not data\n")
    res = _cli(tmp_path / "part-[01].parquet", tmp_path / "tfr", "--to", "tfrecord")
    assert res.returncode == 0, res.stderr
    assert "exported 100 rows" in res.stdout, res.stdout
    res = _cli(tmp_path / "tfr" / "part-*", tmp_path / "back", "--to", "parquet")
    assert res.returncode == 0, res.stderr
    assert pq.read_table(tmp_path / "back").num_rows == 100
    res = _cli(tmp_path / "nothing-*.parquet", tmp_path / "none", "--to", "parquet")
    assert res.returncode != 0 and "nothing-*.parquet matches no data file" in res.stderr


def test_nulls_written_as_absent_features_are_noted(tmp_path):
    # the export said nothing; every reader then refused the column for want of a fill value
    src = tmp_path / "src.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "score": [1.0, None, 3.0]}), src)
    res = _cli(src, tmp_path / "out", "--to", "tfrecord")
    assert res.returncode == 0, res.stderr
    assert ("note: null values were written as absent features in 'score' (1); reading them "
            "back needs fill_values={'score': ...}") in res.stdout, res.stdout


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


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """The session's shared SeaweedFS server (tests.s3server)."""
    yield acquire_shared(tmp_path_factory.mktemp("seaweedfs"))
    release_shared()


@pytest.mark.s3
def test_s3_problems_are_named_before_the_job_and_v_shows_the_traceback(tmp_path, s3_server):
    # --to parquet on s3:// failed with "An error occurred while calling o53.parquet." (Spark's
    # JVM has no S3 connector here); bad credentials printed the SDK's raw text; -v showed no
    # traceback for either
    pq.write_table(numeric_table(20), tmp_path / "a.parquet")
    bucket = s3_server.make_bucket()
    dst = f"s3://{bucket}/out"
    out = _cli(tmp_path, dst, "--to", "parquet", "--master", "local[1]", env=s3_server.env())
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line == (
        f"dataplane export: error: --to parquet writes with Spark's own Parquet writer (and reads a "
        f"Parquet SRC with spark.read.parquet), and this Spark cannot open {dst}: "
        f"UnsupportedFileSystemException: No FileSystem for scheme \"s3\". "
        f"Either for S3, put hadoop-aws on Spark's classpath (spark.jars.packages="
        f"org.apache.hadoop:hadoop-aws:<its Hadoop version> in spark-defaults.conf) and use s3a:// "
        f"URLs, or export --to tfrecord, whose tasks reach s3:// through pyarrow."), line
    assert s3_server.filesystem().get_file_info(f"{bucket}/out").type.name == "NotFound"
    # the tfrecord export reaches the same bucket
    ok = _cli(tmp_path, dst, "--to", "tfrecord", "--master", "local[1]", env=s3_server.env())
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"exported 20 rows from {tmp_path} to {dst} (tfrecord)")
    bad = _cli(tmp_path, f"s3://{bucket}/out2", "--to", "tfrecord",
               env=s3_server.env(secret_key="not-the-secret"), verbose=True)
    assert bad.returncode == 2
    assert "Traceback (most recent call last)" in bad.stderr
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dataplane export: error: cannot reach {tmp_path} or s3://{bucket}/out2: ")
    assert "ACCESS_DENIED" in last and "refused the credentials: check AWS_ACCESS_KEY_ID" in last


@pytest.mark.parametrize("to", ["tfrecord", "parquet"])
@pytest.mark.parametrize("where", ["same", "parent"])
def test_overwrite_of_a_dst_that_holds_src_is_refused_before_anything_is_deleted(tmp_path, to, where):
    # DST == SRC, or DST the folder holding SRC: --overwrite emptied DST first, the job then
    # failed reading files it had deleted, and the source was gone
    src = tmp_path / "parent" / "data"
    src.mkdir(parents=True)
    pq.write_table(numeric_table(50), src / "part-0.parquet")
    dst = src if where == "same" else tmp_path / "parent"
    res = _cli(src, dst, "--to", to, "--overwrite")
    assert res.returncode == 2, res.stderr
    assert f"{dst} holds {src}, which this export reads: mode='overwrite' would delete" in res.stderr, res.stderr
    assert pq.read_table(src / "part-0.parquet").num_rows == 50


def test_overwrite_keeps_the_earlier_tfrecord_output_when_the_new_export_fails(spark, tmp_path):
    import formats

    src = tmp_path / "src.parquet"
    pq.write_table(numeric_table(40).select(["id"]), src)
    dst = tmp_path / "out"
    formats.parquet_to_tfrecords(spark, src, dst)  # (the CLI's own path, without its start-up)
    before = sorted(p.name for p in dst.iterdir())
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": pa.array([1.0, 1e300])}), bad)  # no float32 holds 1e300
    res = _cli(bad, dst, "--to", "tfrecord", "--overwrite")
    assert res.returncode != 0 and "1e+300" in res.stderr, res.stderr
    assert sorted(p.name for p in dst.iterdir()) == before  # the good export is still whole
    formats.parquet_to_tfrecords(spark, src, dst, mode="overwrite")  # a good one replaces it
    assert sorted(p.name for p in dst.iterdir()) == before


def test_parquet_export_into_an_existing_empty_directory(tmp_path):
    # "DST must not exist or be empty", but Spark's writer refused the empty folder
    src = tmp_path / "src.parquet"
    pq.write_table(numeric_table(30).select(["id"]), src)
    dst = tmp_path / "empty"
    dst.mkdir()
    res = _cli(src, dst, "--to", "parquet")
    assert res.returncode == 0, res.stderr
    assert sorted(pq.read_table(dst).column("id").to_pylist()) == list(range(30))


def test_a_feature_the_inference_sample_missed_fails_the_export_instead_of_vanishing(spark, tmp_path):
    # records 1200-1499 carry a feature 'x' the first 1000 do not: the Parquet output had no
    # 'x' column and the export said it succeeded
    import tensorflow as tf

    src = tmp_path / "tf"
    src.mkdir()
    with tf.io.TFRecordWriter(str(src / "part-0.tfrecord")) as w:
        for i in range(1500):
            feats = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))}
            if i >= 1200:
                feats["x"] = tf.train.Feature(float_list=tf.train.FloatList(value=[1.0, 2.0, 3.0]))
            w.write(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())
    res = _cli(src, tmp_path / "out", "--to", "parquet")
    assert res.returncode != 0, res.stdout
    assert "has feature 'x', which is not in the schema (inferred from the first 1000 records" in res.stderr, res.stderr
    assert "--sample N" in res.stderr and not (tmp_path / "out").exists()
    import formats  # what --sample N passes on (the CLI's start-up spared)

    formats.read_tfrecords(spark, src, sample=1500).write.parquet(str(tmp_path / "out"))
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 1500 and table.column("x").null_count == 1200


def test_api_fixes_in_errors_are_said_as_this_commands_options():
    """A non-UTF-8 bytes value past the inference sample (read_tfrecords' NotTextError), as
    the export job reports it: the fix was "pass a schema with a binary type", which no CLI
    option does, under a class path the user never imported; a CRC error found in the job
    said compression='GZIP' without the CLI's option."""
    from dataplane.cli.export import _cli_words, _spark_error_text
    from formats.example_decode import NotTextError

    raised = RuntimeError(f"Job aborted.\nformats.example_decode.NotTextError: "
                          f"{NotTextError('s', pa.string(), 'Invalid UTF8 payload')}")
    text = _spark_error_text(raised)
    assert text.startswith("SchemaError: column 's': bytes_list values cannot be read as string"), text
    assert "a larger --sample N" in text and "pass a schema" not in text, text
    crc = "corrupt record at byte offset 0 (or is compressed: pass compression='GZIP'/'ZLIB')."
    assert _cli_words(crc).endswith("(here: --src-compression gzip or zlib)")
    assert _cli_words(crc + " (here: --src-compression gzip or zlib)").count("--src-compression") == 1
