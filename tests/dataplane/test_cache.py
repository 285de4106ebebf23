"""Push once, train many epochs: the node epoch cache, shuffling and the validation split, on
real Spark, Flight and TensorFlow with two MultiWorkerMirroredStrategy workers."""

from __future__ import annotations

import glob
import os
import time

import pytest

import dataplane
from dataplane.errors import NodeError
from tests.dataplane.clusterutil import node_workdirs, wait_gone, wait_json
from tests.dataplane.loop_mains import cache_main

pytestmark = pytest.mark.cluster

ROWS, VAL_ROWS, WIDTH = 3000, 500, 16
CACHE_BYTES = 64 * 1024  # each worker's share is ~110 KB: most of it spills to disk


def _frame(spark, start: int, rows: int, parts: int):  # type: ignore[no-untyped-def]
    x = ", ".join(f"cast(id * {k} as float)" for k in range(1, WIDTH + 1))
    return spark.range(start, start + rows, 1, parts).selectExpr(
        "id", f"array({x}) as x", "cast(id % 2 as int) as label"
    )


def _spill_files(cluster) -> list[str]:  # type: ignore[no-untyped-def]
    return [f for d in node_workdirs(cluster.cluster_id) for f in glob.glob(os.path.join(d, "cache", "*.arrow"))]


def test_ctrl_c_during_a_cached_call_s_replays_takes_back_the_epochs_not_begun(spark, tmp_path):
    """train(df, 4, cache=True) interrupted while main reads the first replay: the replays
    not begun are taken back like a pushed call's epochs (they had their limits already, so
    main went on to train on all of them), and the next call's epoch is main's next pass."""
    import _thread
    import threading

    scenarios = [{"epochs": 3, "batch_size": 16, "sleep": 0.05}]
    cluster = dataplane.run(spark, cache_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        df = _frame(spark, 0, ROWS, 3)

        def ctrl_c_in_the_first_replay() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if all(m["epochs_consumed"] >= 1 for m in cluster.metrics().values()):
                    break
                time.sleep(0.05)
            _thread.interrupt_main()

        threading.Thread(target=ctrl_c_in_the_first_replay, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            cluster.train(df, 4, cache=True, feed_timeout=120)
        report = cluster.train(df, 1, cache=True, feed_timeout=120)
        # main's third pass is this call's epoch (it read the cancelled third epoch before)
        assert report.spark_jobs == 0 and report.rows == ROWS, report
        assert report.rows_unconsumed == {} and report.dropped_for_balance == 0, report
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)
    seen = [wait_json(tmp_path / f"node{n}-s0.json", 10)["train"] for n in range(2)]
    for p in range(3):  # each pass whole: every row once across the workers
        assert sorted(seen[0][p] + seen[1][p]) == list(range(ROWS)), (p, [[len(x) for x in s] for s in seen])


def test_cached_shuffled_epochs_with_validation_on_two_workers(spark, tmp_path):
    scenarios = [
        {"epochs": 3, "batch_size": 32, "validation": True},  # first call: records, replays
        {"epochs": 2, "batch_size": 32, "validation": True},  # same DataFrames: no Spark job
        {"epochs": 2, "batch_size": 32, "validation": True, "keras": True, "width": WIDTH},
    ]
    cluster = dataplane.run(spark, cache_main, {"dir": str(tmp_path), "scenarios": scenarios},
                            num_nodes=2, cache_bytes=CACHE_BYTES)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    try:
        df = _frame(spark, 0, ROWS, 3)
        val = _frame(spark, 100_000, VAL_ROWS, 2)
        report = cluster.train(df, 3, cache=True, shuffle=True, seed=7, validation=val)
        assert report.spark_jobs == 2  # one per DataFrame, not one per epoch
        assert report.rows_per_split == {"train": 3 * ROWS, "validation": 3 * VAL_ROWS}
        assert report.rows == 3 * (ROWS + VAL_ROWS)
        seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
        m = cluster.metrics()
        for n in workers:
            assert m[n]["cache_spilled_bytes"] > 0, m[n]  # a bound smaller than the share
            assert m[n]["cache_memory_bytes"] <= CACHE_BYTES, m[n]
        assert _spill_files(cluster), "spill files are in the nodes' work directories"
        train_sets = _check_epochs(seen, workers, "train", range(ROWS), 3, report)
        _check_epochs(seen, workers, "validation", range(100_000, 100_000 + VAL_ROWS), 3, report)
        # shuffled: every epoch a different order on every worker
        for n in workers:
            orders = [tuple(e) for e in seen[n]["train"]]
            assert len(set(orders)) == 3, f"node {n} yielded the same order twice"

        # the same DataFrames again: replayed from the caches, no Spark job at all
        report2 = cluster.train(df, 2, cache=True, shuffle=True, seed=7, validation=val)
        assert report2.spark_jobs == 0
        seen2 = {n: wait_json(tmp_path / f"node{n}-s1.json") for n in workers}
        again = _check_epochs(seen2, workers, "train", range(ROWS), 2, report2)
        assert again == train_sets  # each worker holds the same share as before

        # Keras fit(validation_data=...) under MWMS on the cached splits
        report3 = cluster.train(df, 2, cache=True, validation=val)
        assert report3.spark_jobs == 0
        s3 = {n: wait_json(tmp_path / f"node{n}-s2.json") for n in workers}
        for n in workers:
            assert len(s3[n]["val_loss"]) == 2 and all(v == v for v in s3[n]["val_loss"])
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)
    assert _spill_files(cluster) == [], "spill files outlived the cluster"


