"""Failures end quickly with typed errors and leave no processes behind (each bounded by 30 s)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

import dataplane
from dataplane.errors import ClusterStateError, NodeError, ReservationError
from tests.dataplane.clusterutil import node_processes, wait_gone, wait_json
from tests.dataplane.mains import (
    chief_serves_main,
    collective_loop_main,
    describe_main,
    early_main,
    feed_main,
    idle_main,
    passes_main,
    pull_main,
    raise_mid_feed_main,
    slow_reader_main,
    slow_serve_main,
    steady_main,
    wait_stop_main,
)
from tests.dataplane.test_push import make_df

pytestmark = pytest.mark.cluster


def _no_active_jobs(spark, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not spark.sparkContext.statusTracker().getActiveJobsIds():
            return True
        time.sleep(0.2)
    return False


def _kill_midway(cluster, victim, metric: str, work) -> tuple[dict, float]:  # type: ignore[no-untyped-def]
    """Run ``work`` in a thread, SIGKILL ``victim`` once its ``metric`` moves; the outcome has
    ``result`` or ``error`` and ``at`` (when it raised), or ``hung``."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e
            outcome["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if cluster._node_action(victim, "metrics", {})[metric] > 0:
            break
        time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    t.join(60)
    if t.is_alive():
        outcome["hung"] = True
    return outcome, killed_at


def test_more_nodes_than_a_local_master_has_slots_fail_at_once(spark):
    # local[3,3] can never run 4 nodes at once: it waited out reservation_timeout (120 s by
    # default) to say so
    t0 = time.monotonic()
    with pytest.raises(ReservationError) as info:
        dataplane.run(spark, idle_main, num_nodes=4)
    assert time.monotonic() - t0 < 5
    e = info.value
    assert e.missing == [0, 1, 2, 3] and e.registered == []
    msg = str(e)
    assert "num_nodes=4 needs 4 task slots at once" in msg and "master 'local[3,3]' has 3" in msg, msg
    assert ".master('local[4]')" in msg and "lower num_nodes" in msg, msg
    assert _no_active_jobs(spark)


def test_more_nodes_than_a_local_cluster_has_slots_names_its_own_fix(spark, monkeypatch):
    # the fix offered for local-cluster[2,1,1024] was .master('local[3]')
    from dataplane.driver import startup

    monkeypatch.setattr(startup, "_fixed_slots", lambda _: ("local-cluster[2,1,1024]", 2))
    with pytest.raises(ReservationError) as info:
        dataplane.run(spark, idle_main, num_nodes=3)
    msg = str(info.value)
    assert "master 'local-cluster[2,1,1024]' has 2" in msg, msg
    assert ".master('local-cluster[3,1,1024]'): executors times cores each, at least 3" in msg, msg
    assert "local[3]" not in msg, msg


def test_reservation_timeout_names_missing_nodes_and_slots(spark):
    # two of the three slots busy with another job: the nodes wait for slots that stay taken
    def busy(batches):  # type: ignore[no-untyped-def]
        time.sleep(60)
        yield from batches

    def hold() -> None:
        spark.sparkContext.setJobGroup("busy-slots", "holds two slots", interruptOnCancel=True)
        _swallow(spark.range(0, 2, 1, 2).mapInArrow(busy, "id long").collect)

    blocker = threading.Thread(target=hold, daemon=True)
    blocker.start()
    try:
        tracker, deadline = spark.sparkContext.statusTracker(), time.monotonic() + 30
        while time.monotonic() < deadline:  # until both its tasks hold a slot
            stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            if sum(st.numActiveTasks for st in stages if st is not None) >= 2:
                break
            time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(ReservationError) as info:
            dataplane.run(spark, idle_main, num_nodes=2, reservation_timeout=5)
        elapsed = time.monotonic() - t0
    finally:
        spark.sparkContext.cancelJobGroup("busy-slots")
        blocker.join(30)
    e = info.value
    assert e.missing == [0, 1] and e.registered == []
    msg = str(e)
    assert "did not register within 5 s" in msg and "2 free task slots" in msg, msg
    assert "3 task slot(s)" in msg and "lower num_nodes" in msg, msg
    assert elapsed < 30
    assert _no_active_jobs(spark), "the launch job was not cancelled"


def _swallow(call) -> None:  # type: ignore[no-untyped-def]
    try:
        call()
    except Exception:  # noqa: BLE001 - the job is cancelled on purpose
        pass


def test_main_raising_on_one_node_and_shutdown_twice(spark, tmp_path):
    cluster = dataplane.run(spark, describe_main, {"dir": str(tmp_path), "raise_on": 1}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    wait_json(tmp_path / "node1.json")
    t0 = time.monotonic()
    with pytest.raises(NodeError) as info:
        cluster.shutdown(timeout=30)
    assert time.monotonic() - t0 < 30
    e = info.value
    assert e.node.node_id == 1 and e.node.role == "worker"
    assert "ValueError: boom from node 1" in str(e)
    assert "Traceback" in e.remote_traceback and "boom from node 1" in e.remote_traceback
    t1 = time.monotonic()
    assert cluster.shutdown() is None  # second call: nothing left to do
    assert time.monotonic() - t1 < 1
    wait_gone(pids, 10)
    with pytest.raises(dataplane.ClusterStateError, match="cannot train: the cluster is stopped"):
        cluster.train(make_df(spark, 10, 1))
    with pytest.raises(dataplane.ClusterStateError, match="cannot read metrics: the cluster is stopped"):
        cluster.metrics()
    # a with-block around a stopped cluster fails at its start, not call by call inside it
    with pytest.raises(dataplane.ClusterStateError, match="cannot enter a with-block: the cluster is stopped"):
        with cluster:
            pass


def test_node_killed_mid_feed_fails_train_within_30s(spark, tmp_path):
    cluster = dataplane.run(
        spark, feed_main, {"dir": str(tmp_path), "batch_size": 32}, num_nodes=2,
        buffer_bytes=64 * 1024, max_chunk_bytes=16 * 1024, node_timeout=5.0,
    )
    victim = cluster.nodes[1]
    (tmp_path / "slow").write_text("1")  # the feed takes minutes at this pace
    outcome, killed_at = _kill_midway(
        cluster, victim, "rows_in",
        lambda: cluster.train(make_df(spark, 200_000, 2), feed_timeout=600),
    )
    assert "hung" not in outcome, "train() hung after a node died"
    err = outcome.get("error")
    assert isinstance(err, NodeError), outcome
    # on this machine the driver sees the process is gone before its heartbeats lapse
    assert err.node.node_id == victim.node_id and "its process was killed by SIGKILL (signal 9)" in str(err), str(err)
    assert outcome["at"] - killed_at < 30
    with pytest.raises(NodeError):
        cluster.shutdown(timeout=20)
    assert node_processes(cluster.cluster_id) == []
    assert _no_active_jobs(spark), "the feeding job was not cancelled"


def test_a_node_killed_outright_is_named_as_gone_not_as_slow(spark):
    # before its heartbeats lapse, a killed node's first error read "did not answer 'metrics':
    # failed to connect", as if it were busy; on this machine the driver can see it is gone
    cluster = dataplane.run(spark, idle_main, num_nodes=1, node_timeout=60.0)
    victim = cluster.nodes[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_gone([victim.pid], 10)
    t0 = time.monotonic()
    text = cluster.metrics()[victim.node_id]["error"]
    assert time.monotonic() - t0 < 10
    assert f"{victim.describe()}: its process was killed by SIGKILL (signal 9)" in text, text
    assert "out-of-memory killer" in text and "dmesg" in text, text
    t0 = time.monotonic()
    with pytest.raises(NodeError):
        cluster.shutdown(timeout=20)
    # it waited the whole 20 s for the dead node to confirm its exit
    assert time.monotonic() - t0 < 10
    assert node_processes(cluster.cluster_id) == []


def _crash_main(args, ctx):  # type: ignore[no-untyped-def]
    """Die at the first batch without a word: killed (as by the out-of-memory killer) or
    crashing in native code."""
    import ctypes

    for _ in ctx.dataset(16):
        print("first batch read", flush=True)
        if args["how"] == "segfault":
            ctypes.string_at(0)
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how", ["kill", "segfault"])
def test_a_node_on_another_machine_dying_without_a_word_is_named_with_its_signal_at_once(spark, monkeypatch, how):
    # The driver saw a dead node at once only on its own machine (its pid gone); on another
    # machine it waited node_timeout (60 s here) for the heartbeats to lapse, and then could
    # only guess the cause. The node's reaper now tells the driver how it ended.
    import dataplane.driver.cluster as driver_cluster

    monkeypatch.setattr(driver_cluster, "_gone_here", lambda registration: False)  # as on another machine
    cluster = dataplane.run(spark, _crash_main, {"how": how}, num_nodes=1, node_timeout=60.0)
    pids = [n.pid for n in cluster.nodes]
    try:
        t0 = time.monotonic()
        with pytest.raises(NodeError) as info:
            cluster.train(make_df(spark, 2000, 2), num_epochs=1, feed_timeout=120)
        assert time.monotonic() - t0 < 20
        text = str(info.value)
        assert info.value.node.node_id == 0, text
        if how == "kill":
            assert "node 0 (chief 0 on 127.0.0.1, pid" in text and "): its process was killed by SIGKILL (signal 9)" in text, text
            assert "out-of-memory killer" in text and "\nIts last output:\n" in text and "first batch read" in text, text
        else:
            assert "): its process crashed in native code with SIGSEGV (signal 11)" in text, text
            # faulthandler's dump: the crashing thread's stack, down to the user's line
            stack = text.split("\nIts last output:\n", 1)[1]
            assert stack.startswith("Fatal Python error: Segmentation fault\nCurrent thread "), text
            assert f'File "{__file__}", line' in stack and "in _crash_main" in stack, text
    finally:
        with pytest.raises(NodeError):
            cluster.shutdown(timeout=20)
        wait_gone(pids, 15)
    assert node_processes(cluster.cluster_id) == []


def test_a_node_stuck_holding_the_gil_fails_train_after_node_timeout_not_the_action_timeout(spark):
    # A main blocked in native code holding Python's lock (MultiWorkerMirroredStrategy made with
    # a ps node) answers no action: train()'s begin_epoch waited out its own 30 s timeout (61 s
    # in all once), though the node was lost after node_timeout (3 s) without a heartbeat.
    from tests.dataplane.mains import gil_holding_main

    cluster = dataplane.run(spark, gil_holding_main, {"seconds": 45}, num_nodes=1, node_timeout=3.0,
                            stop_grace=1.0)
    node = cluster.nodes[0]
    try:
        df = make_df(spark, 100, 1)
        t0 = time.monotonic()
        with pytest.raises(NodeError) as info:
            cluster.train(df, feed_timeout=50)
        took = time.monotonic() - t0
        text = str(info.value)
        assert f"{node.describe()} stopped responding" in text and f"process (pid {node.pid}) still runs" in text, text
        assert took < 25, f"train() took {took:.0f} s to name a node lost after 3 s: {text}"
    finally:
        with pytest.raises(NodeError):
            cluster.shutdown(timeout=20)
    wait_gone([node.pid], 30)
    assert node_processes(cluster.cluster_id) == []


def test_a_silent_node_whose_process_runs_is_named_as_alive_not_as_dead():
    # MultiWorkerMirroredStrategy made in a cluster with a ps node blocked in TensorFlow's native
    # code without releasing Python's lock: heartbeats stopped, and the error said "its process
    # died or was killed" of a process that was running.
    from dataplane.driver.cluster import _lost

    alive = subprocess.Popen(["sleep", "30"])
    try:
        reg = {"pid": alive.pid, "host": "127.0.0.1"}
        text = str(_lost("node 0 (chief 0)", None, 12.0, reg))
        assert text.startswith("node 0 (chief 0) stopped responding 12 s ago (no heartbeat), though its "
                               f"process (pid {alive.pid}) still runs"), text
        assert "native code that holds Python's lock" in text and "num_ps > 0" in text, text
    finally:
        alive.kill()
        alive.wait()
    text = str(_lost("node 0 (chief 0)", None, 12.0, reg))  # the same pid, now gone
    assert text == ("node 0 (chief 0) stopped responding 12 s ago (no heartbeat): its process died "
                    "or was killed, or its executor was lost."), text
    remote = str(_lost("node 1 (worker 0)", None, 12.0, {"pid": alive.pid, "host": "10.9.9.9"}))
    assert "died or was killed" in remote, remote  # another machine's pid says nothing here


def test_a_worker_dying_under_mwms_is_named_not_the_peer_its_death_broke(spark):
    # the dead worker never reported; the chief's collective failed because of it and was the
    # only error: "node 0 (chief 0): main raised: UnavailableError: Collective ops is aborted"
    from tests.dataplane.loop_mains import dying_worker_main

    df = spark.range(0, 640, 1, 2).selectExpr(
        "id", "array(cast(id as float), 1.0f) as x", "cast(id % 2 as float) as label")
    cluster = dataplane.run(spark, dying_worker_main, {"victim": 1, "epochs": 6}, num_nodes=2,
                            node_timeout=60.0)
    pids = [n.pid for n in cluster.nodes]
    t0 = time.monotonic()
    with pytest.raises(NodeError) as info:
        cluster.train(df, 6, cache=True, feed_timeout=120)
    assert time.monotonic() - t0 < 60
    e = info.value
    assert e.node.node_id == 1, str(e)
    assert "worker 0" in str(e) and "its process exited with code 3 without reporting an error" in str(e), str(e)
    assert "os._exit(3)" in str(e), str(e)
    with pytest.raises(NodeError):
        cluster.shutdown(timeout=20)
    wait_gone(pids, 30)
    assert node_processes(cluster.cluster_id) == []


def test_node_killed_mid_inference_fails_the_job_within_30s(spark):
    cluster = dataplane.run(spark, slow_serve_main, {"delay": 0.05}, num_nodes=2)
    victim = cluster.nodes[1]
    # 4 partitions of 64-row requests at 50 ms each: about 20 s of answers per node
    df = spark.range(0, 40_000, 1, 4).selectExpr("id", "cast(id as double) as x")
    out = cluster.inference(df, passthrough=("id",), max_rows=64)
    outcome, killed_at = _kill_midway(cluster, victim, "inference_rows", out.count)
    assert "hung" not in outcome, "inference hung after a node died"
    err = outcome.get("error")
    assert err is not None, outcome
    text = str(err)
    # the first attempt loses its stream, the retries cannot connect: either names the node
    assert f"node {victim.node_id} at {victim.flight_location}" in text, text[-2000:]
    assert "cluster.shutdown() on the driver report its error" in text
    assert outcome["at"] - killed_at < 30
    with pytest.raises(NodeError) as info:
        cluster.shutdown(timeout=20)
    assert info.value.node.node_id == victim.node_id
    assert node_processes(cluster.cluster_id) == []


def test_main_raising_mid_feed_fails_train_with_its_error(spark):
    cluster = dataplane.run(
        spark, raise_mid_feed_main, {"node": 1}, num_nodes=2, buffer_bytes=64 * 1024,
        max_chunk_bytes=16 * 1024,
    )
    pids = [n.pid for n in cluster.nodes]
    t0 = time.monotonic()
    with pytest.raises(NodeError) as info:
        cluster.train(make_df(spark, 50_000, 2))
    assert time.monotonic() - t0 < 60
    assert info.value.node.node_id == 1 and "main raised" in str(info.value)
    assert "ValueError: bad batch on node 1" in info.value.remote_traceback
    with pytest.raises(NodeError):
        cluster.shutdown(timeout=20)
    wait_gone(pids, 15)


def test_a_with_block_raising_a_nodes_failure_does_not_report_it_twice(spark, caplog):
    # train raises main's NodeError inside the block; leaving the block shuts the cluster down,
    # which finds the same failure: it used to be logged again, traceback and all
    with pytest.raises(NodeError) as info:
        with dataplane.run(spark, raise_mid_feed_main, {"node": 0}, num_nodes=1,
                           buffer_bytes=64 * 1024, max_chunk_bytes=16 * 1024) as cluster:
            pids = [n.pid for n in cluster.nodes]
            cluster.train(make_df(spark, 50_000, 2))
    assert "ValueError: bad batch on node 0" in info.value.remote_traceback
    assert "already raising" not in caplog.text and "bad batch" not in caplog.text
    wait_gone(pids, 15)


def test_inference_fails_fast_when_main_ends_without_serving(spark, tmp_path):
    # main is busy for 4 s and returns without ctx.serve: requests sent meanwhile must fail
    # once it returns, not wait forever
    cluster = dataplane.run(spark, pull_main, {"dir": str(tmp_path), "seconds": 4}, num_nodes=2)
    try:
        df = spark.range(0, 100, 1, 2).selectExpr("id", "cast(id as double) as x")
        schema = pa.schema([("y", pa.float64())])
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            cluster.inference(df, passthrough=("id",), output_schema=schema).count()
        assert time.monotonic() - t0 < 30
        assert "main returned without serving inference" in str(info.value), str(info.value)[-2000:]
    finally:
        cluster.shutdown(timeout=20)


def test_inference_fails_fast_on_a_main_waiting_in_wait_stop_without_serving(spark):
    # a main that ends in ctx.wait_stop() and never calls ctx.serve: the probe used to wait
    # for feed_timeout (600 s) and then say only "Deadline Exceeded"
    df = spark.range(0, 100, 1, 2).selectExpr("id", "cast(id as double) as x")
    with dataplane.run(spark, wait_stop_main, {}, num_nodes=2) as cluster:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            cluster.inference(df, passthrough=("id",)).count()
        assert time.monotonic() - t0 < 30
        msg = str(info.value)
        assert "main waits in ctx.wait_stop() without serving inference" in msg, msg[-2000:]
        assert "call ctx.serve(predict)" in msg, msg[-2000:]
    # the same main waiting in a loop of waits shorter than the grace
    with dataplane.run(spark, wait_stop_main, {"poll": 0.5}, num_nodes=1) as cluster:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            cluster.inference(df, passthrough=("id",)).count()
        assert time.monotonic() - t0 < 30
        assert "main waits in ctx.wait_stop() without serving inference" in str(info.value)
    # serving from a thread while main waits there answers as usual
    with dataplane.run(spark, wait_stop_main, {"serve": True}, num_nodes=2) as cluster:
        time.sleep(4)  # past the grace an unserved request gets
        rows = cluster.inference(df, passthrough=("id",)).collect()
    assert sorted((r.id, r.y) for r in rows) == [(i, 2.0 * i) for i in range(100)]


def test_inference_fails_fast_on_a_main_waiting_in_ctx_dataset_for_more_epochs(spark):
    # a main that reads pass after pass and never serves: before any train() it waits for
    # the first epoch, afterwards for the next one; the driver's probe waited for feed_timeout
    # (600 s) and then said only "Deadline Exceeded"
    df = spark.range(0, 100, 1, 2).selectExpr("id", "cast(id as double) as x")
    with dataplane.run(spark, passes_main, {}, num_nodes=1) as cluster:
        for call in ("before train", "after train"):
            if call == "after train":
                assert cluster.train(df, 1, 60).rows == 100
            t0 = time.monotonic()
            with pytest.raises(Exception) as info:
                cluster.inference(df, passthrough=("id",)).count()
            assert time.monotonic() - t0 < 40, call
            msg = str(info.value)
            assert "in ctx.dataset() for the driver's next cluster.train() call (it read every epoch " \
                   "pushed so far) instead of serving inference" in msg, (call, msg[-2000:])


def test_inference_goes_to_serving_nodes_and_a_request_unanswered_for_feed_timeout_fails(spark):
    # A worker whose main was still busy (not yet in ctx.serve) held its share of the
    # partitions with no deadline: feed_timeout reached only the driver's probe, and the job
    # hung until shutdown. Requests now go to the nodes already serving, and each answer is
    # awaited feed_timeout seconds at most.
    df = spark.range(0, 400, 1, 4).selectExpr("id", "cast(id as double) as x")
    schema = pa.schema([("y", pa.float64())])
    cluster = dataplane.run(spark, chief_serves_main, {}, num_nodes=2)
    try:
        deadline = time.monotonic() + 60
        while not cluster.metrics()[0].get("serving") and time.monotonic() < deadline:
            time.sleep(0.2)
        t0 = time.monotonic()
        rows = cluster.inference(df, passthrough=("id",), output_schema=schema, feed_timeout=60).collect()
        assert time.monotonic() - t0 < 50
        assert sorted((r.id, r.y) for r in rows) == [(i, 2.0 * i) for i in range(400)]
        assert cluster.metrics()[1]["serving"] is False
    finally:
        cluster.shutdown(timeout=5)
    with dataplane.run(spark, slow_serve_main, {"delay": 120.0}, num_nodes=1, stop_grace=2) as cluster:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            cluster.inference(df, passthrough=("id",), output_schema=schema, feed_timeout=2).count()
        # each try of the task (the suite's master retries) waits 2 s, and answers would take
        # 120 s: 13-14 s on a loaded 2-core machine came within 1 s of the old bound of 15
        assert time.monotonic() - t0 < 60
        msg = str(info.value)
        assert "node 0 did not answer request 0 of partition" in msg, msg[-2000:]
        assert "within feed_timeout=2 s" in msg and "lower max_rows or raise feed_timeout" in msg, msg[-2000:]


def test_main_returning_early_ends_the_feed_cleanly(spark, tmp_path):
    cluster = dataplane.run(
        spark, early_main, None, num_nodes=2, buffer_bytes=64 * 1024, max_chunk_bytes=16 * 1024
    )
    try:
        t0 = time.monotonic()
        report = cluster.train(make_df(spark, 50_000, 2))
        assert time.monotonic() - t0 < 60
        assert report.rows == 50_000
        assert sum(report.rows_unconsumed.values()) > 0
        assert any("returned from main while data was still being pushed" in m for m in report.messages)
    finally:
        cluster.shutdown()


def test_shutdown_from_another_thread_stops_a_train_call_pushing_more_epochs(spark, tmp_path):
    """A watchdog thread (or a notebook's stop button) calls shutdown while train() still has
    epochs to push: those are not pushed; train raises saying so, and shutdown does not wait
    for the mains to read epochs nobody wants any more."""
    cluster = dataplane.run(spark, slow_reader_main, {"dir": str(tmp_path)}, num_nodes=2,
                            buffer_bytes=64 * 1024, max_chunk_bytes=16 * 1024)
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["result"] = cluster.train(make_df(spark, 6_000, 2), num_epochs=30)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        wait_json(tmp_path / "reading0.json", timeout=60)  # the first pass is being read
        t0 = time.monotonic()
        cluster.shutdown(timeout=10)
        took = time.monotonic() - t0
    finally:
        t.join(60)
        cluster.shutdown()
    # every pass reads 3,000 rows at 50 ms a 64-row batch (2.4 s): 30 epochs take over 70 s
    assert took < 30, took
    assert not t.is_alive()
    err = outcome.get("error")
    assert isinstance(err, ClusterStateError), outcome
    msg = str(err)
    assert "cluster.shutdown() was called while it ran" in msg and "of its 30 epochs" in msg, msg
    done = int(msg.split("stopped after ")[1].split(" of")[0])
    assert 1 <= done < 30, msg


def test_port_range_exhausted_is_reported_quickly(spark):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    t0 = time.monotonic()
    try:
        with pytest.raises(NodeError) as info:
            dataplane.run(spark, idle_main, num_nodes=2, port_range=(port, port), reservation_timeout=60)
    finally:
        holder.close()
    assert time.monotonic() - t0 < 30
    msg = str(info.value)
    assert f"port_range {port}-{port}" in msg and "Widen port_range" in msg
    assert info.value.node is None  # it never registered
    assert _no_active_jobs(spark)


_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    from pyspark.sql import SparkSession
    import dataplane
    from tests.dataplane.mains import idle_main
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    c = dataplane.run(spark, idle_main, num_nodes=2, heartbeat_timeout=5.0)
    print(json.dumps({"pids": [n.pid for n in c.nodes], "id": c.cluster_id}), flush=True)
    os._exit(0)  # the driver dies without shutting anything down
    """
)


def test_nodes_exit_when_the_driver_dies(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert line, proc.stderr[-3000:]
    info = json.loads(line[-1])
    gone_after = wait_gone(info["pids"], 30)
    assert gone_after < 30
    assert node_processes(info["id"]) == []


_JVM_KILLED_DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from pyspark.sql import SparkSession
    import dataplane
    from dataplane.errors import ClusterStateError, FeedError
    from tests.dataplane.mains import wide_main
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.memory", "512m").getOrCreate())
    out = {}
    df = spark.range(0, 3000000, 1, 4).selectExpr("id", "cast(id as double) as x")
    small = df.limit(10)
    if sys.argv[1] == "oom":  # rows of 300 MB, each made twice (a string, then bytes)
        df = spark.range(0, 4, 1, 2).selectExpr("id", "cast(repeat('x', 314572800) as binary) as vol")
        small = spark.range(0, 4, 1, 2).selectExpr("id", "cast('ab' as binary) as vol")
    with dataplane.run(spark, wide_main, num_nodes=2) as c:
        out["pids"], out["id"] = [n.pid for n in c.nodes], c.cluster_id

        def kill_once_rows_move():  # what the OS's out-of-memory killer does to a big JVM
            while not any(m["rows_in"] for m in c.metrics().values()):
                time.sleep(0.05)
            os.kill(spark.sparkContext._gateway.proc.pid, signal.SIGKILL)
            out["killed_at"] = time.monotonic()

        if sys.argv[1] == "kill":
            threading.Thread(target=kill_once_rows_move, daemon=True).start()
        t0 = time.monotonic()
        try:
            c.train(df, 20, feed_timeout=120)
            out["train"] = "returned"
        except FeedError as e:
            out["train"] = str(e)
        out["seconds"] = time.monotonic() - out.get("killed_at", t0)
        try:
            out["again_rows"] = c.train(small, 1).rows
        except ClusterStateError as e:
            out["again"] = str(e)
        t0 = time.monotonic()
    out["shutdown_seconds"] = time.monotonic() - t0
    if "again" in out:
        try:
            dataplane.run(spark, wide_main, num_nodes=1)
        except ClusterStateError as e:
            out["run"] = str(e)
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.parametrize("how", ["kill", "oom"])
def test_spark_s_jvm_killed_or_out_of_memory_mid_train_fails_it_saying_what_to_do(tmp_path, how):
    """Spark's JVM killed during a push (the OS's out-of-memory killer; an OutOfMemoryError in
    a local-mode task can end it too): train() raised py4j's ConnectionRefusedError (or a
    Py4JJavaError whose text could no longer be read) after waiting 12 s for a node to blame,
    and every later call and run() the same. Rows too big for the heap ("oom") failed the job
    with the bare "OutOfMemoryError: Java heap space"; whichever way it ends, the message
    names the memory settings."""
    script = tmp_path / "driver.py"
    script.write_text(_JVM_KILLED_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=240,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert line, proc.stderr[-3000:]
    out = json.loads(line[-1])
    assert out["train"].startswith("pushing epoch 0 (train, 1 of 20) failed: " if how == "oom" else
                                   "pushing epoch "), out["train"]
    assert "java.lang.OutOfMemoryError" in out["train"] or "OutOfMemoryError: Java heap space" in out["train"]
    assert "spark.driver.memory" in out["train"] and "maxRecordsPerBatch" in out["train"], out["train"]
    if how == "kill" or "again" in out:  # the JVM exited
        assert re.match(r"pushing epoch \d+ \(train, \d+ of 20\) failed: Spark's JVM has exited",
                        out["train"]), out["train"]
        for text in (out["train"], out["again"], out["run"]):
            assert "pyspark cannot start another JVM in this process" in text, text
            assert "java.lang.OutOfMemoryError" in text and "spark.driver.memory" in text, text
        assert out["again"].startswith("cannot train: the JVM of the SparkSession"), out["again"]
        assert out["run"].startswith("cannot start TF nodes: the SparkSession's JVM has exited"), out["run"]
    else:  # it lived on, and so does the cluster
        assert "Spark ran out of memory" in out["train"], out["train"]
        assert out["again_rows"] == 4, out
    assert out["seconds"] < (5 if how == "kill" else 60), out
    assert out["shutdown_seconds"] < 30, out
    wait_gone(out["pids"], 15)
    assert node_processes(out["id"]) == []


_INTERRUPTED_DRIVER = textwrap.dedent(
    """
    import json, sys
    from pyspark.sql import SparkSession, functions as F
    import dataplane
    from tests.dataplane.mains import slow_reader_main
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    df = spark.range(200000).select("id", (F.col("id") * 2.0).alias("x"))
    with dataplane.run(spark, slow_reader_main, {"dir": sys.argv[1]}, num_nodes=2) as c:
        print(json.dumps({"pids": [n.pid for n in c.nodes], "id": c.cluster_id}), flush=True)
        c.train(df, 5, cache=True)  # minutes of work for the slow readers
    """
)


def _interrupt_driver(tmp_path, script_text, ready_files, *, settle=0.0, timeout=120):
    """Run ``script_text`` as a driver, wait for its JSON line and for the nodes' ready files,
    send it SIGINT after ``settle`` seconds; its node info, stderr and seconds to exit."""
    script = tmp_path / "driver.py"
    script.write_text(script_text)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    try:
        info = json.loads(proc.stdout.readline())
        for name in ready_files:
            wait_json(tmp_path / name, 120)
        time.sleep(settle)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=timeout)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    return info, err, took


def test_ctrl_c_on_the_driver_during_train_ends_everything_within_seconds(tmp_path):
    """Ctrl-C while train() waits on slow readers: the with-block stops the nodes at once
    (no draining of the epochs already pushed; before, the driver took 72 s to exit)."""
    # settle: well into the first epoch, with the rest of it buffered on the nodes
    info, err, took = _interrupt_driver(
        tmp_path, _INTERRUPTED_DRIVER, [f"reading{n}.json" for n in range(2)], settle=2.0
    )
    assert took < 30, took
    wait_gone(info["pids"], 15)
    assert node_processes(info["id"]) == []


_INTERRUPTED_BUSY_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from pyspark.sql import SparkSession
    import dataplane
    from tests.dataplane.mains import busy_main
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    with dataplane.run(spark, busy_main, {"dir": sys.argv[1]}, num_nodes=2, stop_grace=120) as c:
        print(json.dumps({"pids": [n.pid for n in c.nodes], "id": c.cluster_id}), flush=True)
        time.sleep(600)
    """
)


