"""The Flight push data plane on real Spark, real Flight and real TF: one shared 2-node cluster."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

import dataplane
from dataplane.errors import FeedError, SchemaError
from feeders.push import PartitionPusher
from tests.builders import row_checksum
from tests.dataplane.clusterutil import wait_gone, wait_json
from tests.dataplane.mains import feed_main

pytestmark = pytest.mark.cluster

BUFFER = 256 * 1024
CHUNK = 32 * 1024


@pytest.fixture(scope="module")
def feed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("feed")


@pytest.fixture(scope="module")
def cluster(spark, feed_dir):
    c = dataplane.run(
        spark, feed_main, {"dir": str(feed_dir), "batch_size": 64}, num_nodes=2,
        buffer_bytes=BUFFER, max_chunk_bytes=CHUNK,
    )
    yield c
    pids = [n.pid for n in c.nodes]
    c.shutdown()
    wait_gone(pids, 15)


class _Epochs:
    """Hands out the node-side epoch numbers in the order the tests push them."""

    next = 0


def make_df(spark, rows: int, partitions: int):
    """id, x, a fixed-length vec (dense [n, 3]) and a variable-length tags list (ragged)."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "id",
        "cast(id as double) * 0.5 as x",
        "array(cast(id as float), cast(id + 1 as float), cast(id + 2 as float)) as vec",
        "slice(array(id, id, id), 1, cast(id % 3 as int)) as tags",
    )


def epoch_results(feed_dir, epoch: int, node_ids) -> list[dict]:
    return [wait_json(feed_dir / f"node{i}-epoch{epoch}.json") for i in node_ids]


def check_epoch(results, rows: int) -> None:
    count = sum(r["count"] for r in results)
    sumsq = sum(r["sumsq"] for r in results)
    assert (count, sumsq) == row_checksum(np.arange(rows))
    assert len({r["batches"] for r in results}) == 1, "workers yielded different batch counts"


