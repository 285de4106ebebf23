"""``dataplane demo``: a real Keras model trained on embedded Spark through the push path.

The scikit-learn digits (8x8 images, 1797 rows) become a Spark DataFrame; a 2-node cluster
trains a small Keras model with MultiWorkerMirroredStrategy on rows pushed over Flight once
(``cache=True``: each worker replays its share for the later epochs, shuffled), validating on a
held-out split pushed alongside, then answers ``cluster.inference`` on the held-out rows.
Prints what a user needs to judge the data plane: the feed's rows/s and MB/s, the share of
training time the model waited for input, rows per node, Spark jobs, and accuracy.
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


def _positive(text: str) -> int:
    """An argparse type: an int >= 1 (a bad value is a usage error naming the flag, before
    Spark or any node starts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=_positive, default=20, help="training epochs (default 20)")
    parser.add_argument("--batch-size", type=_positive, default=32, help="per-worker batch (default 32)")
    parser.add_argument("--nodes", type=_positive, default=2, help="TF nodes (default 2)")
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
    ds = ctx.dataset(args["batch_size"], features="image", label="label")
    val = ctx.dataset(args["batch_size"], split="validation", features="image", label="label")
    scale = lambda x, y: (x / 16.0, y)  # noqa: E731
    waited = _InputWait()
    t0 = time.monotonic()
    hist = model.fit(ds.map(scale), validation_data=val.map(scale), epochs=args["epochs"],
                     verbose=0, callbacks=[waited])
    ctx.set_metric("fit_seconds", time.monotonic() - t0)
    ctx.set_metric("input_wait_seconds", waited.seconds)
    ctx.set_metric("val_accuracy", float(hist.history["val_accuracy"][-1]))

    def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # A plain call, not model.predict(): under MultiWorkerMirroredStrategy predict() is a
        # collective across all workers and would wait for the others forever.
        probs = model(batch["image"].astype("float32") / 16.0, training=False).numpy()
        return {"prediction": probs.argmax(axis=1).astype("int64"), "confidence": probs.max(axis=1)}

    ctx.serve(predict)


def _input_wait_class():  # type: ignore[no-untyped-def]
    import tf_keras as keras

    class InputWait(keras.callbacks.Callback):
        """Seconds fit spent between one training step's end and the next one's start: the
        time the model waited for its next batch (and Keras' own few microseconds a step)."""

        def __init__(self) -> None:
            super().__init__()
            self.seconds = 0.0
            self._end: float | None = None

        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self._end = time.monotonic()

        def on_train_batch_begin(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if self._end is not None:
                self.seconds += time.monotonic() - self._end

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self._end = time.monotonic()

        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self._end = None

    return InputWait()


_InputWait = _input_wait_class


def _pace(wait: float, fit: float) -> str:
    """What the input-bound share says: who set the pace of training."""
    share = 100 * wait / fit if fit > 0 else 0.0
    if share < 10:
        verdict = "the model, not the feed, set the pace"
    elif share < 50:
        verdict = "the feed slowed training somewhat"
    else:
        verdict = "the feed, not the model, set the pace (input-bound)"
    return f"the model waited for input {share:.1f}% of that time: {verdict}"


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

    b = (SparkSession.builder.master(master).appName("dataplane-demo").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false"))
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
            f"node {n.node_id} ({n.role} {n.index}) @ {n.host}:{n.flight_port}" for n in cluster.nodes))
        val_df = test_df.select("image", "label")
        report = cluster.train(train_df, num_epochs=args.epochs, cache=True, shuffle=True,
                               seed=args.seed, validation=val_df)
        # train() returns once every worker has read the last epoch; fit ends just after
        _wait_serving(cluster, timeout=600.0)
        m = cluster.metrics()
        fit = max(mm.get("user.fit_seconds", 0.0) for mm in m.values())
        wait = max(mm.get("user.input_wait_seconds", 0.0) for mm in m.values())
        val_acc = min(mm.get("user.val_accuracy", 0.0) for mm in m.values())
        rows = report.rows_consumed
        mb = sum(mm["bytes_in"] for mm in m.values()) / 1e6  # pushed and replayed
        print(
            f"the feed gave fit {rows:,} rows ({mb:.1f} MB: {args.epochs} epochs of {n_train} "
            f"training and {n_test} validation rows) in {fit:.1f} s: {rows / fit:,.0f} rows/s, "
            f"{mb / fit:.1f} MB/s; {_pace(wait, fit)}"
        )
        print(
            f"Spark jobs that pushed data: {report.spark_jobs} (each DataFrame once; the workers "
            f"replayed the other epochs from their caches, shuffled); rows received per node "
            f"{report.rows_per_node}, of which {report.dropped_for_balance} left out so that "
            f"every worker takes the same number of batches; validation accuracy {val_acc:.3f}"
        )
        t2 = time.monotonic()
        out = cluster.inference(test_df, passthrough=("id", "label")).toPandas()
        acc = float((out["prediction"] == out["label"]).mean())
        print(f"inference on {len(out)} held-out rows in {time.monotonic() - t2:.1f} s: "
              f"accuracy {acc:.3f}")
    spark.stop()
    print(f"done in {time.monotonic() - t_start:.1f} s")
    return 0 if acc >= 0.8 else 1
