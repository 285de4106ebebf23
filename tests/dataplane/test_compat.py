"""dataplane.compat: TFoS's TFCluster / DataFeed API on the Flight data plane."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

from dataplane.compat import InputMode, TFCluster, rdd_to_dataframe
from dataplane.compat.TFNode import decode_rows
from dataplane.errors import ClusterStateError, FeedError, SchemaError
from tests.dataplane.clusterutil import node_processes, wait_gone, wait_json
from tests.dataplane.tfos_programs import (every_element_main, feed_and_answer_main, ps_joins_main,
                                          raising_answer_main, short_answer_main, stalled_worker_main)

ELEMENTS = [([float(i), i / 2.0, -1.0], i, f"row{i}") for i in range(60)]


def test_rdd_elements_round_trip_through_columns(spark):
    cases = {
        "tuple": ELEMENTS[:5],
        "list": [[i, "a", [1.5, 2.5]] for i in range(4)],
        "value": [1.5, 2.5, 3.5],
        "vector": [np.arange(3, dtype=np.float32) + i for i in range(3)],
        # ints first, floats later in the same field: the field is floating point for all
        "mixed": [([1, 2], 0, True), ([1.5, 2.5], 1, 2), ([3, 4], 0.5, 3)],
    }
    for name, elements in cases.items():
        df = rdd_to_dataframe(spark, spark.sparkContext.parallelize(elements, 2))
        table = pa.Table.from_pylist([r.asDict() for r in df.collect()], schema=None)
        rows = decode_rows({n: table.column(n) for n in table.column_names})
        assert len(rows) == len(elements), name
        for got, want in zip(rows, elements):
            assert type(got) is type(want) or isinstance(want, np.ndarray), (name, got)
            if name == "tuple":
                assert np.asarray(got[0]).tolist() == want[0] and got[1:] == want[1:]
            elif name == "vector":
                np.testing.assert_array_equal(got, want)
            elif name == "list":
                assert got[:2] == want[:2] and np.asarray(got[2]).tolist() == want[2]
            elif name == "mixed":
                assert got[0].dtype == np.float64 and got[0].tolist() == want[0], got
                assert type(got[1]) is float and got[1] == want[1], got
                assert type(got[2]) is int and got[2] == int(want[2]), got  # True widens to 1
            else:
                assert got == want


def test_inference_results_keep_their_types_without_pickle():
    from dataplane.compat.TFNode import _encoded, decode_result, encode_result
    from dataplane.errors import FeedError

    values = [None, True, 3, -2**70, 1.5, "é", b"\x00", np.float32(2.5), np.arange(6).reshape(2, 3),
              ("a", np.float32(1), np.array([1.0])), [1, [2, (3,)]], {"k": np.int64(4)}, np.array(["x", "yy"])]
    for v in values:
        back = decode_result(encode_result(v))
        assert type(back) is type(v), v
        if isinstance(v, np.ndarray):
            assert back.dtype == v.dtype and back.tolist() == v.tolist()
        elif isinstance(v, tuple):
            assert back[0] == v[0] and type(back[1]) is np.float32 and back[2].tolist() == [1.0]
        else:
            assert back == v, v
    with pytest.raises(FeedError, match=r"batch_results value 1 holds a set \(\{1\}\), which cannot be "
                                        r"returned to the driver; return numbers, str, bytes"):
        _encoded([1.0, {1}])


def test_unfeedable_elements_are_refused(spark):
    sc = spark.sparkContext
    with pytest.raises(SchemaError, match="empty RDD"):
        rdd_to_dataframe(spark, sc.parallelize([], 1))
    with pytest.raises(SchemaError, match="dict"):
        rdd_to_dataframe(spark, sc.parallelize([({"a": 1}, 2)], 1))
    with pytest.raises(SchemaError, match=r"field 1 of RDD element 2 is 'x' \(string\) but the "
                                          r"first element's field 1 is bigint"):
        rdd_to_dataframe(spark, sc.parallelize([([1.0], 1), ([2.0], 2), ([3.0], "x")], 1))


def test_a_float_after_the_typed_sample_is_refused_not_cut(spark):
    """The first TYPE_SAMPLE elements type the columns; a later 1.5 in an integer field would be
    cut to 1, so the task refuses it and names the field and the fix."""
    from formats.staging import task_error

    sc = spark.sparkContext
    ints = [([1, 2], 0)] * 150
    for bad, why in [(([1.5, 2.5], 1), "its values would be cut to integers"),
                     (([1, 2], 0.5), "it would lose its fraction")]:
        df = rdd_to_dataframe(spark, sc.parallelize(ints + [bad], 2))
        assert [f.dataType.simpleString() for f in df.schema] == ["array<bigint>", "bigint"]
        with pytest.raises(Exception) as info:
            df.collect()
        refused = task_error(info.value)
        assert isinstance(refused, SchemaError), str(info.value)[-600:]
        field = 0 if isinstance(bad[0][0], float) else 1
        assert str(refused).startswith(f"field {field} of an RDD element is {bad[field]!r}, "
                                       f"but the first 100 elements held only integers"), refused
        assert why in str(refused) and "floating point in every element" in str(refused)
    # integral floats fit an integer field exactly and pass as ints
    rows = rdd_to_dataframe(spark, sc.parallelize(ints + [([3.0, 4.0], 2.0)], 2)).collect()
    assert rows[-1][0] == [3, 4] and rows[-1][1] == 2 and type(rows[-1][1]) is int


@pytest.mark.cluster
def test_tfos_program_trains_terminates_and_infers(spark, tmp_path):
    sc = spark.sparkContext
    rdd = sc.parallelize(ELEMENTS, 4)
    args = {"dir": str(tmp_path), "take": len(ELEMENTS)}
    cluster = TFCluster.run(sc, feed_and_answer_main, args, 1, 0, False, InputMode.SPARK,
                            master_node="chief")
    try:
        # refused before any row is pushed: the driver raises the task's SchemaError, not Spark's
        with pytest.raises(SchemaError, match=r"^field 0 of an RDD element is \[1.5, 2.5\], but"):
            cluster.train(sc.parallelize([([1, 2], 0, "a")] * 120 + [([1.5, 2.5], 1, "b")], 2), 1)
        cluster.train(rdd, 1)
        info = wait_json(tmp_path / "tfos.json")
        cluster.train(rdd, 3)  # after terminate(): the node refuses these, train must not hang
        results = cluster.inference(sc.parallelize(ELEMENTS, 3)).collect()
    finally:
        cluster.shutdown(timeout=120)
    assert (info["job_name"], info["task_index"], info["worker_num"], info["num_workers"]) == (
        "chief", 0, 0, 1)
    assert list(info["cluster_spec"]) == ["chief"]
    assert info["should_stop_after_terminate"] is False  # as TFoS: only the feed's end stops it
    # every element of the first epoch exactly once, as a tuple with an ndarray field
    assert all(r[0] == "tuple" and r[2] == "ndarray" for r in info["rows"])
    got = sorted((r[3], r[4], tuple(r[1])) for r in info["rows"])
    assert got == sorted((e[1], e[2], tuple(e[0])) for e in ELEMENTS)
    # the values batch_results got, types kept (as TFoS's pickled queue did)
    assert [r[0] for r in results] == [f"{e[1] * 10}:{e[2]}" for e in ELEMENTS]
    assert all(type(r[1]) is np.float32 and r[1] == e[1] for r, e in zip(results, ELEMENTS))
    assert all(r[2].dtype == np.float64 and r[2].tolist() == e[0] for r, e in zip(results, ELEMENTS))
    # map_fun saw each inference element exactly once: no probe batch before the real ones
    answered = sorted(int(x) for x in (tmp_path / "answered.txt").read_text().split())
    assert answered == sorted(e[1] for e in ELEMENTS)


def _labels(tmp_path, want: int, timeout: float = 60.0) -> list[int]:
    """Every label the two workers' map_fun has read, once their count reaches ``want``."""
    import json

    deadline = time.monotonic() + timeout
    got: list[int] = []
    while time.monotonic() < deadline:
        got = []
        for i in (0, 1):
            p = tmp_path / f"node{i}.json"
            if p.exists():
                try:
                    got += json.loads(p.read_text())
                except ValueError:  # being replaced
                    break
        if len(got) >= want:
            break
        time.sleep(0.1)
    return got