def test_every_row_once_per_epoch_over_three_epochs(spark, cluster, feed_dir):
    rows = 3000
    df = make_df(spark, rows, 4).cache()
    bytes_before = {n: mm["bytes_in"] for n, mm in cluster.metrics().items()}
    report = cluster.train(df, num_epochs=3)
    assert report.rows == 3 * rows and report.dropped_for_balance == 0
    # Bytes: what the tasks sent is what the nodes took in (no retries here), and it is the
    # rows' own payload: at least the fixed-width columns (id 8, x 8, vec 3 x 4 bytes a row),
    # at most that plus tags (<= 2 x 8), offsets and validity bits. Counting a slice's whole
    # parent buffers (the chunks are slices of Spark's batches) would overshoot it many times.
    taken = sum(mm["bytes_in"] - bytes_before[n] for n, mm in cluster.metrics().items())
    assert report.bytes == taken
    assert 3 * rows * 28 <= report.bytes <= 3 * rows * (28 + 16 + 8 + 2)
    assert sum(report.rows_per_node.values()) == 3 * rows
    assert report.rows_per_node == {0: 3 * rows // 2, 1: 3 * rows // 2}
    for _ in range(3):
        res = epoch_results(feed_dir, _Epochs.next, [0, 1])
        _Epochs.next += 1
        check_epoch(res, rows)
        for r in res:
            assert r["vec_shapes"] == [[3]]  # fixed-length arrays arrive dense [batch, 3]
            assert r["dtypes"] == {"id": "int64", "x": "float64", "vec": "float32", "tags": "int64"}
            assert r["tag_rows"] == r["count"]
        ids = np.arange(rows)
        assert sum(r["tag_values"] for r in res) == int(np.sum(ids % 3))


def test_uneven_partitions_give_equal_batches(spark, cluster, feed_dir):
    # partitions of 5, 9, 1, 0 and 500 rows: split row by row with the rotation, the workers
    # receive 258 and 257, so one row is dropped to keep their batch counts equal
    bounds = [0, 5, 14, 15, 15, 515]
    parts = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    from pyspark.sql import Row

    rdd = spark.sparkContext.parallelize(parts, len(parts)).flatMap(lambda p: [Row(id=i) for i in p])
    df = make_df(spark, 1, 1).limit(0).unionByName(
        spark.createDataFrame(rdd, "id long").selectExpr(
            "id", "cast(id as double) * 0.5 as x",
            "array(cast(id as float), cast(id + 1 as float), cast(id + 2 as float)) as vec",
            "slice(array(id, id, id), 1, cast(id % 3 as int)) as tags",
        )
    )
    report = cluster.train(df)
    res = epoch_results(feed_dir, _Epochs.next, [0, 1])
    _Epochs.next += 1
    yielded = sum(r["count"] for r in res)
    assert res[0]["count"] == res[1]["count"] and res[0]["batches"] == res[1]["batches"]
    assert report.rows == 515 and report.rows_per_node == {0: 258, 1: 257}
    assert report.dropped_for_balance == 1 and yielded == 514
    assert res[0]["count"] == 257


def test_one_push_job_serves_every_epoch_of_a_dataframe(spark, cluster, feed_dir):
    # Classic Spark: the epoch rides on a job-local property, so the mapInArrow DataFrame is
    # built once per (DataFrame, workers) and each epoch's rows still land in their own epoch.
    rows = 600
    df = make_df(spark, rows, 3)
    cluster.train(df, num_epochs=2)
    frame = cluster._feeder._jobs._push_frame[2]
    cluster.train(df)
    assert cluster._feeder._jobs._push_frame[2] is frame
    for _ in range(3):
        check_epoch(epoch_results(feed_dir, _Epochs.next, [0, 1]), rows)
        _Epochs.next += 1


def test_a_push_job_outside_train_says_so(spark, cluster):
    from feeders.push import PUSH_RESULT_SCHEMA

    pusher = PartitionPusher(
        secret="x", epoch=None, locations=[(0, cluster.nodes[0].flight_location)],
        schema_ipc=pa.schema([("id", pa.int64())]).serialize().to_pybytes(),
    )
    with pytest.raises(Exception, match="carries no 'dataplane.push.epoch' property; push jobs are started by cluster.train"):
        spark.range(3).mapInArrow(pusher, PUSH_RESULT_SCHEMA).collect()


class FailingPusher(PartitionPusher):
    """The real pusher, whose input fails on partition 1's first attempt after six batches: the
    rows before the failure are pushed for sure, so the retry must be deduplicated."""

    def __call__(self, batches):  # type: ignore[no-untyped-def]
        from pyspark import TaskContext

        tc = TaskContext.get()

        def failing():
            for i, b in enumerate(batches):
                if tc.partitionId() == 1 and tc.attemptNumber() == 0 and i == 6:
                    raise RuntimeError("injected failure on the first attempt")
                yield b

        yield from super().__call__(failing())


def _train_with_a_failed_attempt(spark, cluster, monkeypatch, rows: int, **train_kw):
    """``cluster.train`` of ``rows`` rows in 50-row Arrow batches, partition 1's first attempt
    failing after six of them (FailingPusher); returns (report, rows counted as duplicates)."""
    import feeders.push

    before = sum(m["rows_duplicate"] for m in cluster.metrics().values())
    monkeypatch.setattr(feeders.push, "PartitionPusher", FailingPusher)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "50")
    try:
        report = cluster.train(make_df(spark, rows, 2), **train_kw)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    return report, sum(m["rows_duplicate"] for m in cluster.metrics().values()) - before


def test_retried_task_feeds_every_row_exactly_once(spark, cluster, feed_dir, monkeypatch):
    rows = 2000
    report, dup = _train_with_a_failed_attempt(spark, cluster, monkeypatch, rows)
    res = epoch_results(feed_dir, _Epochs.next, [0, 1])
    _Epochs.next += 1
    check_epoch(res, rows)
    assert report.rows == rows
    # six 50-row batches of partition 1 were pushed by the failed attempt and re-sent by the retry
    assert dup == 300


def test_a_task_retried_while_recording_the_cache_replays_every_row_once(spark, cluster, feed_dir, monkeypatch):
    # the failed attempt's 300 rows reach the nodes' caches before the retry sends them again:
    # the cache must hold them once, or every replayed epoch repeats them
    rows = 2000
    report, dup = _train_with_a_failed_attempt(spark, cluster, monkeypatch, rows, num_epochs=3,
                                               cache=True, shuffle=True, seed=3)
    for _ in range(3):
        check_epoch(epoch_results(feed_dir, _Epochs.next, [0, 1]), rows)
        _Epochs.next += 1
    assert (report.rows, report.spark_jobs, report.dropped_for_balance) == (3 * rows, 1, 0)
    assert report.rows_unconsumed == {}
    assert dup == 300


