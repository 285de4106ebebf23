"""Training programs a user would write, run against the push path end to end.

Each test starts one cluster, runs ``cluster.train`` calls whose node programs read the pushed
data in one user-style way, and checks the books on both sides: the ids the program saw
(checksummed when it read everything), the rows the nodes handed to TensorFlow
(``metrics()['rows_out']``), and ``rows_unconsumed`` + ``dropped_for_balance`` from the report,
which must add up to ``report.rows``. Every call must end far within its ``feed_timeout``;
failures must be typed, quick, and leave no node process behind.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

import dataplane
from dataplane.driver.pushjob import TASKS_PER_SLOT
from dataplane.errors import NodeError
from tests.dataplane.clusterutil import epoch_name, node_processes, wait_gone, wait_json

pytestmark = pytest.mark.cluster

FEED_TIMEOUT = 90.0
# A call that wedges fails with feed_timeout's error; one that stalls and goes on takes long.
# Calls took up to 32 s with both stacks' suites running at once on 2 cores, and 46-49 s with
# a third test process beside them (2026-11-28).
RETURNS_WITHIN = 0.75 * FEED_TIMEOUT


# ---------------------------------------------------------------------------------------------
# the node program: one scenario per cluster.train call, written the way users write loops


def _write(path: str, obj) -> None:  # type: ignore[no-untyped-def]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _ids(batch) -> list[int]:  # type: ignore[no-untyped-def]
    f = batch[0] if isinstance(batch, tuple) else batch
    return [int(i) for i in f["id"].numpy().reshape(-1)]


def user_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf

    scenarios = args["scenarios"]
    keras_needed = any(sc["pattern"] == "fit_repeat_validation" for sc in scenarios)
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if keras_needed and ctx.num_workers > 1 else None
    out_dir = args["dir"]
    for j, sc in enumerate(scenarios):
        pattern, bs = sc["pattern"], sc.get("batch_size", 32)
        rec: dict = {"train": [], "validation": []}
        path = os.path.join(out_dir, f"node{ctx.node_id}-s{j}.json")
        if pattern == "fit_repeat_validation":
            import tf_keras as keras

            lock = threading.Lock()
            seen = {"train": [], "validation": []}

            def recorder(split):  # type: ignore[no-untyped-def]
                def record(ids, x):  # type: ignore[no-untyped-def]
                    with lock:
                        seen[split].extend(int(i) for i in ids.numpy().reshape(-1))
                    return x

                def to_xy(f, y):  # type: ignore[no-untyped-def]
                    x = tf.py_function(record, [f["id"], f["x"]], tf.float32)
                    x.set_shape(f["x"].shape)
                    return x, y

                return to_xy

            # repeat=True, or (as TF tutorials write it) tf.data's own .repeat() over the passes
            train = ctx.dataset(bs, features=["id", "x"], label="label", repeat=not sc.get("tf_repeat"))
            if sc.get("tf_repeat"):
                train = train.repeat()
            val = ctx.dataset(bs, features=["id", "x"], label="label", split="validation",
                              repeat=sc.get("val_repeat", False))
            with strategy.scope() if strategy is not None else _Null():
                model = keras.Sequential([keras.layers.Input((sc["width"],)), keras.layers.Dense(2)])
                model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            hist = model.fit(train.map(recorder("train")), validation_data=val.map(recorder("validation")),
                             epochs=sc["fit_epochs"], steps_per_epoch=sc["k"],
                             validation_steps=sc["j"], verbose=0)
            rec = {"train": [seen["train"]], "validation": [seen["validation"]],
                   "val_loss": [float(v) for v in hist.history["val_loss"]]}
            _write(path, rec)
            continue
        ds = ctx.dataset(bs, features=["id", "x"], label="label", drop_remainder=sc.get("drop_remainder", False)) \
            if pattern != "validation_only" else None
        if pattern == "tf_cache":  # TensorFlow's own cache: it reads the feed's first pass only
            ds = ds.cache()
        if ds is not None:  # the batch dimension of every element (None: not static)
            rec["batch_dims"] = [s.shape[0] for s in tf.nest.flatten(ds.element_spec)]
        val = ctx.dataset(bs, features=["id", "x"], label="label", split="validation") \
            if sc.get("validation") or pattern == "validation_only" else None
        for e in range(sc["read_epochs"]):
            if ds is not None:
                ids: list[int] = []
                for i, b in enumerate(ds):
                    if pattern == "raise_in_replay" and e == 1 and i == 3 and ctx.node_id == sc["node"]:
                        _write(path, rec)
                        raise ValueError(f"user bug in epoch {e} on node {ctx.node_id}")
                    ids.extend(_ids(b))
                rec["train"].append(ids)
            if val is not None:
                ids = []
                for i, b in enumerate(val):
                    if pattern == "raise_in_validation" and i == 1 and ctx.node_id == sc["node"]:
                        _write(path, rec)
                        raise ValueError(f"user bug in validation on node {ctx.node_id}")
                    ids.extend(_ids(b))
                rec["validation"].append(ids)
        _write(path, rec)
        if pattern in ("return_early", "tf_cache"):
            return
    if args.get("serve"):
        ctx.serve(lambda b: {"y": np.asarray(b["id"], np.float64) * 2.0})


class _Null:
    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *a):  # type: ignore[no-untyped-def]
        return False


# ---------------------------------------------------------------------------------------------
# driver-side helpers


def _frame(spark, start: int, rows: int, parts: int, width: int = 4):  # type: ignore[no-untyped-def]
    x = ", ".join(f"cast(id * {k} as float)" for k in range(1, width + 1))
    return spark.range(start, start + rows, 1, parts).selectExpr(
        "id", f"array({x}) as x", "cast(id % 2 as int) as label"
    )


def _rows_out(cluster) -> dict[int, int]:  # type: ignore[no-untyped-def]
    return {n: m["rows_out"] for n, m in cluster.metrics().items()}


def _balanced(cluster, report, before) -> int:  # type: ignore[no-untyped-def]
    """The nodes' own count of rows handed to TF, checked against the report's books."""
    after = _rows_out(cluster)
    handed = sum(after[n] - before.get(n, 0) for n in after)
    assert handed + sum(report.rows_unconsumed.values()) + report.dropped_for_balance == report.rows, (handed, report)
    return handed


def _full_epochs(seen, workers, split, ids, epochs):  # type: ignore[no-untyped-def]
    """Every row once per epoch across the workers (less what was dropped for balance)."""
    want = set(ids)
    for e in range(epochs):
        per = [seen[n][split][e] for n in workers]
        assert len({len(p) for p in per}) == 1, (split, e, [len(p) for p in per])
        union = [i for p in per for i in p]
        assert len(union) == len(set(union)), (split, e)
        assert set(union) <= want and len(want) - len(union) < len(workers), (split, e, len(union))


def _check_fit_steps(tmp_path, workers, handed, *, rows, val_rows, bs, k, j) -> None:  # type: ignore[no-untyped-def]
    """A 3-epoch fit(steps_per_epoch=k, validation_steps=j) on 2 MWMS workers: each worker took
    k steps a fit epoch and j validation steps a validation pass, of bs / 2 rows each (under
    MWMS the dataset's batch is the global batch: Keras rebatches it over the 2 replicas);
    Keras may read ahead, never less; ids from the right DataFrame only."""
    seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
    for n in workers:
        tr, va = seen[n]["train"][0], seen[n]["validation"][0]
        assert 3 * k * bs // 2 <= len(tr) and all(0 <= i < rows for i in tr), (n, len(tr))
        assert 3 * j * bs // 2 <= len(va) and all(100_000 <= i < 100_000 + val_rows for i in va), (n, len(va))
        assert len(seen[n]["val_loss"]) == 3 and all(np.isfinite(seen[n]["val_loss"]))
    assert sum(len(seen[n]["train"][0]) + len(seen[n]["validation"][0]) for n in workers) <= handed


def _stop(cluster, pids) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    try:
        cluster.shutdown(timeout=30)
    finally:
        assert time.monotonic() - t0 < 30
        wait_gone(pids, 30)
        assert node_processes(cluster.cluster_id) == []


# ---------------------------------------------------------------------------------------------
# the programs


def test_mwms_fit_on_repeated_cached_shuffled_splits_with_validation_steps(spark, tmp_path):
    """fit(train, validation_data=val, epochs=3, steps_per_epoch=k, validation_steps=j) on
    ``repeat=True`` datasets of a cached, shuffled push with a validation DataFrame."""
    rows, val_rows, width, bs, k, j = 1200, 300, 4, 32, 10, 3
    sc = {"pattern": "fit_repeat_validation", "batch_size": bs, "width": width, "k": k, "j": j, "fit_epochs": 3}
    # then the same program with a repeat=True validation stream, which Keras cannot read (it
    # starts a new pass every epoch): it hung until feed_timeout; now ctx.dataset refuses it
    scenarios = [sc, dict(sc, val_repeat=True)]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        df, val = _frame(spark, 0, rows, 3, width), _frame(spark, 100_000, val_rows, 2, width)
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(df, 3, FEED_TIMEOUT, cache=True, shuffle=True, seed=3, validation=val)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        assert report.rows_per_split == {"train": 3 * rows, "validation": 3 * val_rows}
        assert report.spark_jobs == 2
        handed = _balanced(cluster, report, before)
        _check_fit_steps(tmp_path, workers, handed, rows=rows, val_rows=val_rows, bs=bs, k=k, j=j)
        # fit stopped after 3 * k steps, far short of the 3 pushed epochs: the rest was refused
        assert sum(report.rows_unconsumed.values()) > 0, report

        t0 = time.monotonic()
        with pytest.raises(NodeError) as info:
            cluster.train(df, 3, FEED_TIMEOUT, cache=True, validation=val)
        assert time.monotonic() - t0 < 15
        assert "ValueError: ctx.dataset(split='validation', repeat=True)" in info.value.remote_traceback
        assert "drop repeat=True" in info.value.remote_traceback
    finally:
        try:
            _stop(cluster, pids)
        except NodeError as e:  # the second program's error, raised again at shutdown
            assert "repeat=True" in e.remote_traceback
            wait_gone(pids, 30)
            assert node_processes(cluster.cluster_id) == []


def test_mwms_fit_on_tf_data_repeat_with_validation_steps(spark, tmp_path):
    """The same fit written the tutorials' way: ``ctx.dataset(...).repeat()`` instead of
    ``repeat=True``, on an uncached push of 3 epochs with a validation DataFrame."""
    rows, val_rows, width, bs, k, j = 960, 192, 4, 32, 20, 2  # 60 steps: across pushed epochs
    sc = {"pattern": "fit_repeat_validation", "batch_size": bs, "width": width, "k": k, "j": j,
          "fit_epochs": 3, "tf_repeat": True}
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": [sc]}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        df, val = _frame(spark, 0, rows, 3, width), _frame(spark, 100_000, val_rows, 2, width)
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(df, 3, FEED_TIMEOUT, validation=val)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        assert report.rows_per_split == {"train": 3 * rows, "validation": 3 * val_rows}
        handed = _balanced(cluster, report, before)
        _check_fit_steps(tmp_path, workers, handed, rows=rows, val_rows=val_rows, bs=bs, k=k, j=j)
    finally:
        _stop(cluster, pids)


def test_two_trains_cached_then_uncached_then_inference(spark, tmp_path):
    """Two DataFrames trained one after the other on one cluster (the first cached, the second
    not), every epoch read to its end, then inference on the same cluster."""
    a_rows, b_rows = 900, 500
    scenarios = [{"pattern": "full", "read_epochs": 2, "batch_size": 32},
                 {"pattern": "full", "read_epochs": 2, "batch_size": 50}]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios, "serve": True},
                            num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        for j, (df, rows, cache) in enumerate([(_frame(spark, 0, a_rows, 3), a_rows, True),
                                                (_frame(spark, 50_000, b_rows, 2), b_rows, False)]):
            before = _rows_out(cluster)
            t0 = time.monotonic()
            report = cluster.train(df, 2, FEED_TIMEOUT, cache=cache, shuffle=cache, seed=1)
            assert time.monotonic() - t0 < RETURNS_WITHIN
            assert report.rows == 2 * rows and report.spark_jobs == (1 if cache else 2), report
            handed = _balanced(cluster, report, before)
            assert report.rows_unconsumed == {}, report
            seen = {n: wait_json(tmp_path / f"node{n}-s{j}.json") for n in workers}
            start = 0 if j == 0 else 50_000
            _full_epochs(seen, workers, "train", range(start, start + rows), 2)
            assert sum(len(e) for n in workers for e in seen[n]["train"]) == handed
        out = cluster.inference(spark.range(0, 300, 1, 3), passthrough=("id",)).collect()
        assert sorted((r["id"], r["y"]) for r in out) == [(i, 2.0 * i) for i in range(300)]
    finally:
        _stop(cluster, pids)


def test_drop_remainder_on_two_workers_pushed_then_cached(spark, tmp_path):
    """ctx.dataset(64, drop_remainder=True), as custom MWMS loops want static batch shapes:
    every batch whole and the same count on both workers, each epoch's ids once at most, and
    the tails dropped are the report's rows_unconsumed, each epoch saying why."""
    rows, bs = 1000, 64
    scenarios = [{"pattern": "full", "read_epochs": 2, "batch_size": bs, "drop_remainder": True}] * 2
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        for j, cache in enumerate([False, True]):
            before = _rows_out(cluster)
            report = cluster.train(_frame(spark, 0, rows, 3), 2, FEED_TIMEOUT, cache=cache, shuffle=cache, seed=3)
            assert report.rows == 2 * rows and report.spark_jobs == (1 if cache else 2), report
            handed = _balanced(cluster, report, before)
            seen = {n: wait_json(tmp_path / f"node{n}-s{j}.json") for n in workers}
            # static batch shapes, as tf.data's own batch(drop_remainder=True) gives: features
            # id and x, and the label
            assert [seen[n]["batch_dims"] for n in workers] == [[bs, bs, bs]] * 2, seen
            for e in range(2):
                per = [seen[n]["train"][e] for n in workers]
                assert len(per[0]) == len(per[1]) and len(per[0]) % bs == 0 and len(per[0]) > 0, [len(p) for p in per]
                union = per[0] + per[1]
                assert len(union) == len(set(union)) and set(union) <= set(range(rows))
                # a worker's share is at least rows // 2 - 1 after balancing: less than a batch left
                assert rows - len(union) - report.dropped_for_balance // 2 < 2 * bs, (e, len(union))
            assert handed == sum(len(ids) for n in workers for ids in seen[n]["train"])
            dropped = 2 * rows - handed - report.dropped_for_balance
            assert dropped > 0 and sum(report.rows_unconsumed.values()) == dropped, report
            # both epochs split the same rows over the workers: each balanced to the same
            # share, whose tail past the last whole batch each worker left unread
            share = (rows - report.dropped_for_balance // 2) // 2
            tails = [2 * (share - len(seen[workers[0]]["train"][e])) for e in range(2)]
            assert sum(tails) == dropped, (tails, report)
            assert (f"train(seed=3) without shuffle=True: the seed changes nothing, rows arrive "
                    f"in Spark's order; pass shuffle=True to shuffle every epoch."
                    in report.messages) is not cache, report.messages
            notes = [m for m in report.messages if "drop_remainder=True" in m]
            assert notes == [
                f"{epoch_name(report, e)}: node(s) {sorted(workers)} dropped the last "
                f"partial batch of the pass (ctx.dataset(drop_remainder=True)): {tails[e]} row(s) "
                f"not read." for e in range(2)], report.messages
    finally:
        _stop(cluster, pids)


def test_train_after_main_went_on_to_serve_returns_with_the_rows_refused(spark, tmp_path):
    """main trains on one pushed epoch, then serves in its own thread; a second train() (a
    fine-tuning pass the program will never read) used to wait feed_timeout and then blame
    the node for not reading. It returns at once, the rows refused and the report saying so,
    and inference goes on answering."""
    rows = 600
    scenarios = [{"pattern": "full", "read_epochs": 1, "batch_size": 50}]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios, "serve": True},
                            num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        report = cluster.train(_frame(spark, 0, rows, 3), 1, FEED_TIMEOUT)
        assert report.rows_unconsumed == {} and report.rows == rows, report
        seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
        _full_epochs(seen, workers, "train", range(rows), 1)
        out = cluster.inference(spark.range(0, 200, 1, 2), passthrough=("id",)).collect()
        assert sorted((r["id"], r["y"]) for r in out) == [(i, 2.0 * i) for i in range(200)]
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(_frame(spark, 10_000, rows, 3), 2, FEED_TIMEOUT)
        assert time.monotonic() - t0 < 30, time.monotonic() - t0
        assert _balanced(cluster, report, before) == 0
        assert sum(report.rows_unconsumed.values()) == 2 * rows - report.dropped_for_balance, report
        notes = [m for m in report.messages if "ended their feed" in m]
        assert notes and all("ctx.serve()" in m for m in notes), report.messages
        out = cluster.inference(spark.range(0, 50, 1, 2), passthrough=("id",)).collect()
        assert sorted((r["id"], r["y"]) for r in out) == [(i, 2.0 * i) for i in range(50)]
    finally:
        _stop(cluster, pids)


def test_uneven_partitions_then_a_main_that_returns_after_fewer_cached_epochs(spark, tmp_path):
    """Partitions that are empty, one partition, fifty partitions; then a main that reads one
    of three cached epochs and returns."""
    frames = [
        # (rows, partitions, how): empty partitions from a filter on a range
        (600, 6, "empty"), (437, 1, None), (1000, 50, None),
        # one row for two workers: each yields the smallest share, none (the report says so)
        (1, 1, None),
        # no rows at all (a filter that kept nothing): empty passes, and the report says so
        (0, 2, None),
    ]
    scenarios = [{"pattern": "full", "read_epochs": 2, "batch_size": 32} for _ in frames]
    scenarios.append({"pattern": "return_early", "read_epochs": 1, "batch_size": 32})
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        for j, (rows, parts, how) in enumerate(frames):
            df = _frame(spark, 0, rows, parts)
            if how == "empty":  # partitions 0, 2, 4 keep their rows; 1, 3, 5 become empty
                df = df.where(f"floor(id / {rows // parts}) % 2 = 0")
                want = [i for i in range(rows) if (i // (rows // parts)) % 2 == 0]
            else:
                want = list(range(rows))
            before = _rows_out(cluster)
            report = cluster.train(df, 2, FEED_TIMEOUT, cache=j == 2)
            assert report.rows == 2 * len(want), (j, report)
            # a task per partition, but no more than a few per task slot: the 50 partitions
            # are pushed by TASKS_PER_SLOT x slots tasks (coalesced, not shuffled)
            tasks = min(df.rdd.getNumPartitions(), TASKS_PER_SLOT * spark.sparkContext.defaultParallelism)
            assert (report.spark_jobs, report.spark_tasks) == (1 if j == 2 else 2, report.spark_jobs * tasks), report
            handed = _balanced(cluster, report, before)
            seen = {n: wait_json(tmp_path / f"node{n}-s{j}.json") for n in workers}
            _full_epochs(seen, workers, "train", want, 2)
            assert sum(len(e) for n in workers for e in seen[n]["train"]) == handed
            empty = [m for m in report.messages if "leave some worker none" in m]
            no_rows = [m for m in report.messages if "has no rows" in m]
            if rows == 1:
                assert handed == 0 and report.dropped_for_balance == 2, report
                assert len(empty) == 2 and "its 1 row(s) over 2 workers" in empty[0], report.messages
                # said in full once; the second epoch points back to it
                assert "push at least one row per worker" in empty[0], report.messages
                assert empty[1] == (f"{epoch_name(report, 1)}: its 1 row(s) over 2 workers "
                                    f"leave some worker none (the note on {epoch_name(report, 0)} "
                                    f"says why)."), report.messages
            else:
                assert empty == [], report.messages
            if rows == 0:  # said once for the call, not once per epoch
                assert handed == 0 and report.rows_unconsumed == {}, report
                assert no_rows == [f"{epoch_name(report, 0)}: the DataFrame given to "
                                   f"train(df) has no rows, so every worker's pass over it is "
                                   f"empty; check the filters or joins that built it."], report.messages
            else:
                assert no_rows == [], report.messages
        rows = 800
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(_frame(spark, 0, rows, 2), 3, FEED_TIMEOUT, cache=True)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        handed = _balanced(cluster, report, before)
        seen = {n: wait_json(tmp_path / f"node{n}-s{len(frames)}.json") for n in workers}
        _full_epochs(seen, workers, "train", range(rows), 1)
        assert handed == sum(len(seen[n]["train"][0]) for n in workers)
        assert report.rows == 3 * rows and sum(report.rows_unconsumed.values()) == 3 * rows - handed - report.dropped_for_balance
        returned = [m for m in report.messages if "returned from main" in m]
        # epochs 1 and 2 were never read at all: the message says why that happens (and does
        # not offer cache=True, which this call already used)
        assert [m.split(":")[0] for m in returned if "read fewer passes than train(num_epochs=...)" in m] == [
            epoch_name(report, 1), epoch_name(report, 2)], report.messages
        # the first says it in full; the second, unread for the same reason, points back to it
        assert "a fit that EarlyStopping ended" in returned[0], returned
        # (a stream's steps counted as if each step took batch_size rows from every worker)
        assert ("fit(steps_per_epoch=k, epochs=E) on a repeat=True stream whose E x k steps take "
                "fewer rows than were pushed (under MultiWorkerMirroredStrategy a step takes "
                "batch_size / 2 rows from each worker, so this epoch's 800 rows last 800 // "
                "batch_size steps, not 800 // batch_size // 2)") in returned[0], returned
        assert returned[1].endswith(f"(the note on {epoch_name(report, 1)} says why)."), returned
        assert not any("use train(..., cache=True)" in m for m in returned), report.messages
    finally:
        _stop(cluster, pids)


def test_tensorflow_cache_over_the_feed_reads_one_pushed_epoch(spark, tmp_path):
    """``ctx.dataset(...).cache()`` then three passes, under ``train(df, 3)``: TensorFlow
    replays its own copy of the first pass, so the two later pushed epochs are never read; the
    call still ends at once and says so, pointing at ``train(cache=True)``."""
    rows = 500
    scenarios = [{"pattern": "tf_cache", "read_epochs": 3, "batch_size": 20}]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(_frame(spark, 0, rows, 3), 3, FEED_TIMEOUT)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        handed = _balanced(cluster, report, before)
        seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
        _full_epochs(seen, workers, "train", range(rows), 1)
        for n in workers:  # the later passes are TensorFlow's copy of the first, in its order
            assert seen[n]["train"][1] == seen[n]["train"][0] == seen[n]["train"][2]
        assert handed == sum(len(seen[n]["train"][0]) for n in workers)
        assert report.rows == 3 * rows and report.spark_jobs == 3
        assert sum(report.rows_unconsumed.values()) == 3 * rows - handed - report.dropped_for_balance
        # the first unread epoch says why (TensorFlow's cache; ours is cache=True), the second
        # points back to it instead of repeating the paragraph
        e = report.epochs
        hints = [m for m in report.messages if "Dataset.cache()" in m and "cache=True" in m]
        assert [m.split(":")[0] for m in hints] == [epoch_name(report, 1)], report.messages
        assert [m for m in report.messages if m.startswith(f"epoch {e[2]} ")] == [
            f"{epoch_name(report, 2)}: node(s) {sorted(workers)} returned from main while data was still being "
            f"pushed; {rows} row(s) were not consumed: their main read fewer passes than "
            f"train(num_epochs=...) pushed (the note on {epoch_name(report, 1)} says why)."], report.messages
    finally:
        _stop(cluster, pids)


def _one_split_read(spark, tmp_path, pattern: str, rows: int, val_rows: int, **train_kw):  # type: ignore[no-untyped-def]
    """Two MWMS workers whose main reads one split only, two passes of 16-row batches; one
    2-epoch train(validation=...) call that must return at once. Returns the report, the rows
    the nodes handed to TensorFlow (books checked) and what each worker read."""
    scenarios = [{"pattern": pattern, "read_epochs": 2, "batch_size": 16}]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(_frame(spark, 0, rows, 2), 2, FEED_TIMEOUT,
                               validation=_frame(spark, 100_000, val_rows, 2), **train_kw)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        handed = _balanced(cluster, report, before)
        seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
    finally:
        _stop(cluster, pids)
    return report, handed, seen, workers


def test_main_reading_only_the_validation_split(spark, tmp_path):
    rows, val_rows = 700, 300
    report, handed, seen, workers = _one_split_read(spark, tmp_path, "validation_only", rows, val_rows, cache=True)
    _full_epochs(seen, workers, "validation", range(100_000, 100_000 + val_rows), 2)
    assert handed == sum(len(e) for n in workers for e in seen[n]["validation"])
    assert report.rows_per_split == {"train": 2 * rows, "validation": 2 * val_rows}
    assert sum(report.rows_unconsumed.values()) == 2 * rows + 2 * val_rows - handed - report.dropped_for_balance


def test_main_never_reading_the_validation_split_is_told_so(spark, tmp_path):
    # train(validation=df) with a main that reads two training passes and returns: no wait,
    # and the report says the validation rows went unread because main never asked for them
    # (it used to say main "read fewer passes than train(num_epochs=...) pushed")
    rows, val_rows = 700, 300
    report, handed, seen, workers = _one_split_read(spark, tmp_path, "return_early", rows, val_rows)
    _full_epochs(seen, workers, "train", range(rows), 2)
    assert handed == sum(len(e) for n in workers for e in seen[n]["train"])
    assert sum(report.rows_unconsumed.values()) == 2 * val_rows
    e = report.epochs  # train, validation, train, validation
    notes = {m.split(" (")[0].split(":")[0]: m for m in report.messages}
    assert set(notes) == {f"epoch {e[1]}", f"epoch {e[3]}"}, report.messages
    # the last one, after main returned; the first, depending on when the books were
    # settled, as skipped by a new training pass or as unread when main returned (and then the
    # last one only points back to the first, which says why)
    returned = [notes[f"epoch {x}"] for x in (e[1], e[3]) if "returned from main" in notes[f"epoch {x}"]]
    assert returned and returned[-1] == notes[f"epoch {e[3]}"], report.messages
    assert "never read this validation epoch" in returned[0], report.messages
    assert "leave validation= out of train()" in returned[0]
    if len(returned) == 2:
        assert returned[1].endswith(f"their main never read ctx.dataset(split='validation') "
                                    f"(the note on {epoch_name(report, 1, ('train', 'validation'))} says why)."), returned
    assert all("split='validation'" in m for m in notes.values()), report.messages
    assert not any("fewer passes" in m for m in report.messages), report.messages


def test_big_rows_tiny_buffer_everything_spilled(spark, tmp_path):
    """~200 KiB rows, a buffer of about two rows and cache_bytes=0: every cached batch goes to
    disk, three shuffled epochs replayed from it, with validation."""
    width, rows, val_rows = 51_200, 40, 12  # 51,200 float32 = 200 KiB a row
    scenarios = [{"pattern": "full", "read_epochs": 3, "batch_size": 4, "validation": True}]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2,
                            buffer_bytes=512 * 1024, max_chunk_bytes=256 * 1024, cache_bytes=0)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        x = f"transform(sequence(1, {width}), i -> cast(id + i as float))"

        def big(start, n, parts):  # type: ignore[no-untyped-def]
            return spark.range(start, start + n, 1, parts).selectExpr("id", f"{x} as x", "cast(id % 2 as int) as label")

        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(big(0, rows, 4), 3, FEED_TIMEOUT, cache=True, shuffle=True, seed=5,
                               validation=big(1000, val_rows, 2))
        assert time.monotonic() - t0 < RETURNS_WITHIN
        assert report.rows == 3 * (rows + val_rows) and report.spark_jobs == 2
        handed = _balanced(cluster, report, before)
        assert report.rows_unconsumed == {}
        seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
        _full_epochs(seen, workers, "train", range(rows), 3)
        _full_epochs(seen, workers, "validation", range(1000, 1000 + val_rows), 3)
        assert handed == sum(len(e) for n in workers for s in ("train", "validation") for e in seen[n][s])
        m = cluster.metrics()
        for n in workers:
            assert m[n]["cache_memory_bytes"] == 0 and m[n]["cache_spilled_bytes"] > 0, m[n]
    finally:
        _stop(cluster, pids)


@pytest.mark.parametrize("where", ["raise_in_replay", "raise_in_validation"])
def test_main_raising_in_a_cached_replay_or_in_validation(spark, tmp_path, where):
    rows, val_rows = 2000, 600
    scenarios = [{"pattern": where, "read_epochs": 3, "batch_size": 16, "node": 1,
                  "validation": where == "raise_in_validation"}]
    cluster = dataplane.run(spark, user_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        t0 = time.monotonic()
        with pytest.raises(NodeError) as info:
            cluster.train(_frame(spark, 0, rows, 2), 3, FEED_TIMEOUT, cache=True,
                          validation=_frame(spark, 100_000, val_rows, 2) if where == "raise_in_validation" else None)
        took, raised_at = time.monotonic() - t0, time.time()
        # the node's error fails the call soon after main raised (its record is written just
        # before the raise), however long the Spark jobs and TF's start-up took before it:
        # the whole call took 8-10 s on an idle machine and 15.7-17.9 s in a fresh-clone CI
        # (both stacks at once on 2 cores), past the 15 s this test used to allow it
        since_raise = raised_at - (tmp_path / "node1-s0.json").stat().st_mtime
        assert since_raise < 10, (since_raise, took)
        assert took < RETURNS_WITHIN, took
        assert info.value.node.node_id == 1
        text = "user bug in epoch 1 on node 1" if where == "raise_in_replay" else "user bug in validation on node 1"
        assert f"ValueError: {text}" in info.value.remote_traceback
        assert "main raised" in str(info.value), str(info.value)
        t1 = time.monotonic()
        with pytest.raises(NodeError):
            cluster.shutdown(timeout=20)
        assert time.monotonic() - t1 < 20
    finally:
        try:
            cluster.shutdown(timeout=20)  # a no-op once shut down
        except NodeError:
            pass
        wait_gone(pids, 15)
    assert node_processes(cluster.cluster_id) == []


# ---------------------------------------------------------------------------------------------
# Keras schedules that read fewer passes than train() pushes


def keras_schedule_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Three programs, one per train call, as users write them under MultiWorkerMirroredStrategy:
    ``fit(validation_freq=2)``; the same on a ``repeat=True`` stream with ``steps_per_epoch``;
    a ``fit`` that ``EarlyStopping`` ends after two of four epochs, without validation_data
    although the driver pushes a validation DataFrame, then ``ctx.end_feed()`` and a wait for
    shutdown."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def xy(ds):  # type: ignore[no-untyped-def]
        return ds.map(lambda f, y: (f["x"], y))

    def done(name, h):  # type: ignore[no-untyped-def]
        _write(os.path.join(args["dir"], f"node{ctx.node_id}-{name}.json"),
               {k: len(v) for k, v in h.history.items()})

    train = xy(ctx.dataset(32, features=["x"], label="label"))
    stream = xy(ctx.dataset(32, features=["x"], label="label", repeat=True))
    val = xy(ctx.dataset(32, features=["x"], label="label", split="validation"))
    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    done("freq", model.fit(train, validation_data=val, epochs=3, validation_freq=2, verbose=0))
    done("stream", model.fit(stream, validation_data=val, epochs=4, steps_per_epoch=25,
                             validation_freq=2, verbose=0))
    # loss + 1e9 never beats the best loss: EarlyStopping stops after the second epoch
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    done("early", model.fit(train, epochs=4, callbacks=[stop], verbose=0))
    ctx.end_feed()  # the program reads no more pushed rows
    ctx.wait_stop()


def test_keras_validation_freq_then_early_stopping_with_a_validation_split_never_read(spark, tmp_path):
    """Two MWMS workers, a 64 KiB buffer, a validation DataFrame about twice a worker's buffer.
    ``fit(validation_freq=2)`` skips every other validation pass; then the same on a
    ``repeat=True`` stream with ``steps_per_epoch``; then a ``fit`` that never reads the
    validation split and is ended by ``EarlyStopping``. Every call returns at once (they waited for feed_timeout: a
    skipped validation epoch bigger than the buffer also wedged the next training epoch's
    push), the books balance, the report says why rows went unread, and shutdown does not wait
    for a main blocked in ``ctx.wait_stop()``."""
    rows, val_rows = 1200, 8000  # a worker's share of a validation epoch: ~2x its buffer
    # a wedged feed ends in a feed_timeout error, or takes past a third of it if something
    # unwedges it late; the first call took 30.6 s on a busy 2-core CI machine (3 fits)
    timeout = 3 * FEED_TIMEOUT
    cluster = dataplane.run(spark, keras_schedule_main, {"dir": str(tmp_path)}, num_nodes=2,
                            buffer_bytes=64 * 1024, max_chunk_bytes=16 * 1024)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]

    def skipped(report):  # type: ignore[no-untyped-def]
        return [m.split(" (")[0] for m in report.messages if "began their next training pass" in m]

    try:
        df, val = _frame(spark, 0, rows, 3), _frame(spark, 100_000, val_rows, 2)
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(df, 3, timeout, validation=val)
        assert time.monotonic() - t0 < timeout / 3
        _balanced(cluster, report, before)
        assert report.rows_per_split == {"train": 3 * rows, "validation": 3 * val_rows}
        for n in workers:
            assert wait_json(tmp_path / f"node{n}-freq.json") == {"loss": 3, "val_loss": 1}
        # epochs go train, validation, train, ...: Keras validated after fit epoch 2 only (with
        # the validation epoch pushed after train epoch 2); the first was skipped when the
        # second training pass began, the last when the next fit's first pass began
        e = report.epochs
        assert skipped(report) == [f"epoch {e[1]}", f"epoch {e[5]}"], report.messages
        # the first says why (validation_freq), the later one points back to it
        first, later = [m for m in report.messages if "began their next training pass" in m]
        assert f"node(s) {sorted(workers)} began their next training pass" in first
        assert "fit(validation_freq=k)" in first, report.messages
        assert later.endswith(f"(the note on {epoch_name(report, 1, ('train', 'validation'))} says why)."), report.messages
        assert sum(report.rows_unconsumed.values()) == 2 * val_rows, report

        # one stream over the pushed epochs, whose fit epochs (25 steps) do not line up with the
        # pushed ones: the stream reads ahead into the next training epoch while the validation
        # epoch before it, twice a worker's buffer, is still being pushed (it stalled until
        # feed_timeout before the node parked such rows on disk)
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(df, 4, timeout, validation=val)
        assert time.monotonic() - t0 < timeout / 3
        _balanced(cluster, report, before)
        for n in workers:
            assert wait_json(tmp_path / f"node{n}-stream.json") == {"loss": 4, "val_loss": 2}
        # 4 x 25 steps of 16 rows a worker read about 2.7 of the 4 pushed training epochs (Keras
        # splits each 32-row batch over the 2 replicas); Keras validated twice,
        # and the validation epochs after the last training epochs were closed unread
        e = report.epochs
        assert f"epoch {e[7]}" in skipped(report), report.messages

        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(df, 4, timeout, validation=val)
        assert time.monotonic() - t0 < timeout / 3
        handed = _balanced(cluster, report, before)
        for n in workers:
            assert wait_json(tmp_path / f"node{n}-early.json") == {"loss": 2}
        e = report.epochs
        # two training epochs read whole; the first validation epoch closed when the second
        # training pass began; everything after EarlyStopping refused through ctx.end_feed()
        assert handed + report.dropped_for_balance == 2 * rows, (handed, report)
        assert skipped(report) == [f"epoch {e[1]}"], report.messages
        ended = [m for m in report.messages if "ended their feed (ctx.end_feed()" in m]
        assert [m.split(" (")[0] for m in ended] == [f"epoch {x}" for x in e[3:]], report.messages
        t0 = time.monotonic()
        _stop(cluster, pids)
        assert time.monotonic() - t0 < 10  # the mains wait in ctx.wait_stop(): nothing to drain
    finally:
        _stop(cluster, pids)


def stream_then_pass_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """Per train call, as a user schedules it under MultiWorkerMirroredStrategy: a ``fit`` over
    a ``repeat=True`` stream whose ``epochs x steps_per_epoch`` is exactly the call's pushed
    epochs; then a plain pass over the next call's epoch. The fit's last step lingers until
    the next call has announced its epoch and pushed rows (the stream's read-ahead took them
    when it did)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    buffer = ctx._buffer  # the test's way to see the next call arrive

    class Linger(keras.callbacks.Callback):
        def on_train_end(self, logs=None):  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 60
            while buffer.metrics["epochs_begun"] < 3 * (1 + call) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(1.0)  # its rows arrive meanwhile

    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for call in range(2):
        stream = ctx.dataset(32, features="x", label="label", repeat=True)
        h = model.fit(stream, epochs=2, steps_per_epoch=args["steps"], callbacks=[Linger()], verbose=0)
        ids = [int(i) for b in ctx.dataset(32, features="id") for i in b.numpy()]
        _write(os.path.join(args["dir"], f"node{ctx.node_id}-round{call}.json"),
               {"steps": len(h.history["loss"]), "rows": len(ids), "unique": len(set(ids)),
                "sum": sum(ids)})


def test_a_stream_fit_dropped_at_its_last_step_leaves_the_next_call_whole(spark, tmp_path):
    """``fit(ctx.dataset(repeat=True), epochs=2, steps_per_epoch=k)`` reads exactly one train
    call, then the program's next pass reads the next call. The stream used to read ahead
    into the next call's epoch as soon as the driver announced it (fit's last steps still
    running): when fit dropped the stream those batches were lost, and the next pass found
    its epoch closed: 0 rows, "ended their pass early"."""
    rows = 1200  # 600 a worker: 19 batches of 32 (the last of 24), each 2 steps of 16 rows or fewer
    cluster = dataplane.run(spark, stream_then_pass_main, {"dir": str(tmp_path), "steps": 38}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        for round in range(2):
            df, nxt = _frame(spark, 0, rows, 3), _frame(spark, 10_000, rows, 3)
            before = _rows_out(cluster)
            report = cluster.train(df, 2, FEED_TIMEOUT)
            assert (report.rows, report.rows_unconsumed, report.messages) == (2 * rows, {}, []), report
            _balanced(cluster, report, before)
            before = _rows_out(cluster)
            report = cluster.train(nxt, 1, FEED_TIMEOUT)
            assert (report.rows, report.rows_unconsumed, report.messages) == (rows, {}, []), report
            _balanced(cluster, report, before)
            got = [wait_json(tmp_path / f"node{n}-round{round}.json") for n in workers]
            assert [g["steps"] for g in got] == [2, 2]
            assert sum(g["rows"] for g in got) == sum(g["unique"] for g in got) == rows, got
            assert sum(g["sum"] for g in got) == sum(range(10_000, 10_000 + rows)), got
    finally:
        _stop(cluster, pids)


def early_stopped_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """fit(validation_data=...) that EarlyStopping ends after two of four epochs; then main
    returns, as most programs do."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tf_keras as keras

    train = ctx.dataset(32, features="x", label="label")
    val = ctx.dataset(32, features="x", label="label", split="validation")
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9)
    h = model.fit(train, validation_data=val, epochs=4, callbacks=[stop], verbose=0)
    _write(os.path.join(args["dir"], f"node{ctx.node_id}-early.json"), {k: len(v) for k, v in h.history.items()})