def test_tfos_train_on_two_workers_feeds_every_element_and_survives_a_terminate(spark, tmp_path):
    """TFoS feeds every element: 103 rows in 3 partitions over 2 workers lost one row an
    epoch (the same one: id 85) to the equal-batches rule of Cluster.train. And a worker that
    terminate()s while the other reads on made the next epoch fail with 'rows were lost in
    transit' (it was told the other worker's row count), after which shutdown waited its
    whole timeout."""
    sc = spark.sparkContext
    rdd = sc.parallelize([([float(i)], i) for i in range(103)], 3)
    cluster = TFCluster.run(sc, every_element_main, {"dir": str(tmp_path), "more": 30}, 2, 0, False,
                            InputMode.SPARK)
    pids = [n.pid for n in cluster.cluster.nodes]
    try:
        cluster.train(rdd, 2)
        _labels(tmp_path, 206 - 2 * 6)  # (each worker's next_batch(7) may still hold 6 rows)
        (tmp_path / "terminate").touch()
        t0 = time.monotonic()
        cluster.train(rdd, 2, feed_timeout=60)  # worker 1 terminates on the way: no error
        assert time.monotonic() - t0 < 50
        t0 = time.monotonic()
        cluster.shutdown(timeout=120)  # the feed's end hands map_fun its last partial batches
        assert time.monotonic() - t0 < 30
        got = _labels(tmp_path, 0)
        counts = [got.count(i) for i in range(103)]
        # the first train: every element twice; the second: worker 0's share twice, worker 1's
        # 30-36 rows before its terminate(), the rest of its share refused
        assert min(counts) >= 2 and max(counts) <= 4 and len(got) == sum(counts), counts
        assert 206 + 30 < len(got) < 412, len(got)
    finally:
        if cluster.cluster._state == "running":
            cluster.shutdown(timeout=30)
        wait_gone(pids, 30)


