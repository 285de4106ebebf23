"""Bad input to the push path: ``cluster.train`` and ``cluster.inference`` (issue #22).

One shared 1-node cluster whose main reads every pushed epoch with a fill value for column
``g`` only. What the driver can tell from the schema or the arguments fails the call before
any job; a null in a column without a fill value is refused by the node as the rows arrive, so
the push job fails and ``train`` raises a SchemaError naming the column and the partition.
After each case the cluster still trains.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
from pyspark.errors import PythonException

import dataplane
from dataplane.errors import ClusterStateError, NodeError, SchemaError
from tests.badinput.catalogue import Case, Env, check, params
from tests.dataplane.clusterutil import wait_gone
from tests.dataplane.loop_mains import catalogue_main

pytestmark = pytest.mark.cluster

TR, INF = "cluster.train", "cluster.inference"
GOOD = "SELECT id, CAST(id AS FLOAT) AS f, CAST(id AS DOUBLE) AS g FROM range(0, 200, 1, 2)"


@pytest.fixture(scope="module")
def cluster(spark):
    c = dataplane.run(spark, catalogue_main, {}, num_nodes=1)
    c.train(spark.sql(GOOD))  # the node's dataset now knows its columns and fill values
    yield c
    pids = [n.pid for n in c.nodes]
    c.shutdown(timeout=30)
    wait_gone(pids, 30)


def _still_trains(env: Env) -> None:
    cluster = env.request.getfixturevalue("cluster")
    report = cluster.train(env.spark.sql(GOOD))
    assert report.rows == 200 and sum(report.rows_unconsumed.values()) == 0


def _train(sql=GOOD, *, df=None, **kw):  # type: ignore[no-untyped-def]
    def build(env: Env):
        cluster = env.request.getfixturevalue("cluster")
        data = df(env) if df is not None else env.spark.sql(sql)
        return lambda: cluster.train(data, **kw)

    return build


def _infer(sql=GOOD, **kw):  # type: ignore[no-untyped-def]
    def build(env: Env):
        cluster = env.request.getfixturevalue("cluster")
        data = env.spark.sql(sql)
        return lambda: cluster.inference(data, **kw)

    return build


class _StoppedSession:
    """What a classic SparkSession looks like after ``spark.stop()``: no JVM context."""

    class _sc:  # noqa: N801 - stands in for the SparkContext attribute
        _jsc = None


def _after_spark_stop(call: str):  # type: ignore[no-untyped-def]
    # the real session must keep running for the other tests: the cluster sees a stopped one
    def build(env: Env):
        cluster = env.request.getfixturevalue("cluster")
        data = env.spark.sql(GOOD)

        def run():  # type: ignore[no-untyped-def]
            live, cluster.spark = cluster.spark, _StoppedSession()
            try:
                return cluster.train(data) if call == "train" else cluster.inference(data)
            finally:
                cluster.spark = live

        return run

    return build


def _raising_udf_frame(env: Env):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    def f(i):  # type: ignore[no-untyped-def]
        if i == 150:
            raise ValueError(f"no price for id {i}")
        return float(i)

    return env.spark.sql(GOOD).withColumn("f", F.udf(f, FloatType())("id"))


def _file_gone_frame(env: Env):  # type: ignore[no-untyped-def]
    import glob
    import os

    path = str(env.tmp / "gone.parquet")
    env.spark.sql(GOOD).repartition(2).write.parquet(path)
    df = env.spark.read.parquet(path)  # the plan lists the files now
    os.remove(sorted(glob.glob(os.path.join(path, "part-*")))[1])
    return df


CASES = [
    # a JVM error while Spark reads the rows: its message, not Py4J's "An error occurred while
    # calling o85.collectToPython."
    Case(TR, "parquet-file-deleted-after-read", _train(df=_file_gone_frame), dataplane.FeedError,
         ("pushing epoch", "part-00001", "does not exist"), within=60, after=_still_trains),
    # a Python UDF failing while Spark computes the rows: its error, not PySpark's header line
    Case(TR, "udf-raising-while-computing-rows", _train(df=_raising_udf_frame), dataplane.FeedError,
         ("pushing epoch", "failed: PythonException: ValueError: no price for id 150"), within=60,
         after=_still_trains),
    Case(TR, "null-without-fill-value",
         _train("SELECT id, IF(id = 77, NULL, CAST(id AS FLOAT)) AS f, CAST(id AS DOUBLE) AS g "
                "FROM range(0, 200, 1, 2)"),
         SchemaError, ("column 'f' has 1 null value(s)", "partition 0", "fill_values", "df.na.drop"),
         within=60, after=_still_trains),
    # a null inside an array: refused as the rows arrive too, not by main's conversion later
    Case(TR, "null-inside-an-array-without-fill-value",
         _train("SELECT id, IF(id = 123, array(1.0f, NULL), array(CAST(id AS FLOAT), 2.0f)) AS f, "
                "CAST(id AS DOUBLE) AS g FROM range(0, 200, 1, 2)"),
         SchemaError, ("column 'f' has 1 null element(s) inside its arrays", "partition 1",
                       "fill_values", "F.exists('f', lambda v: v.isNull())"),
         within=60, after=_still_trains),
    Case(TR, "no-columns", _train("SELECT * FROM range(10)", df=lambda env: env.spark.range(10).select()),
         SchemaError, ("no columns", "df.select("), after=_still_trains),
    Case(TR, "map-column", _train("SELECT id, map('a', id) AS m FROM range(10)"),
         SchemaError, ("'m'",)),
    Case(TR, "decimal-column", _train("SELECT id, CAST(id AS DECIMAL(10, 2)) AS d FROM range(10)"),
         SchemaError, ("'d'", "cast('double')", "leave it out: df.drop('d')")),
    Case(TR, "several-unpushable-columns",
         _train("SELECT id, map('a', id) AS m, CAST(id AS FLOAT) AS f, named_struct('a', id) AS s "
                "FROM range(10)"),
         SchemaError, ("column 'm'", "map_keys()", "pushes every column", "df.drop('m', 's')")),
    # after a join, select(a.id, a.x, b.x): a bare KeyError "Column x does not exist in schema"
    Case(TR, "a-name-twice", _train("SELECT id, CAST(id AS FLOAT) AS f, CAST(id AS DOUBLE) AS f FROM range(10)"),
         SchemaError, ("column name 'f' appears 2 times", "train() pushes", "positions [1, 2]",
                       "df.toDF('id', 'f_1', 'f_2')"), after=_still_trains),
    Case(INF, "a-name-twice",
         _infer("SELECT id, CAST(id AS FLOAT) AS f, CAST(id AS DOUBLE) AS f FROM range(10)"),
         SchemaError, ("column name 'f' appears 2 times", "inference reads", "df.toDF('id', 'f_1', 'f_2')")),
    Case(TR, "struct-column", _train("SELECT id, named_struct('a', id) AS s FROM range(10)"),
         SchemaError, ("'s'",)),
    Case(TR, "num-epochs-zero", _train(num_epochs=0), ValueError, ("num_epochs", "0")),
    Case(TR, "num-epochs-negative", _train(num_epochs=-1), ValueError, ("num_epochs", "-1")),
    Case(TR, "num-epochs-bool", _train(num_epochs=True), ValueError, ("num_epochs", "True")),
    Case(TR, "cache-not-bool", _train(cache="yes"), TypeError, ("cache", "'yes'")),
    Case(TR, "shuffle-not-bool", _train(shuffle=1), TypeError, ("shuffle", "1")),
    Case(TR, "seed-not-int", _train(seed="7"), TypeError, ("seed", "'7'")),
    Case(TR, "feed-timeout-zero", _train(feed_timeout=0), ValueError, ("feed_timeout", "0")),
    Case(TR, "not-a-dataframe", _train(df=lambda env: [1, 2, 3]), TypeError, ("Spark DataFrame", "list")),
    Case(TR, "validation-not-a-dataframe", _train(validation="val.parquet"), TypeError,
         ("validation", "Spark DataFrame", "str")),
    Case(TR, "validation-map-column", _train(validation=None, df=None) if False else
         (lambda env: (lambda c=env.request.getfixturevalue("cluster"): c.train(
             env.spark.sql(GOOD), validation=env.spark.sql("SELECT map('a', 1) AS m")))),
         SchemaError, ("'m'",)),
    Case(TR, "spark-session-stopped", _after_spark_stop("train"), ClusterStateError,
         ("SparkSession", "spark.stop()", "with dataplane.run(", "cluster.shutdown()"),
         within=5, after=_still_trains),
    Case(INF, "spark-session-stopped", _after_spark_stop("inference"), ClusterStateError,
         ("cannot run inference", "spark.stop()"), within=5, after=_still_trains),
    Case(INF, "passthrough-not-a-column", _infer(passthrough=("nope",)), SchemaError,
         ("passthrough column 'nope'", "['id', 'f', 'g']")),
    Case(INF, "columns-not-a-column", _infer(columns=["f", "zz"]), SchemaError,
         ("column 'zz' is not in the DataFrame",)),
    # what only the rows show fails the action on the lazy output, as Spark reports a task's
    # error; the message is the node's, naming the column and the fix
    Case(INF, "null-in-a-feature",
         _infer("SELECT id, IF(id = 150, NULL, CAST(id AS FLOAT)) AS f, CAST(id AS DOUBLE) AS g "
                "FROM range(0, 200, 1, 2)", output_schema=pa.schema([("y", pa.float32())])),
         PythonException, ("partition 1", "node 0", "column 'f' has 1 null value(s)", "df.fillna({'f': 0})",
                          "df.na.drop(subset=['f'])"), stage="action", within=120,
         after=_still_trains),
    # ... unless the probe that learns predict's output columns meets it first: then the call
    Case(INF, "null-in-a-feature-of-the-probe-rows",
         _infer("SELECT id, IF(id = 1, NULL, CAST(id AS FLOAT)) AS f, CAST(id AS DOUBLE) AS g "
                "FROM range(0, 200, 1, 2)"),
         dataplane.FeedError, ("probe batch", "column 'f' has 1 null value(s)", "df.fillna({'f': 0})"),
         within=60, after=_still_trains),
]


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case, request, tmp_path):
    check(case, Env(request, tmp_path))


def test_a_node_dying_mid_train_fails_that_call_and_every_later_one(spark):
    cluster = dataplane.run(spark, catalogue_main, {"die_on": 1500}, num_nodes=1)
    pids = [n.pid for n in cluster.nodes]
    try:
        cluster.train(spark.sql(GOOD))  # warm: TensorFlow is loaded, the dataset built
        df = spark.sql("SELECT id, CAST(id AS FLOAT) AS f, CAST(id AS DOUBLE) AS g FROM range(0, 4000, 1, 2)")
        t0 = time.monotonic()
        with pytest.raises(NodeError) as info:
            cluster.train(df, num_epochs=2)
        assert time.monotonic() - t0 < 20  # a push job, the node's death, and ~10 s to tell
        assert "ValueError: row 1500 is poison" in info.value.remote_traceback
        assert not isinstance(info.value, SchemaError)  # only a node's SchemaError is one
        for call in (lambda: cluster.train(df), lambda: cluster.inference(df)):
            t1 = time.monotonic()
            with pytest.raises(NodeError, match="main raised"):
                call()
            assert time.monotonic() - t1 < 2, "a later call did not fail at once"
    finally:
        with pytest.raises(NodeError):
            cluster.shutdown(timeout=20)
        wait_gone(pids, 30)
