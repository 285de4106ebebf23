"""Cluster lifecycle on real Spark: start, cluster spec, TF_CONFIG, a real MWMS step, shutdown."""

from __future__ import annotations

import _thread
import os
import shutil
import signal
import socket
import threading
import time
import urllib.request

import pytest

import dataplane
from dataplane.errors import NodeError
from dataplane.topology import assign_roles
from tests.dataplane.clusterutil import node_processes, node_workdirs, wait_gone, wait_json
from tests.dataplane.mains import busy_main, describe_main, slow_reader_main, spawn_main, temp_main

pytestmark = pytest.mark.cluster


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def test_two_nodes_spec_tf_config_mwms_step_and_tensorboard(spark, tmp_path):
    args = {"dir": str(tmp_path), "mwms": True}
    with dataplane.run(spark, describe_main, args, num_nodes=2, tensorboard=True) as cluster:
        nodes = cluster.nodes
        assert [(n.role, n.index, n.worker_index) for n in nodes] == [("chief", 0, 0), ("worker", 0, 1)]
        assert all(n.host == "127.0.0.1" and n.flight_port > 0 and n.tf_port > 0 for n in nodes)
        infos = [wait_json(tmp_path / f"node{n.node_id}.json") for n in nodes]
        url = cluster.tensorboard_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 60
        while True:  # TensorBoard takes a few seconds to import and bind
            try:
                assert urllib.request.urlopen(url, timeout=2).status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, f"TensorBoard at {url} never answered"
                time.sleep(0.5)
        pids = [n.pid for n in nodes]
        cluster_id = cluster.cluster_id
    spec = {"chief": [f"127.0.0.1:{nodes[0].tf_port}"], "worker": [f"127.0.0.1:{nodes[1].tf_port}"]}
    for info, n in zip(infos, nodes):
        expected = {"cluster": spec, "task": {"type": n.role, "index": n.index}}
        assert info["tf_config"] == expected
        assert info["env_tf_config"] == expected
        assert info["num_workers"] == 2
        # a real all-reduce across the two node processes: 1 + 2
        assert info["mwms_sum"] == 3.0 and info["mwms_replicas"] == 2
    wait_gone(pids, 10)
    assert node_processes(cluster_id) == []
    tb_port = int(url.rsplit(":", 1)[1])
    assert not _port_open("127.0.0.1", tb_port), "TensorBoard outlived the cluster"
    # with no log_dir given the logs go to a new directory, which outlives the cluster (the
    # user's to keep): the chief got it as ctx.log_dir, cluster.log_dir names it
    assert os.path.basename(cluster.log_dir).startswith(f"dataplane-{cluster_id}-tb-")
    assert infos[0]["log_dir"] == cluster.log_dir and os.path.isdir(cluster.log_dir)
    shutil.rmtree(cluster.log_dir)


def test_three_nodes_with_a_parameter_server(spark, tmp_path):
    cluster = dataplane.run(spark, describe_main, {"dir": str(tmp_path), "wait_stop": True}, num_nodes=3, num_ps=1)
    try:
        nodes = cluster.nodes
        assert [(n.role, n.index) for n in nodes] == [("ps", 0), ("chief", 0), ("worker", 0)]
        infos = {n.node_id: wait_json(tmp_path / f"node{n.node_id}.json") for n in nodes}
        # rows pushed into a ParameterServerStrategy cluster, whose nodes wait in
        # ctx.wait_stop() (the chief's coordinator feeds the workers itself): refused, and
        # the report says why instead of only suggesting fit(epochs=) or cache=True
        report = cluster.train(spark.range(0, 100, 1, 2).selectExpr("cast(id as float) as x"), 1, 60)
        assert report.rows == 100 and sum(report.rows_unconsumed.values()) + report.dropped_for_balance == 100, report
        assert ("no worker read any pushed row, and this cluster has 1 parameter server(s): under "
                "ParameterServerStrategy the workers' input comes from the chief's dataset_fn, "
                "which ctx.dataset() cannot be") in report.messages[-1], report.messages
    finally:
        cluster.shutdown()
    by_role = {n.role: n for n in nodes}
    spec = {
        "chief": [by_role["chief"].tf_address],
        "worker": [by_role["worker"].tf_address],
        "ps": [by_role["ps"].tf_address],
    }
    for n in nodes:
        assert infos[n.node_id]["tf_config"] == {"cluster": spec, "task": {"type": n.role, "index": n.index}}
        assert infos[n.node_id]["num_workers"] == 2
    assert infos[by_role["ps"].node_id]["worker_index"] is None
    wait_gone([n.pid for n in nodes], 10)


