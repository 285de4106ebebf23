"""TensorFlowOnSpark 2.2.5-style programs run on dataplane.compat with only imports renamed.

The node programs (tests/dataplane/tfos_programs.py) follow TFoS's Keras MNIST examples on
sklearn's 8x8 digits: mnist_data_setup (TFRecords via dfutil), mnist_spark (InputMode.SPARK,
DataFeed + generator + steps_per_epoch + compat.export_saved_model + terminate), mnist_inference
(TFParallel.run), mnist_tf_ds (InputMode.TENSORFLOW reading TFRecords) and mnist_pipeline
(TFEstimator / TFModel). Every test asserts values: rows, columns, exported models' predictions.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np
import pytest

from dataplane.compat import TFCluster, TFParallel, dfutil
from dataplane.compat.pipeline import TFEstimator, TFModel
from dataplane.errors import NodeError, SchemaError, StorageError
from tests.dataplane import tfos_programs

ROWS = 600  # digits fed per epoch: enough to learn the 10 classes, few enough to be quick


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return [(x.astype(int).tolist(), int(y)) for x, y in zip(d.data, d.target)]


@pytest.fixture(scope="module")
def digits_tfr(spark, digits, tmp_path_factory):
    """mnist_data_setup.py: the digits as TFRecords of int64 image[64] and label, via dfutil."""
    out = str(tmp_path_factory.mktemp("tfos") / "tfr")
    df = spark.createDataFrame(digits, ["image", "label"]).repartition(4)
    dfutil.saveAsTFRecords(df, out)
    return out


def _accuracy(lines):
    pairs = [line.split() for line in lines]
    return float(np.mean([a == b for a, b in pairs]))


def test_dfutil_round_trip_keeps_rows_columns_and_values(spark, tmp_path):
    from pyspark.sql import types as T

    rows = [(i, i / 4.0, f"s{i}", bytearray(b"\xffb%d" % i), [float(i), 0.5], [i, -i, 7])
            for i in range(30)]  # blobs that are not UTF-8 text
    schema = T.StructType([
        T.StructField("an_int", T.IntegerType()), T.StructField("a_float", T.FloatType()),
        T.StructField("text", T.StringType()), T.StructField("blob", T.BinaryType()),
        T.StructField("floats", T.ArrayType(T.DoubleType())),
        T.StructField("ints", T.ArrayType(T.LongType())),
    ])
    df = spark.createDataFrame(rows, schema).repartition(3)
    out = str(tmp_path / "tfr")
    dfutil.saveAsTFRecords(df, out)
    assert sorted(os.path.basename(p) for p in glob.glob(out + "/part-*")) == [
        f"part-{i:05d}.tfrecord" for i in range(3)]
    back = dfutil.loadTFRecords(spark.sparkContext, out, binary_features=["blob"])
    # TFoS's types: columns sorted, int64 -> bigint, float -> double, bytes -> string/binary
    assert back.dtypes == [("a_float", "double"), ("an_int", "bigint"), ("blob", "binary"),
                           ("floats", "array<double>"), ("ints", "array<bigint>"),
                           ("text", "string")]
    assert dfutil.isLoadedDF(back) and not dfutil.isLoadedDF(df)
    got = sorted((r.an_int, r.a_float, r.text, bytes(r.blob), r.floats, r.ints)
                 for r in back.collect())
    assert got == [(i, i / 4.0, f"s{i}", b"\xffb%d" % i, [float(i), 0.5], [i, -i, 7])
                   for i in range(30)]
    # the fixes named are this API's: binary_features=, and no mode= that saveAsTFRecords lacks
    with pytest.raises(SchemaError, match=r"column 'blob': bytes_list values cannot be read as string.*"
                                          r"\(loadTFRecords\(sc, path, binary_features=\['blob'\]\)\)"):
        dfutil.loadTFRecords(spark.sparkContext, out)
    with pytest.raises(StorageError, match=r"already exists and is not empty; as in TFoS \(Hadoop's output "
                                           r"format\), it is not overwritten"):
        dfutil.saveAsTFRecords(df, out)  # as Hadoop's output format: never over existing files


@pytest.mark.cluster
@pytest.mark.slow
def test_keras_spark_mode_exports_and_tfparallel_scores(spark, digits, digits_tfr, tmp_path):
    sc = spark.sparkContext
    args = argparse.Namespace(
        batch_size=16, epochs=4, rows=ROWS, lr=0.01, export_dir=str(tmp_path / "export"),
        report_dir=str(tmp_path), images_labels=digits_tfr, output=str(tmp_path / "predictions"),
    )
    images_labels = sc.parallelize(digits[:ROWS], 4)
    cluster = TFCluster.run(sc, tfos_programs.keras_spark_main, args, 2, num_ps=0,
                            tensorboard=False, input_mode=TFCluster.InputMode.SPARK,
                            master_node="chief")
    # more epochs than the nodes read: they stop at 90% and terminate() the rest
    cluster.train(images_labels, args.epochs + 1)
    cluster.shutdown()

    reports = [json.loads((tmp_path / f"node{i}.json").read_text()) for i in range(2)]
    roles = sorted((r["job_name"], r["task_index"]) for r in reports)
    assert roles == [("chief", 0), ("worker", 0)]
    for r in reports:
        assert r["num_workers"] == 2 and r["keras"] == "tf_keras" and r["epochs"] == 4
        # batch_size is global under MultiWorkerMirroredStrategy: 8 rows per worker and step,
        # and the generator reads ahead a few batches; what is left is refused after terminate()
        assert r["steps"] * 4 * 8 <= r["rows_read"] <= r["steps"] * 4 * 8 + 4 * 16
        assert r["rows_read"] < ROWS * (args.epochs + 1) / 2
    assert os.path.exists(os.path.join(args.export_dir, "saved_model.pb"))

    TFParallel.run(sc, tfos_programs.parallel_inference, args, 2)
    files = sorted(glob.glob(args.output + "/part-*"))
    assert [os.path.basename(f) for f in files] == ["part-00000", "part-00001"]
    lines = [ln for f in files for ln in open(f).read().splitlines()]
    assert len(lines) == len(digits)  # every record scored once, across both instances
    assert sorted(int(ln.split()[0]) for ln in lines) == sorted(y for _, y in digits)
    assert _accuracy(lines) > 0.7


@pytest.mark.cluster
@pytest.mark.slow
def test_tensorflow_mode_reads_tfrecords_and_exports(spark, digits, digits_tfr, tmp_path):
    args = argparse.Namespace(
        batch_size=32, epochs=3, steps_per_epoch=20, buffer_size=256, cluster_size=1, lr=0.01,
        images_labels=digits_tfr + "/part-*", export_dir=str(tmp_path / "export"),
        report_dir=str(tmp_path),
    )
    cluster = TFCluster.run(spark.sparkContext, tfos_programs.tensorflow_mode_main, args, 1,
                            num_ps=0, input_mode=TFCluster.InputMode.TENSORFLOW,
                            master_node="chief", log_dir=str(tmp_path / "logs"))
    cluster.shutdown()  # waits for map_fun, as TFoS's shutdown in InputMode.TENSORFLOW
    report = json.loads((tmp_path / "node0.json").read_text())
    assert report["job_name"] == "chief"
    assert report["pattern"] == "file://" + digits_tfr + "/part-*"
    # the chief reloaded the SavedModel it exported and scored every record with it
    assert report["scored"] == len(digits)
    assert report["accuracy"] > 0.7


@pytest.mark.cluster
@pytest.mark.slow
def test_pipeline_estimator_fits_and_model_transforms(spark, digits, tmp_path):
    df = spark.createDataFrame(
        [(np.asarray(x, dtype=float).tolist(), y) for x, y in digits[:ROWS]], ["image", "label"]
    ).repartition(3)
    tf_args = {"rows": ROWS, "lr": 0.01}
    estimator = (TFEstimator(tfos_programs.pipeline_train_fn, tf_args)
                 .setInputMapping({"image": "image", "label": "label"})
                 .setModelDir(str(tmp_path / "model")).setExportDir(str(tmp_path / "export"))
                 .setClusterSize(1).setTensorboard(False).setEpochs(4).setBatchSize(16)
                 .setGraceSecs(60))
    model = estimator.fit(df)
    assert isinstance(model, TFModel)
    assert model.getExportDir() == str(tmp_path / "export") and model.getBatchSize() == 16
    model = (model.setInputMapping({"image": "hidden_input"})
             .setOutputMapping({"out": "prediction"}).setSignatureDefKey("serving_default"))
    test = spark.createDataFrame(  # one partition: one Python worker loads TensorFlow
        [((np.asarray(x) / 16.0).tolist(), y) for x, y in digits[ROWS:]], ["image", "label"]
    ).coalesce(1)
    out = model.transform(test)
    assert out.columns == ["prediction"]  # TFoS's TFModel returns only the output_mapping columns
    rows = out.collect()
    assert len(rows) == len(digits) - ROWS
    preds = [int(np.argmax(r.prediction)) for r in rows]
    assert np.mean([p == y for p, (_, y) in zip(preds, digits[ROWS:])]) > 0.7


@pytest.mark.cluster
def test_a_failing_map_fun_makes_train_raise(spark, digits):
    sc = spark.sparkContext
    cluster = TFCluster.run(sc, tfos_programs.failing_main, None, 1, 0, False,
                            TFCluster.InputMode.SPARK, master_node="chief")
    with pytest.raises(NodeError, match="map_fun failed on purpose"):
        cluster.train(sc.parallelize(digits, 2), 3)
    with pytest.raises(NodeError, match="map_fun failed on purpose"):
        cluster.shutdown()  # as TFoS's shutdown, which exits with an error status