def test_slow_consumer_keeps_the_buffer_bounded(spark, cluster, feed_dir):
    rows = 24_000  # ~0.5 MB of Arrow data a node, twice its buffer: producers must wait
    stalled = {n: mm["stall_seconds"] for n, mm in cluster.metrics().items()}
    (feed_dir / "slow").write_text("1")
    try:
        report = cluster.train(make_df(spark, rows, 3))
        res = epoch_results(feed_dir, _Epochs.next, [0, 1])
        _Epochs.next += 1
    finally:
        (feed_dir / "slow").unlink()
    check_epoch(res, rows)
    m = cluster.metrics()
    for node_id, mm in m.items():
        assert mm["buffer_capacity"] == BUFFER
        assert BUFFER // 2 <= mm["buffer_peak_bytes"] <= BUFFER, (node_id, mm)
        # Stall counts only time spent waiting on a full buffer. The slow main stops at its
        # first batch until producers have waited 0.3 s without a break, so every node's producers
        # waited at least that long (a CI run where Spark pushed no faster than 0.05 s a batch was read
        # saw 0.02 s before the main held).
        waited = mm["stall_seconds"] - stalled[node_id]
        assert waited >= 0.3, ("the producers never waited", node_id, waited, mm)
    assert report.rows == rows


def test_metrics_count_what_was_pushed(cluster):
    m = cluster.metrics()
    assert set(m) == {0, 1}
    for mm in m.values():
        for key in ("rows_in", "bytes_in", "batches_in", "buffer_bytes", "stall_seconds"):
            assert key in mm
        assert mm["rows_in"] > 0 and mm["bytes_in"] > 0 and mm["batches_in"] > 0
        assert mm["serving"] is True  # feed_main serves from a thread all along
    # every epoch the tests above fed, in order; a cached epoch's replays count as they are fed
    assert sum(mm["rows_in"] for mm in m.values()) == 3 * 3000 + 515 + 3 * 600 + 2000 + 3 * 2000 + 24_000


def test_inference_returns_one_answer_per_row_keyed_by_id(spark, cluster):
    rows = 5000
    df = make_df(spark, rows, 3)
    out = cluster.inference(df, passthrough=("id",))
    assert out.columns == ["id", "y", "vec_sum", "mask"]
    # a [rows, 2, 3] uint8 answer keeps its shape, in a type Spark holds (it has no uint8)
    assert out.schema["mask"].dataType.simpleString() == "array<array<bigint>>"
    pdf = out.toPandas().sort_values("id").reset_index(drop=True)
    ids = np.arange(rows)
    assert len(pdf) == rows and (pdf["id"].to_numpy() == ids).all()
    np.testing.assert_allclose(pdf["y"].to_numpy(), ids * 0.5 * 2.0)
    np.testing.assert_allclose(pdf["vec_sum"].to_numpy(), 3 * ids + 3.0, rtol=1e-6)
    assert str(pdf["vec_sum"].dtype) == "float32"
    masks = np.array([np.stack(list(m)) for m in pdf["mask"]])
    want = (ids[:, None] + np.arange(3)[None, :]) % 256
    np.testing.assert_array_equal(masks, np.stack([want, (want + 1) % 256], axis=1))


def test_inference_of_one_large_partition_answers_every_request(spark, cluster):
    # 60,000 rows in one partition, 512-row requests: 118 round trips on one do_exchange stream
    rows = 60_000
    df = make_df(spark, rows, 1).select("id", "x", "vec")
    out = cluster.inference(df, passthrough=("id",), max_rows=512).toPandas()
    assert len(out) == rows and out["id"].nunique() == rows
    out = out.sort_values("id").reset_index(drop=True)
    np.testing.assert_allclose(out["y"].to_numpy(), np.arange(rows) * 0.5 * 2.0)
    np.testing.assert_allclose(out["vec_sum"].to_numpy(), 3 * np.arange(rows) + 3.0, rtol=1e-6)


def test_inference_of_many_small_partitions_runs_a_few_tasks_per_slot(spark, cluster):
    # a join's or aggregation's output has 200 partitions (spark.sql.shuffle.partitions): Spark
    # spends tens of ms on every Python task, and each opened its own exchange streams (200
    # partitions of 100,000 rows took 7 s a pass before, 0.5 s coalesced)
    from dataplane.driver.pushjob import TASKS_PER_SLOT

    rows, parts = 3000, 60
    df = make_df(spark, rows, parts).select("id", "x", "vec")
    out = cluster.inference(df, passthrough=("id",))
    tasks = min(parts, TASKS_PER_SLOT * spark.sparkContext.defaultParallelism)
    assert tasks < parts and out.rdd.getNumPartitions() == tasks
    pdf = out.toPandas().sort_values("id").reset_index(drop=True)
    assert len(pdf) == rows and (pdf["id"].to_numpy() == np.arange(rows)).all()
    np.testing.assert_allclose(pdf["y"].to_numpy(), np.arange(rows) * 0.5 * 2.0)