def test_a_nodes_temp_files_go_with_its_work_directory(spark, tmp_path):
    # nodes end with os._exit, so exit-time cleanup (TensorFlow's autograph modules) never
    # runs: before, every node left its temp files in the executor's /tmp, every run
    with dataplane.run(spark, temp_main, {"dir": str(tmp_path)}, num_nodes=1) as cluster:
        info = wait_json(tmp_path / "node0.json")
        pids = [n.pid for n in cluster.nodes]
        workdirs = node_workdirs(cluster.cluster_id)
    assert info["value"] == 2.0
    assert len(workdirs) == 1 and info["tempdir"] == os.path.join(workdirs[0], "tmp"), (info, workdirs)
    names = [os.path.basename(f) for f in info["files"]]
    assert any(n.endswith(".mine") for n in names), names
    assert any(n.startswith("__autograph_generated_file") for n in names), names
    wait_gone(pids, 10)
    deadline = time.monotonic() + 10  # the reaper removes the directory after the node ends
    while os.path.exists(workdirs[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [f for f in info["files"] if os.path.exists(f)] == []
    assert not os.path.exists(workdirs[0])


def test_roles_keep_the_evaluator_out_of_the_cluster_spec():
    regs = {i: {"host": "h", "flight_port": 1000 + i, "tf_port": 2000 + i, "pid": i} for i in range(4)}
    topo = assign_roles(regs, num_ps=1, evaluator=True)
    assert [(n.role, n.index) for n in topo.nodes] == [("ps", 0), ("chief", 0), ("worker", 0), ("evaluator", 0)]
    assert topo.cluster_spec == {"chief": ["h:2001"], "worker": ["h:2002"], "ps": ["h:2000"]}
    ev = topo.node(3)
    assert topo.tf_config(ev) == {"cluster": topo.cluster_spec, "task": {"type": "evaluator", "index": 0}}
    assert [n.node_id for n in topo.workers] == [1, 2]


def test_programs_a_main_left_running_end_with_its_node(spark, tmp_path):
    # a helper's main started `sleep 1000` and a shell with a child of its own: all of them
    # outlived shutdown and the driver, reparented to init, for as long as they ran
    cluster = dataplane.run(spark, spawn_main, {"dir": str(tmp_path)}, num_nodes=1)
    try:
        pids = wait_json(tmp_path / "spawned0.json")["pids"]
        assert len(pids) == 3 and all(_alive(p) for p in pids), pids
    finally:
        cluster.shutdown(timeout=30)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_a_second_ctrl_c_while_a_with_block_stops_its_nodes_lets_the_stop_finish(spark, tmp_path):
    """Ctrl-C in a with-block stops the nodes at once (a busy main gets one second); a
    second Ctrl-C during that stop (notebook users press it twice) is held until the stop is
    done, then raised. It used to cut the stop short: the cluster stayed "stopping" for good,
    with the driver's control server, its port and threads still open, and shutdown() a
    no-op."""
    window = threading.Event()

    def press(signum, frame):  # type: ignore[no-untyped-def]
        if window.is_set():  # (never outside the block: pytest would stop the whole run)
            raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, press)
    second = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            with dataplane.run(spark, busy_main, {"dir": str(tmp_path)}, num_nodes=1) as cluster:
                pids = [n.pid for n in cluster.nodes]
                wait_json(tmp_path / "busy0.json", 60)
                window.set()
                second.start()  # lands in the stop: the busy main holds it for a second
                raise KeyboardInterrupt  # the first Ctrl-C
        window.clear()
        second.join(5)
        assert cluster.state == "stopped"
        assert [t.name for t in threading.enumerate() if t.name.startswith("dataplane-action")] == []
        wait_gone(pids, 30)
        assert node_processes(cluster.cluster_id) == []
    finally:
        window.clear()
        second.cancel()
        signal.signal(signal.SIGINT, before)


def test_a_train_call_after_ctrl_c_in_a_push_job_runs_whole(spark, tmp_path):
    """Ctrl-C while a push job runs cancels it, and the next train() on the same DataFrame
    pushes again. Spark's adaptive execution keeps the cancelled run in the reused push
    frame's plan, whose collect() then raised the first call's "Job N cancelled" at once (a
    sweep: 2 of 17 retries failed so; a frame with a shuffle under a cache, as here). Also:
    during train, Ctrl-C is Python's plain KeyboardInterrupt (PySpark's handler calls into
    the JVM from inside the signal, mid-call, printing py4j tracebacks), and PySpark's handler
    is back afterwards."""
    pyspark_handler = signal.getsignal(signal.SIGINT)
    assert getattr(pyspark_handler, "__module__", "").startswith("pyspark")  # (the session's)
    during = []
    # a slow reader and a 64 KiB buffer (~500 of these rows): the push jobs wait for it
    cluster = dataplane.run(spark, slow_reader_main, {"dir": str(tmp_path)}, num_nodes=1, buffer_bytes=1 << 16)
    pids = [n.pid for n in cluster.nodes]
    df = spark.range(0, 1000, 1, 2).selectExpr("id", "array_repeat(CAST(id AS DOUBLE), 16) AS x")
    df = df.repartition(3).cache()
    try:
        report = cluster.train(df, 1, progress=lambda p: during.append(signal.getsignal(signal.SIGINT)))
        assert report.rows == 1000 and during and all(h is signal.default_int_handler for h in during)
        assert signal.getsignal(signal.SIGINT) is pyspark_handler

        def ctrl_c_in_a_push_job() -> None:
            tracker = spark.sparkContext.statusTracker()
            deadline = time.monotonic() + 60
            while not tracker.getActiveJobsIds() and time.monotonic() < deadline:
                time.sleep(0.02)
            _thread.interrupt_main()  # as a SIGINT would, through the handler in place

        threading.Thread(target=ctrl_c_in_a_push_job, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            cluster.train(df, 50, feed_timeout=60)
        assert signal.getsignal(signal.SIGINT) is pyspark_handler
        report = cluster.train(df, 2, feed_timeout=60)
        assert report.rows == 2000 and report.spark_jobs == 2, report
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)
        df.unpersist()


def test_a_cluster_dropped_without_shutdown_stops_its_nodes(spark, caplog):
    """A notebook cell that runs `cluster = dataplane.run(...)` again drops the cluster it
    made before. Its nodes, ports and work directories used to stay until the driver
    exited, even past spark.stop(); now collecting it stops them, and says so."""
    import gc

    from tests.dataplane.mains import idle_main

    cluster = dataplane.run(spark, idle_main, {}, num_nodes=2)
    pids, cluster_id = [n.pid for n in cluster.nodes], cluster.cluster_id
    with caplog.at_level("WARNING", logger="dataplane.driver.cluster"):
        del cluster
        gc.collect()
    wait_gone(pids, 30)
    assert node_processes(cluster_id) == []
    deadline = time.monotonic() + 30
    while any(t.name == "dataplane-dropped-cluster" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the dropped cluster's stop did not end"
        time.sleep(0.1)
    notes = [r.getMessage() for r in caplog.records if "was dropped without shutdown()" in r.getMessage()]
    assert len(notes) == 1 and cluster_id in notes[0], notes


def test_bad_arguments_fail_before_anything_starts(spark):
    with pytest.raises(ValueError, match="num_nodes=2 cannot hold 2 ps"):
        dataplane.run(spark, describe_main, num_nodes=2, num_ps=2)
    with pytest.raises(TypeError, match="main must be callable"):
        dataplane.run(spark, "not a function")
    with pytest.raises(ValueError, match="port_range"):
        dataplane.run(spark, describe_main, port_range=(10, 5))


def test_a_parameter_server_layout_without_a_worker_is_warned_about(spark, caplog):
    """num_nodes=3, num_ps=1, evaluator=True is ps + chief + evaluator: TensorFlow's
    ParameterServerStrategy fails on it inside main, so run() says so before starting (the
    bad port_range then stops it before any node starts)."""
    with caplog.at_level("WARNING", logger="dataplane.driver.startup"):
        with pytest.raises(ValueError, match="port_range"):
            dataplane.run(spark, describe_main, num_nodes=3, num_ps=1, evaluator=True, port_range=(10, 5))
        with pytest.raises(ValueError, match="port_range"):
            dataplane.run(spark, describe_main, num_nodes=4, num_ps=1, evaluator=True, port_range=(10, 5))
    assert [r.getMessage() for r in caplog.records if r.name == "dataplane.driver.startup"] == [
        "num_nodes=3 with num_ps=1 and evaluator=True leaves no worker: the nodes are 1 ps + 1 "
        "chief + 1 evaluator. TensorFlow's ParameterServerStrategy needs at least one worker "
        "besides the chief (it raises 'There must be at least one worker'); use num_nodes=4 for one."
    ]


def test_importing_dataplane_does_not_import_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys, dataplane, formats, feeders, dataplane.driver.startup, "
        "dataplane.driver.cluster, dataplane.driver.feed; "
        "print('tensorflow' in sys.modules, 'pyspark' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_shutdown_waits_for_busy_mains_and_stops_waiting_ones(spark, tmp_path, monkeypatch, caplog):
    import dataplane.driver.cluster as driver_cluster
    from tests.dataplane.mains import polling_main, pull_main

    # pull mode: main is busy for 12 s, longer than stop_grace and than shutdown's timeout;
    # shutdown must not cut the training short (it did once `timeout` ran out)
    cluster = dataplane.run(spark, pull_main, {"dir": str(tmp_path), "seconds": 12}, num_nodes=2,
                            stop_grace=2.0)
    busy = cluster.metrics()
    assert [m["serving"] for m in busy.values()] == [False, False], busy  # no ctx.serve here
    assert [m.get("checks_should_stop", False) for m in busy.values()] == [False, False], busy
    t0 = time.monotonic()
    cluster.shutdown(timeout=3)
    assert all((tmp_path / f"finished{i}.json").exists() for i in (0, 1))
    assert time.monotonic() - t0 < 40
    # a main that polls ctx.should_stop expects to be told: stopped once the timeout runs out.
    # Until then the driver said nothing (60 s by default), so the wait is explained early.
    monkeypatch.setattr(driver_cluster, "POLLING_NOTE_AFTER", 0.5)
    cluster = dataplane.run(spark, polling_main, None, num_nodes=2, stop_grace=2.0)
    deadline = time.monotonic() + 30  # (a main just started may not have polled yet: then it is busy)
    while not all(m.get("checks_should_stop") for m in cluster.metrics().values()):
        assert time.monotonic() < deadline, cluster.metrics()
        time.sleep(0.1)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="dataplane.driver.cluster"):
        cluster.shutdown(timeout=3)
    assert 3 <= time.monotonic() - t0 < 20
    notes = [r.getMessage() for r in caplog.records if "which polls ctx.should_stop" in r.getMessage()]
    assert len(notes) == 1, notes
    assert notes[0].startswith("shutdown: node(s) [0, 1] still run main, which polls ctx.should_stop"), notes
    assert "timeout runs out (2 s from now)" in notes[0] or "timeout runs out (3 s from now)" in notes[0], notes
    assert "should call ctx.wait_stop(), which shutdown ends at once" in notes[0], notes


_BLOCK_DATAPLANE = '''
import sys


class _NotInstalledHere:
    """Executors of this test's app: spark-tf-dataplane is not installed in their Python."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dataplane", "feeders", "formats"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalledHere())
'''

_APP_WITHOUT_DATAPLANE_ON_EXECUTORS = '''
import os, sys
from pyspark.sql import SparkSession
import dataplane
from dataplane.errors import NodeError

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
try:
    dataplane.run(spark, lambda args, ctx: None, num_nodes=1, reservation_timeout=60)
    print("STARTED")
except NodeError as e:
    print("NODEERROR", e)
spark.stop()
'''


def test_executors_without_the_package_are_told_how_to_get_it(tmp_path):
    """A cluster whose executors' Python lacks spark-tf-dataplane (installed on the driver
    only): the launch fails at once, naming the missing module and the way to install it."""
    import os
    import subprocess
    import sys

    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(_BLOCK_DATAPLANE)
    python = tmp_path / "executor-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{block}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (tmp_path / "app.py").write_text(_APP_WITHOUT_DATAPLANE_ON_EXECUTORS)
    env = {**os.environ, "PYSPARK_PYTHON": str(python), "SPARK_LOCAL_IP": "127.0.0.1"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(tmp_path / "app.py")], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(("NODEERROR", "STARTED")))
    assert "the job starting the TF nodes failed" in line, line
    assert "No module named 'dataplane" in line, line
    assert "The executors' Python cannot import 'dataplane" in line, line
    assert "install spark-tf-dataplane with its dependencies in the Python they run" in line, line
    assert str(python) in line and "spark.archives" in line, line
    assert time.monotonic() - t0 < 120


