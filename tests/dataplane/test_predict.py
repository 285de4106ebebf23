"""dataplane.predict on real Spark + real Keras: values equal a local model.predict, loaded once."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dataplane.errors import SchemaError, StorageError
from dataplane.workloads.batch_predict import load_predictor, predict

ROWS = 300


class CountingLoader:
    """The default loader, appending this process's pid to a file on every (uncached) load."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path

    def __call__(self, model_path, layer, input_cols):
        with open(self.log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return load_predictor(model_path, layer, input_cols)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A classifier (.keras and SavedModel) and a scalar regressor, with local references."""
    import keras

    keras.utils.set_random_seed(3)
    root = tmp_path_factory.mktemp("models")
    inp = keras.Input(shape=(4,), name="features")
    hidden = keras.layers.Dense(8, activation="relu", name="dense_1")(inp)
    out = keras.layers.Dense(3, activation="softmax", name="out")(hidden)
    clf = keras.Model(inp, out)
    reg = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(1, name="y")])
    paths = {"clf": str(root / "clf.keras"), "reg": str(root / "reg.keras"),
             "saved": str(root / "clf_savedmodel")}
    clf.save(paths["clf"])
    reg.save(paths["reg"])
    clf.export(paths["saved"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    hidden_model = keras.Model(inp, hidden)
    ref = {
        "clf": clf.predict(x, verbose=0),
        "reg": reg.predict(x, verbose=0).reshape(-1),
        "dense_1": hidden_model.predict(x, verbose=0),
    }
    return paths, x, ref


@pytest.fixture(scope="module")
def frame(spark, models):
    _, x, _ = models
    rows = [(i, *map(float, x[i]), [float(v) for v in x[i]], f"r{i}") for i in range(ROWS)]
    schema = "id long, f0 float, f1 float, f2 float, f3 float, vec array<float>, tag string"
    return spark.createDataFrame(rows, schema).repartition(6)


def _by_id(df, col):
    return {r["id"]: r[col] for r in df.select("id", col).collect()}


def test_keras_predictions_equal_local_predict_and_keep_columns(frame, models):
    paths, _, ref = models
    out = predict(frame, paths["clf"], input_cols=["f0", "f1", "f2", "f3"], batch_size=32)
    assert out.columns == frame.columns + ["prediction"]
    assert out.schema["prediction"].dataType.simpleString() == "array<float>"
    rows = out.collect()
    assert len(rows) == ROWS
    assert all(r["tag"] == f"r{r['id']}" for r in rows)  # input columns kept, row for row
    got = {r["id"]: r["prediction"] for r in rows}
    for i in range(ROWS):
        np.testing.assert_allclose(got[i], ref["clf"][i], rtol=1e-5, atol=1e-6)


def test_list_column_input_and_scalar_output(frame, models):
    paths, _, ref = models
    out = predict(frame, paths["reg"], input_cols=["vec"], output_col="y_hat", batch_size=50)
    assert out.schema["y_hat"].dataType.simpleString() == "float"
    got = _by_id(out, "y_hat")
    np.testing.assert_allclose([got[i] for i in range(ROWS)], ref["reg"], rtol=1e-5, atol=1e-6)


def test_savedmodel_directory(frame, models):
    paths, _, ref = models
    out = predict(frame, paths["saved"], input_cols=["vec"])
    got = _by_id(out, "prediction")
    np.testing.assert_allclose(np.array([got[i] for i in range(ROWS)]), ref["clf"],
                               rtol=1e-5, atol=1e-6)


def test_a_model_saved_by_tf_keras_with_batch_normalization(frame, models, tmp_path):
    # what a multi-worker program trains and saves (tf_keras, since Keras 3's fit does not run
    # under MultiWorkerMirroredStrategy); Keras 3 cannot load its BatchNormalization config
    import tf_keras

    _, x, _ = models
    tf_keras.utils.set_random_seed(5)
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(6),
                                 tf_keras.layers.BatchNormalization(), tf_keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    model.fit(x, np.ones((ROWS, 2), np.float32), epochs=1, verbose=0)  # moving stats move
    path = str(tmp_path / "mwms.keras")
    model.save(path)
    out = predict(frame, path, input_cols=["vec"])
    got = _by_id(out, "prediction")
    np.testing.assert_allclose(np.array([got[i] for i in range(ROWS)]), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)


def test_intermediate_layer_features(frame, models):
    paths, _, ref = models
    out = predict(frame, paths["clf"], input_cols=["vec"], output_col="emb", layer="dense_1")
    assert out.schema["emb"].dataType.simpleString() == "array<float>"
    got = _by_id(out, "emb")
    assert len(got[0]) == 8
    np.testing.assert_allclose(np.array([got[i] for i in range(ROWS)]), ref["dense_1"],
                               rtol=1e-5, atol=1e-6)


def test_model_loaded_once_per_executor_process(frame, models, tmp_path):
    paths, _, ref = models
    log = tmp_path / "loads.txt"
    # a new layer key so no process has this (path, layer, loader) cached yet
    out = predict(frame.repartition(8), paths["clf"], input_cols=["vec"], batch_size=8,
                  loader=CountingLoader(str(log)))
    assert out.count() == ROWS
    again = predict(frame.repartition(5), paths["clf"], input_cols=["vec"], batch_size=8,
                    loader=CountingLoader(str(log)))
    got = _by_id(again, "prediction")
    np.testing.assert_allclose(got[7], ref["clf"][7], rtol=1e-5, atol=1e-6)
    pids = [int(p) for p in log.read_text().split()]
    workers = [p for p in pids if p != os.getpid()]
    # 13 partitions in 2 jobs, cut into >= 38 model calls of 8 rows, yet one load per process
    assert workers, "no executor process loaded the model"
    assert len(workers) == len(set(workers)), pids
    assert len(workers) <= 4


def test_a_model_saved_again_to_the_same_path_is_the_one_that_answers(frame, models, tmp_path):
    """Retrain, save to the same path, predict again (Spark reuses its Python workers, and the
    driver's probe runs in this process): the new weights answer, and other input columns work."""
    import keras

    path = str(tmp_path / "model.keras")

    def save(w):  # type: ignore[no-untyped-def]
        inp = keras.Input((4,))
        out = keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(w))(inp)
        keras.Model(inp, out).save(path)

    _, x, _ = models
    save(1.0)
    first = _by_id(predict(frame, path, input_cols=["vec"]), "prediction")
    save(2.0)
    second = _by_id(predict(frame, path, input_cols=["vec"]), "prediction")
    scalars = _by_id(predict(frame, path, input_cols=["f0", "f1", "f2", "f3"]), "prediction")
    sums = x.sum(axis=1)
    np.testing.assert_allclose([first[i] for i in range(ROWS)], sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([second[i] for i in range(ROWS)], 2 * sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([scalars[i] for i in range(ROWS)], 2 * sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        ({"input_cols": ["nope"]}, SchemaError, "'nope'"),
        ({"input_cols": "vec"}, ValueError, "non-empty list"),
        ({"input_cols": ["vec"], "output_col": "tag"}, SchemaError, "already a column"),
        ({"input_cols": ["vec"], "batch_size": 0}, ValueError, "batch_size"),
        ({"input_cols": ["vec"], "model_path": "/nonexistent/m.keras"}, StorageError,
         "does not exist"),
        ({"input_cols": ["vec"], "layer": "no_such_layer"}, SchemaError, "no layer"),
    ],
)
def test_bad_arguments_fail_on_the_driver(frame, models, kwargs, exc, text):
    paths, _, _ = models
    kwargs.setdefault("model_path", paths["clf"])
    with pytest.raises(exc) as info:
        out = predict(frame, **kwargs)
        out.collect()
    assert text in str(info.value)


@pytest.mark.parametrize("model", ["clf", "saved"])
def test_too_few_scalar_columns_for_the_model_input_fail_on_the_driver(frame, models, model):
    # 3 scalar columns for an input of 4 were accepted and failed in every task of the job
    paths, _, _ = models
    with pytest.raises(SchemaError, match=r"predict: input_cols \['f0', 'f1', 'f2'\] stack 3 scalar "
                                          r"values a row, but the model input takes per-row shape "
                                          r"\(4,\) \(4 values\)"):
        predict(frame, paths[model], input_cols=["f0", "f1", "f2"])  # no Spark action


def test_a_file_named_keras_that_is_not_one_is_called_so(frame, tmp_path):
    # Keras said "File not found" of a file that was there
    path = tmp_path / "notes.keras"
    path.write_text("not a model")
    with pytest.raises(StorageError) as info:
        predict(frame, str(path), input_cols=["vec"])
    text = str(info.value)
    assert f"cannot load {str(path)!r}: it exists but is not a .keras archive" in text, text
    assert "File not found" not in text, text


@pytest.mark.parametrize("given, pattern", [
    # the classifier returns 3 scores a row: a wrong output_shape was ignored ([4]) or failed
    # with numpy's "cannot reshape array of size 750 into shape (250,)" ([])
    ([4], r"returned per-row shape \(3,\) for column 'prediction', but output_shape=\[4\] was given"),
    ([], r"returned per-row shape \(3,\) for column 'prediction', but output_shape=\[\] was given"),
])
def test_an_output_shape_the_model_does_not_return_fails_naming_both(frame, models, given, pattern):
    import re

    paths, _, _ = models
    out = predict(frame, paths["clf"], input_cols=["vec"], output_shape=given)
    with pytest.raises(Exception) as info:
        out.collect()
    text = str(info.value)
    assert re.search(pattern, text), text[-3000:]
    assert "Pass output_shape=[3]" in text, text[-3000:]


def test_a_retry_of_a_task_that_failed_on_its_input_raises_at_once(frame, models, tmp_path):
    # local[3,3] tries a task 3 times; the model was loaded by every try, each in a new Python
    # worker (the one that raised exits), before the same error came back
    paths, _, _ = models
    log = tmp_path / "loads.txt"
    out = predict(frame.coalesce(1), paths["clf"], input_cols=["vec"], output_shape=[4],
                  loader=CountingLoader(str(log)))
    with pytest.raises(Exception) as info:
        out.collect()
    text = str(info.value)
    assert "Pass output_shape=[3]" in text, text[-3000:]
    assert "this retry raised it again without loading the model" in text, text[-3000:]
    assert len(log.read_text().split()) == 1  # the first try only
    # a new action is tried in full: the fixed call answers
    fixed = predict(frame.coalesce(1), paths["clf"], input_cols=["vec"], output_shape=[3])
    assert fixed.count() == ROWS


def test_text_for_a_numeric_input_is_named_with_the_fix(spark, models):
    # a string column was parsed as numbers where it could be, else failed in numpy
    paths, _, _ = models
    df = spark.createDataFrame([(i, [str(float(i))] * 4) for i in range(10)], "id long, v array<string>")
    with pytest.raises(Exception) as info:
        predict(df, paths["clf"], input_cols=["v"]).collect()
    text = str(info.value)
    assert "column 'v' holds text (or bytes), but the model input 'features' takes float32" in text, text[-3000:]
    assert "StringIndexer" in text


def test_wide_rows_lower_the_rows_per_arrow_batch_on_spark_3_5(spark, models, caplog):
    # Spark 3.5 cuts Arrow batches at 10,000 rows whatever their size: 10,000 rows of 48 KiB
    # ran the executor out of direct memory and the task waited for ever. predict's output is
    # a query run later, so the session's setting is lowered (Spark 4 cuts batches by bytes).
    import pyspark

    paths, _, _ = models
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    df = spark.range(ROWS).selectExpr(
        "id", "array_repeat(cast(id as float), 12288) as img", *[f"cast(id as float) as f{i}" for i in range(4)])
    try:
        with caplog.at_level("WARNING", logger="formats.sparkframe"):
            out = predict(df, paths["reg"], input_cols=["f0", "f1", "f2", "f3"])
        after = spark.conf.get(key)
        assert out.count() == ROWS and out.columns == [*df.columns, "prediction"]
    finally:
        spark.conf.set(key, before)
    said = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    if int(pyspark.__version__.split(".")[0]) < 4:
        # id, the floats, four floats: 49,176 bytes a row; 64 MiB of them
        assert int(after) == (64 << 20) // 49176, after
        assert len(said) == 1 and said[0].startswith(
            "dataplane.predict: rows of about 48 KiB make Arrow batches of 469 MiB"), said
        assert f"Set it to {after} for this session" in said[0]
    else:
        assert after == before and not said, (after, said)