def test_ctrl_c_ends_busy_mains_at_once_whatever_their_stop_grace(tmp_path):
    """Ctrl-C while the mains train without checking ctx.should_stop (a Keras fit): the nodes
    gave them stop_grace (TFEstimator: 120 s) and the driver killed them after its own wait."""
    info, err, took = _interrupt_driver(
        tmp_path, _INTERRUPTED_BUSY_DRIVER, [f"busy{n}.json" for n in range(2)], timeout=180
    )
    assert took < 15, (took, err[-3000:])
    assert "did not confirm their exit" not in err, err[-3000:]
    wait_gone(info["pids"], 15)
    assert node_processes(info["id"]) == []


def test_inference_output_computed_after_shutdown_says_it_is_lazy(spark):
    # the usual slip: inference() inside the with block, the write after it
    df = spark.range(0, 40, 1, 2).selectExpr("id", "cast(id as double) as x")
    with dataplane.run(spark, slow_serve_main, {"delay": 0.0}, num_nodes=1) as cluster:
        out = cluster.inference(df, passthrough=("id",))
        assert sorted(r["y"] for r in out.collect()) == [2.0 * i for i in range(40)]
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        out.count()
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert "inference" in text and "node 0" in text, text[-2000:]
    assert "the DataFrame that cluster.inference() returns is lazy" in text, text[-2000:]