def test_what_nodes_print_shows_on_the_driver_prefixed_with_the_node(spark, capsys):
    # a user's print() and Keras' progress lines went to node.log, which is removed with the
    # node: nothing of them ever reached the driver
    from tests.dataplane.mains import print_main

    cluster = dataplane.run(spark, print_main, {"raise_on": "worker"}, num_nodes=2)
    with pytest.raises(dataplane.NodeError, match="boom from worker"):
        cluster.shutdown()
    err = capsys.readouterr().err.splitlines()
    assert "[node 0 chief] hello from chief 0" in err
    assert "[node 1 worker] hello from worker 0" in err
    # a partial last line comes with the node's last message; the failing main's traceback too
    assert "[node 0 chief] last words, no newline" in err
    assert "[node 1 worker] ValueError: boom from worker" in err
    with dataplane.run(spark, print_main, {}, num_nodes=1, log_to_driver=False):
        pass
    assert "[node" not in capsys.readouterr().err


def test_tensorflow_noise_is_not_forwarded(capsys):
    # TF 2.16 (the compat stack) logs three "E ... Unable to register cuDNN factory" lines in
    # every node on a machine without a GPU, TF 2.21 a "failed call to cuInit" error and two
    # notices; forwarded, they read as each node's errors
    import threading
    from types import SimpleNamespace

    from dataplane.driver.control import ControlServer

    fake = SimpleNamespace(_cond=threading.Condition(), topology=None, status={})
    log = (
        "2026-11-27 17:29:34.404786: E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:10575] "
        "Unable to register cuDNN factory: Attempting to register factory for plugin cuDNN when "
        "one has already been registered\n"
        "2026-11-27 17:29:34.404827: E external/local_xla/xla/stream_executor/cuda/cuda_blas.cc:1442] "
        "Unable to register cuBLAS factory: Attempting to register factory for plugin cuBLAS when "
        "one has already been registered\n"
        # TF 2.21 (the current stack), whatever TF_CPP_MIN_LOG_LEVEL says
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795865792.122664   11205 port.cc:153] oneDNN custom operations are on. You "
        "may see slightly different numerical results due to floating-point round-off errors\n"
        "I0000 00:00:1795865792.123825   11205 cudart_stub.cc:31] Could not find cuda drivers on "
        "your machine, GPU will not be used.\n"
        "E0000 00:00:1795865796.887931   11205 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
        "I0000 00:00:1795874159.731369    5881 cpu_feature_guard.cc:227] This TensorFlow binary is "
        "optimized to use available CPU instructions in performance-critical operations.\n"
        "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other "
        "operations, rebuild TensorFlow with the appropriate compiler flags.\n"
        # what TF logs about the generator op under ctx.dataset(): ours, not the user's to act on
        "I0000 00:00:1795874168.474720    5881 generator_dataset_op.cc:213] Memory patch applied: "
        "M_TRIM_THRESHOLD=128 kb was set.\n"
        "W0000 00:00:1795874168.829006    5881 dataset.cc:997] Input of GeneratorDatasetOp::Dataset "
        "will not be optimized because the dataset does not implement the AsGraphDefInternal() "
        "method needed to apply optimizations.\n"
        # TF 2.16 (compat): at start-up, and whenever a pass over a dataset ends
        "2026-11-28 13:58:13.990785: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] "
        "TF-TRT Warning: Could not find TensorRT\n"
        "2026-11-28 13:58:27.930074: W tensorflow/core/framework/local_rendezvous.cc:404] Local "
        "rendezvous is aborting with status: OUT_OF_RANGE: End of sequence\n"
        "\t [[{{node MultiDeviceIteratorGetNextFromShard}}]]\n"
        "2026-11-28 13:58:27.940747: W tensorflow/core/framework/local_rendezvous.cc:404] Local "
        "rendezvous is aborting with status: OUT_OF_RANGE: End of sequence\n"
        "\t [[{{function_node cond_false_671}}{{node cond/IteratorGetNext}}]]\n"
        "epoch 1 loss 0.5\n"
        "\t [[{{node MyOwnOp}}]] (a tab-indented line of the program's own)\n"
        "To enable the following instructions in my model, see the README\n"
        "E something else went wrong\n"
        # a GPU machine whose driver fails is told so
        "E0000 00:00:1795865796.887931   11205 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL: CUDA error: Failed call to cuInit: CUDA_ERROR_NO_DEVICE (100)\n"
    )
    ControlServer._show_log(fake, {"node_id": 1, "log": log})
    assert capsys.readouterr().err.splitlines() == [
        "[node 1] epoch 1 loss 0.5",
        "[node 1] \t [[{{node MyOwnOp}}]] (a tab-indented line of the program's own)",
        "[node 1] To enable the following instructions in my model, see the README",
        "[node 1] E something else went wrong",
        "[node 1] E0000 00:00:1795865796.887931   11205 cuda_platform.cc:52] failed call to "
        "cuInit: INTERNAL: CUDA error: Failed call to cuInit: CUDA_ERROR_NO_DEVICE (100)"]
    ControlServer._show_log(fake, {"node_id": 1, "log": log.split("epoch")[0]})
    assert capsys.readouterr().err == ""


