"""ctx.save_model's write: a path holds a whole model or what it held before, never a part."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dataplane.node.context import save_whole


def _half_save(path: str) -> None:
    """What a save cut off by a lost peer leaves: the SavedModel folder, then the error."""
    os.makedirs(os.path.join(path, "variables"))
    raise RuntimeError("UnavailableError: Collective ops is aborted by: peer lost")


def test_a_save_that_fails_leaves_no_model_at_the_path(tmp_path):
    # it left final_sm/variables/ (empty) at the final path: a restart script checking
    # os.path.exists(path) took the run as saved
    with pytest.raises(RuntimeError, match="peer lost"):
        save_whole(_half_save, str(tmp_path / "final_sm"))
    assert os.listdir(tmp_path) == []


def test_a_save_that_fails_over_an_earlier_model_keeps_it(tmp_path):
    target = tmp_path / "final_sm"
    (target / "variables").mkdir(parents=True)
    (target / "saved_model.pb").write_bytes(b"the earlier model")
    with pytest.raises(RuntimeError, match="peer lost"):
        save_whole(_half_save, str(target))
    assert os.listdir(tmp_path) == ["final_sm"]
    assert sorted(os.listdir(target)) == ["saved_model.pb", "variables"]
    assert (target / "saved_model.pb").read_bytes() == b"the earlier model"
    with pytest.raises(FileExistsError, match="final_sm exists and save_model was given overwrite=False"):
        save_whole(lambda p: None, str(target), overwrite=False)


@pytest.mark.parametrize("name", ["sm", "model.h5", "model.keras"])
def test_keras_models_saved_whole_load_back_equal(tmp_path, name):
    # a SavedModel folder and .h5 (tf_keras), .keras (Keras 3): the sibling written first keeps
    # the extension that picks the format; saving again replaces the first copy
    import tf_keras
    import keras

    k = keras if name.endswith(".keras") else tf_keras
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    for seed in (1, 2):
        k.utils.set_random_seed(seed)
        model = k.Sequential([k.layers.Input((3,)), k.layers.Dense(2)])
        save_whole(model.save, str(tmp_path / name))
        assert os.listdir(tmp_path) == [name]
        back = k.models.load_model(str(tmp_path / name))
        np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(model(x)))


# ---- models on S3 (or HDFS): TensorFlow 2.18+ writes and reads neither itself ----------------

@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """The session's shared SeaweedFS server (tests.s3server)."""
    from tests.s3server import acquire_shared, release_shared

    yield acquire_shared(tmp_path_factory.mktemp("seaweedfs"))
    release_shared()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """The standard AWS variables pointed at the test server, a fresh bucket, and a temp
    directory of this test's own (to see what a save or load leaves behind)."""
    import tempfile

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return s3_server, s3_server.make_bucket(), scratch


def _ours(scratch) -> list[str]:
    """What this package left in the temp directory (not TensorFlow's autograph files)."""
    return [n for n in os.listdir(scratch) if n.startswith("dataplane")]


def _s3_files(server, prefix: str) -> list[str]:
    from pyarrow import fs as pafs

    infos = server.filesystem().get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    return sorted(i.path[len(prefix) + 1:] for i in infos if i.type == pafs.FileType.File)


@pytest.mark.s3
@pytest.mark.parametrize("name", ["sm", "model.h5", "model.keras"])
def test_a_model_saved_to_s3_loads_back_for_predict_and_a_new_save_replaces_it(s3, name):
    # model.save('s3://...') raised "File system scheme 's3' not implemented" on TF 2.21, and
    # dataplane.predict could not read a model from there: executors of a real cluster share
    # no local disk, so a model had nowhere to go
    import tf_keras
    import keras

    from dataplane.workloads.batch_predict import load_predictor

    server, bucket, scratch = s3
    url = f"s3://{bucket}/runs/{name}"
    k = keras if name.endswith(".keras") else tf_keras
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    for seed in (1, 2):
        k.utils.set_random_seed(seed)
        model = k.Sequential([k.layers.Input((3,), name="x"), k.layers.Dense(2)])
        if seed == 2 and name == "sm":  # a file the first save did not write must not survive
            server.filesystem().open_output_stream(f"{bucket}/runs/sm/variables/stale.index").close()
        save_whole(model.save, url)
        back = load_predictor(url, None, ["x"])
        np.testing.assert_allclose(np.asarray(back({"x": x})).reshape(4, 2), np.asarray(model(x)), rtol=1e-6)
    files = _s3_files(server, f"{bucket}/runs/{name}") if name == "sm" else _s3_files(server, f"{bucket}/runs")
    assert files == (["fingerprint.pb", "keras_metadata.pb", "saved_model.pb", "variables/variables.data-00000-of-00001",
                      "variables/variables.index"] if name == "sm" else [name]), files
    assert _ours(scratch) == []  # the local copies are gone
    with pytest.raises(FileExistsError, match=f"s3://{bucket}/runs/{name} exists and the save was given overwrite=False"):
        save_whole(model.save, url, overwrite=False)