def test_early_stopping_with_validation_then_main_returning_is_told_so(spark, tmp_path):
    """The epochs after EarlyStopping go unread because main returned: the report says that
    fit ended early for both splits, not that main never read the validation split (it read
    two validation passes)."""
    rows, val_rows = 400, 200
    cluster = dataplane.run(spark, early_stopped_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        before = _rows_out(cluster)
        report = cluster.train(_frame(spark, 0, rows, 2), 4, FEED_TIMEOUT,
                               validation=_frame(spark, 100_000, val_rows, 2))
        handed = _balanced(cluster, report, before)
        assert wait_json(tmp_path / "node0-early.json") == {"loss": 2, "val_loss": 2}
        assert handed == 2 * (rows + val_rows) and report.rows_unconsumed == {0: 2 * (rows + val_rows)}, report
        e = report.epochs  # train, validation, train, ...
        notes = {m.split(":")[0]: m for m in report.messages}
        # named by id, split and place in the call: "epoch 6 (train, 4 of 4)", not the user's 7th
        name = {x: epoch_name(report, x, ("train", "validation")) for x in range(len(e))}
        assert name[4] == f"epoch {e[4]} (train, 3 of 4)" and name[7] == f"epoch {e[7]} (validation, 4 of 4)"
        assert set(notes) == {name[x] for x in range(4, 8)}, report.messages
        # the first unread epoch of each split says why; the later one points back to it (a
        # 10-epoch EarlyStopping run printed the same paragraph 16 times)
        first, later = name[4], name[6]
        assert "read fewer passes than train(num_epochs=...) pushed: a fit that EarlyStopping ended" in notes[first]
        # (a sweep's fit(steps_per_epoch=) without repeat=True was told only the other causes)
        assert "fit(steps_per_epoch=...) on a dataset without repeat=True" in notes[first]
        assert notes[later] == (
            f"{later}: node(s) [0] returned from main while data was still being pushed; "
            f"{rows} row(s) were not consumed: their main read fewer passes than "
            f"train(num_epochs=...) pushed (the note on {first} says why)."), report.messages
        assert notes[name[5]].endswith(
            "Their main had read earlier validation epochs: its fit ended before "
            "train(num_epochs=...)'s last epochs (EarlyStopping, or fit(epochs=) below num_epochs)."), report.messages
        assert notes[name[7]] == (
            f"{name[7]}: node(s) [0] returned from main while data was still being "
            f"pushed; {val_rows} row(s) were not consumed: their fit ended before "
            f"train(num_epochs=...)'s last epochs (the note on {name[5]} says why)."), report.messages
    finally:
        _stop(cluster, pids)


def tiny_validation_main(args, ctx) -> None:  # type: ignore[no-untyped-def]
    """An MWMS fit(validation_data=...) over 3 epochs, as in the README."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    with tf.distribute.MultiWorkerMirroredStrategy().scope():
        model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    h = model.fit(ctx.dataset(32, features="x", label="label"), epochs=3, verbose=0,
                  validation_data=ctx.dataset(32, features="x", label="label", split="validation"))
    _write(os.path.join(args["dir"], f"node{ctx.node_id}-tiny.json"), {k: len(v) for k, v in h.history.items()})


def test_a_validation_split_of_fewer_rows_than_workers_is_named_once_not_as_unread(spark, tmp_path):
    """One validation row for two MWMS workers: every worker's validation pass is empty, and
    Keras, having found the first one empty, skips the later ones. The report says so once in
    full and then briefly, and does not blame main for skipping validation (it said "began
    their next training pass without reading it", then "Their main never read this
    validation epoch")."""
    rows = 300
    cluster = dataplane.run(spark, tiny_validation_main, {"dir": str(tmp_path)}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(_frame(spark, 0, rows, 2), 3, FEED_TIMEOUT, cache=True,
                               validation=_frame(spark, 100_000, 1, 1))
        assert time.monotonic() - t0 < RETURNS_WITHIN
        handed = _balanced(cluster, report, before)
        assert handed == 3 * rows and report.rows_per_split == {"train": 3 * rows, "validation": 3}, report
        for n in workers:  # three training epochs, and no validation result at all
            assert wait_json(tmp_path / f"node{n}-tiny.json") == {"loss": 3}
        e = report.epochs  # train, validation, ...
        name = {x: epoch_name(report, x, ("train", "validation")) for x in range(len(e))}
        assert report.messages[0] == (
            f"{name[1]}: its 1 row(s) over 2 workers leave some worker none, so "
            f"every worker yielded none (each yields the smallest worker's share); push at least "
            f"one row per worker."), report.messages
        for x in (3, 5):
            mine = [m for m in report.messages if m.startswith(name[x])]
            assert mine[0] == (f"{name[x]}: its 1 row(s) over 2 workers leave some "
                               f"worker none (the note on {name[1]} says why)."), report.messages
            # the pass Keras skipped is counted as unconsumed, for the reason above
            assert all("did not read it" in m and "see above" in m for m in mine[1:]), report.messages
        assert not any("began their next training pass" in m or "never read" in m
                       for m in report.messages), report.messages
        assert report.dropped_for_balance + sum(report.rows_unconsumed.values()) == 3, report
    finally:
        _stop(cluster, pids)


_SHIPPED_MAIN = '''
import json, os


def main(args, ctx):
    with open(os.path.join(args["dir"], f"ran{ctx.index}.json"), "w") as f:
        json.dump({"module": __name__, "role": ctx.role}, f)
'''


def test_main_from_a_module_the_executors_get_with_add_py_file(spark, tmp_path):
    """A main kept in the user's own module (TFoS programs ship theirs with --py-files):
    without the module on the executors the node says how to ship it; shipped with
    sc.addPyFile, the node imports it."""
    import importlib
    import sys
    import uuid

    name = f"dp_user_module_{uuid.uuid4().hex[:8]}"
    src = tmp_path / f"{name}.py"
    src.write_text(_SHIPPED_MAIN)
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)  # pickled by reference, as a user's module is
    finally:
        sys.path.remove(str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()

    cluster = dataplane.run(spark, module.main, {"dir": str(out)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    with pytest.raises(NodeError) as info:
        cluster.shutdown(timeout=30)
    text = str(info.value)
    assert f"No module named '{name}'" in text and "addPyFile(path)" in text, text
    assert list(out.iterdir()) == []
    wait_gone(pids, 30)

    spark.sparkContext.addPyFile(str(src))
    cluster = dataplane.run(spark, module.main, {"dir": str(out)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    assert wait_json(out / "ran0.json", 60) == {"module": name, "role": "chief"}
    _stop(cluster, pids)


def _square(x: int) -> int:
    return x * x


def _pool_main(args, ctx):  # type: ignore[no-untyped-def]
    """A user's preprocessing in a process pool, a new pool for every batch, beside the feed;
    node 1's main picks its own start method first, as some programs do."""
    import multiprocessing as mp

    if ctx.node_id == 1:
        mp.set_start_method("spawn")
    total = 0
    for b in ctx.dataset(100):
        with mp.Pool(2) as pool:
            total += sum(pool.map(_square, b["id"].numpy().tolist()))
    _write(os.path.join(args["dir"], f"pool{ctx.node_id}.json"), {"method": mp.get_start_method(), "total": total})


def test_a_process_pool_in_main_runs_beside_the_feed(spark, tmp_path):
    """multiprocessing forks main's process by default on Linux, its gRPC and TensorFlow
    threads and all: with a pool a batch, one node of two hung in two runs of three (a child
    waiting on a lock another thread held at the fork) until feed_timeout. A node's children
    now start from a forkserver by default; a main may still choose its own start method."""
    rows = 2000
    df = spark.range(0, rows, 1, 2).selectExpr("id", "cast(id as float) as x")
    with dataplane.run(spark, _pool_main, {"dir": str(tmp_path)}, num_nodes=2) as cluster:
        t0 = time.monotonic()
        report = cluster.train(df, 1, feed_timeout=FEED_TIMEOUT)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        got = [wait_json(tmp_path / f"pool{n.node_id}.json", 60) for n in cluster.nodes]
        pids = [n.pid for n in cluster.nodes]
    assert [g["method"] for g in got] == ["forkserver", "spawn"]
    assert report.dropped_for_balance == 0 and report.rows_unconsumed == {}
    assert sum(g["total"] for g in got) == sum(i * i for i in range(rows))
    wait_gone(pids, 30)


def _keras_fit_main(args, ctx):  # type: ignore[no-untyped-def]
    import tf_keras as keras

    class Steps(keras.callbacks.Callback):  # batches per epoch, written when fit returns
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.steps = getattr(self, "steps", []) + [0]

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.steps[-1] += 1

    import tensorflow as tf

    mwms = ctx.num_workers > 1  # (one node, or every node a MultiWorkerMirroredStrategy worker)
    with (tf.distribute.MultiWorkerMirroredStrategy() if mwms else tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.layers.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    steps = Steps()
    model.fit(ctx.dataset(32, features="f", label="g"), epochs=args["epochs"], verbose=0, callbacks=[steps])
    with open(os.path.join(args["dir"], f"steps{ctx.node_id}.json"), "w") as f:
        json.dump(steps.steps, f)


def test_a_keras_fit_carries_on_after_a_train_call_whose_dataframe_failed(spark, tmp_path):
    """A DataFrame whose rows a Python UDF computes, failing on one row (a bad record): train
    says what the UDF raised, not PySpark's header line. The epoch being pushed ends with the
    rows that had arrived; the call's later epochs, which no pass had begun, are taken back,
    so the node's Keras fit waits for the next call instead of stopping on empty epochs, and
    the user's next call, with the data fixed, trains its remaining epochs."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    begun = tmp_path / "fit-has-begun"

    def price(i):  # type: ignore[no-untyped-def]
        if i == 350:  # once fit has trained on some rows (else the epoch is taken back too)
            deadline = time.monotonic() + 60
            while not begun.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ValueError(f"no price for id {i}")
        return float(i)

    df = spark.range(0, 400, 1, 2).select(
        F.udf(price, FloatType())("id").alias("f"), F.col("id").cast("float").alias("g"))
    cluster = dataplane.run(spark, _keras_fit_main, {"epochs": 3, "dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]

    def mark_begun() -> None:
        deadline = time.monotonic() + 60
        while cluster.metrics()[0]["rows_taken"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # taken from the buffer; now handed to fit in batches
        begun.touch()

    try:
        threading.Thread(target=mark_begun, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(dataplane.FeedError) as info:
            cluster.train(df, 3, feed_timeout=FEED_TIMEOUT)
        assert "failed: PythonException: ValueError: no price for id 350" in str(info.value), str(info.value)
        assert begun.exists() and time.monotonic() - t0 < 60
        time.sleep(2)
        assert [n.node_id for n in cluster._live_workers()] == [0]  # fit is waiting, not over
        report = cluster.train(df.where("g < 300"), 2, feed_timeout=FEED_TIMEOUT)
        assert report.rows == 600 and report.spark_jobs == 2
        steps = wait_json(tmp_path / "steps0.json", RETURNS_WITHIN)
        # epoch 0 had only the rows that arrived (up to all 200 of partition 0 and 150 of
        # partition 1: 1-11 batches); tf_keras takes the first epoch's steps as every later
        # epoch's (a dataset of unknown length), so epochs 1-2 read at most that many
        assert len(steps) == 3 and 1 <= steps[0] <= 11, steps
        assert steps[1] == steps[2] == min(steps[0], 10), steps
        # handed to TensorFlow: what fit trained on, plus what tf.data had prefetched
        handed = report.rows - sum(report.rows_unconsumed.values())
        assert 2 * min(300, 32 * steps[1]) <= handed <= 600, (report, steps)
    finally:
        _stop(cluster, pids)


@pytest.mark.parametrize("fault", ["raise", "null"])
def test_an_mwms_keras_fit_whose_later_epoch_a_failed_call_cut_trains_the_next_call(spark, tmp_path, fault):
    """Two MultiWorkerMirroredStrategy workers in one Keras fit(epochs=3); the train call's
    second epoch fails, so that epoch ends with the rows that had arrived, shorter than fit's
    first. ``raise``: a UDF raises on a row once it is recomputed. Keras stops a fit at a pass
    shorter than its first epoch ("Your input ran out of data"): main used to return there,
    and the user's next call, with the data fixed, was pushed to nobody and returned a report
    of unconsumed rows. The cut pass now goes on with the next call's first epoch, and fit
    trains all its 3 epochs, equal steps on both workers.

    ``null``: the UDF returns a null instead, in worker 1's slice of its Arrow batch while
    worker 0's slice is clean. Worker 1 used to refuse its chunk while worker 0 took its own
    and yielded it, trusting the sibling chunk to follow: its pass ran 184 rows past the rows
    worker 1 holds (the workers' passes differed; a loop with a collective per batch then
    hangs, see test_faults). Now every worker refuses the whole batch (each chunk says which
    columns hold nulls anywhere in its batch), and the passes stay equal."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    seen, begun = tmp_path / "row-600", tmp_path / "epoch-1-begun"

    def price(i):  # type: ignore[no-untyped-def]
        if i == 600:
            with open(seen, "a") as f:
                f.write("x")
            if seen.stat().st_size >= 2:  # epoch 1's push, and its task's retries
                deadline = time.monotonic() + 60
                while not begun.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if fault == "null":
                    return None
                raise ValueError(f"no price for id {i}")
        return i / 1000

    df = spark.range(0, 800, 1, 2).select(
        F.udf(price, FloatType())("id").alias("f"), (F.col("id") / 1000).cast("float").alias("g"))
    fixed = spark.range(0, 800, 1, 2).selectExpr("CAST(id / 1000 AS FLOAT) AS f", "CAST(id / 1000 AS FLOAT) AS g")
    cluster = dataplane.run(spark, _keras_fit_main, {"epochs": 3, "dir": str(tmp_path)}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]

    def mark_begun() -> None:  # fit reads epoch 1 (else the failed call takes it back unread)
        deadline = time.monotonic() + 60
        while (min(m.get("rows_taken", 0) for m in cluster.metrics().values()) <= 400
               and time.monotonic() < deadline):
            time.sleep(0.05)
        time.sleep(0.5)
        begun.touch()

    try:
        threading.Thread(target=mark_begun, daemon=True).start()
        with pytest.raises(dataplane.SchemaError if fault == "null" else dataplane.FeedError) as info:
            cluster.train(df, 3, feed_timeout=FEED_TIMEOUT)
        assert begun.exists()
        expected = ("column 'f' has 1 null value(s) in a batch of partition 1 (epoch 1)" if fault == "null"
                    else "pushing epoch 1 (train, 2 of 3) failed: PythonException: ValueError: no price for id 600")
        assert expected in str(info.value), info.value
        report = cluster.train(fixed, 2, feed_timeout=FEED_TIMEOUT)
        assert report.rows == 1600 and report.epochs == [3, 4], report
        # a worker's 400 rows an epoch are 13 batches (the last of 16 rows), each of which
        # Keras under MWMS cuts in two: 26 steps. The cut epoch plus epoch 3 make a longer
        # pass, which fit ends at 26 steps (the rest of epoch 3 refused); epoch 4 is whole.
        # Before: [26, k] with k < 26, and main returned
        assert wait_json(tmp_path / "steps0.json", RETURNS_WITHIN) == [26, 26, 26]
        assert wait_json(tmp_path / "steps1.json", RETURNS_WITHIN) == [26, 26, 26]
        assert set(report.rows_unconsumed) <= {0, 1} and report.dropped_for_balance == 0, report
        assert not any("returned from main" in m for m in report.messages), report.messages
        assert not any(m.get("overran_cut") for m in cluster.metrics().values())
    finally:
        _stop(cluster, pids)


def test_a_keras_fit_begun_on_a_call_that_delivered_nothing_trains_on_the_next(spark, tmp_path):
    """Every row of the first call's DataFrame fails (a UDF that cannot work): fit's first
    pass had begun and yielded nothing. That epoch is taken back too, the pass goes on with
    the next call's first epoch, and fit trains its 2 epochs whole (before: its first epoch
    ended empty and fit stopped, so main returned and the next call had no reader)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    def broken(i):  # type: ignore[no-untyped-def]
        raise KeyError(f"no column for {i}")

    bad = spark.range(0, 400, 1, 2).select(
        F.udf(broken, FloatType())("id").alias("f"), F.col("id").cast("float").alias("g"))
    good = spark.range(0, 320, 1, 2).selectExpr("CAST(id AS FLOAT) AS f", "CAST(id AS FLOAT) AS g")
    cluster = dataplane.run(spark, _keras_fit_main, {"epochs": 2, "dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        with pytest.raises(dataplane.FeedError) as info:
            cluster.train(bad, 3, feed_timeout=FEED_TIMEOUT)
        assert "KeyError: 'no column for 0'" in str(info.value) or "no column for" in str(info.value), info.value
        report = cluster.train(good, 2, feed_timeout=FEED_TIMEOUT)
        assert report.rows == 640 and sum(report.rows_unconsumed.values()) == 0, report
        assert wait_json(tmp_path / "steps0.json", RETURNS_WITHIN) == [10, 10]
    finally:
        _stop(cluster, pids)


def _dense_fit_main(args, ctx):  # type: ignore[no-untyped-def]
    import tf_keras as keras

    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(ctx.dataset(32, features="x", label="y"), epochs=1, verbose=0)


def _declared_shape_main(args, ctx):  # type: ignore[no-untyped-def]
    for _ in ctx.dataset(32, shapes={"x": (4,)}):
        pass


def test_a_row_that_does_not_convert_fails_train_instead_of_a_clean_report(spark):
    """A bad row the node finds only when converting (here: 3 values in a column declared 4
    wide) ends main's pass with an error. The pass used to count as left early, so a one-epoch
    train returned a report saying every row was consumed, and only shutdown raised."""
    from pyspark.sql import functions as F

    df = spark.range(0, 300, 1, 2).select(
        "id", F.when(F.col("id") == 250, F.array(*[F.lit(1.0).cast("float")] * 3))
        .otherwise(F.array(*[F.lit(2.0).cast("float")] * 4)).alias("x"))
    for attempt in range(2):  # the driver may learn of main's failure before or after the pass's
        cluster = dataplane.run(spark, _declared_shape_main, {}, num_nodes=1)
        pids = [n.pid for n in cluster.nodes]
        try:
            with pytest.raises(NodeError) as info:
                report = cluster.train(df, 1, feed_timeout=FEED_TIMEOUT)
                raise AssertionError(f"train returned {report}")
            text = str(info.value)
            assert "column 'x' is fed as dense shape (4,)" in text and "has 3 values" in text, text
        finally:
            try:
                cluster.shutdown(timeout=30)
            except NodeError:
                pass
            wait_gone(pids, 30)


def _pull_dense_fit_main(args, ctx):  # type: ignore[no-untyped-def]
    import tf_keras as keras

    import feeders

    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    ds = feeders.parquet_dataset(args["path"], batch_size=32, label="y", shard=ctx)
    model.fit(ds.map(lambda f, y: (f["x"], y)), epochs=1, verbose=0)


def test_an_undeclared_list_column_read_by_a_pull_reader_is_told_its_shapes_fix(spark, tmp_path):
    """Files with a 4-value array column, every row alike, read without shapes=: the reader
    yields the column ragged (it cannot know the arrays' length from the schema) and a Dense
    layer fails in Keras' words; the node's error says to declare the shape."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    pq.write_table(pa.table({"x": list(x), "y": x.sum(axis=1)}), str(tmp_path / "part-0.parquet"))
    cluster = dataplane.run(spark, _pull_dense_fit_main, {"path": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        with pytest.raises(NodeError) as info:
            cluster.shutdown(timeout=60)
        text = str(info.value)
        assert "Dense layer only supports RaggedTensors" in text, text  # Keras' own words first
        assert "A list column reached the model as a tf.RaggedTensor" in text, text
        assert "shapes={'image': (784,)}, on the reader or on ctx.dataset" in text, text
        assert "The data may be why" not in text, text  # the driver pushed nothing
    finally:
        wait_gone(pids, 30)


def _text_label_fit_main(args, ctx):  # type: ignore[no-untyped-def]
    import keras

    ds = ctx.dataset(64, features="x", label="animal")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(ds, epochs=1, verbose=0)


def test_a_text_label_into_a_keras_loss_is_named_with_the_fix(spark):
    """Labels left as text ('cat', 'dog'), as a DataFrame often has them: the train call's
    NodeError said only "UnimplementedError: Graph execution error:", since TensorFlow puts
    the stack of where its op was made before the message."""
    df = spark.range(0, 400, 1, 2).selectExpr("cast(id as float) as x", "IF(id % 2 = 0, 'cat', 'dog') as animal")
    cluster = dataplane.run(spark, _text_label_fit_main, None, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        with pytest.raises(NodeError) as info:
            cluster.train(df)
        text = str(info.value)
        assert "UnimplementedError: Graph execution error:\nCast string to float is not supported\n" in text, text
        assert "Make it numbers on the DataFrame first (pyspark.ml.feature.StringIndexer" in text, text
    finally:
        try:
            cluster.shutdown(timeout=30)
        except NodeError:
            pass
        wait_gone(pids, 30)


def test_a_bad_row_making_an_array_column_ragged_is_named_when_the_model_fails(spark):
    """One row of 3 values in a column of 4-value arrays (a bad record): the column arrives
    ragged and Keras' Dense fails on it in its own words; the error adds which column, its
    lengths, and how to find the rows."""
    from pyspark.sql import functions as F

    df = spark.range(0, 200, 1, 2).select(
        F.when(F.col("id") == 117, F.array(*[F.lit(1.0).cast("float")] * 3))
        .otherwise(F.array(*[(F.col("id") + i).cast("float") for i in range(4)])).alias("x"),
        F.col("id").cast("float").alias("y"))
    cluster = dataplane.run(spark, _dense_fit_main, {}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        with pytest.raises(NodeError) as info:
            cluster.train(df, 1, feed_timeout=FEED_TIMEOUT)
            cluster.shutdown(timeout=30)  # main may fail once train has returned
        text = str(info.value)
        assert "Dense" in text, text  # Keras' own message comes first
        assert "The data may be why: column 'x' holds arrays of 3 to 4 values" in text, text
        assert "df.where(F.size('x') != 4)" in text, text
    finally:
        try:
            cluster.shutdown(timeout=30)  # a no-op when it raised above
        except NodeError:
            pass
        wait_gone(pids, 30)


def _dataset_per_pass_main(args, ctx):  # type: ignore[no-untyped-def]
    """A loop that builds a new ctx.dataset() for every pass, reading until the feed ends, then
    saves: the code after the loop must run."""
    seen = []
    while not ctx.should_stop:
        ids = [int(i) for b in ctx.dataset(50) for i in b["id"].numpy()]
        if not ids:
            break
        seen.append(sorted(ids))
    _write(os.path.join(args["dir"], f"saved{ctx.node_id}.json"), seen)


def test_a_dataset_built_for_a_pass_after_the_last_epoch_ends_empty_and_main_goes_on(spark, tmp_path):
    """The pass after the last pushed epoch waits until shutdown. Built with a new
    ctx.dataset() (not a second iteration of the same one), it used to raise FeedStopped ('shut
    down before any data was pushed', after 2 epochs), which stopped main before its save
    without a word, as a shutdown stop is not a failure."""
    df = spark.range(0, 120, 1, 2)
    cluster = dataplane.run(spark, _dataset_per_pass_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        report = cluster.train(df, 2, feed_timeout=FEED_TIMEOUT)
        assert report.rows == 240 and report.spark_jobs == 2
        cluster.shutdown(timeout=30)
        assert json.loads((tmp_path / "saved0.json").read_text()) == [list(range(120))] * 2
    finally:
        wait_gone(pids, 30)


def _evaluates_every_few_steps_main(args, ctx):  # type: ignore[no-untyped-def]
    """A custom loop that looks at two validation batches every 5 training steps: first the
    way that works (one validation pass per training epoch, next() on its iterator), then the
    way users first write it (val_ds.take(2) each time: a new pass, so a pushed epoch each)."""
    train_ds = ctx.dataset(10, split="train")
    val_ds = ctx.dataset(10, split="validation")
    for mode in ("one pass per epoch", "take"):
        seen = []
        for _ in range(2):
            ids, val_ids = [], []
            val_it = iter(val_ds) if mode == "one pass per epoch" else None
            for step, batch in enumerate(train_ds):
                ids += _ids(batch)
                if step % 5:
                    continue
                for _ in range(2):
                    vb = next(val_it, None) if val_it is not None else None
                    if vb is not None:
                        val_ids += _ids(vb)
                if val_it is None:
                    val_ids += [i for vb in val_ds.take(2) for i in _ids(vb)]
            seen.append([ids, val_ids])
        _write(os.path.join(args["dir"], f"{mode}.json"), seen)


def test_evaluating_every_few_steps_reads_one_validation_pass_per_epoch(spark, tmp_path, capsys):
    """val_ds.take(2) inside the training loop starts a pass, so reads a pushed epoch, each
    time: the third waits for a later train() call, which cannot come while the training
    pass it interrupted stands open. That wedged train() until feed_timeout with a message
    about reading fewer epochs; the node now warns within seconds, and train() names the
    waiting pass and the fix (one pass per epoch: next() on its iterator), shown working."""
    df = spark.range(0, 600, 1, 3)
    dv = spark.range(10_000, 10_200, 1, 2)
    cluster = dataplane.run(spark, _evaluates_every_few_steps_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        report = cluster.train(df, 2, validation=dv, feed_timeout=FEED_TIMEOUT)
        assert report.epochs == [0, 1, 2, 3] and report.rows == 1_600
        assert report.rows_unconsumed == {} and report.dropped_for_balance == 0
        seen = wait_json(tmp_path / "one pass per epoch.json")
        # 60 steps, 12 looks of 2 batches: each epoch's 20 validation batches, read whole
        for ids, val_ids in seen:
            assert sorted(ids) == list(range(600)) and sorted(val_ids) == list(range(10_000, 10_200))
        t0 = time.monotonic()
        with pytest.raises(dataplane.FeedError) as err:
            cluster.train(df, 2, validation=dv, feed_timeout=10)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        msg = str(err.value)
        assert "epoch 4 (train, 1 of 2) was pushed, but node(s) [0] stopped reading it" in msg, msg
        assert ("Node(s) [0]'s main waits in a pass over ctx.dataset(split='validation') past the "
                "2 validation epoch(s) this call pushes, while its pass over epoch 4 (train, 1 of "
                "2) stands open") in msg, msg
        assert "val_it = iter(val_ds) when the epoch begins, next(val_it) each time" in msg, msg
        cluster.shutdown(timeout=30)
        err_text = capsys.readouterr().err
        line = next((ln for ln in err_text.splitlines() if "has waited" in ln), err_text[-3000:])
        assert line.startswith("[node 0 chief]") and "WARNING feeders.buffer" in line, line
        # (the node counts the validation epochs of both calls)
        assert "all 4 pushed so far were read by earlier passes, while the pass over epoch 4 (train) stands open" in line, line
    finally:
        wait_gone(pids, 30)


def _reads_once_then_saves_main(args, ctx):  # type: ignore[no-untyped-def]
    _write(os.path.join(args["dir"], "started.json"), True)
    for _ in ctx.dataset(10):
        pass
    _write(os.path.join(args["dir"], "saved.json"), True)


def test_a_shutdown_that_stops_main_waiting_for_its_first_data_says_so(spark, tmp_path, capsys):
    """No train() call: the shutdown stops main inside ctx.dataset(). Not a failure, but the
    code after it (the save) did not run, and the node's log now says where main stopped."""
    cluster = dataplane.run(spark, _reads_once_then_saves_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        wait_json(tmp_path / "started.json")
        time.sleep(1)  # main waits in ctx.dataset()
        cluster.shutdown(timeout=30)
        assert not (tmp_path / "saved.json").exists()
        err = capsys.readouterr().err
        line = next((ln for ln in err.splitlines() if "the shutdown stopped main" in ln), err[-3000:])
        assert line.startswith("[node 0 chief]"), line
        assert "where it waited for data (" + __file__ in line, line
        assert "the cluster shut down before any 'train' data was pushed); the rest of main did not run." in line, line
    finally:
        wait_gone(pids, 30)


def _pull_collective_loop_main(args, ctx):  # type: ignore[no-untyped-def]
    """A custom MWMS loop over the pull dataset itself (no experimental_distribute_dataset):
    an all-reduce per batch, so every worker must take as many batches as the others."""
    import tensorflow as tf

    import feeders

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    read = feeders.parquet_dataset if args["format"] == "parquet" else feeders.tfrecord_dataset
    ds = read(args["path"], batch_size=32, shard=ctx)

    @tf.function
    def rows_everywhere(ids):  # type: ignore[no-untyped-def]
        return strategy.run(lambda i: tf.distribute.get_replica_context().all_reduce(
            "sum", tf.size(i)), args=(ids,))

    epochs = []
    for _ in range(2):
        ids, total = [], 0
        for batch in ds:
            total += int(strategy.experimental_local_results(rows_everywhere(batch["id"]))[0])
            ids += batch["id"].numpy().tolist()
        epochs.append({"ids": ids, "total": total})
    _write(os.path.join(args["dir"], f"{ctx.role}{ctx.index}.json"), epochs)


def test_pull_shards_of_uneven_files_under_a_collective_loop(spark, tmp_path):
    """Parquet files of 1000, 10 and 517 rows read with shard=ctx by 2 MWMS workers whose
    loop runs an all-reduce per batch of the dataset itself. Every other file gave 1517 and 10
    rows, and the loop hung once the small shard ran out of batches; shards now split the rows
    (763 / 764: 24 batches of 32 each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    table = pa.table({"id": np.arange(1527, dtype=np.int64), "x": np.arange(1527, dtype=np.float32)})
    for k, (a, b) in enumerate([(0, 1000), (1000, 1010), (1010, 1527)]):
        pq.write_table(table.slice(a, b - a), str(data / f"part-{k}.parquet"))
    cluster = dataplane.run(spark, _pull_collective_loop_main,
                            {"path": str(data), "format": "parquet", "dir": str(tmp_path)}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        deadline = time.monotonic() + 120  # a hang fails here (shutdown would wait for it)
        while any(m.get("main") == "running" for m in cluster.metrics().values()):
            assert time.monotonic() < deadline, "the collective loop hung: the shards' batch counts differ"
            time.sleep(0.5)
    finally:
        cluster.shutdown(timeout=30, drain=False)  # (a hung main is ended, not waited for)
        wait_gone(pids, 30)
    seen = [wait_json(tmp_path / f"{name}.json") for name in ("chief0", "worker0")]
    for e in range(2):
        assert [s[e]["ids"] for s in seen] == [list(range(763)), list(range(763, 1527))]
        assert [s[e]["total"] for s in seen] == [1527, 1527]  # the all-reduce saw every row


def _lists_while_files_arrive_main(args, ctx):  # type: ignore[no-untyped-def]
    """The chief plans its shard; a writer adds a file; then the worker plans its own."""
    import feeders

    flag = os.path.join(args["dir"], "chief-planned.json")
    if ctx.worker_index == 1:
        from pathlib import Path

        wait_json(Path(flag))
    ds = feeders.parquet_dataset(args["path"], batch_size=64, shard=ctx)
    if ctx.worker_index == 0:
        import pyarrow.parquet as pq

        pq.write_table(pa_table(1000, 1500), os.path.join(args["path"], "part-9.parquet"))
        _write(flag, True)
    _write(os.path.join(args["dir"], f"ids{ctx.worker_index}.json"),
           [int(i) for b in ds for i in b["id"].numpy()])


def pa_table(lo: int, hi: int):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    return pa.table({"id": np.arange(lo, hi, dtype=np.int64), "x": np.arange(lo, hi, dtype=np.float32)})


def test_pull_shards_agree_on_one_listing_when_a_file_arrives_between_the_nodes(spark, tmp_path, capsys):
    """Each node listed the path itself: a file written between the chief's listing and the
    worker's made them cut rows from different totals (1000 vs 1500), and rows 500-749 were
    read by neither, without a word. The driver now settles one listing for every node."""
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        pq.write_table(pa_table(500 * k, 500 * (k + 1)), str(data / f"part-{k}.parquet"))
    cluster = dataplane.run(spark, _lists_while_files_arrive_main,
                            {"path": str(data), "dir": str(tmp_path)}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        cluster.shutdown(timeout=120)
    finally:
        wait_gone(pids, 30)
    ids = [wait_json(tmp_path / f"ids{i}.json") for i in range(2)]
    assert ids == [list(range(500)), list(range(500, 1000))]  # the chief's listing: no row lost
    err = capsys.readouterr().err
    line = next((ln for ln in err.splitlines() if "the first to plan this dataset" in ln), err[-3000:])
    assert line.startswith("[node 1 worker]"), line
    assert "this node listed 3 file(s) (1500 rows), node 0, the first to plan this dataset, 2 (1000 rows)" in line, line
    assert "part-9.parquet) are not read by this dataset; build it again to read them." in line, line


def _looks_at_a_batch_then_fits_main(args, ctx):  # type: ignore[no-untyped-def]
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    seen: list[int] = []

    def record(ids, x):  # type: ignore[no-untyped-def]
        seen.extend(int(i) for i in ids.numpy())
        return x

    def to_xy(f, y):  # type: ignore[no-untyped-def]
        x = tf.py_function(record, [f["id"], f["x"]], tf.float32)
        x.set_shape(f["x"].shape)
        return x, y

    ds = ctx.dataset(64, features=["id", "x"], label="label")
    x0, _ = next(iter(ds))  # size the model from a batch, as many programs do
    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((x0["x"].shape[1],)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fits = []
    for epochs in (3, 2):  # one fit per train() call
        seen.clear()
        hist = model.fit(ds.map(to_xy), epochs=epochs, verbose=0)
        fits.append({"loss": hist.history["loss"], "ids": sorted(seen)})
        _write(os.path.join(args["dir"], f"node{ctx.node_id}.json"), fits)


def test_a_look_at_a_batch_before_fit_takes_an_epoch_and_the_report_says_so(spark, tmp_path):
    """``x, y = next(iter(ds))`` to size the model is a pass: it takes the first pushed epoch
    (the rest refused at once), so ``fit(epochs=3)`` over ``train(df, 3)`` trains on two and
    its third epoch waits for the next call. The report used to say only "ended their pass
    early"; it now names the look and the fix (``ds.element_spec``), once. Two MWMS workers,
    ids exact over both calls."""
    rows = 3_000
    df = _frame(spark, 0, rows, 3, width=2)
    cluster = dataplane.run(spark, _looks_at_a_batch_then_fits_main, {"dir": str(tmp_path)}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        before = _rows_out(cluster)
        report = cluster.train(df, 3, FEED_TIMEOUT)
        handed = _balanced(cluster, report, before)
        first = epoch_name(report, 0)
        glance = [m for m in report.messages if "next(iter(ds))" in m]
        assert len(glance) == 1 and glance[0].startswith(
            f"{first}: node(s) {sorted(workers)} ended their pass early after reading "), report.messages
        assert ("it took this epoch, so a fit(epochs=3) after it trains on one pushed epoch fewer"
                in glance[0] and "ds.element_spec" in glance[0]), glance
        assert handed + sum(report.rows_unconsumed.values()) == rows * 3
        assert sum(report.rows_unconsumed.values()) > rows // 2  # most of the first epoch
        # the second call: the first fit's third epoch, then fit(epochs=2): every row read,
        # no note (a fit reading every epoch it was pushed)
        before = _rows_out(cluster)
        report2 = cluster.train(df, 3, FEED_TIMEOUT)
        assert _balanced(cluster, report2, before) == rows * 3 - report2.dropped_for_balance
        assert report2.rows_unconsumed == {} and report2.messages == [], report2.messages
        fits = {n: wait_json(tmp_path / f"node{n}.json") for n in workers}
        while any(len(f) < 2 for f in fits.values()):
            time.sleep(0.2)
            fits = {n: wait_json(tmp_path / f"node{n}.json") for n in workers}
        for n in workers:
            first_fit, second_fit = fits[n]
            assert len(first_fit["loss"]) == 3 and len(second_fit["loss"]) == 2
            assert all(np.isfinite(first_fit["loss"] + second_fit["loss"]))
        # the first fit read epochs 1 and 2 of call 1 and epoch 0 of call 2: each row 3 times
        # over the workers (less the few dropped for balance); the second fit twice
        for k, times in ((0, 3), (1, 2)):
            ids = [i for n in workers for i in fits[n][k]["ids"]]
            counts = np.bincount(ids, minlength=rows)
            assert counts.max() == times and (counts < times).sum() <= times * len(workers), (k, counts.min())
    finally:
        _stop(cluster, pids)


def _short_stream_fit_then_more_work_main(args, ctx):  # type: ignore[no-untyped-def]
    import keras  # Keras 3, one node

    ds = ctx.dataset(32, features="x", label="label", repeat=True)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(ds, epochs=2, steps_per_epoch=5, verbose=0)  # 320 rows of 3 x 1,200
    _write(os.path.join(args["dir"], "fitted.json"), len(hist.history["loss"]))
    deadline = time.monotonic() + 60  # main goes on (saving, evaluating elsewhere) until told
    while not os.path.exists(os.path.join(args["dir"], "done")) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_short_stream_fit_followed_by_more_work_says_why_epochs_went_unread(spark, tmp_path):
    """``fit(repeat=True stream, steps_per_epoch=5, epochs=2)`` takes 320 of the call's 3,600
    rows, then main works on. Dropping the stream closes the two epochs it never reached, so
    train() returns; their note said only "ended their pass early" (a pass that never began)
    unless main had returned first, when it named the cause. Now it names the cause either way,
    and is not taken for a look at a batch (a stream's epoch, not a pass of its own)."""
    rows = 1_200
    cluster = dataplane.run(spark, _short_stream_fit_then_more_work_main, {"dir": str(tmp_path)}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        before = _rows_out(cluster)
        t0 = time.monotonic()
        report = cluster.train(_frame(spark, 0, rows, 3), 3, FEED_TIMEOUT)
        assert time.monotonic() - t0 < RETURNS_WITHIN
        assert wait_json(tmp_path / "fitted.json") == 2
        handed = _balanced(cluster, report, before)
        assert 320 <= handed < rows and report.rows_unconsumed == {0: 3 * rows - handed}, report
        names = [epoch_name(report, i) for i in range(3)]
        assert report.messages[0] == (f"{names[0]}: node(s) [0] ended their pass early; the remaining "
                                      f"{rows - handed} row(s) were not sent to them."), report.messages
        first, second = report.messages[1:]
        assert first.startswith(f"{names[1]}: node(s) [0] never read it; its {rows} row(s) were refused. "
                                f"Their main read fewer passes than train(num_epochs=...) pushed: "), first
        assert "fit(steps_per_epoch=k, epochs=E) on a repeat=True stream whose E x k steps take fewer rows" in first
        assert second == (f"{names[2]}: node(s) [0] never read it; its {rows} row(s) were refused: their main "
                          f"read fewer passes than train(num_epochs=...) pushed (the note on {names[1]} says why).")
        (tmp_path / "done").write_text("")
    finally:
        _stop(cluster, pids)
