"""Batch inference with ``dataplane.predict``: a saved Keras model scores a DataFrame.

    python -m examples.predict_digits

The model is loaded once per executor Python process (not per batch); the output keeps every
input column and adds ``probs`` (10 class probabilities); ``--layer hidden`` adds the hidden
layer's activations as features too.
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


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive_int, default=20)
    p.add_argument("--layer", default="hidden", help="also extract this layer ('' for none)")
    p.add_argument("--batch-size", type=positive_int, default=256)
    add_master_option(p)
    a = p.parse_args(argv)
    import dataplane

    ids, x, y = digits_arrays()
    train, _ = split(ids)
    model = build_mlp()
    model.fit(x[train], y[train], epochs=a.epochs, batch_size=32, verbose=0)
    with tempfile.TemporaryDirectory(prefix="predict-") as work:
        path = os.path.join(work, "digits.keras")
        model.save(path)

        spark = spark_session("predict-digits", a.master)
        test = digits_frame(spark).filter("id % 5 = 0")
        out = dataplane.predict(test, path, input_cols=["pixels"], output_col="probs",
                                batch_size=a.batch_size)
        if a.layer:
            out = dataplane.predict(out, path, input_cols=["pixels"], output_col="features",
                                    layer=a.layer, batch_size=a.batch_size)
        rows = out.collect()
    accuracy = float(np.mean([int(np.argmax(r["probs"])) == r["label"] for r in rows]))
    return {"accuracy": accuracy, "rows": len(rows), "columns": out.columns,
            "feature_width": len(rows[0]["features"]) if a.layer else 0}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
