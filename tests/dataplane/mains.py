"""Node programs (``main(args, ctx)``) used by the cluster tests; importable on executors."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np


def _write(path: str, obj) -> None:  # type: ignore[no-untyped-def]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def describe_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Record what the node sees; optionally run one MultiWorkerMirroredStrategy step."""
    info = {
        "role": ctx.role,
        "index": ctx.index,
        "node_id": ctx.node_id,
        "num_workers": ctx.num_workers,
        "worker_index": ctx.worker_index,
        "tf_config": ctx.tf_config,
        "env_tf_config": json.loads(os.environ["TF_CONFIG"]),
        "log_dir": ctx.log_dir,
    }
    if args.get("mwms") and ctx.role in ("chief", "worker"):
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        mine = float(ctx.worker_index + 1)
        total = strategy.reduce(
            tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(mine)), axis=None
        )
        info["mwms_sum"] = float(total.numpy())
        info["mwms_replicas"] = strategy.num_replicas_in_sync
    _write(os.path.join(args["dir"], f"node{ctx.node_id}.json"), info)
    if args.get("raise_on") == ctx.node_id:
        raise ValueError(f"boom from node {ctx.node_id}")
    if args.get("block"):
        while not ctx.should_stop:
            time.sleep(0.1)
    if args.get("wait_stop"):  # as a ps or a ParameterServerStrategy worker waits
        ctx.wait_stop()


def temp_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Leave temp files the way libraries and programs do: one of ours, and TensorFlow's
    autograph module for a converted function (removed by TF only at a normal exit)."""
    import tempfile

    import tensorflow as tf

    with tempfile.NamedTemporaryFile("w", suffix=".mine", delete=False) as f:
        f.write("left behind")

    @tf.function
    def clipped(x):  # type: ignore[no-untyped-def]
        if x > 0:  # a tensor condition: autograph converts the function
            return x
        return -x

    value = float(clipped(tf.constant(-2.0)))
    where = tempfile.gettempdir()
    files = sorted(os.path.join(where, n) for n in os.listdir(where))
    _write(os.path.join(args["dir"], f"node{ctx.node_id}.json"),
           {"tempdir": where, "files": files, "value": value})


def _predict(batch):  # type: ignore[no-untyped-def]
    # "mask": a [rows, 2, 3] answer of uint8, as a segmentation model gives
    mask = np.stack([batch["vec"], batch["vec"] + 1]).transpose(1, 0, 2).astype(np.uint8)
    return {"y": batch["x"] * 2.0, "vec_sum": batch["vec"].sum(axis=1).astype(np.float32), "mask": mask}


def _hold_until_producers_wait(ctx, limit: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Stop reading until producers have waited on the full buffer for 0.3 s without a break
    (tf.data's prefetch may still take a few batches at first): the slow-consumer test's waiting
    no longer depends on how fast a busy machine's Spark tasks push."""
    now = time.monotonic()
    deadline, waiting_since = now + limit, None
    while now < deadline:
        if not ctx._buffer._stalled:
            waiting_since = None
        elif waiting_since is None:
            waiting_since = now
        elif now - waiting_since >= 0.3:
            return
        time.sleep(0.01)
        now = time.monotonic()


