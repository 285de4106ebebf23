"""Node programs for the workload tests (ml, streaming, compat); importable on executors."""

from __future__ import annotations

import json
import os

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
    """Record every pushed epoch (= one streaming micro-batch): its ids, in arrival order."""
    ds = ctx.dataset(batch_size=64)
    out = args["dir"]
    epoch = 0
    while True:
        ids = [int(i) for b in ds for i in b["value"].numpy()]
        if not ids and ctx.should_stop:
            break
        with open(os.path.join(out, f"epoch{epoch:05d}.json"), "w") as f:
            json.dump(ids, f)
        epoch += 1
    with open(os.path.join(out, "done.json"), "w") as f:
        json.dump({"epochs": epoch}, f)
    _ = np  # keep numpy imported for the dataset conversion


def tfos_fun(args, ctx):  # type: ignore[no-untyped-def]
    """A TFoS-style map_fun: answer inference in a thread (label*10) and read exactly
    ``args["take"]`` training rows with next_batch, then terminate() the rest of the feed."""
    import threading

    from dataplane.compat import TFNode

    def serve():
        feed = TFNode.DataFeed(ctx.mgr, False)
        while not feed.should_stop():
            batch = feed.next_batch(5)
            if batch:
                feed.batch_results([f"{row[1] * 10}:{row[2]}" for row in batch])

    threading.Thread(target=serve, daemon=True).start()
    feed = ctx.get_data_feed(train_mode=True)
    seen = []
    while len(seen) < args["take"] and not feed.should_stop():
        seen.extend(feed.next_batch(min(7, args["take"] - len(seen))))
    feed.terminate()
    info = {
        "job_name": ctx.job_name, "task_index": ctx.task_index, "worker_num": ctx.worker_num,
        "num_workers": ctx.num_workers, "cluster_spec": ctx.cluster_spec,
        "rows": [[type(r).__name__, np.asarray(r[0]).tolist(), type(r[0]).__name__, r[1], r[2]]
                 for r in seen],
    }
    with open(os.path.join(args["dir"], "tfos.json"), "w") as f:
        json.dump(info, f)
    while not ctx.dataplane.should_stop:  # keep serving inference until shutdown
        import time

        time.sleep(0.1)
