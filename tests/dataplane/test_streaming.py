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
from tests.dataplane.workload_mains import stream_main, stream_repeat_main

pytestmark = pytest.mark.cluster


def _landed(src, sizes, extra=None) -> list[list[int]]:
    """Parquet files ``part-0``, ``part-1``, ... under ``src`` of consecutive ids ``value``
    (``extra(k, ids)``: more columns), modified in that order: read with maxFilesPerTrigger=1,
    file k is micro-batch k. Returns each file's ids."""
    src.mkdir()
    start, files = 0, []
    for k, n in enumerate(sizes):
        ids = list(range(start, start + n))
        path = src / f"part-{k}.parquet"
        pq.write_table(pa.table({"value": pa.array(ids, pa.int64()), **(extra(k, ids) if extra else {})}), path)
        os.utime(path, (1_000_000 + k, 1_000_000 + k))
        files.append(ids)
        start += n
    return files


def _epochs(directory) -> list[list[int]]:
    names = sorted(n for n in os.listdir(directory) if n.startswith("epoch"))
    return [json.loads((directory / n).read_text()) for n in names]


def test_file_stream_every_row_once_in_batch_order(spark, tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    files = _landed(src, [50] * 4)
    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)))
    with dataplane.run(spark, stream_main, {"dir": str(out)}, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        query.processAllAvailable()
        query.stop()
        assert query.feed.batches == 4 and query.feed.rows == 200
        assert repr(query.feed) == ("StreamFeed(batches=4, rows=200, last_batch_id=3, held_back=0, "
                                    "dropped_for_balance=0)")
    assert wait_json(out / "done.json") == {"epochs": 4}
    seen = _epochs(out)
    assert [sorted(e) for e in seen] == files  # micro-batch k == file k, in order, complete


@pytest.mark.parametrize("workers,partitions,sizes", [
    (2, 2, [9, 1, 50, 51]),
    (3, 4, [5, 3, 2, 40, 1, 13]),  # small batches over more partitions than rows
])
def test_several_workers_read_each_row_once_in_order_and_evened(spark, tmp_path, workers,
                                                                 partitions, sizes):
    # each pass gives every worker the same rows; a worker's rows past that count are held
    # back and read first in a later micro-batch's pass (the next one unless that one is too
    # small to even out), so every row is read once, never before its own micro-batch, except
    # those still held back after the last one
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    batches = [set(ids) for ids in _landed(src, sizes)]
    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).repartition(partitions))
    reports = []
    with dataplane.run(spark, stream_main, {"dir": str(out), "batch_size": 8, "per_node": True},
                       num_nodes=workers) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"),
                            on_batch=lambda bid, r: reports.append(r))
        query.processAllAvailable()
        query.stop()
        assert query.feed.batches == len(sizes) and query.feed.rows == sum(sizes)
    nodes = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(nodes) == workers, nodes
    for d in nodes:
        assert wait_json(out / d / "done.json") == {"epochs": len(sizes)}
    seen = {d: _epochs(out / d) for d in nodes}
    carried = 0
    for k, report in enumerate(reports):
        assert sum(report.rows_per_node.values()) == sizes[k] and report.rows == sizes[k], (k, report)
        assert report.carried_in == carried and report.dropped_for_balance == 0, (k, report)
        # (held back: at most about a row per partition and worker)
        assert report.rows_unconsumed == {} and report.carried_out <= partitions * (workers - 1), (k, report)
        got = [i for d in nodes for i in seen[d][k]]
        assert len({len(seen[d][k]) for d in nodes}) == 1, (k, report)  # evened
        assert report.rows_consumed == len(got), (k, report)
        assert set(got) <= set().union(*batches[:k + 1]), k
        carried = report.carried_out
    read = [i for d in nodes for e in seen[d] for i in e]
    assert len(read) == len(set(read)), "a row was read twice"
    assert len(read) + query.feed.held_back == sum(sizes) and query.feed.held_back == carried
    assert query.feed.dropped_for_balance == 0
    assert any(r.carried_out for r in reports)  # (some total is not a multiple of workers)