def feed_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Serve inference in a thread; record a checksum of every pushed epoch."""
    out = args["dir"]
    threading.Thread(target=ctx.serve, args=(_predict,), daemon=True).start()
    ds = ctx.dataset(batch_size=args.get("batch_size", 64))
    epoch = 0
    while not ctx.should_stop:
        ids, batches, shapes, tag_rows, tag_values = [], 0, set(), 0, 0
        for b in ds:
            if not batches and os.path.exists(os.path.join(out, "slow")):
                _hold_until_producers_wait(ctx)
            ids.append(b["id"].numpy())
            batches += 1
            shapes.add(tuple(b["vec"].shape[1:]))
            tag_rows += int(b["tags"].nrows())
            tag_values += int(b["tags"].flat_values.shape[0])
            if os.path.exists(os.path.join(out, "slow")):
                time.sleep(0.05)
        if not ids and ctx.should_stop:
            break
        allids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        _write(
            os.path.join(out, f"node{ctx.node_id}-epoch{epoch}.json"),
            {
                "count": int(allids.size),
                "sumsq": int(np.sum(allids.astype(object) ** 2)) if allids.size else 0,
                "batches": batches,
                "ids": allids.tolist() if args.get("keep_ids") else None,
                "vec_shapes": sorted(shapes),
                "tag_rows": tag_rows,
                "tag_values": tag_values,
                "dtypes": {k: str(v.dtype.name) for k, v in b.items()} if ids else {},
            },
        )
        epoch += 1


def early_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read one batch and return while the driver is still pushing."""
    for _ in ctx.dataset(batch_size=8):
        break


def wait_stop_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Wait for shutdown in ctx.wait_stop() (``poll``: in a loop of waits that long); with
    ``serve``, serving from a thread meanwhile."""
    if args.get("serve"):
        threading.Thread(target=ctx.serve, args=(lambda b: {"y": b["x"] * 2.0},), daemon=True).start()
    if args.get("poll"):  # a loop of short waits, doing a little work between them
        while not ctx.wait_stop(args["poll"]):
            time.sleep(0.05)
        return
    ctx.wait_stop()


def wait_for_shutdown(ctx) -> None:  # type: ignore[no-untyped-def]
    """Wait for shutdown without ending the feed (a train() call still pushes to this node):
    ctx.wait_stop with a timeout, which tells shutdown this main only waits, so it is stopped
    at once. (A loop polling ctx.should_stop looks busy: shutdown waits its whole timeout.)"""
    while not ctx.wait_stop(3600):
        pass


def idle_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Wait for shutdown (used where only the lifecycle matters)."""
    wait_for_shutdown(ctx)


def polling_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Wait for shutdown polling ``ctx.should_stop``, as many programs do: to shutdown, a busy
    main that will stop when told (once its timeout runs out)."""
    while not ctx.should_stop:
        time.sleep(0.1)


def gil_holding_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Blocks in native code without releasing Python's lock (as MultiWorkerMirroredStrategy
    made with a ps node does): no heartbeat, no answer to actions, but the process runs."""
    import ctypes

    ctypes.PyDLL(None).sleep(int(args["seconds"]))


def slow_reader_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """A slow model: 50 ms a batch over many pushed epochs; says when its first batch came."""
    ds = ctx.dataset(64)
    for _ in range(100):
        for i, _b in enumerate(ds):
            if i == 0:
                _write(os.path.join(args["dir"], f"reading{ctx.node_id}.json"), {"ok": True})
            time.sleep(0.05)


def steady_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """A warm-up pass, then a pass slower than the test's feed_timeout (``delay`` s a batch of
    16 rows) that keeps reading, each pass's rows recorded; then it reads nothing until stopped."""
    ds = ctx.dataset(16)
    for n in range(2):
        rows = 0
        for b in ds:
            rows += int(b["id"].shape[0])
            if n:
                time.sleep(args["delay"])
        _write(os.path.join(args["dir"], f"steady{ctx.node_id}-pass{n}.json"), {"rows": rows})
    wait_for_shutdown(ctx)