def test_feed_timeout_limits_standing_still_not_the_length_of_training(spark, tmp_path):
    # feed_timeout=3: an epoch that takes 7.5 s to train on, rows moving all the while, must
    # finish (a real run trains for hours under the default 600 s); a node that then stops
    # reading fails the next train about 3 s after the last row moved
    # (a take empties the 64 KiB buffer, ~1,400 rows, 1.8 s of training: well within 3 s)
    cluster = dataplane.run(spark, steady_main, {"dir": str(tmp_path), "delay": 0.02}, num_nodes=1,
                            buffer_bytes=64 * 1024, max_chunk_bytes=16 * 1024)
    try:
        # warm-up: the node's first pass waits for TensorFlow to build its pipeline
        assert cluster.train(make_df(spark, 100, 2), num_epochs=1, feed_timeout=60).rows == 100
        report = cluster.train(make_df(spark, 6000, 2), num_epochs=1, feed_timeout=3)
        assert report.rows == 6000 and report.seconds > 6, report
        assert wait_json(tmp_path / "steady0-pass1.json") == {"rows": 6000}
        t0 = time.monotonic()
        with pytest.raises(dataplane.FeedError) as info:
            cluster.train(make_df(spark, 3000, 2), num_epochs=1, feed_timeout=3)
        assert 3 <= time.monotonic() - t0 < 30
        text = str(info.value)
        assert "pushing epoch 2 (train, 1 of 1): no row moved into or out of any node for feed_timeout=3 s" in text, text
        assert "Node(s) [0] read none of it while their main still runs" in text, text
    finally:
        cluster.shutdown(timeout=5)


