"""Training programs written the ways users write them, for the push plane's loop tests.

``loops_main`` runs a list of scenarios, one per ``cluster.train`` call on the driver; each
scenario reads the pushed data with one consumption pattern and writes what the program saw to
``node<id>-s<j>.json``.
"""

from __future__ import annotations

import gc
import json
import os
import threading

import numpy as np


def _write(path: str, obj) -> None:  # type: ignore[no-untyped-def]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class _Seen:
    """Ids a program saw, per epoch of its own loop (thread-safe: tf.data calls from threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epochs: list[list[int]] = [[]]
        self.batches: list[int] = [0]

    def add(self, ids) -> None:  # type: ignore[no-untyped-def]
        with self.lock:
            self.epochs[-1].extend(int(i) for i in np.asarray(ids).reshape(-1))
            self.batches[-1] += 1

    def next_epoch(self) -> None:
        self.epochs.append([])
        self.batches.append(0)

    def result(self) -> dict:
        return {"epochs": self.epochs, "batches": self.batches}


def loops_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Keras 3 fit fails under MWMS
    import tensorflow as tf
    import tf_keras as keras

    import feeders

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if ctx.num_workers > 1 else None
    # Python's cyclic collector off: a pass whose iterator a program drops inside a reference
    # cycle (tf_keras's first evaluate(steps=k) on TF 2.16 does) must end without it. With
    # automatic collection on, that depended on when the collector happened to run.
    gc.disable()
    try:
        _run_scenarios(args, ctx, strategy, tf, keras, feeders)
    finally:
        gc.enable()


def _run_scenarios(args, ctx, strategy, tf, keras, feeders) -> None:  # type: ignore[no-untyped-def]
    for j, sc in enumerate(args["scenarios"]):
        pattern, epochs, k, bs = sc["pattern"], sc["epochs"], sc["k"], sc["batch_size"]
        seen = _Seen()
        ds = ctx.dataset(bs, features=["id", "x"], label="label", repeat=pattern == "fit_steps")
        steps = {"train": 0, "test": 0}  # the steps Keras ran (the ids a map saw include read-ahead)

        class Steps(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
                steps["train"] += 1

            def on_test_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
                steps["test"] += 1

        def model_and_data(d):  # type: ignore[no-untyped-def]
            def record(ids, x):  # type: ignore[no-untyped-def]
                seen.add(ids.numpy())
                return x

            def to_xy(f, y):  # type: ignore[no-untyped-def]
                x = tf.py_function(record, [f["id"], f["x"]], tf.float32)
                x.set_shape(f["x"].shape)
                return x, y

            scope = strategy.scope() if strategy is not None else _nullscope()
            with scope:
                model = keras.Sequential([keras.layers.Input((sc["width"],)), keras.layers.Dense(2)])
                model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model, d.map(to_xy)

        if pattern == "full":
            for e in range(epochs):
                for f, _ in ds:
                    seen.add(f["id"].numpy())
                seen.next_epoch()
        elif pattern == "break":
            for e in range(epochs):
                for i, (f, _) in enumerate(ds):
                    seen.add(f["id"].numpy())
                    if i + 1 == k:
                        break
                seen.next_epoch()
        elif pattern == "take":
            for e in range(epochs):
                for f, _ in ds.take(k):
                    seen.add(f["id"].numpy())
                seen.next_epoch()
        elif pattern == "strategy_loop":
            # a custom loop as TensorFlow's MultiWorkerMirroredStrategy tutorial writes it:
            # distribute_datasets_from_function, strategy.run with an all-reduce every step
            st = strategy if strategy is not None else tf.distribute.get_strategy()
            dist = st.distribute_datasets_from_function(lambda input_context: ds)

            @tf.function
            def step(batch):  # type: ignore[no-untyped-def]
                def on_replica(f, y):  # type: ignore[no-untyped-def]
                    total = tf.distribute.get_replica_context().all_reduce("sum", tf.size(y))
                    return f["id"], total
                return st.run(on_replica, args=batch)

            for e in range(epochs):
                for batch in dist:
                    ids, _ = step(batch)
                    seen.add(np.concatenate([t.numpy() for t in st.experimental_local_results(ids)]))
                seen.next_epoch()
        elif pattern == "fit_steps":
            model, data = model_and_data(ds)
            model.fit(data, epochs=sc["fit_epochs"], steps_per_epoch=k, verbose=0, callbacks=[Steps()])
        elif pattern == "evaluate_steps":
            model, data = model_and_data(ds)
            for _ in range(epochs // 2):
                model.fit(data, epochs=1, verbose=0, callbacks=[Steps()])
                seen.next_epoch()
                model.evaluate(data, steps=k, verbose=0, callbacks=[Steps()])
                seen.next_epoch()
        elif pattern == "fit_validation_pull":
            model, data = model_and_data(ds)
            val = feeders.parquet_dataset(sc["validation"], batch_size=bs, columns=["x", "label"],
                                          label="label").map(lambda f, y: (f["x"], y))
            hist = model.fit(data, epochs=epochs, validation_data=val, verbose=0, callbacks=[Steps()])
            seen.val_loss = [float(v) for v in hist.history["val_loss"]]  # type: ignore[attr-defined]
        else:
            raise ValueError(f"unknown pattern {pattern!r}")
        out = seen.result()
        out["val_loss"] = getattr(seen, "val_loss", None)
        out["steps"] = steps
        _write(os.path.join(args["dir"], f"node{ctx.node_id}-s{j}.json"), out)


class _nullscope:
    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *a):  # type: ignore[no-untyped-def]
        return False


def cache_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Per scenario: E epochs of (a training pass, then a validation pass when asked), ids
    recorded per pass in order; or a Keras fit with validation_data (``keras``)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if ctx.num_workers > 1 else None
    for j, sc in enumerate(args["scenarios"]):
        out: dict = {"train": [], "validation": []}
        ds = ctx.dataset(sc["batch_size"], features=["id", "x"], label="label")
        val = ctx.dataset(sc["batch_size"], split="validation", features=["id", "x"], label="label") \
            if sc.get("validation") else None
        if sc.get("keras"):
            import tf_keras as keras

            with strategy.scope() if strategy is not None else _nullscope():
                model = keras.Sequential([keras.layers.Input((sc["width"],)), keras.layers.Dense(2)])
                model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            xy = lambda f, y: (f["x"], y)  # noqa: E731
            hist = model.fit(ds.map(xy), validation_data=val.map(xy), epochs=sc["epochs"], verbose=0)
            out["val_loss"] = [float(v) for v in hist.history["val_loss"]]
        else:
            import time

            for _ in range(sc["epochs"]):
                ids = []
                for f, _ in ds:
                    ids.extend(int(i) for i in f["id"].numpy())
                    time.sleep(sc.get("sleep", 0))
                out["train"].append(ids)
                if val is not None:
                    out["validation"].append([int(i) for f, _ in val for i in f["id"].numpy()])
        _write(os.path.join(args["dir"], f"node{ctx.node_id}-s{j}.json"), out)


def catalogue_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read every pushed epoch (a new dataset a pass, so any schema is taken), 'g' filled;
    answer inference with x * 2. Raises on a row whose id is ``args['die_on']``."""
    import numpy as np

    threading.Thread(target=ctx.serve, args=(lambda b: {"y": np.asarray(b["f"], np.float32) * 2},),
                     daemon=True).start()
    while not ctx.should_stop:
        try:
            ds = ctx.dataset(32, fill_values={"g": -1.0})
        except BaseException:
            if ctx.should_stop:
                return
            raise
        for b in ds:
            if args.get("die_on") is not None and args["die_on"] in b["id"].numpy():
                raise ValueError(f"row {args['die_on']} is poison")


def repeat_batches_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read ``args['batches']`` batches of one repeat=True stream through one iterator; record
    each batch's ids."""
    it = iter(ctx.dataset(args["batch_size"], features="id", repeat=True))
    seen = [[int(i) for i in next(it).numpy()] for _ in range(args["batches"])]
    _write(os.path.join(args["dir"], f"batches{ctx.node_id}.json"), seen)
    ctx.end_feed()


def dying_worker_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """A Keras fit under MultiWorkerMirroredStrategy in which worker ``args["victim"]``'s process
    ends outright (``os._exit``, as the out-of-memory killer would end it) after epoch 1."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")

    class Die(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            if epoch == 1 and ctx.node_id == args["victim"]:
                os._exit(3)

    ds = ctx.dataset(16, features="x", label="label")
    model.fit(ds, epochs=args["epochs"], verbose=0, callbacks=[Die()])
