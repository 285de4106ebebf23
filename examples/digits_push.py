"""Push training: Spark streams the digits rows into the TF nodes over Arrow Flight.

    python -m examples.digits_push [--nodes 2] [--epochs 20]

With more than one node the nodes train one model with MultiWorkerMirroredStrategy (every worker
gets an equal share of each pushed epoch). The chief evaluates on the held-out split and writes
the accuracy; the driver prints it. Expect about 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from examples._common import (
    add_master_option,
    build_mlp,
    digits_frame,
    evaluate_local,
    positive_int,
    spark_session,
    write_json,
)


def _fit_multi_worker(strategy, ds, args: dict):  # type: ignore[no-untyped-def]
    """Synchronous data-parallel training across the nodes (all-reduce of the gradients)."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = build_mlp(args["hidden"], args["lr"])
        optimizer = keras.optimizers.Adam(args["lr"])
    # ctx.dataset's batch_size is the global batch: experimental_distribute_dataset splits each
    # worker's batch over all the replicas, so a step trains on batch_size rows in all
    global_batch = args["batch_size"]

    @tf.function
    def step(x, y):  # type: ignore[no-untyped-def]
        def replica_step(x, y):  # type: ignore[no-untyped-def]
            with tf.GradientTape() as tape:
                per_row = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True))
                loss = tf.nn.compute_average_loss(per_row, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    loss = 0.0
    for _ in range(args["epochs"]):  # each pass over ds reads the next pushed epoch
        total, steps = 0.0, 0
        for x, y in strategy.experimental_distribute_dataset(ds):
            total += float(step(x, y))
            steps += 1
        loss = total / max(steps, 1)
    return model, loss


def train_main(args: dict, ctx) -> None:  # type: ignore[no-untyped-def]
    """On every node: train on the pushed rows; the chief writes the test accuracy."""
    import keras
    import tensorflow as tf

    # MultiWorkerMirroredStrategy must exist before any other TF op runs in the process
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if ctx.num_workers > 1 else None
    keras.utils.set_random_seed(args["seed"])
    ds = ctx.dataset(args["batch_size"], features="pixels", label="label")
    if strategy is None:
        model = build_mlp(args["hidden"], args["lr"])
        loss = model.fit(ds, epochs=args["epochs"], verbose=0).history["loss"][-1]
    else:  # Keras 3's fit() does not run under MultiWorkerMirroredStrategy: a custom loop does
        model, loss = _fit_multi_worker(strategy, ds, args)
    if ctx.role == "chief":
        write_json(os.path.join(args["out"], "metrics.json"), {
            "accuracy": evaluate_local(model), "final_loss": float(loss),
        })


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=positive_int, default=2)
    p.add_argument("--epochs", type=positive_int, default=20)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    add_master_option(p, default_help="local[max(2, --nodes)]")
    a = p.parse_args(argv)
    import dataplane

    spark = spark_session("digits-push", a.master or f"local[{max(2, a.nodes)}]")
    df = digits_frame(spark).filter("id % 5 != 0").select("pixels", "label").cache()
    with tempfile.TemporaryDirectory(prefix="digits-push-") as out:
        args = {"epochs": a.epochs, "batch_size": a.batch_size, "hidden": a.hidden, "lr": a.lr,
                "seed": 0, "out": out}
        with dataplane.run(spark, train_main, args, num_nodes=a.nodes) as cluster:
            report = cluster.train(df, num_epochs=a.epochs)
        with open(os.path.join(out, "metrics.json")) as f:
            metrics = json.load(f)
    metrics.update(rows_pushed=report.rows, rows_per_node=report.rows_per_node, nodes=a.nodes)
    return metrics


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
