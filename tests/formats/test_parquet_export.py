"""parquet_to_tfrecords on a real SparkSession: the same records as write_tfrecords, and the
same guarantees (one copy after a retried task, no output after an error, errors naming the
file and column)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyspark
import pytest
from pyarrow import fs as pafs

import formats
from dataplane.errors import SchemaError, StorageError
from formats.example import decode_examples
from formats.schemafile import read_schema_file
from formats.tfrecord import iter_records, open_compressed
from tests.builders import all_types_table, numeric_table, row_checksum

ROWS = 300


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    """Two files, several row groups each, every Spark-readable type with nulls."""
    path = tmp_path_factory.mktemp("src")
    table = all_types_table(ROWS, spark_types_only=True)
    pq.write_table(table.slice(0, 170), path / "a.parquet", row_group_size=70)
    pq.write_table(table.slice(170), path / "b.parquet", row_group_size=70)
    (path / "_SUCCESS").write_bytes(b"")
    return str(path)


def _records(path) -> list[bytes]:
    out = []
    for name in sorted(os.listdir(path)):
        if name.startswith("part-"):
            with open(os.path.join(path, name), "rb") as f:
                comp = "GZIP" if name.endswith(".gz") else None
                out += list(iter_records(open_compressed(f, comp), name=name))
    return out


def _data_files(path):
    return sorted(f for f in os.listdir(path) if not f.startswith(("_", ".")))


def _rows(df):
    return sorted((r.asDict(recursive=True) for r in df.collect()), key=lambda r: r["id"])


def test_same_records_and_round_trip_as_write_tfrecords(spark, parquet_dir, tmp_path):
    df = spark.read.parquet(parquet_dir)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    res = formats.parquet_to_tfrecords(spark, parquet_dir, ours, compression="gzip")
    formats.write_tfrecords(df.coalesce(1), theirs, compression="gzip")
    assert res.rows == ROWS and res.files == len(_data_files(ours)) >= 2
    assert sorted(os.listdir(ours)) == ["_tf_schema.json", *_data_files(ours)]  # no _temporary
    # byte for byte the records write_tfrecords(spark.read.parquet(src)) writes, in file order
    assert _records(ours) == _records(theirs)
    schema = read_schema_file(ours)
    assert schema.null_counts == read_schema_file(theirs).null_counts
    assert schema.null_counts["i32"] == ROWS // 5  # ids divisible by 5
    back = formats.read_tfrecords(spark, ours)
    assert back.schema == df.schema  # the Spark types spark.read.parquet gives
    assert _rows(back) == _rows(df)


def test_spark_written_parquet_int96_timestamps(spark, parquet_dir, tmp_path):
    src = str(tmp_path / "spark-written")
    spark.read.parquet(parquet_dir).select("id", "ts", "day").write.parquet(src)  # ts as INT96
    out = str(tmp_path / "tfr")
    formats.parquet_to_tfrecords(spark, src, out, num_files=1)
    df = spark.read.parquet(src)
    back = formats.read_tfrecords(spark, out)
    assert back.schema == df.schema
    assert _rows(back) == _rows(df)


def test_num_files_splits_row_groups_and_keeps_row_order(spark, tmp_path):
    src = tmp_path / "one.parquet"
    pq.write_table(numeric_table(1000), src)  # a single row group
    out = tmp_path / "tfr"
    res = formats.parquet_to_tfrecords(spark, str(src), str(out), num_files=3)
    assert (res.rows, res.files) == (1000, 3)
    specs = read_schema_file(str(out)).specs
    ids = []
    for name in _data_files(out):
        recs = list(iter_records(open(out / name, "rb"), name=name))
        ids.append(decode_examples(recs, specs, name=name).column("id").to_pylist())
    assert [len(x) for x in ids] == [333, 333, 334]
    assert sum(ids, []) == list(range(1000))


def test_sql_job_form_used_under_spark_connect_writes_the_same(spark, parquet_dir, tmp_path, monkeypatch):
    from formats import parquet_export

    rdd_out, sql_out = str(tmp_path / "rdd"), str(tmp_path / "sql")
    formats.parquet_to_tfrecords(spark, parquet_dir, rdd_out, num_files=2)
    monkeypatch.setattr(parquet_export, "_spark_context", lambda s: None)  # as under Connect
    res = formats.parquet_to_tfrecords(spark, parquet_dir, sql_out, num_files=2)
    assert (res.rows, res.files) == (ROWS, 2)
    assert _records(sql_out) == _records(rdd_out)


def test_missing_column_in_one_file_is_written_as_nulls(spark, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"id": [0, 1], "x": [1.5, 2.5]}), src / "a.parquet")
    pq.write_table(pa.table({"id": [2]}), src / "b.parquet")
    out = str(tmp_path / "tfr")
    formats.parquet_to_tfrecords(spark, str(src), out)
    assert read_schema_file(out).null_counts == {"id": 0, "x": 1}
    assert _rows(formats.read_tfrecords(spark, out)) == _rows(spark.read.parquet(str(src)))


class _FlakyLocal(pafs.FileSystemHandler):
    """Local files, but partition 1's first attempt dies in the middle of writing its data file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.fs = pafs.LocalFileSystem()

    def __eq__(self, other):
        return isinstance(other, _FlakyLocal) and other.marker == self.marker

    def __ne__(self, other):
        return not self == other

    def equals(self, other):
        return self == other

    def get_type_name(self):
        return "flaky-local"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not supported")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)

    def open_output_stream(self, path, metadata):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        stream = self.fs.open_output_stream(path, metadata=metadata)
        if ctx is None or "/_temporary/" not in path or ctx.partitionId() != 1 or ctx.attemptNumber():
            return stream
        marker = self.marker

        class _DiesOnClose:
            closed = False

            def write(self, data):
                return stream.write(data)

            def flush(self):
                stream.flush()

            def writable(self):
                return True

            def close(self):
                stream.close()
                self.closed = True
                with open(marker, "w") as f:
                    f.write(path)
                raise RuntimeError("injected failure after the rows were written")

        return pa.PythonFile(_DiesOnClose(), mode="w")


