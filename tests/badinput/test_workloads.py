"""Bad input to the workloads: ``dataplane.predict``, ``dataplane.tune`` and
``dataplane.ml.TFEstimator``.

Everything the schema or the arguments can tell fails the call on the driver, before any job
or TF node starts (the estimator's rows start no cluster); afterwards the session still runs
jobs and nothing is left running.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from pyspark.errors import PythonException

import dataplane
from dataplane.errors import SchemaError, StorageError
from dataplane.ml import TFEstimator
from dataplane.workloads.batch_predict import Predictor
from tests.badinput.catalogue import Case, Env, bad, check, params, spark_usable

PR, TU, EST = "dataplane.predict", "dataplane.tune", "dataplane.ml.TFEstimator"

BASE = "SELECT id, CAST(id AS FLOAT) AS x, array(1.0f, 2.0f) AS v FROM range(4)"


def sum_loader(model_path: str, layer, input_cols) -> Predictor:
    """A model without TensorFlow: the sum of each row's inputs (picklable by reference)."""
    return Predictor(lambda arrays: np.stack([arrays[c].reshape(len(arrays[c]), -1).sum(axis=1)
                                              for c in input_cols], axis=1).sum(axis=1),
                     output_shape=(), output_dtype="float32")


def _predict(sql: str = BASE, *, model=lambda env: str(env.tmp), **kw):
    def build(env: Env):
        df, path = env.spark.sql(sql), model(env)
        kw.setdefault("output_shape", ())
        kw.setdefault("loader", sum_loader)
        return lambda: dataplane.predict(df, path, **kw)

    return build


def _not_a_model(env: Env) -> str:
    path = env.tmp / "model.keras"
    path.write_text("not a model")
    return str(path)


def train_fn(params, data):
    return {"loss": float(params.get("lr", 0.0))}


def _tune(space=None, **kw):
    space = {"lr": [0.1, 0.01]} if space is None else space

    def build(env: Env):
        spark = env.spark
        data = kw.pop("data_of", None)
        if data is not None:
            kw["data"] = data(env)
        return lambda: dataplane.tune(spark, kw.pop("fn", train_fn), space, **kw)

    return build


def node_main(args, ctx):  # pragma: no cover - no row gets as far as starting a node
    return None


def _fit(sql: str = BASE, **params):
    def build(env: Env):
        df = env.spark.sql(sql)
        params.setdefault("exportDir", str(env.tmp / "export"))
        if params["exportDir"] == "FILE":
            (env.tmp / "file").write_text("x")
            params["exportDir"] = str(env.tmp / "file")
        est = TFEstimator(node_main, **params)
        return lambda: est.fit(df)

    return build


