"""A Spark ML Pipeline with a TF stage: scale pixels with SQL, train with ``TFEstimator``.

    python -m examples.ml_pipeline

``fit`` starts a TF cluster, pushes the training rows through it and saves the Keras model;
the fitted ``PipelineModel`` transforms new rows keeping every input column, and survives a
save/load round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from examples._common import add_master_option, digits_frame, positive_int, spark_session


def train_fn(args, ctx):  # type: ignore[no-untyped-def]
    """TFEstimator's train_fn: build, train on the pushed rows, return the model to save."""
    from examples._common import build_mlp

    ds = ctx.dataset(args.batch_size, features=args.input_cols, label=args.label_col)
    ds = ds.map(lambda f, y: (f[args.input_cols[0]], y))
    model = build_mlp(args.hidden, args.lr)
    model.fit(ds, epochs=args.epochs, verbose=0)
    return model


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive_int, default=20)
    p.add_argument("--work-dir", help="where the model and the pipeline are saved (default: "
                                      "a temporary directory, removed at the end)")
    add_master_option(p)
    a = p.parse_args(argv)
    if a.work_dir:
        return _fit_save_load(a, a.work_dir)
    with tempfile.TemporaryDirectory(prefix="ml-pipeline-") as work:
        out = _fit_save_load(a, work)
    out["model_path"] = "(removed with the temporary work directory; pass --work-dir to keep it)"
    return out


def _fit_save_load(a: argparse.Namespace, work: str) -> dict:
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import SQLTransformer

    from dataplane.ml import TFEstimator

    spark = spark_session("ml-pipeline", a.master)
    digits = digits_frame(spark).withColumnRenamed("pixels", "raw")  # raw is 0..1 here
    train, test = digits.filter("id % 5 != 0"), digits.filter("id % 5 = 0")
    pipeline = Pipeline(stages=[
        SQLTransformer(statement="SELECT *, transform(raw, v -> CAST(v * 2 - 1 AS FLOAT)) "
                                 "AS centered FROM __THIS__"),
        TFEstimator(train_fn, {"hidden": 64, "lr": 0.01}, inputCols=["centered"],
                    labelCol="label", epochs=a.epochs, batchSize=32,
                    exportDir=os.path.join(work, "model"), predictionCol="probs"),
    ])
    model = pipeline.fit(train)
    model.write().overwrite().save(os.path.join(work, "pipeline"))
    loaded = PipelineModel.load(os.path.join(work, "pipeline"))
    out = loaded.transform(test)
    rows = out.collect()
    accuracy = float(np.mean([int(np.argmax(r["probs"])) == r["label"] for r in rows]))
    return {"accuracy": accuracy, "rows": len(rows), "columns": out.columns,
            "model_path": model.stages[-1].getModelPath()}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