def test_one_repeat_stream_over_micro_batches_on_three_workers(spark, tmp_path):
    # ctx.dataset(repeat=True) reads the micro-batches back to back; every worker reads as
    # many rows, each row once, in micro-batch order per worker, all but those held back
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    sizes = [13, 1, 2, 57, 5, 100, 3]
    batch_of = {i: k for k, ids in enumerate(_landed(src, sizes)) for i in ids}
    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).repartition(3))
    with dataplane.run(spark, stream_repeat_main, {"dir": str(out)}, num_nodes=3) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        query.processAllAvailable()
        query.stop()
    read = {p.name: wait_json(p) for p in sorted(out.glob("*.json"))}
    assert len(read) == 3 and len({len(v) for v in read.values()}) == 1, {k: len(v) for k, v in read.items()}
    ids = [i for v in read.values() for i in v]
    assert len(ids) == len(set(ids)) and len(ids) + query.feed.held_back == sum(sizes) == 181
    assert query.feed.dropped_for_balance == 0 and query.feed.held_back <= 3 * 2
    for v in read.values():  # one worker's rows in micro-batch order (not within one)
        order = [batch_of[i] for i in v]
        assert order == sorted(order), order


def test_a_worker_that_leaves_a_micro_batch_early_loses_only_that_pass(spark, tmp_path):
    # two workers; the chief reads one batch of the second micro-batch and leaves it: the rest
    # of its share, and the rows it held back from the first, count as unconsumed; the
    # micro-batches after it go on evened, and every row is read at most once
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    sizes = [31, 45, 17]
    _landed(src, sizes)
    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).coalesce(1))
    reports = []
    args = {"dir": str(out), "batch_size": 4, "per_node": True, "break_pass": 1}
    with dataplane.run(spark, stream_main, args, num_nodes=2) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"),
                            on_batch=lambda bid, r: reports.append(r))
        query.processAllAvailable()
        query.stop()
    nodes = sorted(p.name for p in out.iterdir() if p.is_dir())
    chief = next(d for d in nodes if d.startswith("chief"))
    for d in nodes:
        assert wait_json(out / d / "done.json") == {"epochs": 3}
    seen = {d: _epochs(out / d) for d in nodes}
    assert [r.rows for r in reports] == sizes
    first, left, last = reports
    assert first.carried_out == 1 and first.rows_unconsumed == {}  # 31 rows over 2 workers
    worker = next(d for d in nodes if d != chief)
    assert len(seen[chief][1]) == 4 and len(left.rows_unconsumed) == 1, left
    assert left.carried_in == 1 and left.dropped_for_balance == 0
    # the worker read its whole pass, and holds back nothing: the chief left it
    assert len(seen[worker][1]) > 4 and left.carried_out == 0, left
    assert last.rows_unconsumed == {} and last.carried_in == 0
    assert len(seen[chief][2]) == len(seen[worker][2]) > 0
    read = [i for d in nodes for e in seen[d] for i in e]
    assert len(read) == len(set(read)) and set(read) <= set(range(sum(sizes)))
    # every row is accounted for: read (or read ahead by the chief's left pass), unconsumed,
    # or still held back
    consumed = sum(r.rows_consumed for r in reports)
    assert consumed + sum(sum(r.rows_unconsumed.values()) for r in reports) + last.carried_out == sum(sizes)
    # (the chief's read-ahead: FeedReport.rows_unconsumed says up to about 2k + 2 batches)
    assert len(read) <= consumed and consumed - len(read) <= (2 * 1 + 2) * 4


def test_an_array_column_declared_ragged_reads_micro_batches_of_any_lengths(spark, tmp_path):
    # the first micro-batch's arrays had one length, so the column was fed dense and the
    # second batch failed the stream ('Declare the column ragged (leave its shape
    # undeclared)', which no argument could do; shapes={'toks': None} raised a TypeError)
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    lengths = [[3], [3, 2, 5, 1]]
    _landed(src, [1, 4], lambda k, ids: {
        "toks": pa.array([list(range(n)) for n in lengths[k]], pa.list_(pa.int64()))})
    stream = (spark.readStream.schema("value long, toks array<long>")
              .option("maxFilesPerTrigger", 1).parquet(str(src)))
    args = {"dir": str(out), "batch_size": 2, "shapes": {"toks": None}}
    with dataplane.run(spark, stream_main, args, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        query.processAllAvailable()
        query.stop()
        assert query.exception() is None and query.feed.batches == 2
    assert [sorted(e) for e in _epochs(out)] == [[0], [1, 2, 3, 4]]


def test_held_back_rows_of_other_array_lengths_are_dropped_not_fed(spark, tmp_path):
    # a held-back row whose array is longer than the next micro-batch's would fail that pass's
    # dense column: it is dropped for balance, and the report says why
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    width = [4, 3, 3]  # arrays of 4 values in the first micro-batch, 3 after
    _landed(src, [7, 6, 5], lambda k, ids: {
        "vec": pa.array([[float(i)] * width[k] for i in ids], pa.list_(pa.float32()))})
    stream = (spark.readStream.schema("value long, vec array<float>")
              .option("maxFilesPerTrigger", 1).parquet(str(src)).coalesce(1))
    reports = []
    args = {"dir": str(out), "batch_size": 2, "per_node": True, "fresh": True}
    with dataplane.run(spark, stream_main, args, num_nodes=2) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"),
                            on_batch=lambda bid, r: reports.append(r))
        query.processAllAvailable()
        query.stop()
        assert query.exception() is None and query.feed.batches == 3
    nodes = sorted(p.name for p in out.iterdir() if p.is_dir())
    seen = {d: _epochs(out / d) for d in nodes}
    assert [len(seen[d]) for d in nodes] == [3, 3]
    first, second, third = reports
    assert first.carried_out == 1 and second.carried_in == 1 and second.dropped_for_balance == 1
    assert any("array lengths differ" in m for m in second.messages), second.messages
    assert third.carried_in == second.carried_out and third.dropped_for_balance == 0
    read = [i for d in nodes for e in seen[d] for i in e]
    assert len(read) == len(set(read)) and len(read) + 1 + query.feed.held_back == 18