def test_log_tail_sends_whole_lines_then_the_rest(tmp_path):
    from dataplane.node.logtail import FINAL_BYTES, LogTail

    path = tmp_path / "node.log"
    tail = LogTail(str(path))
    assert tail.take() == ""  # no file yet
    path.write_bytes(b"one\ntwo\nhalf")
    assert tail.take() == "one\ntwo\n"
    assert tail.take() == ""  # a line still being written waits
    with open(path, "ab") as f:
        f.write(b" a line\n\xff\n")
    assert tail.take() == "half a line\n\ufffd\n"
    with open(path, "ab") as f:
        f.write(b"x" * (FINAL_BYTES + 10) + b"end")
    text = tail.take(final=True)
    note = "[... 1037 bytes of this node's log were not forwarded (it wrote faster than the heartbeats carry, 256 KiB each) ...]\n"
    assert text.startswith(note)
    assert text.endswith("xend") and len(text) == len(note) + FINAL_BYTES - 1024 <= FINAL_BYTES


def test_a_chatty_node_s_last_log_says_what_was_skipped_and_cuts_no_line(tmp_path):
    # a main that printed 100,000 lines: the driver got the first ~14,000 and the last ~10,000
    # with no word of the 76,000 between, and the first line after the hole arrived cut (the
    # note was sliced off with it)
    from dataplane.node.logtail import FINAL_BYTES, LogTail, clip

    path = tmp_path / "node.log"
    path.write_bytes(b"".join(b"line %07d of a chatty main\n" % i for i in range(100_000)))
    tail = LogTail(str(path))
    beat = tail.take()  # a heartbeat's worth
    assert beat.endswith("of a chatty main\n")
    text = clip(tail.take(final=True), FINAL_BYTES)
    head, first, rest = text.split("\n", 2)
    assert head.startswith("[... ") and head.endswith(" bytes of this node's log were not forwarded "
                                                      "(it wrote faster than the heartbeats carry, 256 KiB each) ...]")
    assert first.startswith("line ") and first.endswith(" of a chatty main") and len(first) == 29, first
    assert rest.endswith("line 0099999 of a chatty main\n") and len(text) <= FINAL_BYTES
    # what the heartbeat carried, what was skipped and what the last message carries: the file
    assert len(beat) + int(head.split()[1]) + len(text) - len(head) - 1 == path.stat().st_size


