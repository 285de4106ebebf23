"""An MLP on scikit-learn's digits with Keras, before (keras_local.py) and after (keras_on_spark.py)
the move onto Spark with spark-tf-dataplane; README.md shows the diff and how to run each.
"""

import argparse
import json

import dataplane
import keras
import numpy as np
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits


def load_data():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    test = np.arange(len(y)) % 5 == 0
    return x[~test], y[~test], x[test], y[test]


def build_model(hidden, lr):
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def train(args, ctx):
    x_train, y_train, x_test, y_test = load_data()
    model = build_model(args.hidden, args.lr)
    model.fit(ctx.dataset(args.batch_size, label="y").map(lambda f, y: (f["x"], y)), epochs=args.epochs, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(json.dumps({"accuracy": accuracy}))
    if args.metrics:
        with open(args.metrics, "w") as f:
            json.dump({"accuracy": accuracy}, f)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics", default=None, help="also write the accuracy to this JSON file")
    args = parser.parse_args(argv)
    spark = SparkSession.builder.getOrCreate()
    x_train, y_train, _, _ = load_data()
    df = spark.createDataFrame([(x.tolist(), int(y)) for x, y in zip(x_train, y_train)], "x array<float>, y long")
    with dataplane.run(spark, train, args, num_nodes=1) as cluster:
        cluster.train(df, num_epochs=args.epochs)


if __name__ == "__main__":
    main()
