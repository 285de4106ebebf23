"""``dataplane inspect`` run as a real subprocess on Parquet and TFRecord data, local and S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from formats.schema import column_specs
from formats.schemafile import TFRecordSchema, write_schema_file
from tests.builders import conformance_table, write_parquet_files, write_tfrecord_files
from tests.s3server import acquire_shared, release_shared

ROOT = Path(__file__).resolve().parents[2]


def _inspect(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dataplane.cli", "inspect", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=full_env,
    )


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """The session's shared SeaweedFS server (tests.s3server)."""
    yield acquire_shared(tmp_path_factory.mktemp("seaweedfs"))
    release_shared()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    table = conformance_table(120)
    write_parquet_files(table, root / "pq", files=2, row_group_size=25)
    write_tfrecord_files(table, root / "tr", files=3)
    write_tfrecord_files(table, root / "trs", files=1, compression="GZIP")
    write_schema_file(root / "trs", TFRecordSchema(specs=column_specs(table.schema), compression="GZIP"))
    return root


def test_parquet_text(data):
    out = _inspect(str(data / "pq"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"dataset: {data / 'pq'}" in text
    assert "format:  parquet, 2 file(s)" in text
    assert "rows:    120" in text
    assert "vec     fixed_size_list<element: float>[3]  TensorSpec(shape=(None, 3), dtype=tf.float32)" in text
    assert "RaggedTensorSpec(shape=(None, None), dtype=tf.int64, ragged_rank=1)" in text
    assert f"{data / 'pq' / 'part-00001.parquet'}  60 rows" in text
    # Neither TensorFlow nor Spark is needed to inspect.
    assert "tensorflow" not in out.stderr.lower()


def test_tfrecord_with_schema_file_json(data):
    out = _inspect(str(data / "trs"), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["format"], info["compression"], info["rows"]) == ("tfrecord", "GZIP", 120)
    assert info["schema_source"] == "schema file"
    cols = {c["name"]: c for c in info["columns"]}
    assert cols["i32"] == {"name": "i32", "arrow_type": "int32",
                           "tf": "TensorSpec(shape=(None,), dtype=tf.int32)", "nulls": 0}
    assert cols["vec"]["tf"] == "TensorSpec(shape=(None, 3), dtype=tf.float32)"
    assert [f["rows"] for f in info["files"]] == [120]


def test_long_steps_say_how_far_they_are(data, monkeypatch):
    """Reading every Parquet footer and counting TFRecord files to their ends are quick here
    and silent; past SlowStep's first mark (both marks at 0 here) each says what it does and
    how far it is, file by file, and describes the data the same."""
    from dataplane.cli import console
    from dataplane.cli.inspect import describe

    lines: list[str] = []
    quick = {d: describe(str(data / d), progress=lines.append) for d in ("pq", "tr")}
    assert lines == []
    monkeypatch.setattr(console, "SLOW_STEP_MARKS", (0.0, 0.0))
    assert describe(str(data / "pq"), progress=lines.append) == quick["pq"]
    assert lines[0] == "reading the footers of 2 Parquet files", lines
    assert [line.split(" in ")[0] for line in lines[1:]] == ["  read 1/2 footers"], lines
    lines.clear()
    assert describe(str(data / "tr"), progress=lines.append) == quick["tr"]
    assert lines[0] == "counting the records of 3 TFRecord files to their ends (--no-count skips it)", lines
    assert [line.split(" files, ")[0] for line in lines[1:]] == ["  counted 1/3", "  counted 2/3"], lines
    counted = [int(line.split(", ")[1].split()[0]) for line in lines[1:]]
    assert 0 < counted[0] < counted[1] < 120, lines
    assert describe(str(data / "tr"), count=False, progress=lines.append)["rows"] is None
    assert len(lines) == 3, lines  # --no-count reads no file to its end: nothing to say


def test_tfrecord_inferred(data):
    out = _inspect(str(data / "tr"))
    assert out.returncode == 0, out.stderr
    assert "format:  tfrecord, 3 file(s)" in out.stdout
    assert "rows:    120" in out.stdout
    assert "inferred from the first records" in out.stdout
    # Inference cannot know a fixed length: vec comes back ragged, and f64 as float32.
    assert "vec     list<item: float>" in out.stdout


def test_unsupported_column_is_shown_not_fatal(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1], "m": pa.array([[("a", 1)]], pa.map_(pa.string(), pa.int64()))}),
                   tmp_path / "m.parquet")
    out = _inspect(str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "NOT CARRIED: column 'm' is a map" in out.stdout


def test_records_with_no_feature_are_flagged(tmp_path):
    # a TFRecord of empty tf.train.Example messages showed an empty table and nothing else
    from formats import tfrecord

    with open(tmp_path / "empty.tfrecord", "wb") as f:
        tfrecord.write_records(f, [b""] * 5)
    out = _inspect(str(tmp_path / "empty.tfrecord"))
    assert out.returncode == 0, out.stderr
    assert ("warning: no column: every record sampled (up to 1000) is an empty tf.train.Example "
            "(no feature), so a reader has nothing to read; check how the files were written.") in out.stdout
    assert "5 rows" in out.stdout
    doc = json.loads(_inspect(str(tmp_path / "empty.tfrecord"), "--json").stdout)
    assert doc["columns"] == [] and doc["warning"].startswith("no column: every record sampled")


def test_missing_path_fails_with_message(tmp_path):
    out = _inspect(str(tmp_path / "nope"))
    assert out.returncode == 1
    assert f"dataplane inspect: error: {tmp_path / 'nope'} does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    # -v: the traceback, then the same line (the README: "-v for the traceback")
    loud = subprocess.run([sys.executable, "-m", "dataplane.cli", "-v", "inspect", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1].startswith(f"dataplane inspect: error: {tmp_path / 'nope'} does not exist")


@pytest.mark.s3
def test_s3(data, s3_server):
    bucket = s3_server.make_bucket()
    url = s3_server.upload_dir(data / "pq", bucket, "pq")
    out = _inspect(url, env=s3_server.env())
    assert out.returncode == 0, out.stderr
    assert f"dataset: {url}" in out.stdout and "rows:    120" in out.stdout
    assert f"{url}/part-00000.parquet  60 rows" in out.stdout
    turl = s3_server.upload_dir(data / "trs", bucket, "trs")
    out = _inspect(turl, "--json", env=s3_server.env())
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["rows"], info["schema_source"]) == (120, "schema file")
    bad = _inspect(url, env=s3_server.env(secret_key="wrong"))
    assert bad.returncode == 1 and "refused the credentials" in bad.stderr


def test_parquet_list_columns_of_one_length_get_the_shapes_to_declare(tmp_path):
    # Spark writes an image as array<float>: Parquet keeps no list lengths, so it reads ragged
    # unless declared; inspect says what to declare when the first row group shows one shape.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "image": pa.array([[[float(i)] * 3] * 2 for i in range(10)], pa.list_(pa.list_(pa.float32()))),
        "tokens": pa.array([[1] * (i % 3 + 1) for i in range(10)], pa.list_(pa.int64())),
        "label": pa.array(range(10), pa.int64()),
    })
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5)
    out = _inspect(str(tmp_path))
    assert out.returncode == 0, out.stderr
    hints = [ln.strip() for ln in out.stdout.splitlines() if "reads it dense" in ln]
    assert hints == ["image: every row of the first row group holds [2, 3]: "
                     "shapes={'image': [2, 3]} reads it dense"]
    info = json.loads(_inspect(str(tmp_path), "--json").stdout)
    by_name = {c["name"]: c for c in info["columns"]}
    assert by_name["image"]["dense_in_sample"] == [2, 3]
    assert "dense_in_sample" not in by_name["tokens"]

    # the same rows as TFRecords from TensorFlow's own writer: the hint comes from the sample
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(tmp_path / "records.tfrecord")) as w:
        for row in table.to_pylist():
            feats = {"image": tf.train.Feature(float_list=tf.train.FloatList(value=sum(row["image"], []))),
                     "tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=row["tokens"]))}
            w.write(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())
    out = _inspect(str(tmp_path / "records.tfrecord"))
    assert out.returncode == 0, out.stderr
    assert [ln.strip() for ln in out.stdout.splitlines() if "reads it dense" in ln] == [
        "image: every row of the 10 sampled records holds [6]: shapes={'image': [6]} reads it dense"]


def test_a_list_column_of_one_shape_with_null_rows_gets_the_fill_it_needs_to_read_dense(tmp_path):
    # The hint used to say "every row holds [4]: shapes= reads it dense", and that read
    # failed on the first null row; the null count read "unknown".
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [None if i % 10 == 3 else [float(i)] * 4 for i in range(100)]
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.float32()))}), tmp_path / "n.parquet")
    out = _inspect(str(tmp_path))
    assert out.returncode == 0, out.stderr
    notes = [ln.strip() for ln in out.stdout.splitlines() if ln.strip().startswith("x: ")]
    assert notes == [
        "x: every non-null row of the first row group holds [4], and 10 row(s) are null: "
        "shapes={'x': [4]} with fill_values={'x': 0} reads it dense (a null row as shape [4] "
        "filled with 0)",
        "x: at least 10 null row(s) in the first row group (the footers keep no count for a "
        "list column); a null stops the readers unless fill_values= names the column",
    ]
    import feeders

    # what the hint says works, and gives what it says
    ds = feeders.parquet_dataset(str(tmp_path), batch_size=100, shapes={"x": [4]},
                                 fill_values={"x": 0})
    (batch,) = list(ds)
    x = batch["x"].numpy()
    assert x.shape == (100, 4) and x[3].tolist() == [0.0] * 4 and x[4].tolist() == [4.0] * 4
    assert x.sum() == 4 * sum(i for i in range(100) if i % 10 != 3)


