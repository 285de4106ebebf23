"""TFEstimator / TFModel as real Spark ML stages: Pipeline fit on a TF cluster, transform, save/load."""

from __future__ import annotations

import os

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import SQLTransformer

from dataplane.errors import SchemaError, StorageError
from dataplane.ml import TFEstimator, TFModel
from tests.builders import digits_table
from tests.dataplane.workload_mains import digits_train_fn

pytestmark = pytest.mark.cluster

ACCURACY_FLOOR = 0.85  # a 32-unit MLP on 8x8 digits reaches ~0.95 after 15 epochs


@pytest.fixture(scope="module")
def digits(spark):
    t = digits_table()
    df = spark.createDataFrame(t.to_pandas()).repartition(4).cache()
    train = df.filter("id % 5 != 0").cache()
    test = df.filter("id % 5 = 0").cache()
    return train, test


@pytest.fixture(scope="module")
def fitted(digits, tmp_path_factory):
    train, _ = digits
    scale = SQLTransformer(
        statement="SELECT *, transform(pixels, x -> CAST(x / 16.0 AS FLOAT)) AS features FROM __THIS__"
    )
    est = TFEstimator(
        digits_train_fn, {"hidden": 32, "lr": 0.01, "seed": 1},
        inputCols=["features"], labelCol="label", epochs=15, batchSize=64,
        exportDir=str(tmp_path_factory.mktemp("export")), predictionCol="probs",
    )
    pipeline = Pipeline(stages=[scale, est])
    return pipeline, pipeline.fit(train)


def _accuracy(df) -> float:
    rows = df.select("label", "probs").collect()
    pred = np.array([int(np.argmax(r["probs"])) for r in rows])
    return float(np.mean(pred == np.array([r["label"] for r in rows])))


def test_pipeline_fit_transform_keeps_columns_and_learns(fitted, digits):
    _, model = fitted
    _, test = digits
    tf_model = model.stages[-1]
    assert isinstance(tf_model, TFModel)
    assert tf_model.getModelPath().endswith("/model.keras") and "/fit-" in tf_model.getModelPath()
    out = model.transform(test)
    assert out.columns == ["id", "pixels", "label", "features", "probs"]
    assert out.count() == test.count() == 360
    assert _accuracy(out) > ACCURACY_FLOOR


