"""Node programs for the workload tests (ml, streaming, compat); importable on executors."""

from __future__ import annotations

import json
import os
import time

import numpy as np


def digits_train_fn(args, ctx):  # type: ignore[no-untyped-def]
    """TFEstimator train_fn: a small MLP on 64 pixel features, trained on the pushed rows."""
    import keras

    keras.utils.set_random_seed(getattr(args, "seed", 0))
    ds = ctx.dataset(args.batch_size, features=args.input_cols, label=args.label_col)
    ds = ds.map(lambda f, y: (f[args.input_cols[0]], y))
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(args.hidden, activation="relu", name="hidden"),
        keras.layers.Dense(10, activation="softmax", name="probs"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(args.lr), loss="sparse_categorical_crossentropy")
    model.fit(ds, epochs=args.epochs, verbose=0)
    return model


def stream_main(args, ctx):  # type: ignore[no-untyped-def]
    """Record every pushed epoch (= one streaming micro-batch): its ids, in arrival order
    (``per_node``: in a folder per node, ``chief0``, ``worker1``...); ``break_pass``: the
    chief reads one batch of that pass and leaves it; ``fresh``: a new dataset every pass;
    ``passes``: the chief stops reading after that many passes, and returns ``stall`` seconds
    later."""
    ds = ctx.dataset(batch_size=args.get("batch_size", 64), shapes=args.get("shapes"))
    out = args["dir"]
    if args.get("per_node"):
        out = os.path.join(out, f"{ctx.role}{ctx.index}")
        os.makedirs(out, exist_ok=True)
    epoch = 0
    while True:
        if args.get("fresh"):  # a dataset per pass: each micro-batch's own array lengths
            ds = ctx.dataset(batch_size=args.get("batch_size", 64), shapes=args.get("shapes"))
        if epoch == args.get("break_pass", -1) and ctx.role == "chief":  # leaves it early
            ids = []
            for b in ds:
                ids = [int(i) for i in b["value"].numpy()]
                break
        else:
            ids = [int(i) for b in ds for i in b["value"].numpy()]
        if ctx.should_stop and not ids:  # read every pass, as the streaming docs say
            break
        with open(os.path.join(out, f"epoch{epoch:05d}.json"), "w") as f:
            json.dump(ids, f)
        epoch += 1
        if epoch == args.get("passes") and ctx.role == "chief":
            time.sleep(args.get("stall", 0))
            break
    with open(os.path.join(out, "done.json"), "w") as f:
        json.dump({"epochs": epoch}, f)
    _ = np  # keep numpy imported for the dataset conversion


def stream_repeat_main(args, ctx):  # type: ignore[no-untyped-def]
    """Read a stream's micro-batches as one ``repeat=True`` dataset until shutdown ends it;
    write every id read, in order, to ``<dir>/<role><index>.json``."""
    ids = [int(i) for b in ctx.dataset(batch_size=8, repeat=True) for i in b["value"].numpy()]
    with open(os.path.join(args["dir"], f"{ctx.role}{ctx.index}.json"), "w") as f:
        json.dump(ids, f)


def const_train_fn(args, ctx):  # type: ignore[no-untyped-def]
    """TFEstimator train_fn that reads every pushed epoch and returns a model whose output is
    the constant ``epochs * 10 + batch_size`` (so a model tells which fit made it); raises
    first when ``args.fail`` is set."""
    import keras

    if getattr(args, "fail", False):
        raise RuntimeError("this fit fails on purpose")
    ds = ctx.dataset(args.batch_size, features=args.input_cols, label=args.label_col)
    for _ in range(args.epochs):
        for _batch in ds:
            pass
    c = float(args.epochs * 10 + args.batch_size)
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        1, kernel_initializer="zeros", bias_initializer=keras.initializers.Constant(c))])