def test_retried_task_leaves_exactly_one_copy(spark, tmp_path):
    src = tmp_path / "src.parquet"
    pq.write_table(numeric_table(400), src, row_group_size=100)
    marker = tmp_path / "failed-once"
    flaky = pafs.PyFileSystem(_FlakyLocal(str(marker)))
    out = tmp_path / "tfr"
    res = formats.parquet_to_tfrecords(spark, str(src), str(out), num_files=2, filesystem=flaky)
    assert marker.exists() and "/_temporary/" in marker.read_text()  # the failure happened
    assert res.rows == 400 and _data_files(out) == ["part-00000.tfrecord", "part-00001.tfrecord"]
    assert not (out / "_temporary").exists()
    ids = np.array([r.id for r in formats.read_tfrecords(spark, str(out)).select("id").collect()])
    assert row_checksum(ids) == row_checksum(np.arange(400))


def test_bad_value_fails_the_job_naming_file_and_column_and_leaves_nothing(spark, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"id": [0], "v": pa.array([[1.0]], pa.list_(pa.float32()))}), src / "a.parquet")
    pq.write_table(pa.table({"id": [1], "v": pa.array([[1.0, None]], pa.list_(pa.float32()))}),
                   src / "b.parquet")
    out = tmp_path / "tfr"
    with pytest.raises(SchemaError, match=r"b\.parquet: column 'v' has 1 null element"):
        formats.parquet_to_tfrecords(spark, str(src), str(out))
    assert not out.exists()


def test_partitioned_dataset_keeps_its_partition_columns(spark, tmp_path):
    # what df.write.partitionBy makes: key=value directories, a null key, an escaped value
    from pyspark.sql import functions as F

    src = str(tmp_path / "src")
    df = spark.range(0, 60, 1, 3).select(
        "id", (F.col("id") * 0.5).cast("float").alias("x"),
        F.when(F.col("id") % 3 == 0, None).otherwise(F.col("id") % 3).alias("day"),
        F.when(F.col("id") % 2 == 0, F.lit("a/b")).otherwise(F.lit("c")).alias("city"))
    df.write.partitionBy("day", "city").parquet(src)
    out = str(tmp_path / "tfr")
    res = formats.parquet_to_tfrecords(spark, src, out)
    assert res.rows == 60
    cols = {s.name: s for s in read_schema_file(out).specs}
    assert list(cols) == ["id", "x", "day", "city"]
    assert (cols["day"].dtype, cols["city"].dtype) == ("int64", "string")
    back = formats.read_tfrecords(spark, out)
    got = sorted(tuple(r) for r in back.collect())
    want = sorted((r.id, r.x, r.day, r.city) for r in df.collect())
    assert got == want
    assert got[3] == (3, 1.5, None, "c") and got[4] == (4, 2.0, 1, "a/b")


@pytest.mark.parametrize(
    "layout, error, message",
    [
        ({"a.parquet": pa.table({"id": [1]}), "b.parquet": pa.table({"id": ["x"]})},
         SchemaError, r"b\.parquet: column 'id' is string there but bigint in .*a\.parquet"),
        ({"a.parquet": pa.table({"id": [1], "m": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64()))})},
         SchemaError, "column 'm' is a map"),
        ({"a=1/b=2/x.parquet": pa.table({"id": [1]}), "a=1/y.parquet": pa.table({"id": [2]})},
         SchemaError, "must sit under the same key=value directories"),
        ({"a.parquet": b"not parquet at all"}, StorageError, r"a\.parquet: cannot read it as Parquet"),
        ({}, StorageError, "no data files"),
    ],
    ids=["type-differs", "map-column", "partition-keys-differ", "not-parquet", "empty-dir"],
)
def test_bad_source_fails_before_any_output(spark, tmp_path, layout, error, message):
    src = tmp_path / "src"
    src.mkdir()
    for name, content in layout.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (src / name).write_bytes(content)
        else:
            pq.write_table(content, src / name)
    out = tmp_path / "tfr"
    with pytest.raises(error, match=message):
        formats.parquet_to_tfrecords(spark, str(src), str(out))
    assert not out.exists()


_CONNECT_SCRIPT = textwrap.dedent(
    """
    import sys
    import pyarrow.parquet as pq
    from pyspark.sql import SparkSession
    import formats
    from tests.builders import mnist_like_table
    src, out = sys.argv[1], sys.argv[2]
    pq.write_table(mnist_like_table(200), src, row_group_size=50)
    spark = SparkSession.builder.remote("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    res = formats.parquet_to_tfrecords(spark, src, out)
    back = formats.read_tfrecords(spark, out).orderBy("id").toPandas()
    ok = back["id"].tolist() == list(range(200)) and all(len(v) == 784 for v in back["image"])
    print("RESULT", type(spark).__module__, res.rows, res.files, ok, flush=True)
    spark.stop()
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    int(pyspark.__version__.split(".")[0]) < 4,
    reason="pyspark 3.5's local Spark Connect server needs the spark-connect jar from Maven "
    "Central (not bundled, not reachable here); pyspark 4 bundles it",
)
def test_runs_under_spark_connect(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_CONNECT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "src.parquet"), str(tmp_path / "tfr")],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    session, rows, files, ok = lines[-1].split()[1:]
    assert (session, rows, ok) == ("pyspark.sql.connect.session", "200", "True") and int(files) >= 1