def test_predictions_equal_local_keras(fitted, digits):
    import keras

    _, model = fitted
    _, test = digits
    out = model.transform(test).select("id", "features", "probs").collect()
    local = keras.models.load_model(model.stages[-1].getModelPath(), compile=False)
    x = np.array([r["features"] for r in out], dtype=np.float32)
    np.testing.assert_allclose(np.array([r["probs"] for r in out]), local.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_pipeline_model_and_stages_save_and_load(fitted, digits, tmp_path):
    pipeline, model = fitted
    _, test = digits
    model.write().overwrite().save(str(tmp_path / "pm"))
    loaded = PipelineModel.load(str(tmp_path / "pm"))
    a = {r["id"]: r["probs"] for r in model.transform(test).select("id", "probs").collect()}
    b = {r["id"]: r["probs"] for r in loaded.transform(test).select("id", "probs").collect()}
    assert a.keys() == b.keys() and all(np.allclose(a[k], b[k]) for k in a)
    # the unfitted pipeline (estimator with its train_fn) round-trips too
    pipeline.write().overwrite().save(str(tmp_path / "p"))
    est = Pipeline.load(str(tmp_path / "p")).getStages()[-1]
    assert isinstance(est, TFEstimator)
    assert est.getEpochs() == 15 and est.getInputCols() == ["features"]
    assert est._train_fn is digits_train_fn and est._args["hidden"] == 32
    m = TFModel(modelPath=model.stages[-1].getModelPath(), inputCols=["features"])
    m.save(str(tmp_path / "m"))
    # a saved model holds a copy of its model (the next fit, or a clean-up, may change exportDir)
    copy = TFModel.load(str(tmp_path / "m")).getModelPath()
    assert copy == str(tmp_path / "m" / "model" / "model.keras")
    assert open(copy, "rb").read() == open(m.getModelPath(), "rb").read()


def test_model_layer_param_extracts_features(fitted, digits):
    _, model = fitted
    _, test = digits
    feats = model.stages[-1].copy().setLayer("hidden").setPredictionCol("emb")
    out = feats.transform(model.stages[0].transform(test))
    row = out.select("emb").first()
    assert len(row["emb"]) == 32 and min(row["emb"]) >= 0.0  # relu output


def test_fit_argument_errors(spark, digits):
    train, _ = digits
    with pytest.raises(SchemaError, match="'nope'"):
        TFEstimator(digits_train_fn, inputCols=["nope"], exportDir="/tmp/x").fit(train)
    with pytest.raises(StorageError, match="exportDir is not set"):
        TFEstimator(digits_train_fn, inputCols=["pixels"]).fit(train)
    with pytest.raises(TypeError, match="no train_fn"):
        TFEstimator(inputCols=["pixels"], exportDir="/tmp/x").fit(train)
    # a string label failed deep inside Keras, after the nodes had started
    named = train.selectExpr("pixels", "CAST(label AS STRING) AS digit")
    with pytest.raises(SchemaError, match=r"labelCol 'digit' is a string column; Keras losses take "
                                          r"numbers\. Index it first \(pyspark\.ml\.feature\.StringIndexer"):
        TFEstimator(digits_train_fn, inputCols=["pixels"], labelCol="digit", exportDir="/tmp/x").fit(named)


def test_pipeline_on_spark_ml_vector_features(digits, tmp_path):
    """The usual Spark ML pipeline: a scaler's vector column feeds TFEstimator as it is."""
    import keras
    from pyspark.ml.feature import StandardScaler
    from pyspark.ml.functions import array_to_vector

    train, test = (d.withColumn("pvec", array_to_vector("pixels")) for d in digits)
    scaler = StandardScaler(inputCol="pvec", outputCol="features", withMean=True)
    est = TFEstimator(
        digits_train_fn, {"hidden": 16, "lr": 0.01, "seed": 2},
        inputCols=["features"], labelCol="label", epochs=2, batchSize=64,
        exportDir=str(tmp_path / "export"), predictionCol="probs",
    )
    model = Pipeline(stages=[scaler, est]).fit(train)
    out = model.transform(test)
    assert out.columns == ["id", "pixels", "label", "pvec", "features", "probs"]
    assert type(out.schema["features"].dataType).__name__ == "VectorUDT"  # kept as a vector
    rows = out.select("id", "features", "probs").collect()
    assert len(rows) == 360
    local = keras.models.load_model(model.stages[-1].getModelPath(), compile=False)
    x = np.array([r["features"].toArray() for r in rows], dtype=np.float32)
    np.testing.assert_allclose(np.array([r["probs"] for r in rows]), local.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_each_fit_keeps_its_own_model_and_a_saved_model_its_copy(spark, tmp_path):
    # Every fit to one exportDir wrote the same model.keras: the first of two param maps then
    # predicted the second's values (and CrossValidator(parallelism=2) scored every point with
    # one model); a refit that failed deleted the good model; a saved PipelineModel held only
    # the path. Column names with dots failed the fit's select; file:// exportDirs failed after
    # training.
    from pyspark.ml import PipelineModel

    from dataplane.errors import NodeError
    from tests.dataplane.workload_mains import const_train_fn

    df = spark.range(24).selectExpr("array(cast(id as float), 1.0f) AS `f.x`", "cast(id % 2 as float) AS label")
    export = tmp_path / "export"
    est = TFEstimator(const_train_fn, inputCols=["f.x"], exportDir=f"file://{export}", batchSize=1)
    m1, m2 = est.fit(df, params=[{est.epochs: 1}, {est.epochs: 2}])
    assert m1.getModelPath() != m2.getModelPath()
    for m in (m1, m2):
        assert m.getModelPath().startswith(f"{export}/fit-") and m.getModelPath().endswith("/model.keras")

    def predicted(model) -> set:
        return {r["prediction"] for r in model.transform(df).collect()}

    assert (predicted(m1), predicted(m2)) == ({11.0}, {21.0})
    PipelineModel(stages=[m1]).write().overwrite().save(str(tmp_path / "pm"))
    with pytest.raises(NodeError, match="this fit fails on purpose"):
        TFEstimator(const_train_fn, {"fail": True}, inputCols=["f.x"], exportDir=str(export)).fit(df)
    assert predicted(m1) == {11.0}  # the failed refit left it alone
    import shutil

    shutil.rmtree(export)
    loaded = PipelineModel.load(str(tmp_path / "pm"))
    assert loaded.stages[0].getModelPath().startswith(str(tmp_path / "pm"))
    assert predicted(loaded) == {11.0}  # the saved stage holds its own copy
    # saved with overwrite onto the folder it was loaded from: the writer deletes the folder,
    # the model's copy included, before the stage writes, and the model was lost for good
    loaded.write().overwrite().save(str(tmp_path / "pm"))
    again = PipelineModel.load(str(tmp_path / "pm"))
    assert predicted(again) == {11.0}
    stage = str(tmp_path / "pm" / "stages" / os.listdir(tmp_path / "pm" / "stages")[0])
    TFModel.load(stage).write().overwrite().save(stage)  # a bare stage, the same way
    assert predicted(TFModel.load(stage)) == {11.0}
    # nothing to train on: refused before any node starts
    with pytest.raises(ValueError, match=r"TFEstimator.fit: the DataFrame has no rows"):
        est.fit(df.limit(0))
    with pytest.raises(TypeError, match=r"TFEstimator: unexpected keyword argument\(s\) \['epoch'\]"):
        TFEstimator(const_train_fn, epoch=3)
    assert (est.getNumNodes(), est.getNumPS(), est.getTrainFn()) == (1, 0, const_train_fn)


def test_args_the_params_replace_are_warned_about(caplog):
    # {"epochs": 5} in args was silently replaced by the epochs param (default 1)
    import logging

    from dataplane.ml import _merge_args

    caplog.set_level(logging.WARNING, logger="dataplane.ml")
    merged = _merge_args({"epochs": 5, "lr": 0.1}, {"epochs": 1, "batch_size": 128})
    assert (merged.epochs, merged.lr, merged.batch_size) == (1, 0.1, 128)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["TFEstimator: args ['epochs'] are replaced by the stage's params (epochs=1); set "
                    "those as params (epochs=, batchSize=, inputCols=, labelCol=, exportDir=) instead."]
    caplog.clear()
    _merge_args({"epochs": 1}, {"epochs": 1})
    assert not caplog.records  # the same value: nothing to say