def test_tfos_batch_results_with_a_result_missing_fails_the_inference_at_once(spark):
    sc = spark.sparkContext
    cluster = TFCluster.run(sc, short_answer_main, {}, 1, 0, False, InputMode.SPARK)
    pids = [n.pid for n in cluster.cluster.nodes]
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            cluster.inference(sc.parallelize([([1.0], i) for i in range(20)], 2), feed_timeout=300).collect()
        assert time.monotonic() - t0 < 60  # it waited for the missing answer until feed_timeout
        # each partition of 10 rows is one request: next_batch(7) takes its first 7
        assert "batch_results got 6 result(s) for the 7 row(s) of the last next_batch" in str(info.value)
    finally:
        try:
            cluster.shutdown(timeout=30)
        except Exception:  # noqa: BLE001 - map_fun raised: shutdown reports it
            pass
        wait_gone(pids, 30)


def test_a_map_fun_raising_during_inference_fails_the_collect_with_its_error(spark):
    # the collect said only that map_fun "stopped reading"; what it raised came at shutdown
    from dataplane.errors import NodeError

    sc = spark.sparkContext
    cluster = TFCluster.run(sc, raising_answer_main, {}, 1, 0, False, InputMode.SPARK)
    pids = [n.pid for n in cluster.cluster.nodes]
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            cluster.inference(sc.parallelize([([1.0], i) for i in range(40)], 2), feed_timeout=300).collect()
        assert time.monotonic() - t0 < 60
        assert "the node's map_fun raised ValueError: the model failed on label" in str(info.value)
    finally:
        with pytest.raises(NodeError, match="ValueError: the model failed on label"):
            cluster.shutdown(timeout=30)
        wait_gone(pids, 30)