def _check_epochs(seen, workers, split, ids, epochs, report):  # type: ignore[no-untyped-def]
    """Exactly once per epoch (less what was dropped for balance), equal counts on every
    worker; returns each worker's set of ids (the same every epoch: its cached share)."""
    want = set(ids)
    shares = None
    for e in range(epochs):
        per_node = [seen[n][split][e] for n in workers]
        assert len({len(p) for p in per_node}) == 1, f"{split} epoch {e}: unequal counts"
        union = [i for p in per_node for i in p]
        assert len(union) == len(set(union)), f"{split} epoch {e}: a row twice"
        assert set(union) <= want
        assert len(want) - len(union) <= 3, (split, e, len(union))  # dropped for balance
        sets = [frozenset(p) for p in per_node]
        if shares is None:
            shares = sets
        else:
            assert sets == shares, f"{split} epoch {e}: a worker's share changed"
    return shares


def test_a_node_killed_during_a_cached_replay_fails_train_quickly(spark, tmp_path):
    import signal

    scenarios = [{"epochs": 4, "batch_size": 16, "sleep": 0.02}]
    cluster = dataplane.run(spark, cache_main, {"dir": str(tmp_path), "scenarios": scenarios},
                            num_nodes=2)
    victim = cluster.nodes[1]
    pids = [n.pid for n in cluster.nodes]
    try:
        df = _frame(spark, 0, ROWS, 2)
        import threading

        out: dict = {}

        def run() -> None:
            t0 = time.monotonic()
            try:
                cluster.train(df, 4, cache=True, feed_timeout=300)
                out["ok"] = True
            except BaseException as e:  # noqa: BLE001
                out["error"] = e
            out["at"] = time.monotonic()
            out["t0"] = t0

        t = threading.Thread(target=run, daemon=True)
        t.start()
        # wait until the replay has started: epoch 0 was pushed and consumed, epoch 1 replays
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = cluster.metrics()
            if m[victim.node_id]["epochs_consumed"] >= 1 and m[victim.node_id]["rows_out"] > 0:
                break
            time.sleep(0.2)
        workdirs = node_workdirs(cluster.cluster_id, str(victim.node_id))
        assert len(workdirs) == 1 and os.path.exists(os.path.join(workdirs[0], "config.json")), workdirs
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(60)
        assert not t.is_alive(), "train hung after a node died during a replay"
        assert isinstance(out.get("error"), NodeError), out
        assert out["at"] - killed < 20, out["at"] - killed
        assert f"node {victim.node_id}" in str(out["error"])
    finally:
        with pytest.raises(NodeError):
            cluster.shutdown(timeout=20)
        wait_gone(pids, 30)
    # a node killed outright cannot clean up: its reaper removes the work directory (the
    # cluster's secret in config.json, the cache) once it is gone
    deadline = time.monotonic() + 10
    while os.path.exists(workdirs[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(workdirs[0]), os.listdir(workdirs[0])


def test_the_same_seed_replays_the_same_orders_whatever_order_partitions_arrived_in(spark, tmp_path):
    # a replay permuted the batches in the order Spark's tasks delivered them, so two runs with
    # the same seed over a DataFrame of several partitions gave different orders
    df = _frame(spark, 0, 1200, 6)
    orders = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        out.mkdir()
        scenarios = [{"epochs": 3, "batch_size": 32, "validation": False}]
        with dataplane.run(spark, cache_main, {"dir": str(out), "scenarios": scenarios}, num_nodes=1) as cluster:
            cluster.train(df, 3, cache=True, shuffle=True, seed=11)
            orders.append(wait_json(out / "node0-s0.json")["train"])
    for e in range(3):
        assert sorted(orders[0][e]) == sorted(orders[1][e]) == list(range(1200)), e
    assert orders[0][1:] == orders[1][1:]  # the replayed epochs: the seed decides
    assert orders[0][1] != orders[0][2]  # and each epoch has its own order


def test_ctrl_c_while_recording_then_the_same_call_again_records_anew(spark, tmp_path):
    """A notebook user presses Ctrl-C while a cached call records its first epoch, then runs
    the cell again. The cache holds only the rows that arrived, so the next call with the
    same DataFrame must record it again (before: it replayed the partial cache, every epoch
    short, silently); the interrupted call's later epochs, which no pass had begun, are
    taken back, so main's next passes read the next call's epochs, whole."""
    import _thread
    import threading

    from pyspark.sql import functions as F

    go = tmp_path / "go"
    gate = str(go)

    @F.udf("int")
    def gated_label(i):  # type: ignore[no-untyped-def]
        # the last partition's rows wait until Ctrl-C has landed, so it always lands inside
        # the push (a fixed slow-down let a busy machine deliver it after the push had ended)
        if i >= ROWS * 3 // 4:
            deadline = time.time() + 60
            while not os.path.exists(gate) and time.time() < deadline:
                time.sleep(0.01)
        return i % 2

    scenarios = [{"epochs": 3, "batch_size": 16}]
    cluster = dataplane.run(spark, cache_main, {"dir": str(tmp_path), "scenarios": scenarios},
                            num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        df = _frame(spark, 0, ROWS, 4).withColumn("label", gated_label("id"))

        def ctrl_c_once_rows_arrive() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if all(m["rows_in"] > 0 for m in cluster.metrics().values()):
                    break
                time.sleep(0.05)
            _thread.interrupt_main()

        threading.Thread(target=ctrl_c_once_rows_arrive, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cluster.train(df, 3, cache=True, feed_timeout=120)
        go.touch()
        assert time.monotonic() - t0 < 60
        report = cluster.train(df, 2, cache=True, feed_timeout=120)
        assert report.spark_jobs == 1 and report.rows == 2 * ROWS, report
        assert sum(report.rows_unconsumed.values()) == 0 and report.dropped_for_balance == 0, report
    finally:
        go.touch()
        cluster.shutdown(timeout=30)  # main's third pass ends here if the cut epoch went too
        wait_gone(pids, 30)
    seen = [wait_json(tmp_path / f"node{n}-s0.json", 10)["train"] for n in range(2)]
    sizes = [[len(p) for p in s] for s in seen]
    assert [len(s) for s in seen] == [3, 3], sizes
    if sizes[0][2] == 0:  # Ctrl-C came before a pass yielded a row: epoch 0 was taken back too
        full = (0, 1)
        assert sizes[1][2] == 0, sizes
    else:  # the interrupted epoch: what had arrived, the same number of rows on both workers
        full = (1, 2)
        assert sizes[0][0] == sizes[1][0] < ROWS // 2, sizes
    for p in full:  # the next call's epochs, every row once across the workers
        assert sorted(seen[0][p] + seen[1][p]) == list(range(ROWS)), (p, sizes)


def test_train_calls_from_two_threads_take_turns(spark, tmp_path, caplog):
    """Two threads call train(cache=True) on one cluster at once. Both calls used to push at
    the same time, each node's pass waited on the other call's epochs, and both failed after
    feed_timeout. Now the second waits for the first (saying so), each call's epochs arrive
    whole and one call after the other; a shutdown while a call waits ends that call at once."""
    import threading

    from dataplane.errors import ClusterStateError

    scenarios = [{"epochs": 4, "batch_size": 64}, {"epochs": 1, "batch_size": 16, "sleep": 0.2}]
    cluster = dataplane.run(spark, cache_main, {"dir": str(tmp_path), "scenarios": scenarios}, num_nodes=2)
    workers = [n.node_id for n in cluster.nodes]
    pids = [n.pid for n in cluster.nodes]
    results: dict = {}

    def call(name: str, df, epochs: int) -> None:  # type: ignore[no-untyped-def]
        try:
            results[name] = cluster.train(df, epochs, cache=True, shuffle=True, seed=1, feed_timeout=60)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            results[name] = e
        results[name + "_at"] = time.monotonic()

    def waiting() -> int:
        return sum("this one waits for it to return" in r.getMessage() for r in caplog.records)

    try:
        frames = {"a": _frame(spark, 0, ROWS, 3), "b": _frame(spark, 100_000, ROWS, 3)}
        with caplog.at_level("WARNING", logger="dataplane.driver.feed"):
            threads = [threading.Thread(target=call, args=(k, df, 2)) for k, df in frames.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), results
        reports = {k: results[k] for k in frames}
        assert all(isinstance(r, dataplane.FeedReport) for r in reports.values()), reports
        assert waiting() == 1, caplog.text
        first, second = sorted(frames, key=lambda k: reports[k].epochs[0])
        assert [reports[first].epochs, reports[second].epochs] == [[0, 1], [2, 3]], reports
        seen = {n: wait_json(tmp_path / f"node{n}-s0.json") for n in workers}
        for k, passes in ((first, slice(0, 2)), (second, slice(2, 4))):
            r = reports[k]
            assert (r.rows, r.spark_jobs, r.rows_unconsumed) == (2 * ROWS, 1, {}), r
            mine = {n: {"train": seen[n]["train"][passes]} for n in workers}
            start = 0 if k == "a" else 100_000
            _check_epochs(mine, workers, "train", range(start, start + ROWS), 2, r)
            assert sum(len(p) for n in workers for p in mine[n]["train"]) == 2 * ROWS - r.dropped_for_balance

        # a call waiting for its turn when the cluster shuts down: it ends at once, nothing pushed
        small = _frame(spark, 0, 600, 2)  # main's last pass: 19 slow batches a worker, about 4 s
        def rows_in() -> int:
            return sum(m["rows_in"] for m in cluster.metrics().values())

        with caplog.at_level("WARNING", logger="dataplane.driver.feed"):
            before = rows_in()
            slow = threading.Thread(target=call, args=("slow", small, 1))
            slow.start()
            deadline = time.monotonic() + 60
            while rows_in() < before + 600 and time.monotonic() < deadline:  # pushed: main reads it
                time.sleep(0.05)
            late = threading.Thread(target=call, args=("late", small, 1))
            late.start()
            while waiting() < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert waiting() == 2, caplog.text
            t0 = time.monotonic()
            cluster.shutdown(timeout=30)  # lets the slow call's pass finish
            late.join(5)
            slow.join(5)
        assert isinstance(results["late"], ClusterStateError), results
        assert str(results["late"]) == (
            "cluster.shutdown() began while this train() call waited for another train() call on "
            "the cluster to return; nothing of it was pushed.")
        assert results["late_at"] - t0 < 2, results
        assert isinstance(results["slow"], dataplane.FeedReport) and results["slow"].rows == 600, results
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)
