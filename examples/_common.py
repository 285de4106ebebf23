"""Pieces every example shares: a Spark session, the digits data, a Keras MLP, waiting on nodes.

Nothing here runs at import: node processes import the examples to find their ``main``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

#: The digits data set: 1797 8x8 images; rows with ``id % 5 == 0`` are the test split.
TEST_EVERY = 5


def spark_session(app: str, master: str | None = None) -> Any:
    """The active SparkSession, or a new one.

    Under ``spark-submit`` (or when a session already exists, as in the tests) the configured
    master is used unchanged; run by plain ``python``, Spark starts on ``master`` (default
    ``local[2]``) bound to loopback.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app)
    # spark-submit starts the JVM first and hands its port over in this variable; its
    # --master is only visible in that JVM's configuration, not in a Python SparkConf() yet
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = (builder.master(master or "local[2]").config("spark.ui.enabled", "false")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.sql.shuffle.partitions", "4"))
    return builder.getOrCreate()


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (epochs, nodes, sizes)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_master_option(parser: argparse.ArgumentParser, *, default_help: str = "local[2]") -> None:
    """``--master``: where Spark runs when the example is not run under spark-submit."""
    parser.add_argument("--master", help=f"Spark master when run by plain python (default: "
                                          f"{default_help}); ignored under spark-submit")


def digits_arrays(rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, pixels scaled to 0..1 as float32 [n, 64], labels int64) of scikit-learn's digits."""
    from sklearn.datasets import load_digits

    d = load_digits()
    n = len(d.target) if rows is None else min(rows, len(d.target))
    return (np.arange(n, dtype=np.int64), (d.data[:n] / 16.0).astype(np.float32),
            d.target[:n].astype(np.int64))


def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boolean masks (train, test) for the ids."""
    test = ids % TEST_EVERY == 0
    return ~test, test


def digits_frame(spark: Any, rows: int | None = None, *, partitions: int = 4) -> Any:
    """Digits as a DataFrame: ``id`` long, ``pixels`` array<float> (64, scaled 0..1), ``label``."""

    ids, x, y = digits_arrays(rows)
    # plain Python values: pyspark 3.5 without Arrow refuses numpy float32 in an array<float>
    rows_ = list(zip(ids.tolist(), x.tolist(), y.tolist()))
    return spark.createDataFrame(rows_, "id long, pixels array<float>, label long") \
        .repartition(partitions, "id")


def build_mlp(hidden: int = 64, lr: float = 0.01) -> Any:
    """A two-layer Keras classifier for 64 pixel inputs (named layers: ``hidden``, ``probs``)."""
    import keras

    model = keras.Sequential([
        keras.Input(shape=(64,), name="pixels"),
        keras.layers.Dense(hidden, activation="relu", name="hidden"),
        keras.layers.Dense(10, activation="softmax", name="probs"),
    ])
    model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def evaluate_local(model: Any) -> float:
    """Accuracy of a Keras model on the digits test split (computed where it is called)."""
    ids, x, y = digits_arrays()
    _, test = split(ids)
    # a direct call, not predict(): under MultiWorkerMirroredStrategy predict() would run
    # collectives with workers that may already have finished
    probs = np.asarray(model(x[test], training=False))
    return float(np.mean(np.argmax(probs, axis=1) == y[test]))


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def wait_for_training(cluster: Any, timeout: float = 900.0) -> None:
    """Block until every chief/worker ``main`` has returned, or fail after ``timeout`` seconds
    (pull mode: ``shutdown`` would wait for training to end too, but with no deadline, so a
    hung example would never end)."""
    workers = {n.node_id for n in cluster.nodes if n.role in ("chief", "worker")}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = cluster.metrics()
        if all(states.get(i, {}).get("main") != "running" for i in workers):
            return
        time.sleep(0.5)
    raise TimeoutError(f"training did not finish within {timeout:.0f} s")