def test_a_micro_batch_that_fails_leaves_every_node_reading(spark, tmp_path):
    # A null in micro-batch 1 fails the query. Its tasks had delivered a chunk to one node
    # and not yet its sibling to the other, so that node's pass had yielded more rows than
    # the other received; the cut ended the epoch below that, and the node's main died on
    # "IndexError: Offset must be non-negative" (held-back rows counted past its pending).
    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()

    def features(k, ids):
        return {"x": pa.array([None if k == 1 and i == ids[150] else [float(i)] * 4 for i in ids],
                              pa.list_(pa.float32()))}

    _landed(src, [301, 300], features)
    stream = (spark.readStream.schema("value long, x array<float>").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).repartition(3))
    with dataplane.run(spark, stream_main, {"dir": str(out), "batch_size": 16, "per_node": True},
                       num_nodes=2) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        with pytest.raises(Exception, match=r"column 'x' has 1 null value"):
            query.awaitTermination(120)
        assert query.feed.batches == 1 and query.feed.rows == 301
        assert {nid: m["main"] for nid, m in cluster.metrics().items()} == {0: "running", 1: "running"}
        # the cluster goes on with the data fixed, every row accounted for
        fixed = spark.createDataFrame([(i, [1.0] * 4) for i in range(100)], "value long, x array<float>")
        report = cluster.train(fixed, 1)
        assert report.rows == 100
        assert (report.rows_consumed + sum(report.rows_unconsumed.values())
                + report.dropped_for_balance == 100), report
    for node in ("chief0", "worker0"):  # both mains returned (a failed one fails the with)
        assert wait_json(out / node / "done.json")["epochs"] >= 2


def test_a_query_started_again_on_its_checkpoint_pushes_no_micro_batch_twice(spark, tmp_path):
    # stopped while micro-batch 1 is being pushed, Spark has not committed it and the next run
    # on the same checkpoint replays it; this cluster already has it, so it is skipped
    import threading

    src, out = tmp_path / "in", tmp_path / "out"
    out.mkdir()
    _landed(src, [20] * 4)

    def stream():
        return (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
                .parquet(str(src)))

    ckpt, runs, pushed = str(tmp_path / "ckpt"), {}, []

    def stop_in_flight(bid, report):
        pushed.append(bid)
        if bid == 1:  # still inside the micro-batch: the stop lands before Spark commits it
            threading.Thread(target=runs["first"].stop).start()
            time.sleep(1)

    with dataplane.run(spark, stream_main, {"dir": str(out), "batch_size": 8}, num_nodes=1) as cluster:
        runs["first"] = feed_stream(cluster, stream(), checkpoint_location=ckpt, on_batch=stop_in_flight)
        runs["first"].awaitTermination(60)
        assert pushed == [0, 1] and not runs["first"].isActive
        # the stop usually lands before Spark commits batch 1; make sure it did (a run whose
        # last batch was never committed replays it)
        for name in ("1", ".1.crc"):
            if os.path.exists(os.path.join(ckpt, "commits", name)):
                os.remove(os.path.join(ckpt, "commits", name))
        again = feed_stream(cluster, stream(), checkpoint_location=ckpt,
                            on_batch=lambda bid, r: pushed.append(bid))
        again.processAllAvailable()
        again.stop()
        assert pushed == [0, 1, 2, 3] and again.feed.last_batch_id == 3
    read = [i for e in _epochs(out) for i in e]
    assert sorted(read) == list(range(80))


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
    out.mkdir()
    _landed(src, [300] * 3)

    started = str(tmp_path / "batch1-started")

    @F.udf("long")
    def slow(v):  # every micro-batch's jobs take seconds, so the stop lands inside one
        if v >= 300:  # micro-batch 1's rows: its first job is running
            open(started, "a").close()
        time.sleep(0.01)
        return v

    stream = (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
              .parquet(str(src)).select(slow("value").alias("value")))
    with dataplane.run(spark, stream_main, {"dir": str(out)}, num_nodes=1) as cluster:
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        deadline = time.monotonic() + 120
        # (waiting for an active job after batch 0 could see batch 0's push job still listed:
        # Spark's status tracker learns of a job's end late)
        while not os.path.exists(started):
            assert time.monotonic() < deadline and query.exception() is None
            time.sleep(0.05)
        query.stop()  # micro-batch 1's first job (the emptiness check, then the push) is running
        assert (query.feed.batches, query.feed.rows, query.feed.last_batch_id) == (2, 600, 1)
    assert wait_json(out / "done.json") == {"epochs": 2}
    assert [sorted(e) for e in _epochs(out)] == [list(range(300)), list(range(300, 600))]


