"""Distributed inference: the TF nodes serve a Keras model; Spark streams rows through them.

    python -m examples.distributed_inference [--nodes 2]

A model is trained quickly on the driver and saved; every node loads it and answers
``cluster.inference`` with ``ctx.serve``. The output keeps ``id`` and ``label`` (passthrough) next
to the node's ``prediction`` and ``confidence`` columns; the driver computes the accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from examples._common import (
    add_master_option,
    build_mlp,
    digits_arrays,
    digits_frame,
    positive_int,
    spark_session,
    split,
)


def serve_main(args: dict, ctx) -> None:  # type: ignore[no-untyped-def]
    """Load the model once, then answer inference requests until the driver shuts down."""
    import keras

    model = keras.models.load_model(args["model"], compile=False)

    def predict(batch: dict) -> dict:
        probs = np.asarray(model(np.stack(batch["pixels"]).astype(np.float32), training=False))
        return {"prediction": probs.argmax(axis=1).astype(np.int64),
                "confidence": probs.max(axis=1).astype(np.float32)}

    ctx.serve(predict)


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=positive_int, default=2)
    p.add_argument("--epochs", type=positive_int, default=20)
    add_master_option(p, default_help="local[max(2, --nodes)]")
    a = p.parse_args(argv)
    import dataplane

    ids, x, y = digits_arrays()
    train, _ = split(ids)
    model = build_mlp()
    model.fit(x[train], y[train], epochs=a.epochs, batch_size=32, verbose=0)
    with tempfile.TemporaryDirectory(prefix="inference-") as work:
        path = os.path.join(work, "digits.keras")
        model.save(path)

        spark = spark_session("distributed-inference", a.master or f"local[{max(2, a.nodes)}]")
        test = digits_frame(spark).filter("id % 5 = 0")
        with dataplane.run(spark, serve_main, {"model": path}, num_nodes=a.nodes) as cluster:
            out = cluster.inference(test, passthrough=("id", "label"), columns=["pixels"])
            rows = out.collect()
    accuracy = float(np.mean([r["prediction"] == r["label"] for r in rows]))
    return {"accuracy": accuracy, "rows": len(rows), "columns": out.columns, "nodes": a.nodes}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