@pytest.mark.s3
def test_a_model_url_with_nothing_there_or_no_model_or_refused_keys_is_named(s3):
    from dataplane.errors import StorageError
    from dataplane.workloads.batch_predict import load_predictor

    server, bucket, scratch = s3
    with pytest.raises(StorageError, match=rf"^predict: nothing is at s3://{bucket}/none/model.keras \(no file, no directory\)"):
        load_predictor(f"s3://{bucket}/none/model.keras", None, ["x"])
    with server.filesystem().open_output_stream(f"{bucket}/notes/model.keras") as f:
        f.write(b"not a model")
    with pytest.raises(StorageError, match=rf"cannot load 's3://{bucket}/notes/model.keras': it exists but is not a .keras archive"):
        load_predictor(f"s3://{bucket}/notes/model.keras", None, ["x"])
    for root in (f"s3://{bucket}", f"s3://{bucket}/"):  # replacing it would empty the bucket
        with pytest.raises(StorageError, match=rf"cannot save to s3://{bucket}/?: it names a bucket or a "
                                               rf"filesystem's root, not a place in it; add a path, e.g. "
                                               rf"s3://{bucket}/models/model.keras"):
            save_whole(lambda p: open(p, "wb").close(), root)
    assert _s3_files(server, bucket) == ["notes/model.keras"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"  # (monkeypatched: set back after the test)
    with pytest.raises(StorageError, match=rf"cannot write s3://{bucket}/m.keras: .*The S3 server refused the credentials"):
        save_whole(lambda p: open(p, "wb").close(), f"s3://{bucket}/m.keras")
    assert _ours(scratch) == []


_S3_DRIVER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from pyspark.sql import SparkSession
    import dataplane
    from dataplane.ml import TFEstimator

    def main(args, ctx):  # two MultiWorkerMirroredStrategy workers, tf_keras (TF_USE_LEGACY_KERAS=1)
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        ds = ctx.dataset(64, features=["a", "b"], label="y")
        ds = ds.map(lambda f, y: ({"x": tf.stack([f["a"], f["b"]], axis=1)}, y))
        with strategy.scope():
            x = tf.keras.Input((2,), name="x")
            model = tf.keras.Model(x, tf.keras.layers.Dense(1)(x))
            model.compile("adam", "mse")
        model.fit(ds, epochs=2, verbose=0)
        ctx.save_model(model, args["url"])  # a SavedModel folder on S3
        ctx.save_model(model, args["local"])
        with ctx.local_copy(args["url"]) as path:  # and read back in main, as a fine-tune would
            back = tf.keras.models.load_model(path)
        x = np.arange(8, dtype=np.float32).reshape(4, 2)
        assert np.array_equal(np.asarray(back(x)), np.asarray(model(x))), "the copy differs"

    def train_fn(args, ctx):  # TFEstimator's, one node, Keras 3
        import keras
        ds = ctx.dataset(args.batch_size, features=args.input_cols, label=args.label_col)
        x = keras.Input((1,), name="a")
        model = keras.Model(x, keras.layers.Dense(1)(x))
        model.compile("adam", "mse")
        model.fit(ds.map(lambda f, y: (f["a"], y)), epochs=args.epochs, verbose=0)
        return model

    bucket, local = sys.argv[1], sys.argv[2]
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    df = spark.range(0, 2000, 1, 2).selectExpr("id", "cast(id % 7 as float) a", "cast(id % 5 as float) b",
                                               "cast(id % 2 as float) y")
    url = f"s3://{bucket}/mwms/model"
    with dataplane.run(spark, main, {"url": url, "local": local}, num_nodes=2) as cluster:
        cluster.train(df, 2)
    remote = dataplane.predict(df, url, input_cols=["a", "b"])
    here = dataplane.predict(df, local, input_cols=["a", "b"])
    r = {row["id"]: row["prediction"] for row in remote.collect()}
    h = {row["id"]: row["prediction"] for row in here.collect()}
    fitted = TFEstimator(train_fn, inputCols=["a"], labelCol="y", epochs=1, batchSize=100,
                         exportDir=f"s3://{bucket}/estimator").fit(df)
    scored = fitted.transform(df).select("prediction").collect()
    try:  # a train_fn that neither returns nor saves its model
        TFEstimator(lambda args, ctx: [b for b in ctx.dataset(100)] and None, inputCols=["a"], labelCol="y",
                    epochs=1, exportDir=f"s3://{bucket}/estimator").fit(df)
        unsaved = "no error"
    except Exception as e:
        unsaved = f"{type(e).__name__}: {e}"
    print(json.dumps({"rows": len(r), "same": r == h, "spread": float(np.std(list(r.values()))),
                      "model_path": fitted.getOrDefault(fitted.modelPath), "scored": len(scored),
                      "nulls": sum(row[0] is None for row in scored), "unsaved": unsaved}), flush=True)
    """
)


@pytest.mark.s3
def test_a_cluster_without_a_shared_disk_trains_saves_to_s3_and_scores_from_there(s3, tmp_path):
    """As on a real cluster, where executors share no local disk: MWMS workers save the model
    to S3 with ctx.save_model, dataplane.predict scores from that URL on the executors, and a
    TFEstimator with an s3:// exportDir fits and transforms. Each failed before with
    TensorFlow's "File system scheme 's3' not implemented"."""
    server, bucket, scratch = s3
    script = tmp_path / "driver.py"
    script.write_text(_S3_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(script), bucket, str(tmp_path / "local_model")], capture_output=True,
        text=True, timeout=300,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable, TF_USE_LEGACY_KERAS="1", TMPDIR=str(scratch)),
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert line, proc.stderr[-3000:]
    out = json.loads(line[-1])
    assert out["rows"] == 2000 and out["same"] and out["spread"] > 0, out
    assert re.fullmatch(rf"s3://{bucket}/estimator/fit-\d{{8}}-\d{{6}}-[0-9a-f]{{6}}/model\.keras", out["model_path"]), out
    assert out["scored"] == 2000 and out["nulls"] == 0, out
    assert re.match(rf"StorageError: TFEstimator.fit: training finished but s3://{bucket}/estimator/fit-[-\d]+-[0-9a-f]{{6}}"
                    rf"/model\.keras does not exist\. train_fn must return", out["unsaved"]), out
    assert _s3_files(server, f"{bucket}/mwms/model")[:3] == ["fingerprint.pb", "keras_metadata.pb", "saved_model.pb"]
    assert _ours(scratch) == []


