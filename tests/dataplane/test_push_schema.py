"""The push path's tensors for every kind of column the schema mapping covers, and a null
without a fill value reported by column, on a real cluster."""

from __future__ import annotations

import pytest

import dataplane
from dataplane.errors import NodeError, SchemaError
from tests.dataplane.clusterutil import wait_gone, wait_json
from tests.dataplane.mains import schema_main

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _frame(spark, rows: int, *, null_score_without_fill: bool = False):
    score = "cast(null as double)" if null_score_without_fill else "cast(id as double) * 0.25"
    return spark.range(0, rows, 1, 3).selectExpr(
        "id",
        "concat('row-', cast(id as string)) as name",
        "cast(repeat(char(cast(id % 256 as int)), 3) as binary) as blob",
        "transform(sequence(0, 11), k -> cast(id + k as float)) as img",
        f"case when id % 5 = 0 then cast(null as double) else {score} end as score",
        "cast(id % 7 as int) as label",
        # Spark hands timestamps over zoned in the session time zone (and binaryFile sources,
        # for one, carry a modificationTime): microseconds / days since the epoch on the node
        "timestamp_micros(id * 1000003) as ts",
        "date_add(date'1970-01-01', cast(id as int)) as day",
        # images as users make them (createDataFrame(images.tolist())): nested arrays, the
        # same shape in every row, come out dense without a declared shape; nested arrays
        # whose inner lengths vary stay ragged
        "transform(sequence(0, 1), i -> transform(sequence(0, 2), j -> cast(id + 3 * i + j as float))) as grid",
        "array(sequence(0, cast(id % 3 as int))) as jag",
        # text that is not UTF-8 (Spark takes CAST(X'FF..' AS STRING)): the node failed with
        # "ArrowException: Wrapping ... failed"; TF strings are bytes, so the bytes arrive
        "cast(unhex(concat('FF', lpad(hex(id % 10), 2, '0'))) as string) as raw",
    )


def test_strings_binary_declared_shapes_and_fill_values(spark, tmp_path):
    # 120 rows: ids < 128 keep char() one byte, so a blob is 3 bytes of the id
    with dataplane.run(spark, schema_main, {"dir": str(tmp_path)}, num_nodes=2) as cluster:
        report = cluster.train(_frame(spark, 120), num_epochs=1)
        assert report.rows == 120
        res = [wait_json(tmp_path / f"node{i}-epoch0.json") for i in (0, 1)]
        assert sum(r["rows"] for r in res) == 120
        cols = res[0]["columns"]
        assert cols == {
            "id": {"dtype": "int64", "shape": []},
            "name": {"dtype": "string", "shape": []},
            "blob": {"dtype": "string", "shape": []},
            "img": {"dtype": "float32", "shape": [3, 4]},
            "score": {"dtype": "float64", "shape": []},
            "label": {"dtype": "int32", "shape": []},
            "ts": {"dtype": "int64", "shape": []},
            "day": {"dtype": "int32", "shape": []},
            "grid": {"dtype": "float32", "shape": [2, 3]},
            "jag": {"dtype": "int32", "shape": [None, None]},
            "raw": {"dtype": "string", "shape": []},
        }


def test_a_null_without_a_fill_value_names_the_column(spark, tmp_path):
    from pyspark.sql import functions as F

    cluster = dataplane.run(spark, schema_main, {"dir": str(tmp_path)}, num_nodes=2)
    pids = [n.pid for n in cluster.nodes]
    df = _frame(spark, 60).withColumn(
        "label", F.when(F.col("id") == 7, None).otherwise(F.col("label"))
    )
    # The null is refused as it arrives once the node's dataset has named its fill values
    # (a SchemaError from train); if it arrives before, the node's main fails on it and train,
    # which waits for every pass, raises that NodeError. Either names the column and the fix.
    # (the node closes its pass just before its main is marked failed, so train may also
    # return a moment earlier; then shutdown raises it)
    err = None
    try:
        cluster.train(df, num_epochs=1)
    except (NodeError, SchemaError) as e:
        err = e
    if err is None or isinstance(err, NodeError):
        with pytest.raises(NodeError) as info:
            cluster.shutdown(timeout=30)
        err = err or info.value
        assert "main raised" in str(err)
        assert not (tmp_path / f"node{err.node.node_id}-epoch0.json").exists()
    else:
        cluster.shutdown(timeout=30)
    # either way `except SchemaError` catches it (a NodeError was only a RuntimeError)
    assert isinstance(err, SchemaError), type(err)
    text = str(err) + getattr(err, "remote_traceback", "")
    assert "column 'label' has 1 null value(s)" in text
    assert "fill_values={'label': 0}" in text
    wait_gone(pids, 15)


def test_a_schema_error_on_the_node_is_a_schema_error_for_the_caller(spark):
    # it came back as a NodeError, a RuntimeError: `except SchemaError` missed it
    from dataplane.errors import NodeSchemaError
    from tests.dataplane.mains import wrong_label_main

    with dataplane.run(spark, wrong_label_main, {}, num_nodes=1) as cluster:
        with pytest.raises(SchemaError) as info:
            cluster.train(spark.range(8), num_epochs=1)
        assert isinstance(info.value, NodeError) and isinstance(info.value, NodeSchemaError)
        assert "label column 'nope' is not in the pushed DataFrame" in str(info.value)
        with pytest.raises(NodeSchemaError):
            cluster.shutdown(timeout=30)


def test_a_fill_value_fills_null_arrays_as_well_as_null_elements(spark, tmp_path):
    # fill_values={"v": -1.0} was accepted, and a null array row then failed the pass with
    # "has 1 null list(s)": only null elements inside arrays were filled
    from tests.dataplane.mains import null_arrays_main

    df = spark.range(40).selectExpr(
        "id",
        "IF(id % 5 = 0, NULL, array(cast(id as float), cast(id as float) + 0.5)) AS v",
        "IF(id % 7 = 0, NULL, IF(id % 3 = 0, array(cast(id as int), NULL), array(cast(id as int)))) AS jag",
    )
    with dataplane.run(spark, null_arrays_main, {"dir": str(tmp_path)}, num_nodes=2) as cluster:
        report = cluster.train(df, num_epochs=1)
    assert report.rows == 40
    rows = {}
    for i in (0, 1):
        rows.update({int(k): v for k, v in wait_json(tmp_path / f"nulls{i}.json").items()})
    assert sorted(rows) == list(range(40))
    for i, r in rows.items():
        assert r["v_shape"] == [2]  # dense: every non-null row holds 2 values
        assert r["v"] == ([-1.0, -1.0] if i % 5 == 0 else [float(i), i + 0.5]), (i, r)
        want = [] if i % 7 == 0 else ([i, 0] if i % 3 == 0 else [i])
        assert r["jag"] == want, (i, r)


def test_the_fewer_passes_note_offers_the_cache_only_when_it_was_not_used(spark):
    # with cache=True already passed the note still said "use train(..., cache=True)"
    from tests.dataplane.mains import one_pass_main

    for cache in (False, True):
        with dataplane.run(spark, one_pass_main, {}, num_nodes=1) as cluster:
            report = cluster.train(spark.range(64), 3, cache=cache)
        notes = [m for m in report.messages if "read fewer passes than train(num_epochs=...)" in m]
        assert len(notes) == 2, report.messages
        # the first of the two unread epochs says why, and offers the cache only without it;
        # the second points back to the first
        assert ("use train(..., cache=True)" in notes[0]) is (not cache), notes
        assert "says why)." in notes[1] and "cache=True" not in notes[1], notes