def test_a_stalled_micro_batch_fails_the_query_in_stream_words(spark, tmp_path):
    """Two nodes; the chief reads one micro-batch, then stalls: the next micro-batch's
    feed_timeout error names the stream's micro-batch and how to read a stream (it named
    "epoch N", which the user never pushed, and train(num_epochs=...))."""
    src, out, later = tmp_path / "in", tmp_path / "out", tmp_path / "later"
    out.mkdir()
    later.mkdir()
    _landed(src, [20, 20])
    os.rename(src / "part-1.parquet", later / "part-1.parquet")
    stream = spark.readStream.schema("value long").option("maxFilesPerTrigger", 1).parquet(str(src))
    args = {"dir": str(out), "per_node": True, "passes": 1, "stall": 8}
    with dataplane.run(spark, stream_main, args, num_nodes=2) as cluster:
        # micro-batch 0 with time for the nodes to start, then micro-batch 1 with 2 s
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"))
        query.processAllAvailable()
        query.stop()
        os.rename(later / "part-1.parquet", src / "part-1.parquet")
        query = feed_stream(cluster, stream, checkpoint_location=str(tmp_path / "ckpt"), feed_timeout=2)
        with pytest.raises(Exception):
            query.processAllAvailable()
    text = str(query.exception())
    assert "the stream's micro-batch (epoch 1) was pushed, but node(s) [0] stopped reading " \
           "it: nothing moved for feed_timeout=2 s" in text, text
    assert "Read a stream with ctx.dataset(repeat=True)" in text and "train(num_epochs=...) pushes" not in text, text
    assert wait_json(out / "chief0" / "done.json", 30) == {"epochs": 1}


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


def test_a_query_started_again_on_its_checkpoint_by_a_new_cluster_pushes_no_batch_twice(spark, tmp_path):
    # a driver restarted: the stopped run's last micro-batch was trained but not committed by
    # Spark, which replays it; the new cluster had no memory of it and trained it again
    src, ckpt = tmp_path / "in", str(tmp_path / "ckpt")
    _landed(src, [20] * 2)

    def stream():
        return (spark.readStream.schema("value long").option("maxFilesPerTrigger", 1)
                .parquet(str(src)))

    outs = [tmp_path / "out0", tmp_path / "out1"]
    for out in outs:
        out.mkdir()
    with dataplane.run(spark, stream_main, {"dir": str(outs[0]), "batch_size": 8}, num_nodes=1) as cluster:
        first = feed_stream(cluster, stream(), checkpoint_location=ckpt)
        first.processAllAvailable()
        first.stop()
    for name in ("1", ".1.crc"):  # as a stop that lands before Spark commits batch 1 leaves it
        if os.path.exists(os.path.join(ckpt, "commits", name)):
            os.remove(os.path.join(ckpt, "commits", name))
    pq.write_table(pa.table({"value": pa.array(range(40, 60), pa.int64())}), src / "part-2.parquet")
    pushed = []
    with dataplane.run(spark, stream_main, {"dir": str(outs[1]), "batch_size": 8}, num_nodes=1) as cluster:
        again = feed_stream(cluster, stream(), checkpoint_location=ckpt,
                            on_batch=lambda bid, r: pushed.append(bid))
        again.processAllAvailable()
        again.stop()
        assert pushed == [2] and again.feed.last_batch_id == 2
    assert [sorted(e) for e in _epochs(outs[0])] == [list(range(20)), list(range(20, 40))]
    assert [sorted(e) for e in _epochs(outs[1])] == [list(range(40, 60))]
    assert json.loads(open(os.path.join(ckpt, "dataplane-pushed.json")).read())["batch_id"] == 2