def test_a_main_that_never_builds_its_dataset_is_told_so_not_as_having_stopped_reading(spark):
    # A main busy with something else (a long set-up, data read another way) never calls
    # ctx.dataset(): it was told it "stopped reading" epoch 0, or that it "reads fewer passes
    # than train() pushes". Both ways a call stands still: the epoch's rows all delivered and
    # waiting (500 rows), and a push blocked on the full 64 KiB buffers (40,000 rows).
    cluster = dataplane.run(spark, idle_main, {}, num_nodes=2, buffer_bytes=64 * 1024,
                            max_chunk_bytes=16 * 1024)
    try:
        for rows, head in ((500, "epoch 0 (train, 1 of 1) was pushed, but nothing moved for feed_timeout=4 s"),
                           (40_000, "no row moved into or out of any node for feed_timeout=4 s")):
            t0 = time.monotonic()
            with pytest.raises(dataplane.FeedError) as info:
                cluster.train(make_df(spark, rows, 2), num_epochs=1, feed_timeout=4)
            assert 4 <= time.monotonic() - t0 < 40
            text = str(info.value)
            assert head in text, text
            assert ("Node(s) [0, 1] have not built ctx.dataset(split='train') yet while their main "
                    "runs: a main that sets up for long before its first pass") in text, text
            assert "larger feed_timeout" in text and "ctx.end_feed()" in text, text
            assert "stopped reading" not in text and "fewer passes" not in text, text
    finally:
        cluster.shutdown(timeout=10)


