"""dataplane.compat: TFoS's TFCluster / DataFeed API on the Flight data plane."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dataplane.compat import InputMode, TFCluster, rdd_to_dataframe
from dataplane.compat_node import decode_rows
from dataplane.errors import ClusterStateError, SchemaError
from tests.dataplane.clusterutil import wait_json
from tests.dataplane.tfos_programs import feed_and_answer_main

ELEMENTS = [([float(i), i / 2.0, -1.0], i, f"row{i}") for i in range(60)]


def test_rdd_elements_round_trip_through_columns(spark):
    cases = {
        "tuple": ELEMENTS[:5],
        "list": [[i, "a", [1.5, 2.5]] for i in range(4)],
        "value": [1.5, 2.5, 3.5],
        "vector": [np.arange(3, dtype=np.float32) + i for i in range(3)],
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
            else:
                assert got == want


def test_unfeedable_elements_are_refused(spark):
    sc = spark.sparkContext
    with pytest.raises(SchemaError, match="empty RDD"):
        rdd_to_dataframe(spark, sc.parallelize([], 1))
    with pytest.raises(SchemaError, match="dict"):
        rdd_to_dataframe(spark, sc.parallelize([({"a": 1}, 2)], 1))


@pytest.mark.cluster
def test_tfos_program_trains_terminates_and_infers(spark, tmp_path):
    sc = spark.sparkContext
    rdd = sc.parallelize(ELEMENTS, 4)
    args = {"dir": str(tmp_path), "take": len(ELEMENTS)}
    cluster = TFCluster.run(sc, feed_and_answer_main, args, 1, 0, False, InputMode.SPARK,
                            master_node="chief")
    try:
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
    assert results == [f"{e[1] * 10}:{e[2]}" for e in ELEMENTS]


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