def test_log_text_reaches_the_driver_in_the_order_written(tmp_path):
    # a heartbeat and the node's "done" each carry new log text; sent from two threads they
    # could overtake each other, and the driver printed the last lines before earlier ones
    import threading

    from dataplane.node.logtail import LogTail
    from dataplane.node.process import _Node

    node = object.__new__(_Node)
    node.log_tail = LogTail(str(tmp_path / "node.log"))
    node._log_lock = threading.Lock()
    node._log_unsent = ""
    sent: list[tuple[str, str]] = []
    beat_in_flight, release_beat = threading.Event(), threading.Event()
    fail_next = []

    def action(client, name, body, timeout):  # type: ignore[no-untyped-def]
        if fail_next:
            fail_next.pop()
            raise ConnectionError("driver busy")
        if name == "heartbeat":
            beat_in_flight.set()
            assert release_beat.wait(10)
        sent.append((name, body.get("log", "")))
        return {}

    node._action = action
    log = tmp_path / "node.log"
    log.write_text("epoch 1\n")
    beat = threading.Thread(target=node._send_with_log, args=(None, "heartbeat", {}), kwargs={"timeout": 1})
    beat.start()
    assert beat_in_flight.wait(10)
    with open(log, "a") as f:
        f.write("epoch 2\nsaved")
    done = threading.Thread(target=node._send_with_log, args=(None, "done", {"ok": True}),
                            kwargs={"timeout": 1, "final": True})
    done.start()
    done.join(0.5)
    assert done.is_alive()  # waits for the heartbeat carrying the earlier lines
    release_beat.set()
    beat.join(10)
    done.join(10)
    assert sent == [("heartbeat", "epoch 1\n"), ("done", "epoch 2\nsaved")]

    # a message that does not arrive hands its text to the next one
    with open(log, "a") as f:
        f.write("\nlost?\n")
    fail_next.append(True)
    with pytest.raises(ConnectionError):
        node._send_with_log(None, "heartbeat", {}, timeout=1)
    node._send_with_log(None, "heartbeat", {}, timeout=1)
    assert sent[-1] == ("heartbeat", "\nlost?\n")