def test_a_slow_model_training_on_one_big_take_is_not_standing_still(spark, tmp_path):
    # The default 64 MiB buffer: a pass takes every row that has arrived at once (here a
    # partition of 6,000 rows, 375 batches, 7.5 s of training at 0.02 s a batch) and then
    # trains on them with nothing taken in or out of the buffer. That used to count as
    # standing still: feed_timeout=3 failed the call after 3 s ("node 0 read 6,000 of
    # 12,000 rows"), as it failed a user's MWMS fit of 200,000 narrow rows at 27 ms a step
    # under feed_timeout=60. Rows handed on to TensorFlow (a generator item of up to 64
    # batches, 1.3 s here) are progress too.
    cluster = dataplane.run(spark, steady_main, {"dir": str(tmp_path), "delay": 0.02}, num_nodes=1)
    try:
        def dense(rows):  # type: ignore[no-untyped-def]  # (a ragged column makes 1-batch items)
            return spark.range(0, rows, 1, 2).selectExpr("id", "CAST(id AS DOUBLE) AS x")

        assert cluster.train(dense(100), num_epochs=1, feed_timeout=60).rows == 100
        report = cluster.train(dense(12000), num_epochs=1, feed_timeout=3)
        assert report.rows == 12000 and report.seconds > 12 and report.rows_unconsumed == {}, report
        assert wait_json(tmp_path / "steady0-pass1.json") == {"rows": 12000}
    finally:
        cluster.shutdown(timeout=5)