@pytest.mark.s3
def test_tfos_export_saved_model_to_s3_serves_tfmodel_s_signature(s3):
    # TFoS programs export to ctx.absolute_path(args.export_dir), a remote URL on a cluster
    # whose default filesystem is; TFModel reads the signature back from there
    import tf_keras

    from dataplane.compat import compat
    from dataplane.compat.pipeline import _signature

    server, bucket, scratch = s3
    url = f"s3://{bucket}/tfos/export"
    tf_keras.utils.set_random_seed(3)
    model = tf_keras.Sequential([tf_keras.layers.Input((3,), name="x"), tf_keras.layers.Dense(2)])
    compat.export_saved_model(model, url, is_chief=True)
    compat.export_saved_model(model, f"s3://{bucket}/tfos/not-the-chief", is_chief=False)
    assert "saved_model.pb" in _s3_files(server, f"{bucket}/tfos/export")
    assert _s3_files(server, f"{bucket}/tfos/not-the-chief") == []
    fn = _signature(url, None, None)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (out,) = fn(x=x).values()
    np.testing.assert_allclose(np.asarray(out), np.asarray(model(x)), rtol=1e-6)
    assert _ours(scratch) == []


@pytest.mark.s3
def test_local_copy_hands_a_loader_the_file_or_folder_at_a_url_then_removes_it(s3, tmp_path):
    from dataplane.errors import StorageError
    from dataplane.node.context import local_copy

    server, bucket, scratch = s3
    fs = server.filesystem()
    with fs.open_output_stream(f"{bucket}/vocab/words.txt") as f:
        f.write(b"alpha\nbeta\n")
    with fs.open_output_stream(f"{bucket}/weights/sub/w.bin") as f:
        f.write(b"\x01\x02")
    with local_copy(f"s3://{bucket}/vocab/words.txt") as p:
        assert os.path.basename(p) == "words.txt" and open(p, "rb").read() == b"alpha\nbeta\n"
    with local_copy(f"s3://{bucket}/weights") as d:
        assert os.path.basename(d) == "weights" and open(os.path.join(d, "sub", "w.bin"), "rb").read() == b"\x01\x02"
    assert not os.path.exists(p) and not os.path.exists(d) and _ours(scratch) == []
    here = tmp_path / "m.keras"
    here.write_bytes(b"x")
    with local_copy(str(here)) as a, local_copy(f"file://{here}") as b:
        assert a == str(here) and b == str(here)
    with pytest.raises(StorageError, match=rf"nothing is at s3://{bucket}/none"):
        with local_copy(f"s3://{bucket}/none"):
            pass