def test_inference_rejects_unknown_passthrough(spark, cluster):
    with pytest.raises(SchemaError, match="passthrough column 'nope'"):
        cluster.inference(make_df(spark, 10, 1), passthrough=("nope",))


def test_inference_keeps_passthrough_keys_tensorflow_cannot_hold_out_of_predict(spark, cluster):
    # a decimal key and a map of attributes come back untouched from Spark's side; a column
    # predict would be sent that no tensor can hold is refused on the driver, with the fix
    df = make_df(spark, 300, 2).selectExpr(
        "id", "x", "vec", "cast(id as decimal(10, 2)) as price", "map('k', id) as attrs")
    out = cluster.inference(df, passthrough=("id", "price", "attrs")).toPandas()
    out = out.sort_values("id").reset_index(drop=True)
    assert list(out.columns) == ["id", "price", "attrs", "y", "vec_sum", "mask"]
    assert [float(p) for p in out["price"]] == list(np.arange(300.0))
    assert [dict(a)["k"] for a in out["attrs"]] == list(range(300))
    np.testing.assert_allclose(out["y"].to_numpy(), np.arange(300) * 0.5 * 2.0)
    with pytest.raises(SchemaError) as info:
        cluster.inference(df, passthrough=("id", "attrs"))
    msg = str(info.value)
    assert "column 'price'" in msg and "decimal" in msg and "pass columns=" in msg, msg
    with pytest.raises(SchemaError, match="leave it out of columns="):
        cluster.inference(df, passthrough=("id",), columns=("x", "vec", "attrs"))
    # every column a passthrough of a type TF lacks: nothing would reach predict
    with pytest.raises(SchemaError) as info:
        cluster.inference(df.select("price", "attrs"), passthrough=("price", "attrs"))
    assert str(info.value) == (
        "inference: no column of the DataFrame can be sent to predict as a tensor (its columns: "
        "['price', 'attrs']); cast the inputs predict reads to numbers, strings or arrays of them.")


def _serve_a_tensor_main(args, ctx):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    ctx.serve(lambda b: tf.constant(np.asarray(b["x"], np.float32) * 2))  # not a dict


def test_predict_returning_a_tensor_is_told_the_shape_of_an_answer(spark):
    """``ctx.serve(lambda b: model(b['x']))``: refused with the form of an answer, in a message
    without gRPC's debug context, whether the columns are probed or declared."""
    want = ("node 0: predict must return a dict of output columns (name -> array with one entry "
            "per input row), got EagerTensor; for example return {'prediction': "
            "np.asarray(model(batch['x']))}")
    df = spark.range(0, 40, 1, 2).selectExpr("id", "CAST(id AS FLOAT) AS x")
    cluster = dataplane.run(spark, _serve_a_tensor_main, {}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        with pytest.raises(FeedError) as info:
            cluster.inference(df)
        assert str(info.value) == f"inference: node 0 could not answer a probe batch: {want}"
        with pytest.raises(Exception) as info:
            cluster.inference(df, output_schema=pa.schema([("y", pa.float32())])).collect()
        text = str(info.value)
        assert f"on node 0 at grpc://127.0.0.1:" in text and f"failed: {want}" in text, text
        assert "If the cluster was shut down" not in text, text  # the node answered: not dead
        assert "gRPC client debug context" not in text and "Detail:" not in text, text
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)


def _picky_serve_main(args, ctx):  # type: ignore[no-untyped-def]
    def predict(batch):  # type: ignore[no-untyped-def]
        x = batch["x"]
        if (x == 33).any():
            raise RuntimeError(f"boom on {float(x[x == 33][0])}")
        return {"y": np.where(x == 20, 1e300, x * 2.0)}

    ctx.serve(predict)