def test_null_counts_are_shown_with_the_fill_to_pass(tmp_path):
    # inspect showed a nullable column's tf spec with no word of its nulls, which every reader
    # then refused; the footers (and an exported set's _tf_schema.json) count them
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2, 3, 4], "score": [1.0, None, None, 4.0], "tag": ["a", None, "c", "d"]}),
                   tmp_path / "t.parquet", row_group_size=2)
    out = _inspect(str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "score: 2 null value(s): the readers refuse them unless given fill_values={'score': 0}" in out.stdout
    assert "tag: 1 null value(s)" in out.stdout and "  id: " not in out.stdout
    cols = {c["name"]: c for c in json.loads(_inspect("--json", str(tmp_path)).stdout)["columns"]}
    assert (cols["id"]["nulls"], cols["score"]["nulls"], cols["tag"]["nulls"]) == (0, 2, 1)
    records = tmp_path / "tr"
    schema = TFRecordSchema(specs=column_specs(pa.schema([("score", pa.float64())])), null_counts={"score": 7})
    write_tfrecord_files(pa.table({"score": [1.0, 2.0]}), records, files=1)
    write_schema_file(records, schema)
    assert "score: 7 null value(s)" in _inspect(str(records)).stdout
    # a list column's absent feature is no refusal: the reader gives an empty list, as
    # tf.io.VarLenFeature does (inspect said the readers refuse it)
    import feeders

    lists = tmp_path / "lists"
    table = pa.table({"ll": pa.array([[1.0], None, [2.0, 3.0]], pa.list_(pa.float32()))})
    write_tfrecord_files(table, lists, files=1)
    write_schema_file(lists, TFRecordSchema(specs=column_specs(table.schema), null_counts={"ll": 1}))
    assert ("ll: 1 null value(s) (absent features): the TFRecord reader reads them as empty "
            "lists, as tf.io.VarLenFeature does") in _inspect(str(lists)).stdout
    assert next(iter(feeders.tfrecord_dataset(str(lists))))["ll"].to_list() == [[1.0], [], [2.0, 3.0]]


def test_absent_features_of_records_without_a_schema_file_are_shown_as_nulls(tmp_path):
    # TFRecords written by plain TensorFlow code, a feature absent from some records: inspect
    # said nothing, and every reader then refused the column without fill_values
    import pyarrow as pa

    write_tfrecord_files(pa.table({"id": list(range(8)), "opt": [1.5, None, 2.5, None, None, 3.0, 4.0, 5.0],
                                   "tags": [[1], [], [2, 3], [4], [], [5], [6, 7], [8]]}), tmp_path, files=1)
    out = _inspect(str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert ("opt: at least 3 null value(s) (absent features) in the first 8 records, without a "
            "_tf_schema.json to count them all: the readers refuse them unless given "
            "fill_values={'opt': 0} (or leave the column out)") in out.stdout, out.stdout
    cols = {c["name"]: c for c in json.loads(_inspect("--json", str(tmp_path)).stdout)["columns"]}
    assert (cols["opt"]["nulls"], cols["opt"]["nulls_in_first"], "nulls" in cols["id"]) == (3, 8, False), cols


def test_nulls_the_footers_cannot_count_are_unknown_not_zero(tmp_path):
    # a file without statistics, a list column with an empty list, and a partition column's
    # null directory all showed no nulls, though the readers then stopped at them
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "day=1").mkdir()
    (tmp_path / "day=__HIVE_DEFAULT_PARTITION__").mkdir()
    pq.write_table(pa.table({"x": [1.0, 2.0], "v": [[1.0], [2.0]], "w": [[1.0], []]}),
                   tmp_path / "day=1" / "a.parquet")
    pq.write_table(pa.table({"x": [1.0, None, 3.0], "v": [[1.0], [2.0], [4.0]], "w": [[1.0], [2.0], [3.0]]}),
                   tmp_path / "day=__HIVE_DEFAULT_PARTITION__" / "b.parquet",
                   write_statistics=["v.list.element", "w.list.element"])
    cols = {c["name"]: c for c in json.loads(_inspect("--json", str(tmp_path)).stdout)["columns"]}
    assert {n: c["nulls"] for n, c in cols.items()} == {"x": None, "v": 0, "w": None, "day": 3}
    text = _inspect(str(tmp_path)).stdout
    assert "x: null count unknown (the footers keep none for it" in text
    assert "w: null count unknown" in text and "v: null" not in text
    assert "day: 3 null value(s): the readers refuse them unless given fill_values={'day': 0}" in text


def test_the_index_pandas_wrote_is_flagged_as_left_out(tmp_path):
    import pandas as pd

    df = pd.DataFrame({"x": [1.0, 2.0, 3.0]})
    df[df.x > 1].to_parquet(tmp_path / "part-0.parquet")
    text = _inspect(str(tmp_path)).stdout
    assert ("__index_level_0__: the index pandas wrote (row numbers, no feature): the readers "
            "leave it out unless columns= names it") in text
    assert "  x: " not in text