def pull_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Busy for a while without pushed data (pull mode), then record that it finished."""
    time.sleep(args["seconds"])
    _write(os.path.join(args["dir"], f"finished{ctx.node_id}.json"), {"ok": True})


def schema_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read pushed epochs with declared shapes and fill values; record what the tensors hold."""
    ds = ctx.dataset(
        batch_size=16, shapes={"img": (3, 4)}, fill_values={"score": -1.0}, label="label"
    )
    epoch = 0
    while not ctx.should_stop:
        rows, seen = 0, {}
        for feats, label in ds:
            rows += int(label.shape[0])
            for name, t in feats.items():
                seen.setdefault(name, {"dtype": t.dtype.name, "shape": t.shape.as_list()[1:]})
            seen.setdefault("label", {"dtype": label.dtype.name, "shape": []})
            names = [s.decode() for s in feats["name"].numpy()]
            ids = feats["id"].numpy()
            assert all(n == f"row-{i}" for n, i in zip(names, ids)), names
            blobs = feats["blob"].numpy()
            assert all(b == bytes([i % 256]) * 3 for b, i in zip(blobs, ids)), blobs
            img = feats["img"].numpy()
            assert (img.reshape(len(ids), 12) == ids[:, None] + np.arange(12)).all()
            score = feats["score"].numpy()
            assert (score == np.where(ids % 5 == 0, -1.0, ids * 0.25)).all(), (ids, score)
            assert (label.numpy() == ids % 7).all()
            if "ts" in feats:
                assert (feats["ts"].numpy() == ids * 1000003).all(), feats["ts"]
                assert (feats["day"].numpy() == ids).all(), feats["day"]
            if "grid" in feats:
                want = ids[:, None, None] + 3 * np.arange(2)[None, :, None] + np.arange(3)[None, None, :]
                assert (feats["grid"].numpy() == want).all(), feats["grid"]
                jag = feats["jag"]
                assert jag.flat_values.numpy().tolist() == [k for i in ids for k in range(i % 3 + 1)]
            if "raw" in feats:
                assert feats["raw"].numpy().tolist() == [bytes([0xFF, i % 10]) for i in ids], feats["raw"]
        if not rows and ctx.should_stop:
            break
        _write(os.path.join(args["dir"], f"node{ctx.node_id}-epoch{epoch}.json"),
               {"rows": rows, "columns": seen})
        epoch += 1


def slow_serve_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Answer inference slowly (``delay`` seconds a request), so a test can kill a node mid-way."""

    def predict(batch):  # type: ignore[no-untyped-def]
        time.sleep(args["delay"])
        return {"y": batch["x"] * 2.0}

    ctx.serve(predict)


def chief_serves_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """The chief serves at once; the other nodes stay busy (a slow model load, training) and
    poll ``ctx.should_stop``."""
    if ctx.role == "chief":
        ctx.serve(lambda batch: {"y": batch["x"] * 2.0})
        return
    while not ctx.should_stop:
        time.sleep(0.1)


def raise_mid_feed_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Node ``args['node']`` raises after a few batches; the others consume everything."""
    for i, _ in enumerate(ctx.dataset(batch_size=64)):
        if ctx.node_id == args["node"] and i == 5:
            raise ValueError(f"bad batch on node {ctx.node_id}")
    while not ctx.should_stop:
        time.sleep(0.1)


def keras_fit_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """The README's program: a Dense model on the array column ``x``, fit under MWMS
    (``args["fits"]`` times, one epoch each: 1 by default)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    with tf.distribute.MultiWorkerMirroredStrategy().scope():
        model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    ds = ctx.dataset(batch_size=32, features=["x"], label="y")
    for _ in range(int(args.get("fits", 1))):
        model.fit(ds.map(lambda f, y: (f["x"], y)), epochs=1, verbose=0)


def wide_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read every pushed epoch to the end (wide rows: nothing kept), until stopped."""
    ds = ctx.dataset(batch_size=64)
    while not ctx.should_stop:
        for _ in ds:
            pass


def byte_count_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Answer inference with the length of each value of column ``jpeg``."""
    import numpy as np

    ctx.serve(lambda batch: {"n": np.array([len(v) for v in batch["jpeg"]], dtype=np.int64)})


def print_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Prints as users' mains do (a line, a line without its newline), then maybe raises."""
    import sys

    print(f"hello from {ctx.role} {ctx.index}")
    sys.stdout.write("last words, no newline")
    if ctx.role == args.get("raise_on"):
        raise ValueError("boom from " + ctx.role)


