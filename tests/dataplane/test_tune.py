"""dataplane.tune on a real SparkSession: one row per trial, failures isolated, data shipped once."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataplane.errors import StorageError
from dataplane.workloads.tuning import tune
from tests.builders import numeric_table


def quadratic(params, data):
    """A 'training' whose loss is known exactly: minimum at lr=0.1, units=32."""
    loss = (params["lr"] - 0.1) ** 2 + (params["units"] - 32) ** 2 / 1000.0
    return {"loss": loss, "acc": 1.0 - loss, "rows": int(data["x"].size) if data is not None else -1,
            "pid": os.getpid(), "data_id": id(data)}


def flaky(params, data):
    if params["units"] == 16:
        raise RuntimeError(f"units={params['units']} diverged")
    return {"loss": float(params["units"]), "pid": os.getpid()}


def test_grid_one_row_per_point_best_first(spark):
    space = {"lr": [0.01, 0.1, 1.0], "units": [16, 32]}
    data = {"x": np.arange(50, dtype=np.float32)}
    out = tune(spark, quadratic, space, data=data, metric="loss", mode="min")
    rows = [r.asDict() for r in out.collect()]
    assert len(rows) == 6
    assert {(r["lr"], r["units"]) for r in rows} == {
        (lr, u) for lr in space["lr"] for u in space["units"]
    }
    assert out.columns[:3] == ["trial", "lr", "units"]
    assert {"loss", "acc", "seconds", "status", "error"} <= set(out.columns)
    assert (rows[0]["lr"], rows[0]["units"]) == (0.1, 32)
    assert rows[0]["loss"] == pytest.approx(0.0)
    losses = [r["loss"] for r in rows]
    assert losses == sorted(losses)
    assert all(r["status"] == "ok" and r["error"] is None for r in rows)
    assert all(r["rows"] == 50 for r in rows)  # the dict of arrays arrived as itself
    # broadcast data materialised once per executor process: one object id per pid
    ids_per_pid: dict[int, set] = {}
    for r in rows:
        ids_per_pid.setdefault(r["pid"], set()).add(r["data_id"])
    assert all(len(ids) == 1 for ids in ids_per_pid.values()), ids_per_pid


def test_mode_max_orders_descending(spark):
    out = tune(spark, quadratic, {"lr": [0.1, 0.5], "units": [32]}, metric="acc", mode="max",
               parallelism=1)
    accs = [r["acc"] for r in out.collect()]
    assert accs == sorted(accs, reverse=True) and accs[0] == pytest.approx(1.0)


def test_failing_trial_is_recorded_not_fatal(spark):
    out = tune(spark, flaky, {"units": [8, 16, 32]}, metric="loss")
    rows = [r.asDict() for r in out.collect()]
    assert [r["units"] for r in rows] == [8, 32, 16]  # failures sort last
    assert [r["status"] for r in rows] == ["ok", "ok", "error"]
    assert rows[2]["loss"] is None
    assert "RuntimeError: units=16 diverged" in rows[2]["error"]
    assert "Traceback" in rows[2]["error"] and "flaky" in rows[2]["error"]


def crashing(params, data):
    if params["units"] == 2:
        os._exit(3)  # the Python worker dies: no exception, no traceback
    return {"loss": float(params["units"])}


def test_crashed_worker_is_recorded_not_fatal(spark):
    out = tune(spark, crashing, {"units": [1, 2, 3]}, metric="loss")
    rows = [r.asDict() for r in out.collect()]
    assert [(r["units"], r["status"]) for r in rows] == [(1, "ok"), (3, "ok"), (2, "error")]
    assert rows[2]["error"].startswith("Spark task failed")
    assert "Python worker exited unexpectedly" in rows[2]["error"]


def sleepy(params, data):
    import time

    with open(os.path.join(params["dir"], f"pid-{params['s']}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(params["s"])
    return {"loss": float(params["s"]), "rows": getattr(data, "num_rows", -1)}


def test_a_trial_past_trial_timeout_is_cancelled_and_the_others_carry_on(spark, tmp_path):
    import time

    from tests.dataplane.clusterutil import alive

    d = str(tmp_path)
    t0 = time.monotonic()
    out = tune(spark, sleepy, [{"s": 0.0, "dir": d}, {"s": 600.0, "dir": d}, {"s": 0.5, "dir": d}],
               parallelism=2, trial_timeout=8)
    took = time.monotonic() - t0
    rows = [r.asDict() for r in out.collect()]
    assert [(r["trial"], r["status"]) for r in rows] == [(0, "ok"), (2, "ok"), (1, "error")]
    assert rows[2]["error"].startswith("trial_timeout: the trial ran past trial_timeout=8 s"), rows[2]
    assert rows[2]["loss"] is None and rows[2]["seconds"] >= 8
    assert took < 300, took  # not the 600 s the trial asked for
    # the cancelled trial's Python worker is stopped, not left sleeping out its 600 s
    pid = int((tmp_path / "pid-600.0").read_text())
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid)


def test_missing_metric_is_a_trial_error(spark):
    out = tune(spark, lambda p, d: {"accuracy": 0.5}, {"a": [1]}, metric="loss")
    row = out.collect()[0]
    assert row["status"] == "error"
    assert "no 'loss' metric" in row["error"] and "accuracy" in row["error"]
    assert row["accuracy"] == 0.5  # what it did return is kept, not dropped with the trial
    assert row["loss"] is None


def _diverges(params, data):
    if params["a"] == 3:
        raise RuntimeError("a=3 failed")
    return {"loss": float("nan") if params["a"] == 1 else float(params["a"])}


def test_a_nan_metric_ranks_after_the_numbers_and_before_the_failures(spark):
    import math

    rows = [r.asDict() for r in tune(spark, _diverges, {"a": [3, 1, 2]}, metric="loss").collect()]
    assert [(r["a"], r["status"]) for r in rows] == [(2, "ok"), (1, "ok"), (3, "error")]
    assert rows[0]["loss"] == 2.0 and math.isnan(rows[1]["loss"]) and rows[2]["loss"] is None


def test_sampler_space_is_seeded(spark):
    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-3, 0)), "units": int(rng.choice([16, 32, 64]))}

    a = tune(spark, quadratic, sampler, num_trials=5, seed=7)
    b = tune(spark, quadratic, sampler, num_trials=5, seed=7)
    ra = sorted((r["lr"], r["units"]) for r in a.collect())
    rb = sorted((r["lr"], r["units"]) for r in b.collect())
    assert len(ra) == 5 and ra == rb
    assert all(1e-3 <= lr <= 1.0 for lr, _ in ra)


def test_path_data_read_once_per_process(spark, tmp_path):
    table = numeric_table(120)
    pq.write_table(table, tmp_path / "train.parquet")

    def fit(params, data):
        assert isinstance(data, pa.Table)
        return {"loss": float(np.mean(data.column("f0").to_numpy())) * params["k"],
                "rows": data.num_rows, "pid": os.getpid(), "data_id": id(data)}

    out = tune(spark, fit, {"k": [1, 2, 3, 4]}, data=str(tmp_path / "train.parquet"))
    rows = [r.asDict() for r in out.collect()]
    assert len(rows) == 4 and all(r["rows"] == 120 for r in rows)
    mean = float(np.mean(table.column("f0").to_numpy()))
    assert {r["k"]: r["loss"] for r in rows} == pytest.approx({k: mean * k for k in (1, 2, 3, 4)})
    ids_per_pid: dict[int, set] = {}
    for r in rows:
        ids_per_pid.setdefault(r["pid"], set()).add(r["data_id"])
    assert all(len(ids) == 1 for ids in ids_per_pid.values()), ids_per_pid


def test_spark_dataframe_data_arrives_as_arrow(spark):
    df = spark.createDataFrame([(i, float(i)) for i in range(10)], "id long, x double")
    out = tune(spark, lambda p, d: {"loss": float(sum(d.column("x").to_pylist())) + p["b"]},
               {"b": [0, 1]}, data=df)
    assert [r["loss"] for r in out.collect()] == [45.0, 46.0]


def test_spark_ml_vector_data_arrives_as_float_lists(spark):
    import pyarrow as pa
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType([StructField("id", LongType()), StructField("v", VectorUDT())])
    df = spark.createDataFrame([(0, Vectors.dense([1.0, 2.0])), (1, Vectors.sparse(2, {1: 5.0}))], schema)

    def trial(p, d):  # type: ignore[no-untyped-def]
        t = d.schema.field("v").type
        assert pa.types.is_list(t) and t.value_type == pa.float64(), d.schema
        return {"loss": float(sum(sum(v) for v in d.column("v").to_pylist())) * p["k"]}

    out = tune(spark, trial, {"k": [1, 2]}, data=df)
    assert sorted((r["loss"], r["status"]) for r in out.collect()) == [(8.0, "ok"), (16.0, "ok")]


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        ({"space": {"lr": []}}, ValueError, "space['lr']"),
        ({"space": {"lr": "0.1"}}, ValueError, "non-empty list"),
        ({"space": 3}, TypeError, "space must be"),
        ({"space": lambda rng: {"a": 1}}, ValueError, "num_trials"),
        ({"space": {"a": [1]}, "mode": "best"}, ValueError, "'min' or 'max'"),
        ({"space": {"a": [1]}, "parallelism": 0}, ValueError, "parallelism"),
        ({"space": {"a": [1]}, "trial_timeout": 0}, ValueError, "trial_timeout must be"),
        ({"space": {"a": [1]}, "trial_timeout": "60"}, ValueError, "trial_timeout must be"),
        ({"space": {"status": [1]}}, ValueError, "clash"),
        ({"space": {"a": [1]}, "data": "/nonexistent/train.parquet"}, StorageError, "does not exist"),
    ],
)
def test_bad_arguments_fail_up_front(spark, kwargs, exc, text):
    with pytest.raises(exc, match=None) as info:
        tune(spark, quadratic, **kwargs)
    assert text in str(info.value)


def tensor_loss(params, data):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    return {"loss": tf.reduce_mean(tf.constant([params["k"], params["k"] + 2.0]))}


def test_a_tensor_metric_ranks_and_a_non_number_is_a_trial_error(spark):
    # a tf.Tensor loss was kept as its repr, ranked after every number with status 'ok', and
    # turned the whole loss column into strings
    out = tune(spark, tensor_loss, {"k": [3.0, 1.0, 2.0]})
    assert dict(out.dtypes)["loss"] == "double"
    assert [(r["k"], r["loss"], r["status"]) for r in out.collect()] == [
        (1.0, 2.0, "ok"), (2.0, 3.0, "ok"), (3.0, 4.0, "ok")]
    out = tune(spark, lambda p, d: {"loss": "n/a" if p["k"] == 2 else float(p["k"])}, {"k": [1, 2, 3]})
    rows = [r.asDict() for r in out.collect()]
    assert [(r["k"], r["status"]) for r in rows] == [(1, "ok"), (3, "ok"), (2, "error")]
    assert rows[2]["error"].startswith("TypeError: train_fn returned 'loss' = 'n/a' (str); the metric "
                                       "that ranks the trials must be a number")
    assert dict(out.dtypes)["loss"] == "double"


def test_a_rewritten_data_file_is_read_again(spark, tmp_path):
    # executors kept serving the first version of a path for the rest of the session
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": list(range(10))}), path)
    count = lambda p, d: {"loss": float(d.num_rows), "cols": ",".join(d.column_names)}  # noqa: E731
    assert [r["loss"] for r in tune(spark, count, {"k": [1]}, data=str(path)).collect()] == [10.0]
    pq.write_table(pa.table({"x": list(range(20)), "y": [1.0] * 20}), path)
    rows = tune(spark, count, {"k": [1]}, data=f"file://{path}").collect()
    assert [(r["loss"], r["cols"]) for r in rows] == [(20.0, "x,y")]
    with pytest.raises(StorageError, match="does not exist"):
        tune(spark, count, {"k": [1]}, data=f"file://{tmp_path}/nope.parquet")


def test_spark_dataframe_data_keeps_its_types(spark):
    # pyspark 3.5 went through pandas: a nullable int arrived as float64
    df = spark.sql("SELECT * FROM VALUES (1, 'a'), (NULL, 'b') AS t(i, s)")
    out = tune(spark, lambda p, d: {"loss": 0.0, "types": str(d.schema.field("i").type),
                                    "values": str(d.column("i").to_pylist())}, {"k": [1]}, data=df)
    row = out.collect()[0]
    assert (row["types"], row["values"]) == ("int32", "[1, None]")


def test_an_unpicklable_train_fn_fails_tune_itself(spark):
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"^tune: train_fn cannot be pickled for the executors \(.*lock"):
        tune(spark, lambda p, d: {"loss": 1.0 if lock else 0.0}, {"k": [1]})