def test_inference_errors_name_the_cause_and_arguments_are_checked_on_the_driver(spark):
    """What a user gets wrong in cluster.inference, and what predict gets wrong, each said once
    and where it can be fixed: arguments on the driver (they failed inside Spark tasks, with
    'range() arg 3 must not be zero' or an Arrow IPC error); predict's exception with its line on
    the node (and no advice about dead nodes after it); a float beyond the float32 output
    (it became inf); an output that output_schema declares but predict does not return; a null
    input, with a fix inference has (fill_values is ctx.dataset's)."""
    df = spark.range(0, 40, 1, 2).selectExpr("id", "CAST(id AS DOUBLE) AS x")
    cluster = dataplane.run(spark, _picky_serve_main, {}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    f32 = pa.schema([("y", pa.float32())])
    try:
        with pytest.raises(ValueError, match=r"max_rows \(rows per request to a node\) must be a positive int, got 0"):
            cluster.inference(df, max_rows=0)
        with pytest.raises(ValueError, match=r"passthrough lists column\(s\) \['id'\] more than once"):
            cluster.inference(df, passthrough=("id", "id"))
        with pytest.raises(TypeError, match=r"passthrough must be a column name or a list of column names, got 7"):
            cluster.inference(df, passthrough=7)
        with pytest.raises(ValueError, match=r"inference\(columns=\[\]\) would send predict no input"):
            cluster.inference(df, columns=[])
        for bad in (0, -1, None):  # 0 was taken, then failed as "could not answer a probe batch"
            with pytest.raises(ValueError, match=rf"feed_timeout \(seconds to wait for each answer\) must be > 0, got {bad}"):
                cluster.inference(df, feed_timeout=bad)
        with pytest.raises(TypeError, match=r"output_schema must be a pyarrow.Schema, e.g. .* got dict"):
            cluster.inference(df, output_schema={"y": "double"})
        small = df.where("id < 10")
        # one name is one column (it was split into characters); None: no passthrough
        out = cluster.inference(small, "id", columns="x").orderBy("id").collect()
        assert [(r["id"], r["y"]) for r in out] == [(i, 2.0 * i) for i in range(10)]
        out = cluster.inference(small, None, columns=["x"]).collect()
        assert sorted(r["y"] for r in out) == [2.0 * i for i in range(10)] and out[0].__fields__ == ["y"]

        with pytest.raises(Exception) as info:
            cluster.inference(df.where("id >= 30"), output_schema=pa.schema([("y", pa.float64())])).collect()
        text = str(info.value)
        assert "node 0: predict raised RuntimeError: boom on 33.0" in text, text
        assert "Traceback on node 0 (innermost calls):" in text and "in predict" in text, text
        assert 'raise RuntimeError(f"boom on {float(x[x == 33][0])}")' in text, text
        assert "If the cluster was shut down" not in text and "If the node died" not in text, text

        with pytest.raises(Exception) as info:
            cluster.inference(df.where("id BETWEEN 15 AND 25"), output_schema=f32).collect()
        text = str(info.value)
        assert ("predict returned output 'y' as double with the value 1e+300, beyond the range of "
                "float, the type output_schema declares") in text, text

        both = pa.schema([("y", pa.float64()), ("z", pa.float64())])
        with pytest.raises(Exception) as info:
            cluster.inference(small, output_schema=both).collect()
        text = str(info.value)
        assert "predict did not return output 'z' for this batch (it returned ['y']); output_schema declares ['y', 'z']" in text, text

        nulls = small.selectExpr("id", "IF(id = 4, NULL, x) AS x")
        with pytest.raises(Exception) as info:
            cluster.inference(nulls, "id", output_schema=pa.schema([("y", pa.float64())])).collect()
        text = str(info.value)
        assert "inference: column 'x' has 1 null value(s) in a request of" in text, text
        # the node sees only the inputs; the task names the row by its passthrough values
        assert "The first row with a null there has id=4." in text, text
        assert "df.fillna({'x': 0})" in text and "fill_values" not in text, text
    finally:
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)


def test_unauthenticated_clients_are_refused(cluster):
    node = cluster.nodes[0]
    client = flight.FlightClient(node.flight_location)
    with pytest.raises(flight.FlightUnauthenticatedError):
        list(client.do_action(flight.Action("metrics", b"{}")))
    wrong = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer not-the-secret")])
    with pytest.raises(flight.FlightUnauthenticatedError):
        list(client.do_action(flight.Action("metrics", b"{}"), options=wrong))
    desc = flight.FlightDescriptor.for_command(json.dumps({"kind": "feed", "epoch": 0, "partition": 0}))
    with pytest.raises(flight.FlightUnauthenticatedError):
        w, _ = client.do_put(desc, pa.schema([("id", pa.int64())]), options=wrong)
        w.write_batch(pa.RecordBatch.from_pydict({"id": [1]}))
        w.close()
