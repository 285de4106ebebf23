"""``dataplane demo``: a real Keras model trained on embedded Spark through the push path.

The scikit-learn digits (8x8 images, 1797 rows) become a Spark DataFrame; a 2-node cluster
trains a small Keras model with MultiWorkerMirroredStrategy on rows pushed over Flight, then
answers ``cluster.inference`` on the held-out rows. Prints feed throughput, rows per node and
test accuracy.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

__all__ = ["add_arguments", "run", "node_main"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch (default 32)")
    parser.add_argument("--nodes", type=int, default=2, help="TF nodes (default 2)")
    parser.add_argument("--master", default=None, help="Spark master (default: local[N], N = nodes)")
    parser.add_argument("--seed", type=int, default=0)


def node_main(args: dict[str, Any], ctx: Any) -> None:
    """Runs on every TF node: fit on the pushed epochs, then serve predictions."""
    import numpy as np
    import tensorflow as tf

    # Keras 3's fit() fails across MultiWorkerMirroredStrategy workers (TF 2.21 / Keras 3.15:
    # "Attempt to convert a value (PerReplica...)"); tf_keras (Keras 2) supports it.
    import tf_keras as keras

    keras.utils.set_random_seed(args["seed"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.layers.Input(shape=(64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    ds = ctx.dataset(args["batch_size"], features=["image"], label="label")
    ds = ds.map(lambda f, y: (f["image"] / 16.0, y))
    model.fit(ds, epochs=args["epochs"], verbose=0)

    def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # A plain call, not model.predict(): under MultiWorkerMirroredStrategy predict() is a
        # collective across all workers and would wait for the others forever.
        probs = model(batch["image"].astype("float32") / 16.0, training=False).numpy()
        return {"prediction": probs.argmax(axis=1).astype("int64"), "confidence": probs.max(axis=1)}

    ctx.serve(predict)


def _wait_serving(cluster: Any, *, timeout: float) -> float:
    """Seconds until every node has finished fit and entered ``ctx.serve``.

    Raises:
        TimeoutError: a node was still training after ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while True:
        states = {i: m.get("serving", False) for i, m in cluster.metrics().items()}
        if all(states.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            late = sorted(i for i, ok in states.items() if not ok)
            raise TimeoutError(
                f"node(s) {late} were still training {timeout:.0f} s after the last epoch was "
                f"pushed; see cluster.metrics() and the node logs."
            )
        time.sleep(0.2)


def _spark(master: str):  # type: ignore[no-untyped-def]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    b = SparkSession.builder.master(master).appName("dataplane-demo").config("spark.ui.enabled", "false")
    if os.environ.get("SPARK_LOCAL_IP"):
        b = b.config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
    return b.getOrCreate()


def run(args: argparse.Namespace) -> int:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("dataplane demo needs scikit-learn: pip install 'spark-tf-dataplane[examples]'", file=sys.stderr)
        return 2
    import numpy as np

    import dataplane

    t_start = time.monotonic()
    spark = _spark(args.master or f"local[{max(args.nodes, 2)}]")
    spark.sparkContext.setLogLevel("ERROR")
    digits = load_digits()
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(digits.target))
    rows = [
        (int(i), digits.data[i].astype(float).tolist(), int(digits.target[i])) for i in order
    ]
    n_test = len(rows) // 5
    schema = "id long, image array<float>, label long"
    test_df = spark.createDataFrame(rows[:n_test], schema).cache()
    train_df = spark.createDataFrame(rows[n_test:], schema).repartition(4).cache()
    n_train = train_df.count()
    test_df.count()
    print(f"digits: {n_train} training rows, {n_test} test rows; starting {args.nodes} TF nodes")
    t0 = time.monotonic()
    node_args = {"epochs": args.epochs, "batch_size": args.batch_size, "seed": args.seed}
    with dataplane.run(spark, node_main, node_args, num_nodes=args.nodes) as cluster:
        print(f"cluster up in {time.monotonic() - t0:.1f} s: " + ", ".join(
            f"{n.role} {n.index} @ {n.host}:{n.flight_port}" for n in cluster.nodes))
        report = cluster.train(train_df, num_epochs=args.epochs)
        feed_rate = report.rows / report.seconds if report.seconds else float("nan")
        stalled = sum(m.get("stall_seconds", 0.0) for m in cluster.metrics().values())
        print(
            f"pushed {report.rows} rows ({report.bytes / 1e6:.1f} MB) in {report.seconds:.1f} s: "
            f"{feed_rate:,.0f} rows/s over {args.epochs} epochs (a Spark job each, on cores "
            f"shared with training; producers waited {stalled:.1f} s on full node buffers); "
            f"rows per node {report.rows_per_node}; dropped to balance workers: "
            f"{report.dropped_for_balance}"
        )
        t1 = time.monotonic()
        # train() returns once the last epoch is in the nodes' buffers; fit goes on after it.
        trained = _wait_serving(cluster, timeout=600.0)
        print(f"training done on every node {trained:.1f} s after the last push")
        t2 = time.monotonic()
        out = cluster.inference(test_df, passthrough=("id", "label")).toPandas()
        acc = float((out["prediction"] == out["label"]).mean())
        print(f"inference on {len(out)} held-out rows in {time.monotonic() - t2:.1f} s: "
              f"accuracy {acc:.3f}")
    spark.stop()
    print(f"done in {time.monotonic() - t_start:.1f} s")
    return 0 if acc >= 0.8 else 1
