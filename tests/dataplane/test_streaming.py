"""Structured Streaming -> running TF cluster: every row once, micro-batches in order, clean stop."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dataplane
from dataplane.workloads.streaming import feed_stream
from tests.dataplane.clusterutil import wait_json
from tests.dataplane.workload_mains import stream_main

pytestmark = pytest.mark.cluster


def _epochs(directory) -> list[list[int]]:
    names = sorted(n for n in os.listdir(directory) if n.startswith("epoch"))
    return [json.loads((directory / n).read_text()) for n in names]


def test_file_stream_every_row_once_in_batch_order(spark, tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    files = []
    for k in range(4):  # 4 files, 1 per micro-batch, modification times in order
        path = src / f"part-{k}.parquet"
        pq.write_table(pa.table({"value": pa.array(range(k * 50, k * 50 + 50), pa.int64())}), path)
        os.utime(path, (1_000_000 + k, 1_000_000 + k))
        files.append(list(range(k * 50, k * 50 + 50)))
    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)))
    with dataplane.run(spark, stream_main, {"dir": str(out)}, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        query.processAllAvailable()
        query.stop()
        assert query.feed.batches == 4 and query.feed.rows == 200
    assert wait_json(out / "done.json") == {"epochs": 4}
    seen = _epochs(out)
    assert [sorted(e) for e in seen] == files  # micro-batch k == file k, in order, complete


def test_two_workers_each_micro_batch_once_in_order_and_evened(spark, tmp_path):
    # micro-batches of 9, 1, 50 and 51 rows over 2 partitions and 2 workers: every row
    # reaches one worker at most, in its micro-batch's pass; each pass gives both workers the
    # same rows (the smaller share), the rest is counted as dropped for balance; the 1-row
    # micro-batch leaves one worker none, so neither yields it
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    sizes, start = [9, 1, 50, 51], 0
    for k, n in enumerate(sizes):
        path = src / f"part-{k}.parquet"
        pq.write_table(pa.table({"value": pa.array(range(start, start + n), pa.int64())}), path)
        os.utime(path, (1_000_000 + k, 1_000_000 + k))
        start += n
    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).repartition(2))
    reports = []
    with dataplane.run(spark, stream_main, {"dir": str(out), "batch_size": 8, "per_node": True},
                       num_nodes=2) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"),
                            on_batch=lambda bid, r: reports.append(r))
        query.processAllAvailable()
        query.stop()
        assert query.feed.batches == 4 and query.feed.rows == sum(sizes)
    nodes = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(nodes) == 2, nodes
    for d in nodes:
        assert wait_json(out / d / "done.json") == {"epochs": 4}
    seen = {d: _epochs(out / d) for d in nodes}
    start = 0
    for k, (n, report) in enumerate(zip(sizes, reports)):
        held = sorted(report.rows_per_node.values())
        assert len(held) == 2 and sum(held) == n and held[1] - held[0] <= 2, (k, report)
        assert [len(seen[d][k]) for d in nodes] == [held[0]] * 2, (k, report)
        assert report.dropped_for_balance == held[1] - held[0] and report.rows_unconsumed == {}
        got = sorted(i for d in nodes for i in seen[d][k])
        assert len(set(got)) == len(got) and set(got) <= set(range(start, start + n))
        start += n
    assert reports[1].dropped_for_balance == 1 and [len(seen[d][1]) for d in nodes] == [0, 0]
    assert query.feed.dropped_for_balance == sum(r.dropped_for_balance for r in reports)


def test_rate_stream_stopped_midway_ends_cleanly(spark, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stream = (spark.readStream.format("rate").option("rowsPerSecond", 40)
              .option("numPartitions", 2).load().select("value"))
    with dataplane.run(spark, stream_main, {"dir": str(out)}, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, trigger={"processingTime": "500 milliseconds"})
        deadline = time.monotonic() + 120
        while query.feed.batches < 3:
            assert time.monotonic() < deadline, "the stream never pushed 3 micro-batches"
            assert query.exception() is None
            time.sleep(0.2)
        query.stop()  # mid-stream: the batch in flight completes, nothing after it starts
        assert not query.isActive
        pushed = query.feed.rows
    done = wait_json(out / "done.json")
    seen = _epochs(out)
    assert done["epochs"] == len(seen) == query.feed.batches
    flat = [i for e in seen for i in e]
    assert len(flat) == pushed
    assert sorted(flat) == list(range(pushed))  # the rate source's 0..n-1, each exactly once
    for before, after in zip(seen, seen[1:]):
        assert max(before) < min(after)  # micro-batches arrive in order


def test_a_stop_during_the_emptiness_check_still_pushes_that_batch(spark, tmp_path):
    # skip_empty's isEmpty() job ran in the query's thread, which query.stop() interrupts: a stop
    # landing there dropped the micro-batch in flight, against the documented guarantee
    from pyspark.sql import functions as F

    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for k in range(3):
        path = src / f"part-{k}.parquet"
        pq.write_table(pa.table({"value": pa.array(range(k * 300, k * 300 + 300), pa.int64())}), path)
        os.utime(path, (1_000_000 + k, 1_000_000 + k))

    @F.udf("long")
    def slow(v):  # every micro-batch's jobs take seconds, so the stop lands inside one
        time.sleep(0.01)
        return v

    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).select(slow("value").alias("value")))
    tracker = spark.sparkContext.statusTracker()
    with dataplane.run(spark, stream_main, {"dir": str(out)}, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        deadline = time.monotonic() + 120
        while query.feed.batches < 1 or not tracker.getActiveJobsIds():
            assert time.monotonic() < deadline and query.exception() is None
            time.sleep(0.05)
        query.stop()  # micro-batch 1's first job (the emptiness check, then the push) is running
        assert (query.feed.batches, query.feed.rows, query.feed.last_batch_id) == (2, 600, 1)
    assert wait_json(out / "done.json") == {"epochs": 2}
    assert [sorted(e) for e in _epochs(out)] == [list(range(300)), list(range(300, 600))]


def test_a_query_left_running_past_shutdown_fails_saying_so(spark, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stream = (spark.readStream.format("rate").option("rowsPerSecond", 20).load().select("value"))
    with dataplane.run(spark, stream_main, {"dir": str(out)}, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, trigger={"processingTime": "300 milliseconds"})
        deadline = time.monotonic() + 120
        while query.feed.batches < 1:
            assert time.monotonic() < deadline and query.exception() is None
            time.sleep(0.1)
    # the block ended without query.stop(): the next micro-batch fails the query with the fix
    deadline = time.monotonic() + 60
    while query.isActive:
        assert time.monotonic() < deadline, "the query went on after the cluster stopped"
        time.sleep(0.2)
    assert "arrived after the cluster began to shut down (it is " in str(query.exception())
    assert "stop the streaming query (query.stop()) before cluster.shutdown()" in str(query.exception())


def test_static_dataframe_is_refused(spark):
    with pytest.raises(ValueError, match="not a streaming DataFrame"):
        feed_stream(object(), spark.range(3))


def test_a_stream_given_to_train_or_inference(spark, tmp_path):
    """inference() on a stream answers as a stream when told its output columns; train() on a
    stream is pointed at feed_stream (both failed with Spark's 'must be executed with
    writeStream.start()')."""
    from tests.dataplane.mains import slow_serve_main

    stream = (spark.readStream.format("rate").option("rowsPerSecond", 100)
              .option("numPartitions", 2).load().selectExpr("value", "cast(value as double) as x"))
    with dataplane.run(spark, slow_serve_main, {"delay": 0.0}, num_nodes=1) as cluster:
        with pytest.raises(TypeError, match=r"train\(\) got a streaming DataFrame .*feed_stream\(cluster, df\)"):
            cluster.train(stream, 1)
        with pytest.raises(ValueError, match=r"streaming DataFrame: .*output_schema=pa\.schema"):
            cluster.inference(stream, passthrough=("value",))
        out = cluster.inference(stream, passthrough=("value",), output_schema=pa.schema([("y", pa.float64())]))
        assert out.isStreaming
        query = (out.writeStream.format("memory").queryName("streamed_preds")
                 .option("checkpointLocation", str(tmp_path / "ckpt")).start())
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and spark.sql("select count(*) c from streamed_preds").first()["c"] < 200:
                time.sleep(0.5)
            query.processAllAvailable()
        finally:
            query.stop()
        rows = spark.sql("select value, y from streamed_preds").collect()
    values = [r["value"] for r in rows]
    assert len(values) >= 200 and len(set(values)) == len(values)  # each streamed row once
    assert sorted(values) == list(range(len(values)))  # the rate source's first rows, none lost
    assert all(r["y"] == 2.0 * r["value"] for r in rows)
