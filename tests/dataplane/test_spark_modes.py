"""The cluster under other Spark deployments, each in its own driver process: separate executor
JVMs (local-cluster) and Spark Connect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyspark
import pytest

from tests.builders import row_checksum
from tests.dataplane.clusterutil import wait_gone

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

_SCRIPT = textwrap.dedent(
    """
    import glob, json, os, sys, time
    from pyspark.sql import SparkSession
    import dataplane
    from tests.dataplane.mains import feed_main
    from tests.dataplane.test_push import make_df
    mode, out = sys.argv[1], sys.argv[2]
    b = SparkSession.builder.config("spark.ui.enabled", "false")
    if mode == "connect":
        spark = b.remote("local[2]").getOrCreate()
    else:
        spark = (b.master("local-cluster[2,1,1024]").config("spark.driver.host", "127.0.0.1")
                 .config("spark.executor.memory", "512m")
                 # the executor JVMs get the JIT and GC flags tests/conftest.py gives the driver's
                 .config("spark.executor.extraJavaOptions", " ".join(
                     o for o in os.environ.get("SPARK_SUBMIT_OPTS", "").split() if o.startswith("-XX:")))
                 .getOrCreate())
    result = {"session": type(spark).__module__}
    with dataplane.run(spark, feed_main, {"dir": out, "batch_size": 50, "keep_ids": True}, num_nodes=2) as c:
        result["pids"] = [n.pid for n in c.nodes]
        df = make_df(spark, 1000, 3)
        rep = c.train(df, num_epochs=2)
        result["rows"], result["per_node"] = rep.rows, rep.rows_per_node
        pdf = c.inference(df, passthrough=("id",)).toPandas()
        result["inference"] = [len(pdf), int(pdf["id"].nunique()),
                               bool(((pdf["y"] - pdf["id"]).abs() < 1e-9).all())]
        # push once, replay shuffled: one Spark job for both epochs
        rep = c.train(df, num_epochs=2, cache=True, shuffle=True, seed=7)
        result["cached"] = [rep.rows, rep.spark_jobs, rep.epochs]
        if mode == "connect":  # foreachBatch cannot carry the cluster: said before the query starts
            from dataplane.workloads.streaming import feed_stream
            try:
                feed_stream(c, spark.readStream.format("rate").load())
                result["feed_stream"] = "started"
            except Exception as e:
                result["feed_stream"] = [type(e).__name__, str(e)]
        deadline = time.monotonic() + 120
        while len(glob.glob(os.path.join(out, "node*-epoch3.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        if mode == "connect":  # Spark finishing tasks (16 of 1 s before a shuffle) is not standing still
            from pyspark.sql import functions as F
            slow = F.udf(lambda i: time.sleep(0.08) or i, "long")
            t0 = time.monotonic()
            rep = c.train(make_df(spark, 200, 16).withColumn("id", slow("id")).repartition(2, "id"),
                          num_epochs=1, feed_timeout=5)
            result["slow"] = [rep.rows, time.monotonic() - t0 > 8]
    if mode == "connect":  # tune: no SparkContext; a trial a job under an operation tag of its own
        from tests.dataplane.test_tune import sleepy
        tdir = os.path.join(out, "tune")
        os.makedirs(tdir)
        rows = dataplane.tune(spark, sleepy, [{"s": 0.0, "dir": tdir}, {"s": 600.0, "dir": tdir}],
                              data=make_df(spark, 10, 3), trial_timeout=6).collect()
        result["tune"] = [[r["trial"], r["status"], r["rows"], r["error"]] for r in rows]
        result["pids"].append(int(open(os.path.join(tdir, "pid-600.0")).read()))
    # column names with dots and spaces (the push runs on stand-in names) and a Spark ML vector
    from pyspark.ml.functions import array_to_vector
    from tests.dataplane.test_spark_frames import _names_frame, names_main
    names = os.path.join(out, "names")
    os.makedirs(names)
    df = _names_frame(spark, 90)
    with dataplane.run(spark, names_main, {"dir": names}, num_nodes=1) as c:
        rep = c.train(df, 2, cache=True)
        ans = c.inference(df.withColumn("vec tor", array_to_vector("`sepal.length`")),
                          passthrough=("row id", "vec tor")).collect()
        result["names"] = [rep.rows, sorted((r["row id"], r["out.sum"], r["vec tor"]) for r in ans)]
    result["names_seen"] = json.load(open(glob.glob(os.path.join(names, "node*.json"))[0]))
    # Spark stopped before the cluster: train says so, and the cluster still shuts down
    c = dataplane.run(spark, names_main, {"dir": os.path.join(out, "stopped")}, num_nodes=1)
    result["pids"] += [n.pid for n in c.nodes]
    spark.stop()
    try:
        c.train(df, 1)
        result["after_stop"] = "trained"
    except Exception as e:
        result["after_stop"] = [type(e).__name__, str(e)]
    c.shutdown(timeout=30)
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _run(mode: str, tmp_path) -> dict:
    script = tmp_path / "driver.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(out)], capture_output=True, text=True,
        timeout=400, env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    order = {}
    for epoch in (0, 1, 2, 3):
        res = [json.loads((out / f"node{i}-epoch{epoch}.json").read_text()) for i in (0, 1)]
        assert (sum(r["count"] for r in res), sum(r["sumsq"] for r in res)) == row_checksum(np.arange(1000))
        assert res[0]["batches"] == res[1]["batches"]
        order[epoch] = [r["ids"] for r in res]
    # the cached epochs hold each node's same rows, in orders of their own
    for i in (0, 1):
        assert sorted(order[2][i]) == sorted(order[3][i]) and order[2][i] != order[3][i]
    assert result["rows"] == 2000 and sum(result["per_node"].values()) == 2000
    assert result["cached"] == [2000, 1, [2, 3]]
    assert result["inference"] == [1000, 1000, True]
    assert result["names"] == [180, [[i, 1.5 * i, [float(i), i * 0.5]] for i in range(90)]]
    for keys, rows in result["names_seen"]:
        assert keys == ["class-x", "row id", "sepal.length"]
        assert rows == {str(i): [float(i), i * 0.5, i % 3] for i in range(90)}
    kind, text = result["after_stop"]
    assert kind == "ClusterStateError" and "has been stopped (spark.stop())" in text, result["after_stop"]
    wait_gone(result["pids"], 15)
    return result


def test_separate_executor_jvms_local_cluster(tmp_path):
    result = _run("local-cluster", tmp_path)
    assert result["session"] == "pyspark.sql.session"


@pytest.mark.skipif(
    int(pyspark.__version__.split(".")[0]) < 4,
    reason="pyspark 3.5's local Spark Connect server needs the spark-connect jar from Maven "
    "Central (not bundled, not reachable here); pyspark 4 bundles it",
)
def test_spark_connect_start_feed_inference_shutdown(tmp_path):
    result = _run("connect", tmp_path)  # (it also waits for the cancelled trial's worker to go)
    assert result["session"] == "pyspark.sql.connect.session"
    # the data went inside each trial's plan; the trial past trial_timeout was interrupted
    assert [row[:3] for row in result["tune"]] == [[0, "ok", 10], [1, "error", None]], result["tune"]
    assert result["tune"][1][3].startswith("trial_timeout: the trial ran past trial_timeout=6 s")
    assert result["slow"] == [200, True]
    kind, text = result["feed_stream"]
    assert kind == "TypeError" and text.startswith("feed_stream needs a classic SparkSession"), text


_DYNAMIC = textwrap.dedent(
    """
    import json, time
    from pyspark.sql import SparkSession
    import dataplane
    from tests.dataplane.mains import feed_main
    spark = (SparkSession.builder.master("local-cluster[1,1,512]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.executor.memory", "512m")
             .config("spark.dynamicAllocation.enabled", "true")
             .config("spark.dynamicAllocation.shuffleTracking.enabled", "true").getOrCreate())
    result = {}
    try:  # Spark's own refusal, which run() mirrors
        spark.sparkContext.parallelize([1], 1).barrier().mapPartitions(lambda it: it).collect()
        result["barrier"] = "ran"
    except Exception as e:
        result["barrier"] = "BarrierJobRunWithDynamicAllocationException" in str(e)
    t0 = time.monotonic()
    try:
        dataplane.run(spark, feed_main, {}, num_nodes=2)
        result["run"] = "started"
    except Exception as e:
        result["run"] = [type(e).__name__, str(e)]
    result["seconds"] = time.monotonic() - t0
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _driver(script: str, tmp_path) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``script`` as a driver program of its own; what it printed after RESULT."""
    path = tmp_path / "driver.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYSPARK_PYTHON=sys.executable))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):]), proc


def test_dynamic_allocation_is_refused_before_any_node_starts(tmp_path):
    # Spark refuses barrier stages under dynamic allocation, but only once the job is submitted,
    # under a Py4J traceback; run() says it first, with the setting to change
    result, _ = _driver(_DYNAMIC, tmp_path)
    assert result["barrier"] is True, result
    assert result["run"] == ["ValueError", (
        "dataplane.run starts its 2 nodes as one barrier stage, which Spark refuses while dynamic "
        "allocation is on (spark.dynamicAllocation.enabled=true, master 'local-cluster[1,1,512]'): "
        "a TF cluster has a fixed size, and an executor Spark removed when idle would take a node "
        "with it. Start the session with .config('spark.dynamicAllocation.enabled', 'false') "
        "(spark-submit: --conf spark.dynamicAllocation.enabled=false) and at least 2 executor task "
        "slots (spark.executor.instances x spark.executor.cores).")], result
    assert result["seconds"] < 5, result  # no barrier job (Spark's refusal would be the error)


@pytest.mark.parametrize("master, enabled, testing, refused", [
    ("yarn", "true", "false", True),
    ("k8s://https://10.0.0.1:6443", "TRUE", "false", True),
    ("spark://10.0.0.1:7077", "true", "false", True),
    ("local-cluster[2,1,1024]", "true", "false", True),
    ("yarn", "false", "false", False),
    ("local[4]", "true", "false", False),  # Spark ignores dynamic allocation on a local master
    ("local", "true", "false", False),
    ("local[4]", "true", "true", True),  # ... unless testing it
])
def test_the_dynamic_allocation_rule_is_sparks(master, enabled, testing, refused):
    from dataplane.driver.startup import dynamic_allocation_refuses

    assert dynamic_allocation_refuses(master, enabled, testing) is refused


_WIDE = textwrap.dedent(
    """
    import json
    from pyspark.sql import SparkSession, functions as F
    import dataplane
    from tests.dataplane.mains import byte_count_main, wide_main
    # Spark's default memory: 1 GiB of heap, and as much direct memory for Arrow
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    df = spark.range(0, 40000, 1, 2).selectExpr("id", "array_repeat(cast(id as float), 12288) as img")
    with dataplane.run(spark, wide_main, {}, num_nodes=1) as c:
        rep = c.train(df, 1, feed_timeout=60)
        result = {"rows": rep.rows, "bytes": rep.bytes, "read": c.metrics()[0]["rows_yielded"]}
    # images as bytes (what spark.read.format("binaryFile") gives): 20,000 of 100 KiB
    df = spark.range(0, 20000, 1, 2).selectExpr(
        "id", "unhex(repeat(lpad(hex(id), 8, '0'), 25600)) as jpeg")
    with dataplane.run(spark, wide_main, {}, num_nodes=1) as c:
        rep = c.train(df, 1, feed_timeout=60)
        result["binary"] = {"rows": rep.rows, "bytes": rep.bytes, "read": c.metrics()[0]["rows_yielded"]}
    # long documents as strings, 20,000 of 100 KB (read from files, or made as here: no shuffle)
    docs = spark.range(0, 20000, 1, 2).selectExpr("id", "repeat(lpad(hex(id), 10, '0'), 10240) as text")
    with dataplane.run(spark, wide_main, {}, num_nodes=1) as c:
        rep = c.train(docs, 1, feed_timeout=60)
        result["text"] = {"rows": rep.rows, "bytes": rep.bytes, "read": c.metrics()[0]["rows_yielded"]}
    # inference's output is a query the user runs later: the session's setting is lowered
    with dataplane.run(spark, byte_count_main, {}, num_nodes=1) as c:
        out = c.inference(df, passthrough=("id",))
        got = out.agg(F.count("id"), F.countDistinct("id"), F.min("n"), F.max("n")).first()
        result["inference"] = list(got)
    result["batch_rows"] = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch"))
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def test_image_rows_binaries_and_documents_of_100_kib_train_and_infer_in_spark_default_memory(tmp_path):
    # 40,000 rows of 64x64x3 float32 in two partitions: Spark 3.5 hands a mapInArrow task
    # Arrow batches of 10,000 rows (480 MB) whatever their size, two tasks ran out of the
    # 1 GiB of direct memory in the thread writing to Python, and the push stood still until
    # feed_timeout. The push job asks for batches of about 64 MiB there (Spark 4 cuts them
    # by bytes itself). The same for 100 KiB binary values and 100 KB strings, whose size a
    # sample tells.
    result, proc = _driver(_WIDE, tmp_path)
    # bytes: id, the floats and one list offset a row; id, the bytes and their offset
    binary, inference, batch_rows = result.pop("binary"), result.pop("inference"), result.pop("batch_rows")
    text = result.pop("text")
    assert result == {"rows": 40000, "bytes": 40000 * (8 + 12288 * 4 + 4), "read": 40000}, result
    assert binary == {"rows": 20000, "bytes": 20000 * (8 + 102400 + 4), "read": 20000}, binary
    # strings alone are sampled too when the frame has no shuffle (it hung as the binaries did)
    assert text == {"rows": 20000, "bytes": 20000 * (8 + 102400 + 4), "read": 20000}, text
    # inference answered every row; on Spark 3.5 it lowered the session's rows per batch to
    # about 64 MiB of these rows, and said so (train's own setting was set back)
    assert inference == [20000, 20000, 102400, 102400], inference
    if int(pyspark.__version__.split(".")[0]) < 4:
        assert 640 <= batch_rows <= 660, batch_rows
        assert "cluster.inference: rows of about 100 KiB make Arrow batches of 977 MiB" in proc.stderr
        assert "Set it to %d for this session" % batch_rows in proc.stderr, proc.stderr[-3000:]
    else:  # Spark 4 cuts batches by bytes: nothing to change
        assert batch_rows == 10000 and "for this session" not in proc.stderr
    assert "OutOfMemoryError" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("fields, shapes, size", [
    ([("id", "int64"), ("img", pa.list_(pa.float32()))], {"img": (64, 64, 3)}, 8 + 12288 * 4),
    ([("x", "float64"), ("tags", pa.list_(pa.int64()))], {}, 8),  # ragged: counts nothing
    ([("jpeg", pa.binary()), ("label", "int32")], {}, 4),
    ([("jpeg", pa.binary()), ("label", "int32")], {"values": {"jpeg": 1000.5}}, 1004),
    ([("m", pa.list_(pa.list_(pa.float64())))], {"m": (8, 8)}, 512),
])
def test_the_bytes_a_row_takes_are_what_its_schema_and_shapes_say(fields, shapes, size):
    from formats.sparkframe import row_bytes

    values = shapes.pop("values", None)
    assert row_bytes(pa.schema(fields), shapes, values) == size


def test_a_sample_tells_the_bytes_of_binary_and_string_values(spark):
    from formats.sparkframe import value_bytes
    from dataplane.driver.sparkjobs import arrow_schema_of

    df = spark.createDataFrame(
        [(1, b"abcd", "x"), (2, None, "\u00e9\u00e9"), (3, b"abcdefgh", None), (4, b"", "yz")],
        "id long, img binary, name string").coalesce(1)
    schema = arrow_schema_of(df)
    # nulls count 0 bytes; strings count their UTF-8 bytes
    assert value_bytes(df, schema) == {"img": 3.0, "name": 7 / 4}
    assert value_bytes(df, schema, rows=2) == {"img": 2.0, "name": 5 / 2}  # the first rows only
    assert value_bytes(df.filter("id > 9"), schema) == {"img": 0.0, "name": 0.0}
    assert value_bytes(df.select("id"), arrow_schema_of(df.select("id"))) == {}


def test_a_frame_computed_without_an_exchange_is_told_from_a_shuffled_one(spark, tmp_path):
    # on Spark 3.5 the push samples the string columns of a frame whose first rows are cheap
    # to read (files read, filtered, projected), not of one whose sample computes a shuffle
    from formats.sparkframe import shuffles

    spark.range(0, 100, 1, 4).selectExpr("id", "cast(id as string) as s").write.parquet(str(tmp_path / "t"))
    files = spark.read.parquet(str(tmp_path / "t"))
    assert shuffles(files.filter("id > 3").select("s")) is False
    assert shuffles(spark.range(10).selectExpr("repeat('x', 9) as s")) is False
    assert shuffles(files.repartition(3)) is True
    assert shuffles(files.groupBy("s").count()) is True
    assert shuffles(files.join(files.select("id").hint("shuffle_hash"), "id")) is True
    assert shuffles(files.orderBy("s")) is True
    # texts joined to a small table of labels: its side is broadcast, the texts stream
    labels = spark.range(0, 100).selectExpr("id", "cast(id % 3 as int) as label")
    assert shuffles(files.join(labels.hint("broadcast"), "id")) is False
    assert shuffles(files.join(labels.groupBy("id").count().hint("broadcast"), "id")) is False
    # a shuffled frame the user cached (as the README advises for costly ones): the sample
    # reads the cache, and the push job the same cache
    cached = files.repartition(3).cache()
    assert shuffles(cached) is False
    cached.count()
    assert shuffles(cached) is False and shuffles(cached.select("s")) is False
    assert shuffles(cached.groupBy("s").count()) is True
    cached.unpersist()


def test_the_shape_scan_tells_the_bytes_of_ragged_arrays(spark):
    # variable-length arrays (audio clips, token ids) count their average values a row:
    # on Spark 3.5 they size the push job's Arrow batches as binaries and fixed shapes do
    from dataplane.driver.pushjob import array_shapes
    from dataplane.driver.sparkjobs import arrow_schema_of

    df = spark.createDataFrame(
        [([1, 2], [[1.0], [2.0, 3.0]], [0.5, 0.5], ["a"]),
         ([3], [[4.0, 5.0, 6.0]], [1.0, 1.0], ["b", "c"]),
         ([4, 5, 6], [[7.0]], [2.0, 2.0], []),
         (None, None, [3.0, 3.0], None)],
        "tokens array<long>, clips array<array<float>>, xy array<double>, tags array<string>")
    scan = array_shapes(df, arrow_schema_of(df))
    assert scan.shapes == {"xy": (2,)} and scan.rows == 4
    # nulls are not rows of no values: the average is over the rows that hold an array
    assert scan.ragged_bytes == {"tokens": 2 * 8, "clips": 7 / 3 * 4}, scan.ragged_bytes
