"""Pull training: the TF node reads Parquet or TFRecord files itself (no rows pass the driver).

    python -m examples.pull_training --format parquet     # or: --format tfrecord

Spark first writes the digits training split as files (Parquet with Spark's writer, TFRecord with
``formats.write_tfrecords``); the node reads its shard with ``feeders.parquet_dataset`` /
``feeders.tfrecord_dataset`` and trains. The chief reports the held-out accuracy (about 0.95).
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
    wait_for_training,
    write_json,
)


def train_main(args: dict, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read this node's shard of the files each epoch and train."""
    import feeders

    if args["format"] == "parquet":
        ds = feeders.parquet_dataset(
            args["data"], columns=["pixels"], label="label", batch_size=args["batch_size"],
            shard=ctx, shapes={"pixels": (64,)},
        )
    else:
        ds = feeders.tfrecord_dataset(
            args["data"], columns=["pixels"], label="label", batch_size=args["batch_size"],
            shard=ctx,
        )
    ds = ds.map(lambda f, y: (f["pixels"], y)).shuffle(64, seed=0)
    model = build_mlp(args["hidden"], args["lr"])
    history = model.fit(ds, epochs=args["epochs"], verbose=0)
    if ctx.role == "chief":
        write_json(os.path.join(args["out"], "metrics.json"), {
            "accuracy": evaluate_local(model), "final_loss": history.history["loss"][-1],
        })


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=["parquet", "tfrecord"], default="parquet")
    p.add_argument("--epochs", type=positive_int, default=20)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--files", type=positive_int, default=4)
    add_master_option(p)
    a = p.parse_args(argv)
    import dataplane
    import formats

    spark = spark_session("pull-training", a.master)
    with tempfile.TemporaryDirectory(prefix="pull-training-") as out:
        data = os.path.join(out, "train")
        train = digits_frame(spark).filter("id % 5 != 0").select("pixels", "label")
        if a.format == "parquet":
            train.repartition(a.files).write.parquet(data)
        else:
            formats.write_tfrecords(train, data, num_files=a.files)
        args = {"format": a.format, "data": data, "epochs": a.epochs, "batch_size": a.batch_size,
                "hidden": a.hidden, "lr": a.lr, "out": out}
        with dataplane.run(spark, train_main, args, num_nodes=1) as cluster:
            wait_for_training(cluster)
        with open(os.path.join(out, "metrics.json")) as f:
            metrics = json.load(f)
        files = len([n for n in os.listdir(data) if n.startswith("part")])
    metrics.update(format=a.format, files=files)
    return metrics


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
