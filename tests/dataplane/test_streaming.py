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
