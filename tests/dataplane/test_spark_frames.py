"""DataFrames as Spark users make them, fed as they are: Spark ML vector columns and column
names with dots, spaces or dashes, images read with Spark's ``binaryFile`` source.

A Spark ML user's DataFrame holds its features as one ``VectorUDT`` column, some rows dense and
some sparse. Pushed for training (cached, with a validation split), sent for inference, given to
``predict`` and exported to TFRecords, it must arrive as the dense float64 values of each vector,
row for row, with no conversion by the user. Names such as ``sepal.length`` (R's iris, a
flattened export's ``parent.child``) must work on the same paths, under their own names.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import dataplane
import formats
from dataplane.workloads.batch_predict import predict
from formats.sparkframe import dense_vectors
from tests.dataplane.clusterutil import node_processes, wait_gone

ROWS = 240
WIDTH = 5


def _dense(i: int) -> list[float]:
    """Row ``i``'s vector as values: odd rows are stored sparse (two non-zeros)."""
    if i % 2:
        v = [0.0] * WIDTH
        v[i % WIDTH] = i + 0.5
        v[(i + 2) % WIDTH] = -float(i)
        return v
    return [i * 0.25 + k for k in range(WIDTH)]


def _vector_frame(spark, ids, parts: int):  # type: ignore[no-untyped-def]
    from pyspark.ml.linalg import Vectors

    def vec(i):  # type: ignore[no-untyped-def]
        v = _dense(i)
        if i % 2:
            return Vectors.sparse(WIDTH, {k: x for k, x in enumerate(v) if x != 0.0})
        return Vectors.dense(v)

    rows = [(i, vec(i), i % 3) for i in ids]
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType([StructField("id", LongType()), StructField("features", VectorUDT()),
                         StructField("label", LongType())])
    return spark.createDataFrame(rows, schema).repartition(parts)


