"""write_tfrecords / read_tfrecords on a real SparkSession (local[2,3]: tasks may be retried)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

import feeders
import formats
from dataplane.errors import SchemaError, StorageError
from formats.schemafile import read_schema_file
from tests.builders import all_types_table, numeric_table, row_checksum

ROWS = 300


@pytest.fixture(scope="module")
def parquet_src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "all.parquet"
    pq.write_table(all_types_table(ROWS, spark_types_only=True), path, row_group_size=100)
    return str(path)


def _rows(df):
    return sorted((r.asDict(recursive=True) for r in df.collect()), key=lambda r: r["id"])


def _data_files(path):
    return sorted(f for f in os.listdir(path) if not f.startswith(("_", ".")))


def test_parquet_to_tfrecord_to_dataframe_round_trip(spark, parquet_src, tmp_path):
    compression = "GZIP"
    df = spark.read.parquet(parquet_src).repartition(3)
    out = str(tmp_path / "tfr")
    res = formats.write_tfrecords(df, out, compression=compression)
    assert (res.rows, res.files) == (ROWS, 3)
    suffix = ".gz" if compression else ""
    assert _data_files(out) == [f"part-0000{i}.tfrecord{suffix}" for i in range(3)]
    assert sorted(os.listdir(out)) == ["_tf_schema.json", *_data_files(out)]  # no _temporary
    back = formats.read_tfrecords(spark, out)
    assert back.schema == df.schema  # every Spark type restored, binary vs string kept apart
    assert _rows(back) == _rows(df)  # values and nulls (f64 values are exact in float32)


def test_retried_task_leaves_exactly_one_copy(spark, tmp_path):
    from pyspark import TaskContext

    marker = tmp_path / "failed-once"

    def fail_first_attempt(batches):
        ctx = TaskContext.get()
        for b in batches:
            yield b
        if ctx.partitionId() == 1 and ctx.attemptNumber() == 0:
            marker.write_text("attempt 0 of partition 1 failed after its rows were written")
            raise RuntimeError("injected failure on the first attempt")

    src = spark.createDataFrame(numeric_table(400).to_pandas()).repartition(2)
    df = src.mapInArrow(fail_first_attempt, src.schema)
    out = str(tmp_path / "tfr")
    res = formats.write_tfrecords(df, out)
    assert marker.exists()  # the failure really happened
    assert res.rows == 400 and len(_data_files(out)) == 2
    ids = np.array([r.id for r in formats.read_tfrecords(spark, out).select("id").collect()])
    assert row_checksum(ids) == row_checksum(np.arange(400))


def test_failed_job_leaves_no_output(spark, tmp_path):
    def always_fail(batches):
        from pyspark import TaskContext

        for b in batches:
            yield b
        if TaskContext.get().partitionId() == 0:
            raise RuntimeError("this partition always fails")

    src = spark.range(100, numPartitions=2)
    out = tmp_path / "tfr"
    with pytest.raises(Exception, match="this partition always fails"):
        formats.write_tfrecords(src.mapInArrow(always_fail, src.schema), str(out))
    assert not out.exists()


def test_unsupported_columns_fail_before_any_output(spark, tmp_path):
    df = spark.sql("SELECT 1 AS id, map('a', 1) AS m")
    with pytest.raises(SchemaError, match="column 'm' is a map"):
        formats.write_tfrecords(df, str(tmp_path / "m"))
    df = spark.sql("SELECT 1 AS id, CAST(1.5 AS DECIMAL(10, 2)) AS price")
    with pytest.raises(SchemaError, match="column 'price' has type decimal"):
        formats.write_tfrecords(df, str(tmp_path / "d"))
    df = spark.sql("SELECT 1 AS id, named_struct('a', 1, 'b', 'x') AS s")
    with pytest.raises(SchemaError, match="column 's' is a struct"):
        formats.write_tfrecords(df, str(tmp_path / "s"))
    assert os.listdir(tmp_path) == []
    res = formats.write_tfrecords(df, str(tmp_path / "flat"), flatten_structs=True)
    assert res.rows == 1
    row = formats.read_tfrecords(spark, str(tmp_path / "flat")).collect()[0]
    assert row.asDict() == {"id": 1, "s.a": 1, "s.b": "x"}


def test_existing_output_is_refused_unless_overwrite(spark, tmp_path):
    out = tmp_path / "tfr"
    out.mkdir()
    (out / "old.tfrecord").write_bytes(b"")
    df = spark.range(10)
    with pytest.raises(StorageError, match="already exists"):
        formats.write_tfrecords(df, str(out))
    formats.write_tfrecords(df, str(out), mode="overwrite", num_files=1)
    assert _data_files(out) == ["part-00000.tfrecord"]


def test_overwriting_the_folder_a_frame_reads_is_refused_and_deletes_nothing(spark, tmp_path):
    # write_tfrecords(spark.read.parquet(p), p, mode="overwrite") emptied p, then the job
    # failed on the files it had deleted (FAILED_READ_FILE), and the data was gone
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(numeric_table(20).select(["id"]), str(data / "part-0.parquet"))
    df = spark.read.parquet(str(data))
    for out in (data, tmp_path):
        with pytest.raises(StorageError, match=r"which this export reads: mode='overwrite' would delete"):
            formats.write_tfrecords(df, str(out), mode="overwrite")
    with pytest.raises(StorageError, match=r"which this export reads"):
        formats.parquet_to_tfrecords(spark, str(data), str(data), mode="overwrite")
    assert sorted(os.listdir(data)) == ["part-0.parquet"]
    assert pq.read_table(str(data)).column("id").to_pylist() == list(range(20))


def test_the_export_of_an_empty_frame_reads_as_no_rows_everywhere(spark, tmp_path):
    # it holds only the schema file: tfrecord_dataset and inspect said "no data files"
    import tensorflow as tf

    from dataplane.cli.inspect import describe

    out = str(tmp_path / "empty")
    result = formats.write_tfrecords(spark.range(10).selectExpr("id", "cast(id as double) * 0.5 as x").limit(0), out)
    assert result.rows == 0 and _data_files(tmp_path / "empty") == []
    ds = feeders.tfrecord_dataset(out, batch_size=4, label="id")
    features, label = ds.element_spec
    assert (features["x"].shape.as_list(), features["x"].dtype, list(features)) == ([None], tf.float64, ["x"])
    assert (label.shape.as_list(), label.dtype) == ([None], tf.int64)
    assert list(ds) == []
    info = describe(out)
    assert (info["format"], info["rows"], info["files"]) == ("tfrecord", 0, [])
    assert [c["name"] for c in info["columns"]] == ["id", "x"]
    assert formats.read_tfrecords(spark, out).count() == 0
    (tmp_path / "empty" / "_tf_schema.json").unlink()  # without it, nothing says it is data
    with pytest.raises(StorageError, match="is a directory with no data files"):
        feeders.tfrecord_dataset(out)
    # a schema file that records rows whose files are gone is not an empty export: no reader
    # may turn the lost files into zero rows
    gone = tmp_path / "gone"
    formats.write_tfrecords(spark.range(10), str(gone), num_files=2)
    for f in _data_files(gone):
        (gone / f).unlink()
    for read in (lambda: feeders.tfrecord_dataset(str(gone)), lambda: describe(str(gone)),
                 lambda: formats.read_tfrecords(spark, str(gone))):
        with pytest.raises(StorageError, match="is a directory with no data files"):
            read()


def test_plain_tensorflow_reads_the_output_with_the_schema_file(spark, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from formats.example import parse_features

    table = numeric_table(200)
    out = str(tmp_path / "tfr")
    formats.write_tfrecords(spark.createDataFrame(table.to_pandas()), out, compression="gzip",
                            num_files=2)
    schema = read_schema_file(out)
    files = sorted(str(tmp_path / "tfr" / f["path"]) for f in schema.files)
    ds = tf.data.TFRecordDataset(files, compression_type=schema.compression)
    ds = ds.batch(64).map(lambda x: tf.io.parse_example(x, parse_features(schema.specs)))
    got = {k: np.concatenate([b[k].numpy() for b in ds]) for k in table.column_names}
    order = np.argsort(got["id"])
    for name in table.column_names:
        want = table.column(name).to_numpy()
        assert np.array_equal(got[name][order], want.astype(got[name].dtype)), name


def test_read_without_schema_file_infers(spark, tmp_path):
    out = tmp_path / "tfr"
    df = spark.sql("SELECT id, CAST(id AS FLOAT) * 0.5 AS x, array(id, id) AS pair, "
                   "CAST(id AS STRING) AS s FROM range(50)")
    formats.write_tfrecords(df, str(out), num_files=1)
    os.remove(out / "_tf_schema.json")
    back = formats.read_tfrecords(spark, str(out))
    assert [(f.name, f.dataType.simpleString()) for f in back.schema.fields] == [
        ("id", "bigint"), ("pair", "array<bigint>"), ("s", "string"), ("x", "float")]
    assert _rows(back)[7] == {"id": 7, "pair": [7, 7], "s": "7", "x": 3.5}


def test_spark_arrays_of_one_length_read_back_dense_and_train_a_model(spark, tmp_path):
    # Spark has no fixed-size array: images are array<float> (or nested arrays). Written from
    # such a DataFrame, the files must read back as [batch, ...] tensors a Keras model takes,
    # not as ragged tensors it refuses.
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(3)
    images = rng.random((120, 4, 4, 2), dtype=np.float32)
    rows = [(i, images[i].reshape(-1).tolist(), images[i].tolist(), ["a", str(i)], i % 2)
            for i in range(120)]
    df = spark.createDataFrame(
        rows, "id long, flat array<float>, grid array<array<array<float>>>, tags array<string>, "
              "label int").repartition(3)
    out = str(tmp_path / "tfr")
    formats.write_tfrecords(df, out)
    cols = {s.name: s for s in read_schema_file(out).specs}
    assert [(cols[c].shape, cols[c].ragged_rank) for c in ("flat", "grid", "tags")] == [
        ((32,), 0), ((4, 4, 2), 0), ((2,), 0)]

    ds = feeders.tfrecord_dataset(out, batch_size=40)
    assert ds.element_spec["grid"] == tf.TensorSpec([None, 4, 4, 2], tf.float32)
    got = {k: np.concatenate([b[k].numpy() for b in ds]) for k in ("id", "flat", "grid", "tags")}
    order = np.argsort(got["id"])
    assert np.array_equal(got["flat"][order], images.reshape(120, -1))
    assert np.array_equal(got["grid"][order], images)
    assert got["tags"][order][7].tolist() == [b"a", b"7"]

    model = tf.keras.Sequential([tf.keras.Input((4, 4, 2)), tf.keras.layers.Conv2D(2, 2),
                                 tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    train = feeders.tfrecord_dataset(out, batch_size=40, label="label").map(
        lambda x, y: (x["grid"], tf.cast(y, tf.float32)))
    hist = model.fit(train, epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0])

    back = formats.read_tfrecords(spark, out)  # the Spark types come back as they were
    assert back.schema == df.schema
    assert _rows(back)[7] == df.where("id = 7").collect()[0].asDict(recursive=True)


def test_list_columns_that_vary_stay_ragged(spark, tmp_path):
    tf = pytest.importorskip("tensorflow")
    # Each task sees one length, but the tasks differ: only the job as a whole can tell.
    rows = [(i, [float(i)] * (3 if i < 40 else 4), [i] if i != 9 else None, [[i]] if i >= 40 else [])
            for i in range(80)]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, 2),
        "id long, split array<float>, nulls array<long>, inner array<array<long>>")
    out = str(tmp_path / "tfr")
    formats.write_tfrecords(df, out)
    cols = {s.name: s for s in read_schema_file(out).specs}
    assert {c: (cols[c].shape, cols[c].ragged_rank) for c in ("split", "nulls", "inner")} == {
        "split": ((None,), 1),  # 3 in one task, 4 in the other
        "nulls": ((None,), 1),  # a null row: a dense reader would need a fill value
        "inner": ((None, None), 2),  # one task's outer lists are all empty
    }
    ds = feeders.tfrecord_dataset(out, batch_size=80)
    assert isinstance(ds.element_spec["split"], tf.RaggedTensorSpec)
    b = next(iter(ds))
    order = np.argsort(b["id"].numpy())
    split = b["split"].to_list()
    assert [len(split[i]) for i in order[[0, 39, 40, 79]]] == [3, 3, 4, 4]
    assert _rows(formats.read_tfrecords(spark, out))[9]["nulls"] is None


def test_list_lengths_per_level():
    import pyarrow as pa

    from formats.schema import column_specs, list_lengths
    from formats.staging import dense_specs

    t = pa.table({"g": pa.array([[[1, 2], [3, 4]], None, [[5, 6], [7, 8]]], pa.list_(pa.list_(pa.int64()))),
                  "e": pa.array([[], []], pa.list_(pa.list_(pa.int64()))).slice(0, 2).take([0, 1, 0]),
                  "f": pa.array([[1, 2]] * 3, pa.list_(pa.int64(), 2))})
    specs = {s.name: s for s in column_specs(t.schema)}
    assert list_lengths(t.column("g").chunk(0).slice(1), specs["g"]) == [[2, 2], [2, 2]]
    assert list_lengths(t.column("e").chunk(0), specs["e"]) == [[0, 0], [0, 0]]
    assert list_lengths(t.column("f").chunk(0), specs["f"]) is None  # already dense
    assert list_lengths(pa.array([None], pa.list_(pa.list_(pa.int64()))), specs["g"]) is None
    dense = dense_specs(list(specs.values()), {"g": [[2, 2], [2, 2]], "e": [[0, 0], [0, 0]]}, {})
    assert [(s.name, s.shape, s.ragged_rank) for s in dense] == [
        ("g", (2, 2), 0), ("e", (None, None), 2), ("f", (2,), 0)]
    assert dense_specs([specs["g"]], {"g": [[2, 2], [2, 2]]}, {"g": 1})[0].shape == (None, None)


def test_uniform_shape_needs_one_length_above_zero_per_level():
    from formats.schema import uniform_shape

    assert uniform_shape([[28, 28], [28, 28]]) == (28, 28)
    assert uniform_shape([(4, 4)]) == (4,)
    assert uniform_shape([[4, 4], [1, 2]]) is None
    assert uniform_shape([[0, 0]]) is None
    assert uniform_shape([[None, None]]) is None
    assert uniform_shape(None) is None and uniform_shape([]) is None


def test_spark_reads_the_parquet_files_ours_read_beside_a_readme(spark, tmp_path):
    # export --to parquet and bench push --data read SRC with spark.read.parquet, which failed
    # on a README.md that parquet_dataset, inspect and export --to tfrecord skip
    import pyarrow as pa

    from formats.sparkframe import read_parquet

    for day in (1, 2):
        (tmp_path / f"day={day}").mkdir()
        pq.write_table(pa.table({"x": [float(day), day + 0.5]}), tmp_path / f"day={day}" / "part-0.parquet")
    (tmp_path / "README.md").write_text("two days of x\n")
    rows = sorted(tuple(r) for r in read_parquet(spark, str(tmp_path)).select("x", "day").collect())
    assert rows == [(1.0, 1), (1.5, 1), (2.0, 2), (2.5, 2)]
    (tmp_path / "README.md").unlink()  # plain spark.read.parquet again, same rows
    assert sorted(tuple(r) for r in read_parquet(spark, f"file://{tmp_path}").select("x", "day").collect()) == rows
    # a glob: partition keys count from the directory above the first wildcard, as in ours
    glob = sorted(tuple(r) for r in read_parquet(spark, f"{tmp_path}/day=*/part-0.parquet").select("x", "day").collect())
    assert glob == rows


def test_progress_ends_at_every_task_done_and_a_raising_callback_is_said_once(spark, tmp_path, caplog):
    """progress= gets (done, total) and its last call, once the job succeeded, has
    done == total; a callback that raises is reported (it was swallowed at debug level) and
    not called again, and the export goes on."""
    src = tmp_path / "src.parquet"
    pq.write_table(numeric_table(200), src)
    seen: list[tuple[int, int]] = []
    formats.parquet_to_tfrecords(spark, src, tmp_path / "a", num_files=3,
                                 progress=lambda done, total: seen.append((done, total)))
    assert seen and all(0 <= d <= t for d, t in seen), seen
    assert seen[-1][0] == seen[-1][1] > 0, seen
    calls: list[int] = []

    def broken(done: int, total: int) -> None:
        calls.append(done)
        raise RuntimeError("the bar broke")

    with caplog.at_level("WARNING", logger="formats.staging"):
        res = formats.parquet_to_tfrecords(spark, src, tmp_path / "b", progress=broken)
    assert res.rows == 200 and len(calls) == 1
    notes = [r.getMessage() for r in caplog.records if "progress callback raised" in r.getMessage()]
    assert len(notes) == 1 and "RuntimeError: the bar broke" in notes[0], notes


def test_the_cli_progress_writes_lines_when_stderr_is_not_a_terminal(capsys):
    from dataplane.cli.export import _Bar

    bar = _Bar("export -> tfrecord", every=0.0)  # (the CLI's: every 30 s)
    bar(3, 10)
    bar(10, 10)
    bar.close()
    assert capsys.readouterr().err.splitlines() == [
        "export -> tfrecord: 3/10 tasks, 0 s", "export -> tfrecord: 10/10 tasks, 0 s"]


def test_the_export_job_of_wide_rows_asks_spark_3_5_for_small_arrow_batches(spark):
    # Spark 3.5 cuts Arrow batches at 10,000 rows whatever their size: an export of 20,000
    # images of 100 KiB in two partitions ran the executor out of direct memory and waited
    # for ever. The job runs with about 64 MiB a batch there; Spark 4 cuts them by bytes.
    import pyspark

    from formats.export import _batch_rows, spark_arrow_schema

    df = spark.range(8).selectExpr(
        "id", "unhex(repeat('00', 102400)) as jpeg", "array(cast(1 as double), cast(2 as double)) as xy",
        "array_repeat(array_repeat(cast(1 as float), 64), cast(id as int)) as clip")
    rows = _batch_rows(df, spark_arrow_schema(df.schema))
    if int(pyspark.__version__.split(".")[0]) < 4:
        # id 8 + jpeg 102,400 + xy 16 + clip 64 x 4 x 3.5 on average = 103,320 bytes a row
        assert rows == (64 << 20) // 103320, rows
    else:
        assert rows is None
    narrow = spark.range(8).selectExpr("id", "cast(id as string) as name")
    assert _batch_rows(narrow, spark_arrow_schema(narrow.schema)) is None  # 10,000 small rows fit