def test_a_model_saved_on_every_worker_and_a_chief_left_working_alone(spark, tmp_path, monkeypatch, caplog):
    # model.save on the chief alone under MWMS waits for the other workers forever (.keras and
    # SavedModel read variables with collectives), and shutdown waited with it, saying only
    # "its main is still running"
    import numpy as np

    import dataplane.driver.cluster as cluster_module
    from tests.dataplane.mains import save_main

    monkeypatch.setattr(cluster_module, "MWMS_HINT_AFTER", 1.0)
    df = spark.createDataFrame([([float(i % 7), 1.0, 2.0, 3.0], float(i % 5)) for i in range(256)],
                               "x array<float>, y float")
    with caplog.at_level("WARNING", logger="dataplane.driver.cluster"):
        with dataplane.run(spark, save_main, {"dir": str(tmp_path), "linger": 6}, num_nodes=2) as c:
            c.train(df, 1)
    chief, worker = (wait_json(tmp_path / f"node{i}.json") for i in (0, 1))
    path = str(tmp_path / "model.keras")
    assert chief["saved"] == path and worker["saved"] is None
    import tf_keras

    loaded = tf_keras.models.load_model(path)
    for got, want in zip(loaded.get_weights(), chief["weights"]):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6)
    assert len(loaded.get_weights()) == 8  # BatchNormalization's moving statistics included
    hints = [r.getMessage() for r in caplog.records if "ctx.save_model(model, path)" in r.getMessage()]
    assert len(hints) == 1, [r.getMessage() for r in caplog.records]
    assert "waiting for node(s) [0]" in hints[0] and "The main of node(s) [1] has returned" in hints[0]