def _slow_id(i):  # type: ignore[no-untyped-def]
    time.sleep(0.06)
    return i


def test_a_dataframe_slow_to_compute_is_not_standing_still(spark, tmp_path):
    # An expensive DataFrame: a stage of 12 tasks, 3 s each (50 rows at 0.06 s), 12 s or more
    # on 3 task slots before a shuffle, so no row reaches a node for longer than
    # feed_timeout=8. Spark finishes tasks all the while: the call used to fail with "no row
    # moved into or out of any node ... Node(s) [0] read none of it", blaming the node (TFoS's
    # feed_timeout limited only a wait on a node's queue). A push whose tasks finish nothing
    # and a task held back by a node that stops reading still fail the call
    # (test_a_main_that_never_builds_its_dataset_is_told_so_not_as_having_stopped_reading).
    from pyspark.sql import functions as F

    from tests.builders import row_checksum
    from tests.dataplane.mains import feed_main

    df = make_df(spark, 600, 12).withColumn("id", F.udf(_slow_id, "long")("id")).repartition(2, "id")
    with dataplane.run(spark, feed_main, {"dir": str(tmp_path)}, num_nodes=1) as cluster:
        t0 = time.monotonic()
        report = cluster.train(df, num_epochs=1, feed_timeout=8)
        assert time.monotonic() - t0 > 12 and report.rows == 600 and report.rows_unconsumed == {}, report
        got = wait_json(tmp_path / "node0-epoch0.json")
    assert (got["count"], got["sumsq"]) == row_checksum(np.arange(600))