def save_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Two MWMS workers fit one epoch and save with ctx.save_model; the chief then stays busy
    alone for ``args["linger"]`` s, as a chief-only ``model.save`` would (it never returns),
    and with ``chief_saves_again`` saves once more alone (it never returns)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(ctx.dataset(16, features="x", label="y"), epochs=1, verbose=0)
    saved = ctx.save_model(model, os.path.join(args["dir"], "model.keras"))
    _write(os.path.join(args["dir"], f"node{ctx.node_id}.json"),
           {"saved": saved, "weights": [np.asarray(w).tolist() for w in model.get_weights()]})
    if ctx.role == "chief":
        time.sleep(args["linger"])
        if args.get("chief_saves_again"):  # the wrong way: a collective the worker never joins
            ctx.save_model(model, os.path.join(args["dir"], "model.keras"))


def collective_loop_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """A custom MWMS loop: one all-reduce per batch of ctx.dataset, read directly (every
    worker yields the same batches); each pass's steps recorded; main returns after
    ``args["passes"]`` passes. ``args["fill_node"]``: that node's dataset fills nulls in
    ``x`` (the others refuse them)."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    fill = {"x": 0.0} if args.get("fill_node") == ctx.node_id else None
    ds = ctx.dataset(100, features="x", fill_values=fill)
    steps: list[int] = []
    for _ in range(args["passes"]):
        steps.append(0)
        for _ in ds:
            strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
            steps[-1] += 1
        _write(os.path.join(args["dir"], f"steps{ctx.node_id}.json"), {"steps": steps})


def late_strategy_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Builds the dataset before MultiWorkerMirroredStrategy, as many first programs do."""
    import tensorflow as tf

    ds = ctx.dataset(32)
    tf.distribute.MultiWorkerMirroredStrategy()
    for _ in ds:
        pass


def null_arrays_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read one pushed epoch of an array column with null rows and a fill value; record each
    row's id and values."""
    ds = ctx.dataset(batch_size=8, fill_values={"v": -1.0, "jag": 0})
    rows = {}
    for b in ds:
        for i, v, jag in zip(b["id"].numpy(), b["v"].numpy(), b["jag"].to_list()):
            rows[int(i)] = {"v": v.tolist(), "jag": jag, "v_shape": b["v"].shape.as_list()[1:]}
    _write(os.path.join(args["dir"], f"nulls{ctx.node_id}.json"), rows)


def wrong_label_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Names a label column the pushed DataFrame does not have (a SchemaError on the node)."""
    for _ in ctx.dataset(batch_size=4, label="nope"):
        pass


def busy_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Busy for ever without reading data or checking ctx.should_stop (a long fit, as far as
    the node can tell)."""
    _write(os.path.join(args["dir"], f"busy{ctx.node_id}.json"), {"pid": os.getpid()})
    while True:
        time.sleep(0.1)


def one_pass_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Reads one pass of the pushed data, then returns (fit(epochs=1) under a longer train)."""
    for _ in ctx.dataset(batch_size=16):
        pass


def passes_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Read pass after pass of ctx.dataset() until shutdown, never serving inference."""
    ds = ctx.dataset(16)
    while not ctx.should_stop:
        for _ in ds:
            pass


def spawn_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Start programs and leave them running, as a main that launches a helper tool does: a
    child, and a shell whose own child sleeps too; record their pids."""
    import subprocess

    kids = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["bash", "-c", "sleep 1001 & wait"])]
    time.sleep(0.5)  # the shell has started its child
    pids = [k.pid for k in kids]
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == kids[1].pid:
                        pids.append(int(name))
            except OSError:
                pass
    _write(os.path.join(args["dir"], f"spawned{ctx.node_id}.json"), {"pids": pids})
    ctx.wait_stop()
