"""Digits on TensorFlowOnSpark (InputMode.SPARK): train from an RDD, then infer on the cluster.

    spark-submit --master local[2] migrated.py --cluster_size 1

original_tfos.py moved onto spark-tf-dataplane: only the TFCluster import changed.
"""

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
from pyspark import SparkConf, SparkContext
from sklearn.datasets import load_digits
from dataplane.compat import TFCluster


def train_fun(args, ctx):
    import keras
    import tensorflow as tf

    tf_feed = ctx.get_data_feed(train_mode=True)

    def rows():
        while not tf_feed.should_stop():
            batch = tf_feed.next_batch(args.batch_size)
            if len(batch) == 0:
                return
            for pixels, label in batch:
                yield np.asarray(pixels, dtype=np.float32) / 16.0, label

    spec = (tf.TensorSpec([64], tf.float32), tf.TensorSpec([], tf.int64))
    ds = tf.data.Dataset.from_generator(rows, output_signature=spec).batch(args.batch_size)
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.Adam(args.lr), "sparse_categorical_crossentropy")
    model.fit(ds, epochs=1, verbose=0)
    if ctx.job_name == "chief":
        model.save(os.path.join(args.model_dir, "digits.keras"))


def inference_fun(args, ctx):
    import keras

    model = keras.models.load_model(os.path.join(args.model_dir, "digits.keras"))
    tf_feed = ctx.get_data_feed(train_mode=False)
    while not tf_feed.should_stop():
        batch = tf_feed.next_batch(args.batch_size)
        if len(batch) == 0:
            continue
        pixels = np.array([np.asarray(p, dtype=np.float32) / 16.0 for p, _ in batch])
        predictions = model.predict(pixels, verbose=0).argmax(axis=1)
        tf_feed.batch_results([f"{label} {pred}" for (_, label), pred in zip(batch, predictions)])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster_size", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--model_dir", default=None, help="default: a temporary directory, removed at the end")
    args = parser.parse_args(argv)
    temporary = args.model_dir is None
    args.model_dir = args.model_dir or tempfile.mkdtemp(prefix="tfos-digits-")

    sc = SparkContext.getOrCreate(SparkConf().setAppName("digits_tfos"))
    digits = load_digits()
    rows = [(x.tolist(), int(y)) for x, y in zip(digits.data, digits.target)]
    train_rdd = sc.parallelize([r for i, r in enumerate(rows) if i % 5 != 0], 4)
    test_rdd = sc.parallelize([r for i, r in enumerate(rows) if i % 5 == 0], 2)

    cluster = TFCluster.run(sc, train_fun, args, args.cluster_size, 0, False,
                            TFCluster.InputMode.SPARK, master_node="chief")
    cluster.train(train_rdd, args.epochs)
    cluster.shutdown()

    cluster = TFCluster.run(sc, inference_fun, args, args.cluster_size, 0, False,
                            TFCluster.InputMode.SPARK, master_node="chief")
    results = cluster.inference(test_rdd).collect()
    cluster.shutdown()
    if temporary:
        shutil.rmtree(args.model_dir, ignore_errors=True)

    pairs = [line.split() for line in results]
    accuracy = float(np.mean([label == pred for label, pred in pairs]))
    print(json.dumps({"accuracy": accuracy, "results": len(results)}))
    return {"accuracy": accuracy, "results": len(results)}


if __name__ == "__main__":
    main()