def test_feed_timeout_counts_from_the_last_row_that_moved():
    # rows move early in the first window (the push fills the buffer), then a node stalls:
    # the clock used to look only when a window ended, see that rows had moved, and start a
    # whole new window from then, so train failed after about twice feed_timeout
    from dataplane.driver.pushjob import FeedClock, Moved

    t0 = time.monotonic()
    clock = FeedClock(2.0, lambda: Moved(100 if time.monotonic() - t0 > 0.2 else 0, 0.0))
    while not clock.expired():
        time.sleep(0.01)
    assert 2.2 <= time.monotonic() - t0 < 3.2  # 2.2 s after the move, plus a look (0.2 s)

    def unreachable() -> int:
        raise ConnectionError("node gone")

    t0 = time.monotonic()
    clock = FeedClock(1.0, lambda: Moved(0, 0.0))
    clock._moved = unreachable  # nodes that cannot answer move no rows: expired after 1 s
    while not clock.expired():
        time.sleep(0.01)
    assert 1.0 <= time.monotonic() - t0 < 2.0
    # asked again in the same round (no look due): the same answer, not a False that made a
    # second question never true and a stalled node never fail the call
    assert clock.expired() and clock.expired()


@pytest.mark.parametrize("rows", [0, 1])
def test_a_main_failing_on_a_pass_without_rows_is_told_why(spark, rows):
    # The filter that left nothing (or a single row for two workers) is the cause; Keras only
    # says a layer got a ragged input, or that its logs were empty.
    from tests.dataplane.mains import keras_fit_main

    df = spark.range(0, rows, 1, 2).selectExpr(
        "array(cast(id as float), 1f, 2f, 3f) as x", "cast(id as float) as y")
    with pytest.raises(NodeError) as info:
        with dataplane.run(spark, keras_fit_main, {}, num_nodes=2) as cluster:
            pids = [n.pid for n in cluster.nodes]
            cluster.train(df, num_epochs=1, feed_timeout=60)
    text = str(info.value)
    assert "main raised:\nValueError: " in text
    if rows == 0:  # the shape scan saw no row, so x has no known length: Keras' reason follows
        assert "Dense layer only supports RaggedTensors when the innermost dimension is non-ragged" in text
        assert text.endswith(
            "The data may be why: the DataFrame given to train(df) has no rows, so every "
            "worker's pass over it is empty; check the filters or joins that built it.")
    else:
        assert "Unexpected result of `train_function` (Empty logs)" in text
        assert text.endswith(
            "The data may be why: epoch 0 (train, 1 of 1): its 1 row(s) over 2 workers leave some worker "
            "none, so every worker yielded none (each yields the smallest worker's share); push "
            "at least one row per worker.")
    wait_gone(pids, 15)