def test_a_parameter_server_that_joins_forever_does_not_hold_up_shutdown(spark):
    """A ps's map_fun is server.join(), which never returns: shutdown waited out stop_grace
    (120 s) for it on every run; TFoS stops its ps nodes at once."""
    cluster = TFCluster.run(spark.sparkContext, ps_joins_main, None, 2, num_ps=1,
                            input_mode=InputMode.TENSORFLOW)
    pids = [n.pid for n in cluster.cluster.nodes]
    assert sorted(n.role for n in cluster.cluster.nodes) == ["chief", "ps"]
    t0 = time.monotonic()
    cluster.shutdown(timeout=120)
    assert time.monotonic() - t0 < 30
    wait_gone(pids, 30)


def test_shutdown_timeout_bounds_a_map_fun_that_never_reads_again(spark):
    """TFoS's shutdown(timeout=) ends the application when it runs out; here a map_fun stuck in
    its own code held shutdown until it returned (123 s for timeout=20, stop_grace=10)."""
    sc = spark.sparkContext
    cluster = TFCluster.run(sc, stalled_worker_main, {"stall": 300}, 2, 0, False, InputMode.SPARK,
                            stop_grace=3)
    pids = [n.pid for n in cluster.cluster.nodes]
    # the stuck worker is named, not the chief that read all it got, with the TFoS-side fix
    with pytest.raises(FeedError) as info:
        cluster.train(sc.parallelize([([float(i)], i) for i in range(4000)], 4), 1, feed_timeout=30)
    msg = str(info.value)
    assert "node(s) [1] stopped reading it" in msg, msg  # (node 0 was blamed too)
    assert "reads its DataFeed until next_batch returns an empty batch" in msg, msg
    t0 = time.monotonic()
    cluster.shutdown(grace_secs=0, timeout=5)
    assert time.monotonic() - t0 < 40
    wait_gone(pids, 30)


def test_spark_only_calls_refused_in_tensorflow_mode(spark):
    fake = TFCluster.TFCluster.__new__(TFCluster.TFCluster)
    fake.input_mode = InputMode.TENSORFLOW
    with pytest.raises(ClusterStateError, match="InputMode.SPARK"):
        fake.train(spark.sparkContext.parallelize([1]), 1)
    sc = spark.sparkContext
    with pytest.raises(ValueError, match="driver_ps_nodes"):
        TFCluster.run(sc, feed_and_answer_main, {}, 1, 0, driver_ps_nodes=True)
    with pytest.raises(ValueError, match="eval_node"):
        TFCluster.run(sc, feed_and_answer_main, {}, 2, 0, False, InputMode.SPARK, eval_node=True)


def test_hdfs_path_follows_tfos_rules():
    from types import SimpleNamespace

    from dataplane.compat import TFNode

    hdfs = SimpleNamespace(defaultFS="hdfs://nn:8020", working_dir="/work/dir")
    local = SimpleNamespace(defaultFS="file://", working_dir="/work/dir")
    assert TFNode.hdfs_path(hdfs, "s3a://b/k") == "s3a://b/k"
    assert TFNode.hdfs_path(hdfs, "/data/x") == "hdfs://nn:8020/data/x"
    assert TFNode.hdfs_path(hdfs, "data/x").startswith("hdfs://nn:8020/user/")
    assert TFNode.hdfs_path(local, "/data/x") == "file:///data/x"
    assert TFNode.hdfs_path(local, "data/x") == "file:///work/dir/data/x"


def test_tf1_names_are_refused_with_their_tf2_replacement():
    from dataplane.compat import TFNode
    from dataplane.compat.pipeline import HasInputMode, TFEstimator, get_meta_graph_def

    with pytest.raises(NotImplementedError, match="tf.distribute"):
        TFNode.start_cluster_server(None)
    with pytest.raises(NotImplementedError, match="compat.export_saved_model"):
        TFNode.export_saved_model(None, "/x", "serve", {})
    for fn in (TFNode.next_batch, TFNode.batch_results, TFNode.terminate):
        with pytest.raises(NotImplementedError, match="DataFeed"):
            fn(None, 1)
    with pytest.raises(NotImplementedError, match="tf.saved_model.load"):
        get_meta_graph_def("/x", "serve")
    with pytest.raises(ValueError, match="compat.export_saved_model"):
        TFEstimator(len, {}, export_fn=len)
    with pytest.raises(ValueError, match="InputMode.TENSORFLOW"):
        TFEstimator(len, {}).setInputMode(InputMode.TENSORFLOW)
    assert issubclass(TFEstimator, HasInputMode)