def vector_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Three epochs of each split, every row's features recorded by id, then serve."""
    train = ctx.dataset(32, features=["id", "features"], label="label")
    val = ctx.dataset(32, features=["id", "features"], label="label", split="validation")
    rec = {"spec": None, "train": [], "validation": []}
    for _ in range(3):
        for split, ds in (("train", train), ("validation", val)):
            rows = {}
            for f, y in ds:
                rec["spec"] = [f["features"].dtype.name, f["features"].shape.as_list()[1:]]
                for i, v in zip(f["id"].numpy(), f["features"].numpy()):
                    rows[str(int(i))] = [float(x) for x in v]
            rec[split].append(rows)
    path = os.path.join(args["dir"], f"node{ctx.node_id}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(rec, fh)
    os.replace(path + ".tmp", path)
    ctx.serve(lambda b: {"total": np.asarray(b["features"], np.float64).sum(axis=1),
                         "width": np.full(len(b["id"]), np.asarray(b["features"]).shape[1])})


def test_vector_columns_train_cached_with_validation_and_infer(spark, tmp_path):
    df = _vector_frame(spark, range(ROWS), 4)
    val = _vector_frame(spark, range(1000, 1000 + ROWS // 4), 2)
    assert type(df.schema["features"].dataType).__name__ == "VectorUDT"
    cluster = dataplane.run(spark, vector_main, {"dir": str(tmp_path)}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        report = cluster.train(df, 2, cache=True, validation=val, feed_timeout=60)
        assert (report.spark_jobs, report.rows_per_split) == (2, {"train": 2 * ROWS, "validation": 2 * ROWS // 4})
        # the same DataFrames again: replayed from the nodes' caches, no Spark job at all
        report = cluster.train(df, 1, cache=True, validation=val, feed_timeout=60)
        assert (report.spark_jobs, report.rows_per_split) == (0, {"train": ROWS, "validation": ROWS // 4})
        recs = []
        for n in cluster.nodes:
            path = tmp_path / f"node{n.node_id}.json"
            for _ in range(300):
                if path.exists():
                    break
                import time

                time.sleep(0.2)
            recs.append(json.loads(path.read_text()))
        for split, ids in (("train", range(ROWS)), ("validation", range(1000, 1000 + ROWS // 4))):
            for e in range(3):
                got = {}
                for r in recs:
                    assert not set(got) & set(r[split][e])  # each row on one node only
                    got.update(r[split][e])
                assert got == {str(i): _dense(i) for i in ids}, (split, e)
        assert recs[0]["spec"] == ["float64", [WIDTH]]

        out = cluster.inference(df, passthrough=("id",)).collect()
        assert len(out) == ROWS
        assert {r["id"]: r["total"] for r in out} == {i: sum(_dense(i)) for i in range(ROWS)}
        assert {r["width"] for r in out} == {WIDTH}
        pdf = df.toPandas()  # a pandas frame is also a "DataFrame": the error says which
        with pytest.raises(TypeError, match=r"got pandas\.core\.frame\.DataFrame; make it a Spark "
                                            r"DataFrame with spark\.createDataFrame\(pdf\)"):
            cluster.train(pdf, 1)
        with pytest.raises(TypeError, match=r"inference\(\) needs a Spark DataFrame, got pandas"):
            cluster.inference(pdf)
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)
        assert node_processes(cluster.cluster_id) == []


def test_predict_reads_vector_inputs_and_keeps_the_vector_column(spark, tmp_path):
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input(shape=(WIDTH,)), keras.layers.Dense(2, name="out")])
    path = str(tmp_path / "m.keras")
    model.save(path)
    x = np.array([_dense(i) for i in range(ROWS)], np.float32)
    ref = model.predict(x, verbose=0)
    df = _vector_frame(spark, range(ROWS), 3)
    out = predict(df, path, input_cols=["features"], batch_size=50)
    assert out.columns == ["id", "features", "label", "prediction"]
    assert type(out.schema["features"].dataType).__name__ == "VectorUDT"
    rows = out.collect()
    assert len(rows) == ROWS
    for r in rows:
        i = r["id"]
        assert r["features"].toArray().tolist() == _dense(i)  # the vector itself, unchanged
        np.testing.assert_allclose(r["prediction"], ref[i], rtol=1e-5, atol=1e-6)


def test_a_null_vector_names_the_column(spark, tmp_path):
    import keras

    model = keras.Sequential([keras.Input(shape=(WIDTH,)), keras.layers.Dense(1)])
    path = str(tmp_path / "m.keras")
    model.save(path)
    from pyspark.sql import functions as F

    df = _vector_frame(spark, range(20), 1).withColumn(
        "features", F.when(F.col("id") == 7, F.lit(None)).otherwise(F.col("features")))
    # a null vector stays a null (Spark's vector_to_array alone fails the task on it)...
    got = {r["id"]: r["features"] for r in dense_vectors(df).collect()}
    assert got == {i: (None if i == 7 else _dense(i)) for i in range(20)}
    # ...which a model input refuses, naming the column
    with pytest.raises(Exception, match="column 'features' has 1 null value"):
        predict(df, path, input_cols=["features"]).collect()


def test_export_writes_vectors_as_float_lists(spark, tmp_path):
    df = _vector_frame(spark, range(ROWS), 3)
    out = str(tmp_path / "tfr")
    res = formats.write_tfrecords(df, out)
    assert res.rows == ROWS
    back = formats.read_tfrecords(spark, out)
    assert back.schema["features"].dataType.simpleString() == "array<double>"
    assert {r["id"]: list(r["features"]) for r in back.collect()} == {i: _dense(i) for i in range(ROWS)}


def names_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Two passes recording each row by id under the pushed names, then serve."""
    ds = ctx.dataset(16)
    rec = []
    for _ in range(2):
        rows = {}
        for b in ds:
            keys = sorted(b.keys())
            for k, i in enumerate(b["row id"].numpy()):
                rows[str(int(i))] = [float(v) for v in b["sepal.length"].numpy()[k]] + [int(b["class-x"].numpy()[k])]
        rec.append([keys, rows])
    path = os.path.join(args["dir"], f"node{ctx.node_id}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(rec, fh)
    os.replace(path + ".tmp", path)
    ctx.serve(lambda b: {"out.sum": np.asarray(b["sepal.length"], np.float64).sum(axis=1)})


def _names_frame(spark, rows: int):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, 3).select(
        F.col("id").alias("row id"),
        F.array(F.col("id").cast("float"), (F.col("id") * 0.5).cast("float")).alias("sepal.length"),
        (F.col("id") % 3).cast("int").alias("class-x"),
    )


def _expected_names_row(i: int) -> list:
    return [float(i), i * 0.5, i % 3]


def test_column_names_with_dots_spaces_and_dashes(spark, tmp_path):
    import keras

    df = _names_frame(spark, 90)
    want = {str(i): _expected_names_row(i) for i in range(90)}
    cluster = dataplane.run(spark, names_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        assert cluster.train(df, 1, cache=True, shuffle=True, seed=3).rows == 90
        assert cluster.train(df, 1).rows == 90  # uncached: the push job itself
        path = tmp_path / f"node{cluster.nodes[0].node_id}.json"
        for _ in range(300):
            if path.exists():
                break
            import time

            time.sleep(0.2)
        for keys, rows in json.loads(path.read_text()):
            assert keys == ["class-x", "row id", "sepal.length"]
            assert rows == want
        out = cluster.inference(df, passthrough=("row id", "sepal.length")).collect()
        assert out[0].asDict().keys() == {"row id", "sepal.length", "out.sum"}
        assert {r["row id"]: r["out.sum"] for r in out} == {i: 1.5 * i for i in range(90)}
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)

    res = formats.write_tfrecords(df, str(tmp_path / "tfr"))
    assert res.rows == 90
    back = formats.read_tfrecords(spark, str(tmp_path / "tfr"))
    assert back.columns == df.columns
    assert {str(r["row id"]): [*r["sepal.length"], r["class-x"]] for r in back.collect()} == want

    model = keras.Sequential([keras.Input(shape=(2,)), keras.layers.Dense(1)])
    model.save(str(tmp_path / "m.keras"))
    x = np.array([_expected_names_row(i)[:2] for i in range(90)], np.float32)
    ref = model.predict(x, verbose=0).reshape(-1)
    scored = predict(df, str(tmp_path / "m.keras"), input_cols=["sepal.length"], output_col="y.hat")
    assert scored.columns == [*df.columns, "y.hat"]
    got = {r["row id"]: r["y.hat"] for r in scored.collect()}
    np.testing.assert_allclose([got[i] for i in range(90)], ref, rtol=1e-5, atol=1e-6)


def image_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Two passes over PNGs decoded on the node: each file's pixel sum, shape and label."""
    ds = ctx.dataset(8, features=["content", "path"], label="label", decode={"content": "png"})
    rec = []
    for _ in range(2):
        got = {}
        for f, y in ds:
            for p, img, label in zip(f["path"].numpy(), f["content"].numpy(), y.numpy()):
                got[p.decode()] = [int(img.sum()), list(img.shape), str(img.dtype), int(label)]
        rec.append(got)
    path = os.path.join(args["dir"], f"node{ctx.node_id}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(rec, fh)
    os.replace(path + ".tmp", path)


def test_images_read_with_the_binary_file_source_decode_on_the_nodes(spark, tmp_path):
    """spark.read.format("binaryFile") (path, modificationTime, length, content), a label taken
    from the file name, pushed once and decoded as PNG on two workers."""
    import tensorflow as tf
    from pyspark.sql import functions as F

    src = tmp_path / "pngs"
    src.mkdir()
    want = {}
    for i in range(30):
        img = (np.arange(12 * 10 * 3).reshape(12, 10, 3) * (i + 1) % 251).astype(np.uint8)
        name = src / f"cls{i % 3}_{i:03d}.png"
        name.write_bytes(tf.io.encode_png(img).numpy())
        want[f"file:{name}"] = [int(img.sum()), [12, 10, 3], "uint8", i % 3]
    df = spark.read.format("binaryFile").option("pathGlobFilter", "*.png").load(str(src))
    df = df.withColumn("label", F.regexp_extract("path", r"cls(\d)_", 1).cast("int"))
    out = tmp_path / "out"
    out.mkdir()
    cluster = dataplane.run(spark, image_main, {"dir": str(out)}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        report = cluster.train(df, 2, cache=True, shuffle=True, seed=4, feed_timeout=60)
        assert (report.rows, report.spark_jobs) == (60, 1)
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)
    recs = [json.loads((out / f"node{n.node_id}.json").read_text()) for n in cluster.nodes]
    for e in range(2):
        got = {}
        for r in recs:
            assert len(r[e]) == 15 and not set(got) & set(r[e])
            got.update(r[e])
        assert got == want, e


def nested_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """A Keras CNN fed nested-array images (no shapes declared), then serving them."""
    import tensorflow as tf

    ds = ctx.dataset(16, features=["img"], label="label")
    model = tf.keras.Sequential([
        tf.keras.Input((4, 4, 3)), tf.keras.layers.Conv2D(2, 3), tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(3),
    ])
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(ds.map(lambda f, y: (f["img"], y)), epochs=1, verbose=0)
    with open(os.path.join(args["dir"], f"node{ctx.node_id}.json"), "w") as fh:
        json.dump({"spec": ds.element_spec[0]["img"].shape.as_list(), "loss": hist.history["loss"]}, fh)
    ctx.serve(lambda b: {"sum": b["img"].sum(axis=(1, 2, 3)), "rank": np.full(len(b["id"]), b["img"].ndim),
                         "lengths": np.asarray([sum(len(r) for r in row) if isinstance(row, list) else -1
                                                for row in b["jag"]])})


def test_images_given_as_nested_arrays_are_dense_for_training_and_serving(spark, tmp_path):
    """What users do with a numpy image set: createDataFrame(images.tolist()), which Spark types
    array<array<array<float>>>. A CNN must train on it and serve it without declared shapes."""
    rng = np.random.default_rng(3)
    imgs = rng.random((60, 4, 4, 3)).astype(np.float32)
    rows = [(i, imgs[i].tolist(), [[1.0] * (i % 3 + 1), [2.0]], i % 3) for i in range(60)]
    df = spark.createDataFrame(
        rows, "id long, img array<array<array<float>>>, jag array<array<float>>, label int"
    )
    cluster = dataplane.run(spark, nested_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        report = cluster.train(df.select("img", "label"), 1, feed_timeout=60)
        assert report.rows == 60
        for _ in range(300):
            if (tmp_path / "node0.json").exists():
                break
            time.sleep(0.2)
        rec = json.loads((tmp_path / "node0.json").read_text())
        assert rec["spec"] == [None, 4, 4, 3] and np.isfinite(rec["loss"][0])
        out = {r["id"]: r for r in cluster.inference(df.select("id", "img", "jag"), passthrough=("id",)).collect()}
        assert sorted(out) == list(range(60))
        for i in range(60):  # float32 sums of each image, as numpy makes them
            assert out[i]["sum"] == pytest.approx(float(imgs[i].sum()), rel=1e-6)
            assert (out[i]["rank"], out[i]["lengths"]) == (4, i % 3 + 2)
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)


def test_frames_that_are_not_spark_dataframes_are_named_with_the_conversion(spark, tmp_path):
    import pandas as pd
    import pyarrow as pa

    pdf = pd.DataFrame({"x": [1.0, 2.0]})
    cases = [
        (pdf, "pandas.core.frame.DataFrame; make it a Spark DataFrame with spark.createDataFrame(pdf)"),
        (pa.table(pdf), "pyarrow.lib.Table; make it a Spark DataFrame with spark.createDataFrame(table.to_pandas())"),
        (spark.createDataFrame(pdf).rdd, "rdd.RDD; pass rdd.toDF()"),  # pyspark(.core).rdd
        (spark.createDataFrame(pdf).pandas_api(), "(pandas-on-Spark); pass its .to_spark()"),
    ]
    for obj, text in cases:
        with pytest.raises(TypeError) as info:
            predict(obj, str(tmp_path), input_cols=["x"])
        assert text in str(info.value), str(info.value)
        with pytest.raises(TypeError) as info:
            formats.write_tfrecords(obj, str(tmp_path / "out"))
        assert text in str(info.value), str(info.value)