def test_a_fit_after_the_last_pushed_epoch_fails_at_shutdown_with_the_reason(spark):
    # Two fits of one epoch each over one pushed epoch: the second fit's pass waits for a
    # train() call that never comes and ends empty at shutdown. tf_keras then says only that
    # its logs were empty, and the guess for an empty first epoch (no rows, fewer rows than
    # workers) is wrong here: the nodes say why instead
    from tests.dataplane.mains import keras_fit_main

    df = spark.range(0, 200, 1, 2).selectExpr(
        "array(cast(id as float), 1f, 2f, 3f) as x", "cast(id as float) as y")
    cluster = dataplane.run(spark, keras_fit_main, {"fits": 2}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    report = cluster.train(df, num_epochs=1, feed_timeout=60)
    assert report.rows == 200 and report.rows_unconsumed == {} and report.messages == []
    with pytest.raises(NodeError) as info:
        cluster.shutdown(timeout=30)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("node 0 (chief 0 on 127.0.0.1, pid ") and lines[0].endswith("): main raised:")
    assert lines[1].startswith("ValueError: Unexpected result of `train_function` (Empty logs).")
    assert lines[2:] == [
        "The data may be why: a pass over ctx.dataset(split='train') ended without rows: the "
        "cluster shut down after earlier passes had read all 1 train epoch(s) pushed. main read "
        "more passes than cluster.train pushed (e.g. fit(epochs=3) over train(df, num_epochs=2), "
        "a layer.adapt(ds) or a look at a batch (next(iter(ds)), ds.take(1)) before fit, or an "
        "evaluate(ds) or a second fit after it: each reads a pass of its own); Keras may report "
        "that pass as an epoch, without data. Read one pass per pushed epoch. (A main fed by a "
        "stream that reads passes until shutdown: read ctx.should_stop after every pass, and "
        "this note goes away.)"], lines
    wait_gone(pids, 15)


def test_a_strategy_made_after_the_dataset_is_told_how_to_order_them(spark):
    # TensorFlow only says "Collective ops must be configured at program startup"
    from tests.dataplane.mains import late_strategy_main

    cluster = dataplane.run(spark, late_strategy_main, {}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    with pytest.raises(NodeError) as info:
        cluster.train(make_df(spark, 100, 2))
    lines = str(info.value).splitlines()
    assert lines[1:] == [
        "RuntimeError: Collective ops must be configured at program startup",
        "Create tf.distribute.MultiWorkerMirroredStrategy() first thing in main, before "
        "ctx.dataset() or any other TensorFlow op (TF_CONFIG is already set when main starts).",
    ], lines
    with pytest.raises(NodeError):
        cluster.shutdown(timeout=20)
    wait_gone(pids, 15)


@pytest.mark.timeout(200)  # (before: shutdown waited for ever)
def _late_null_in_node_1s_share(spark):  # type: ignore[no-untyped-def]
    """One partition of 20,000 one-element arrays in two Arrow batches, the second 2 s late;
    row 17,000, in node 1's half of the second batch, is a null array."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType

    def late(i):  # type: ignore[no-untyped-def]
        if i == 10000:
            time.sleep(2)
        return float(i)

    x = F.array(F.udf(late, DoubleType())("id"))
    return spark.range(0, 20000, 1, 1).select(F.when(F.col("id") == 17000, F.lit(None)).otherwise(x).alias("x"))


def test_a_null_in_one_workers_share_fails_the_call_and_leaves_the_passes_equal(spark, tmp_path):
    """One partition, two MWMS workers running an all-reduce per batch. The second Arrow batch
    (rows 10,000-19,999) comes 2 s late, and its second half, node 1's share, holds a null.
    Both nodes refuse that batch (its chunks say a column holds a null), so the failed call
    cuts the epoch at the 5,000 rows each worker holds and has yielded: both passes take 50
    steps, both mains return, and shutdown is clean. Before, node 0 took and yielded its
    clean half, its pass ran past the cut, and it waited in its 51st all-reduce for ever."""
    df = _late_null_in_node_1s_share(spark)
    cluster = dataplane.run(spark, collective_loop_main, {"dir": str(tmp_path), "passes": 2}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    try:
        # a first call builds both datasets (from then on a null array is refused as it arrives)
        assert cluster.train(df.where("x IS NOT NULL").limit(2000), 1, feed_timeout=60).rows == 2000
        with pytest.raises(dataplane.SchemaError, match="column 'x' has 1 null value"):
            cluster.train(df, 1, feed_timeout=60)
        deadline = time.monotonic() + 60
        while (min(len(wait_json(tmp_path / f"steps{n}.json")["steps"]) for n in (0, 1)) < 2
               and time.monotonic() < deadline):
            time.sleep(0.2)  # (written after each pass)
        assert wait_json(tmp_path / "steps0.json") == {"steps": [10, 50]}
        assert wait_json(tmp_path / "steps1.json") == {"steps": [10, 50]}
        assert not any(m.get("overran_cut") for m in cluster.metrics().values())
    finally:
        t0 = time.monotonic()
        cluster.shutdown(timeout=30)
        assert time.monotonic() - t0 < 30
    wait_gone(pids)


def test_a_worker_a_failed_push_left_in_a_collective_is_stopped_at_shutdown(spark, tmp_path):
    """As above, but node 0's dataset fills nulls (fill_values) and node 1's does not: node 0
    takes its half of the batch and yields it (it may: every worker will hold that much), node
    1 refuses the null. The failed call cuts the epoch at the 5,000 rows every worker holds,
    so node 1's pass ends after 50 batches and its main returns, while node 0 has yielded
    more and waits in its 51st all-reduce for ever; a drain shutdown waited with it. Node 0
    reports the overrun, so shutdown stops it once its timeout runs out and says why. (The
    other way to get here is a task cancelled between two of its sibling chunks.)"""
    df = _late_null_in_node_1s_share(spark)
    cluster = dataplane.run(spark, collective_loop_main, {"dir": str(tmp_path), "passes": 2, "fill_node": 0},
                            num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    # a first call builds both datasets (from then on node 1 refuses a null array as it arrives)
    assert cluster.train(df.where("x IS NOT NULL").limit(2000), 1, feed_timeout=60).rows == 2000
    with pytest.raises(dataplane.SchemaError, match="column 'x' has 1 null value"):
        cluster.train(df, 1, feed_timeout=60)
    deadline = time.monotonic() + 60
    while len(wait_json(tmp_path / "steps1.json")["steps"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # (written after each pass)
    assert wait_json(tmp_path / "steps1.json") == {"steps": [10, 50]}
    t0 = time.monotonic()
    with pytest.raises(NodeError) as info:
        cluster.shutdown(timeout=5)
    assert 5 <= time.monotonic() - t0 < 60
    text = str(info.value)
    assert "node(s) [0] were still running main when shutdown's timeout (5 s) ran out, beside node(s) [1]" in text, text
    assert "A failed push had cut epoch 1 (train) at 5000 row(s) per worker after node 0's pass had yielded" in text, text
    assert info.value.node.node_id == 0
    assert wait_json(tmp_path / "steps0.json") == {"steps": [10]}
    wait_gone(pids)