@pytest.mark.timeout(150)  # (before: shutdown waited for ever)
def test_a_save_on_the_chief_alone_is_stopped_at_shutdown_and_named(spark, tmp_path):
    # Both workers save once, then the chief saves again alone: under MWMS a save is a
    # collective, so it waits for the worker, whose main has returned, for ever, and a drain
    # shutdown waited with it. The drain sees the chief saving its 2nd time beside a worker
    # that returned after 1 save: it stops the chief at once and says why.
    from tests.dataplane.mains import save_main

    df = spark.createDataFrame([([float(i % 7), 1.0, 2.0, 3.0], float(i % 5)) for i in range(256)],
                               "x array<float>, y float")
    cluster = dataplane.run(spark, save_main, {"dir": str(tmp_path), "linger": 0, "chief_saves_again": True},
                            num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    cluster.train(df, 1)
    assert wait_json(tmp_path / "node0.json")["saved"] == str(tmp_path / "model.keras")
    t0 = time.monotonic()
    with pytest.raises(NodeError) as info:
        cluster.shutdown(timeout=300)  # the save cannot finish: not waited for
    assert time.monotonic() - t0 < 60
    text = str(info.value)
    assert "node 0's main was stopped inside ctx.save_model" in text, text
    assert "the main of node(s) [1] had returned without this save (save 2 of node 0)" in text, text
    assert info.value.node.node_id == 0
    import tf_keras

    assert len(tf_keras.models.load_model(str(tmp_path / "model.keras")).get_weights()) == 8  # the 1st save
    wait_gone(pids)
