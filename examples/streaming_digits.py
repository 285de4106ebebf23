"""Streaming training: a Structured Streaming query feeds a running TF cluster.

    python -m examples.streaming_digits

Parquet files landing in a directory are read as a stream (one file per micro-batch); each
micro-batch is pushed into the cluster (``dataplane.workloads.streaming.feed_stream``) and the
node takes training steps on it as it arrives. Stopping the query, then shutting the cluster
down, ends the feed; the chief then reports how many micro-batches it saw and the held-out
accuracy.
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


def train_main(args: dict, ctx) -> None:  # type: ignore[no-untyped-def]
    """One pass of training steps per micro-batch, until the feed ends."""
    model = build_mlp(args["hidden"], args["lr"])
    ds = ctx.dataset(args["batch_size"], features=["pixels"], label="label")
    batches = rows = 0
    while True:
        seen = 0
        for features, label in ds:  # one iteration = one micro-batch
            model.train_on_batch(features["pixels"], label)
            seen += int(label.shape[0])
        # should_stop read every pass (not only after an empty one): the node then knows this
        # main loops until shutdown, and its last, empty pass is no misread epoch
        if ctx.should_stop and seen == 0:
            break
        batches, rows = batches + 1, rows + seen
    if ctx.role == "chief":
        write_json(os.path.join(args["out"], "metrics.json"), {
            "accuracy": evaluate_local(model), "micro_batches": batches, "rows": rows,
        })


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=positive_int, default=10, help="times the training split is streamed")
    p.add_argument("--files-per-pass", type=positive_int, default=3)
    add_master_option(p)
    a = p.parse_args(argv)
    import dataplane
    from dataplane.workloads.streaming import feed_stream

    spark = spark_session("streaming-digits", a.master)
    with tempfile.TemporaryDirectory(prefix="streaming-") as work:
        incoming = os.path.join(work, "incoming")
        train = digits_frame(spark).filter("id % 5 != 0").select("pixels", "label")
        for i in range(a.passes):  # stand-in for files arriving over time
            train.orderBy((train.label * 7919 + i) % 101).repartition(a.files_per_pass) \
                .write.mode("append").parquet(incoming)
        stream = (spark.readStream.schema(train.schema).option("maxFilesPerTrigger", 1)
                  .parquet(incoming))
        args = {"hidden": 64, "lr": 0.01, "batch_size": 32, "out": work}
        with dataplane.run(spark, train_main, args, num_nodes=1) as cluster:
            query = feed_stream(cluster, stream, checkpoint_location=os.path.join(work, "ckpt"))
            query.processAllAvailable()
            query.stop()
            fed = {"micro_batches_fed": query.feed.batches, "rows_fed": query.feed.rows}
        with open(os.path.join(work, "metrics.json")) as f:
            metrics = json.load(f)
    metrics.update(fed)
    return metrics


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
