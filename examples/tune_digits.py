"""Hyper-parameter search: one Keras training per Spark task over a grid (``dataplane.tune``).

    python -m examples.tune_digits

The training split is broadcast once and cached in each executor process; every trial trains an
MLP and reports its validation accuracy. The result DataFrame comes back best first.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from examples._common import add_master_option, digits_arrays, positive_int, spark_session, split


def train_fn(params: dict, data: dict) -> dict:
    """One trial: fit on 80% of the training split, score on the other 20%."""
    import keras

    from examples._common import build_mlp

    keras.utils.set_random_seed(0)
    x, y = data["x"], data["y"]
    cut = int(len(y) * 0.8)
    model = build_mlp(params["hidden"], params["lr"])
    model.fit(x[:cut], y[:cut], epochs=params["epochs"], batch_size=32, verbose=0)
    loss, accuracy = model.evaluate(x[cut:], y[cut:], verbose=0)
    return {"val_accuracy": float(accuracy), "val_loss": float(loss)}


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=positive_int, nargs="+", default=[8, 64])
    p.add_argument("--lr", type=float, nargs="+", default=[0.0003, 0.01])
    p.add_argument("--epochs", type=positive_int, default=10)
    add_master_option(p)
    a = p.parse_args(argv)
    import dataplane

    spark = spark_session("tune-digits", a.master)
    ids, x, y = digits_arrays()
    train, _ = split(ids)
    rng = np.random.default_rng(0)
    order = rng.permutation(int(train.sum()))
    data = {"x": x[train][order], "y": y[train][order]}
    space = {"hidden": a.hidden, "lr": a.lr, "epochs": [a.epochs]}
    results = dataplane.tune(spark, train_fn, space, data=data, metric="val_accuracy",
                             mode="max")
    results.show(truncate=False)
    rows = [r.asDict() for r in results.collect()]
    return {"trials": rows, "best": {k: rows[0][k] for k in ("hidden", "lr", "val_accuracy")}}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1, default=str))