def test_pipeline_params_keep_tfos_names_and_pass_to_the_model():
    from dataplane.compat.pipeline import Namespace, TFEstimator, TFModel

    est = (TFEstimator(len, {"rows": 10}).setInputMapping({"b": "x", "a": "y"})
           .setClusterSize(2).setEpochs(3).setBatchSize(8).setExportDir("/e").setGraceSecs(5))
    args = est.merge_args_params()
    assert (args.rows, args.cluster_size, args.epochs, args.batch_size, args.export_dir,
            args.master_node, args.num_ps) == (10, 2, 3, 8, "/e", "chief", 0)
    model = est._copyValues(TFModel(est.args))
    assert (model.getExportDir(), model.getBatchSize(), model.getInputMapping()) == (
        "/e", 8, {"b": "x", "a": "y"})
    assert model.getSignatureDefKey() is None and Namespace(["--x", "1"]).argv == ["--x", "1"]


def test_without_master_node_every_node_is_a_worker_as_in_tfos():
    from types import SimpleNamespace

    from dataplane.compat.TFCluster import _as_workers_only

    spec = {"chief": ["h:1"], "worker": ["h:2", "h:3"]}
    chief = SimpleNamespace(cluster_spec={k: list(v) for k, v in spec.items()},
                            job_name="chief", task_index=0)
    worker = SimpleNamespace(cluster_spec={k: list(v) for k, v in spec.items()},
                             job_name="worker", task_index=1)
    _as_workers_only(chief)
    _as_workers_only(worker)
    assert (chief.job_name, chief.task_index, worker.job_name, worker.task_index) == (
        "worker", 0, "worker", 2)
    assert chief.cluster_spec == {"worker": ["h:1", "h:2", "h:3"]}


def _report_temp_dir(args, ctx):  # type: ignore[no-untyped-def]
    import json
    import os
    import tempfile

    with open(os.path.join(args, f"instance{ctx.worker_num}.json"), "w") as f:
        json.dump({"temp": tempfile.gettempdir(), "local": os.environ["SPARK_LOCAL_DIRS"],
                   "pid": os.getpid()}, f)


def test_parallel_instances_keep_their_temp_files_in_spark_scratch(spark, tmp_path):
    # a TFParallel instance runs TF in Spark's Python worker, which ends with os._exit: TF's
    # autograph files written to /tmp were never removed (one pair per scoring run)
    import json
    import os

    from dataplane.compat import TFParallel

    TFParallel.run(spark.sparkContext, _report_temp_dir, str(tmp_path), 2)
    reports = [json.loads((tmp_path / f"instance{i}.json").read_text()) for i in range(2)]
    for r in reports:
        scratch = r["local"].split(",")[0]
        assert r["temp"] == os.path.join(scratch, f"dataplane-tmp-{r['pid']}")
        assert os.path.basename(scratch).startswith("blockmgr-")


def test_tfmodel_answers_with_a_savedmodel_exported_again_to_the_same_directory(tmp_path):
    # TFModel's executors keep loaded SavedModels per process (Spark reuses its Python
    # workers): one retrained and exported to the same export_dir must not be served stale
    import tensorflow as tf

    from dataplane.compat.pipeline import _signature

    def export(scale: float) -> None:
        class Scale(tf.Module):
            @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
            def serve(self, x):  # type: ignore[no-untyped-def]
                return {"y": x * scale}

        m = Scale()
        tf.saved_model.save(m, str(tmp_path / "export"), signatures={"serving_default": m.serve})

    x = tf.constant([1.0, 2.0])
    export(2.0)
    assert _signature(str(tmp_path / "export"), None, None)(x=x)["y"].numpy().tolist() == [2.0, 4.0]
    time.sleep(0.01)  # (a new modification time even on coarse clocks)
    export(3.0)
    assert _signature(str(tmp_path / "export"), None, None)(x=x)["y"].numpy().tolist() == [3.0, 6.0]