CASES = [
    # ------------------------------------------------------------------ predict
    Case(PR, "input-column-missing", _predict(input_cols=["nope"]), SchemaError,
         ("['nope']", "not in the DataFrame", "fix input_cols"), within=60, after=spark_usable),
    Case(PR, "zero-column-dataframe", lambda env: (lambda df: lambda: dataplane.predict(
        df, str(env.tmp), input_cols=["x"], output_shape=()))(env.spark.range(2).select()),
         SchemaError, ("['x']", "columns: []"), within=60),
    Case(PR, "map-input-column", _predict("SELECT map('a', 1.0) AS m", input_cols=["m"]), SchemaError,
         ("predict", "'m'", "map_keys()"), within=60),
    Case(PR, "decimal-input-column", _predict("SELECT CAST(1.5 AS DECIMAL(10, 2)) AS p", input_cols=["p"]),
         SchemaError, ("predict", "'p'", "cast('double')"), within=60),
    Case(PR, "output-column-exists", _predict(input_cols=["x"], output_col="id"), SchemaError,
         ("'id'", "already a column", "output_col="), within=60),
    Case(PR, "input-cols-a-string", _predict(input_cols="x"), ValueError, ("input_cols", "'x'"), within=60),
    Case(PR, "batch-size-zero", _predict(input_cols=["x"], batch_size=0), ValueError,
         ("batch_size", "got 0"), within=60),
    Case(PR, "model-path-missing", _predict(input_cols=["x"], model=lambda env: str(env.tmp / "nope.keras"),
                                            loader=None, output_shape=None),
         StorageError, ("nope.keras", "does not exist"), within=60),
    Case(PR, "model-file-not-a-model", _predict(input_cols=["x"], model=_not_a_model, loader=None, output_shape=None),
         StorageError, ("model.keras", "cannot load", "model.save("), within=180, after=spark_usable),
    Case(PR, "output-shape-not-a-shape", _predict(input_cols=["x"], output_shape="10"), ValueError,
         ("output_shape", "'10'", "(10,)"), within=60),
    Case(PR, "output-dtype-not-numeric", _predict(input_cols=["x"], output_dtype="complex64"), ValueError,
         ("output_dtype", "'complex64'", "'float32'"), within=60),
    Case(PR, "ragged-list-input", _predict("SELECT id, IF(id = 2, array(1.0f), array(1.0f, 2.0f)) AS v FROM range(4)",
                                           input_cols=["v"]),
         PythonException, ("'v'", "lists of different lengths", "Pad or filter"), stage="action", within=180,
         after=spark_usable),
    Case(PR, "null-in-input-column", _predict("SELECT id, IF(id = 2, NULL, CAST(id AS FLOAT)) AS x FROM range(4)",
                                              input_cols=["x"]),
         PythonException, ("'x'", "1 null value(s)", "partition", "df.fillna({'x': 0})",
                           "The first row with a null there has id=2."), stage="action",
         within=180, after=spark_usable),
    # fillna does not fill arrays: a null array and a null inside one are told other fixes
    Case(PR, "null-array-in-input-column", _predict("SELECT id, IF(id = 2, NULL, array(1.0f, 2.0f)) AS v FROM range(4)",
                                                    input_cols=["v"]),
         PythonException, ("'v'", "1 null value(s)", "F.coalesce(F.col('v'), F.array_repeat(F.lit(0.0), 2))", "df.na.drop(subset=['v'])",
                           "The first row with a null there has id=2."),
         stage="action", within=180, after=spark_usable),
    Case(PR, "null-inside-an-input-array", _predict("SELECT id, IF(id = 2, array(1.0f, NULL), array(1.0f, 2.0f)) AS v "
                                                    "FROM range(4)", input_cols=["v"]),
         PythonException, ("'v'", "1 null element(s) inside its arrays", "F.transform('v'",
                           "df.where(~F.exists('v', lambda v: v.isNull()))", "The first row with a null there has id=2."),
         stage="action", within=180, after=spark_usable),
    # ------------------------------------------------------------------ tune
    Case(TU, "empty-grid", _tune({}), ValueError, ("empty grid", "{'lr': [0.1, 0.01]}"), within=60),
    Case(TU, "grid-value-not-a-list", _tune({"lr": 0.1}), ValueError, ("space['lr']", "0.1", "non-empty list"),
         within=60),
    Case(TU, "mode-unknown", _tune(mode="best"), ValueError, ("mode", "'best'", "'min' or 'max'"), within=60),
    Case(TU, "parallelism-zero", _tune(parallelism=0), ValueError, ("parallelism", "got 0"), within=60),
    Case(TU, "metric-empty", _tune(metric=""), ValueError, ("metric", "''"), within=60),
    Case(TU, "param-named-like-a-result-column", _tune({"status": [1]}), ValueError,
         ("['status']", "clash", "rename"), within=60),
    Case(TU, "train-fn-not-callable", _tune(fn="train"), TypeError, ("train_fn", "str"), within=60),
    Case(TU, "data-path-missing", _tune(data_of=lambda env: str(env.tmp / "nope")), StorageError,
         ("nope", "does not exist"), within=60, after=spark_usable),
    Case(TU, "data-not-parquet", _tune(data_of=lambda env: str(bad.not_parquet(env.dir("d")))), StorageError,
         ("not readable as Parquet", "Parquet file or directory"), within=60, after=spark_usable),
    Case(TU, "data-zero-column-dataframe", _tune(data_of=lambda env: env.spark.range(3).select()), SchemaError,
         ("no columns", "df.select("), within=60, after=spark_usable),
    Case(TU, "data-zero-column-files", _tune(data_of=lambda env: str(bad.parquet(env.dir("d"), pa.table({})))),
         SchemaError, ("no columns", "data=None"), within=60),
    Case(TU, "num-trials-with-a-grid", _tune(num_trials=3), ValueError, ("num_trials=3", "sampled space"),
         within=60),
    # ------------------------------------------------------------------ TFEstimator.fit
    Case(EST, "input-column-missing", _fit(inputCols=["nope"], labelCol=""), SchemaError,
         ("['nope']", "not in the DataFrame", "inputCols"), within=60, after=spark_usable),
    Case(EST, "label-not-a-column", _fit(inputCols=["x"], labelCol="label"), SchemaError,
         ("['label']", "labelCol=''"), within=60, after=spark_usable),
    Case(EST, "label-also-an-input", _fit(inputCols=["x", "id"], labelCol="id"), SchemaError,
         ("'id'", "also one of inputCols", "labelCol=''"), within=60),
    Case(EST, "input-cols-empty", _fit(inputCols=[], labelCol="id"), SchemaError,
         ("inputCols is empty", "inputCols=['features']"), within=60),
    Case(EST, "zero-column-dataframe", lambda env: (lambda est, df: lambda: est.fit(df))(
        TFEstimator(node_main, inputCols=["x"], labelCol="", exportDir=str(env.tmp)), env.spark.range(2).select()),
         SchemaError, ("['x']", "columns: []"), within=60),
    Case(EST, "map-column", _fit("SELECT map('a', 1) AS m, 1 AS y", inputCols=["m"], labelCol="y"), SchemaError,
         ("TFEstimator.fit", "'m'", "map_keys()"), within=60, after=spark_usable),
    Case(EST, "decimal-label", _fit("SELECT 1.0f AS x, CAST(1 AS DECIMAL(5, 1)) AS y", inputCols=["x"], labelCol="y"),
         SchemaError, ("'y'", "decimal", "cast('double')"), within=60, after=spark_usable),
    Case(EST, "epochs-zero", _fit(inputCols=["x"], labelCol="", epochs=0), ValueError, ("epochs", "got 0"),
         within=60),
    Case(EST, "export-dir-is-a-file", _fit(inputCols=["x"], labelCol="", exportDir="FILE"), StorageError,
         ("exportDir", "is a file", "directory path"), within=60, after=spark_usable),
    Case(EST, "no-export-dir", lambda env: (lambda est, df: lambda: est.fit(df))(
        TFEstimator(node_main, inputCols=["x"], labelCol=""), env.spark.sql(BASE)),
         StorageError, ("exportDir is not set",), within=60),
]


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case: Case, request, tmp_path):
    check(case, Env(request, tmp_path))


def test_a_batch_of_null_arrays_only_does_not_suggest_arrays_of_one_value():
    # with no valid row in the batch the hint said F.array_repeat(F.lit(0.0), 1), which the
    # model input then refused in turn
    import pyarrow as pa

    from dataplane.errors import model_input_nulls

    err = model_input_nulls("v", pa.array([None, None], pa.list_(pa.float32())), "a batch", "predict")
    assert "F.coalesce(F.col('v'), F.array_repeat(F.lit(0.0), <values per row>))" in str(err)
    err = model_input_nulls("v", pa.array([[1.0, 2.0, 3.0], None], pa.list_(pa.float32())), "a batch", "predict")
    assert "F.array_repeat(F.lit(0.0), 3))" in str(err)
