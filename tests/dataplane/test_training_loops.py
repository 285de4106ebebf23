"""The push plane under training loops written the ways users write them.

A matrix on real Spark, Flight and TensorFlow: consumption pattern {every epoch read to the end;
the same through ``strategy.distribute_datasets_from_function`` and ``strategy.run`` (an
all-reduce a step); ``break`` after k batches; ``take(k)``; Keras ``fit(steps_per_epoch=k)`` on ``repeat=True``;
``evaluate(steps=k)`` between epochs; ``fit(validation_data=...)`` from a Parquet pull reader}
x rows {narrow numeric; 48 KiB image rows} x {1 node; 2 MultiWorkerMirroredStrategy workers}
x buffer {smaller than one worker's share of an Arrow batch; the default (image rows)}.

Each case is one ``cluster.train`` call; one cluster per (nodes, buffer) runs every case of
its row so cluster start-up is paid once. Every case must finish well within its feed timeout,
and the books must balance exactly: rows handed to TensorFlow (counted by the nodes) +
``rows_unconsumed`` + ``dropped_for_balance`` = rows pushed, while what the program itself saw
is a duplicate-free subset of it (all of it, checksummed, when every epoch is read to the end).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dataplane
from tests.dataplane.clusterutil import wait_gone, wait_json
from tests.dataplane.loop_mains import loops_main

pytestmark = pytest.mark.cluster

IMAGE = 64 * 64 * 3  # float32 values: 48 KiB rows
SMALL_BUFFER = 1 << 20  # a worker's share of one image partition's Arrow batch is ~2.4 MB
FEED_TIMEOUT = 150.0

ROWS = {
    # kind: (rows, partitions, width, batch size, k for break/take/evaluate, k for fit_steps)
    "narrow": (960, 3, 4, 32, 4, 12),
    "image": (200, 2, IMAGE, 16, 3, 5),
}
# pattern: epochs pushed per train() call
PATTERNS = {
    "full": 2,
    "strategy_loop": 2,
    "break": 2,
    "take": 2,
    "fit_steps": 3,
    "evaluate_steps": 4,
    "fit_validation_pull": 2,
}


def _scenarios(kinds):  # type: ignore[no-untyped-def]
    out = []
    for kind in kinds:
        rows, parts, width, bs, k, k_fit = ROWS[kind]
        for pattern, epochs in PATTERNS.items():
            out.append({
                "kind": kind, "pattern": pattern, "epochs": epochs, "rows": rows, "parts": parts,
                "width": width, "batch_size": bs, "k": k_fit if pattern == "fit_steps" else k,
                "fit_epochs": 3,
            })
    return out


def _frame(spark, sc):  # type: ignore[no-untyped-def]
    if sc["width"] == 4:
        x = "array(cast(id as float), cast(id * 2 as float), cast(id % 7 as float), 1.0f)"
    else:
        x = f"transform(sequence(1, {sc['width']}), i -> cast((id % 251) / 251.0 as float))"
    return spark.range(0, sc["rows"], 1, sc["parts"]).selectExpr(
        "id", f"{x} as x", "cast(id % 2 as int) as label"
    ).cache()


def _validation_file(tmp_path, width: int) -> str:
    n = 64
    x = pa.FixedSizeListArray.from_arrays(pa.array(np.tile(np.arange(width, dtype=np.float32) / width, n)), width)
    table = pa.table({"x": x, "label": pa.array(np.arange(n, dtype=np.int32) % 2)})
    path = tmp_path / f"val{width}.parquet"
    pq.write_table(table, path)
    return str(path)


def _metric(cluster, key):  # type: ignore[no-untyped-def]
    return {n: m[key] for n, m in cluster.metrics().items()}


def _run_matrix(spark, tmp_path, *, num_nodes: int, buffer_bytes: int, kinds) -> None:  # type: ignore[no-untyped-def]
    scenarios = _scenarios(kinds)
    for sc in scenarios:
        if sc["pattern"] == "fit_validation_pull":
            sc["validation"] = _validation_file(tmp_path, sc["width"])
    cluster = dataplane.run(spark, loops_main, {"dir": str(tmp_path), "scenarios": scenarios},
                            num_nodes=num_nodes, buffer_bytes=buffer_bytes)
    workers = [n.node_id for n in cluster.nodes]
    try:
        for j, sc in enumerate(scenarios):
            case = f"{sc['kind']} rows, {sc['pattern']}, {num_nodes} node(s), buffer {buffer_bytes}"
            df = _frame(spark, sc)
            out_before = _metric(cluster, "rows_out")
            t0 = time.monotonic()
            report = cluster.train(df, num_epochs=sc["epochs"], feed_timeout=FEED_TIMEOUT)
            took = time.monotonic() - t0
            assert took < FEED_TIMEOUT / 2, (case, took)
            seen = {n: wait_json(tmp_path / f"node{n}-s{j}.json") for n in workers}
            df.unpersist()
            pushed = sc["rows"] * sc["epochs"]
            assert report.rows == pushed, case
            assert report.spark_jobs == sc["epochs"], case
            handed = sum(_metric(cluster, "rows_out")[n] - out_before[n] for n in workers)
            # the books balance exactly, counted on both sides
            assert handed + sum(report.rows_unconsumed.values()) + report.dropped_for_balance == pushed, (case, report)
            assert report.rows_consumed == handed, (case, report)
            ids = [i for n in workers for e in seen[n]["epochs"] for i in e]
            assert len(ids) <= handed, case
            # no row more often than it was pushed; none twice within one pass of a loop
            assert max(Counter(ids).values(), default=0) <= sc["epochs"], case
            if sc["pattern"] in ("full", "strategy_loop", "break", "take"):
                for n in workers:
                    for e in seen[n]["epochs"]:
                        assert len(e) == len(set(e)), (case, n)
            if sc["pattern"] in ("full", "strategy_loop", "fit_validation_pull"):
                assert report.rows_unconsumed == {}, (case, report)
            elif sc["kind"] == "image":
                # a pass left after a few batches: the rest was refused (narrow rows may all
                # have been handed over already, in the few multi-batch items read ahead)
                assert sum(report.rows_unconsumed.values()) > 0, (case, report)
            if sc["pattern"] in ("full", "strategy_loop"):
                # every row of every epoch, checksummed; equal batch counts on every worker
                assert report.dropped_for_balance == 0
                for e in range(sc["epochs"]):
                    got = sorted(i for n in workers for i in seen[n]["epochs"][e])
                    assert got == list(range(sc["rows"])), (case, e)
                    assert len({seen[n]["batches"][e] for n in workers}) == 1, case
            elif sc["pattern"] in ("break", "take"):
                for n in workers:
                    assert seen[n]["batches"][: sc["epochs"]] == [sc["k"]] * sc["epochs"], (case, n)
            else:  # Keras: every worker ran the same steps (counted by a callback: the ids a
                # map saw include what tf.data read ahead, which differs between workers)
                assert len({(seen[n]["steps"]["train"], seen[n]["steps"]["test"]) for n in workers}) == 1, (case, seen)
                assert seen[workers[0]]["steps"]["train"] > 0, (case, seen)
                if sc["pattern"] == "fit_steps":
                    assert seen[workers[0]]["steps"]["train"] == sc["fit_epochs"] * sc["k"], (case, seen)
                if sc["pattern"] == "evaluate_steps":
                    assert seen[workers[0]]["steps"]["test"] == sc["epochs"] // 2 * sc["k"], (case, seen)
                for n in workers:
                    assert len(ids_of(seen[n])) > 0, (case, n)
            if sc["pattern"] == "fit_validation_pull":
                for n in workers:
                    val = seen[n]["val_loss"]
                    assert len(val) == sc["epochs"] and all(np.isfinite(val)), (case, val)
        m = cluster.metrics()
        for n in workers:
            assert m[n]["buffer_peak_bytes"] <= buffer_bytes + (1 << 20), m[n]
    finally:
        pids = [n.pid for n in cluster.nodes]
        cluster.shutdown(timeout=30)
        wait_gone(pids, 30)


def ids_of(record: dict) -> list[int]:
    return [i for e in record["epochs"] for i in e]


def test_one_node_small_buffer(spark, tmp_path):
    _run_matrix(spark, tmp_path, num_nodes=1, buffer_bytes=SMALL_BUFFER, kinds=("narrow", "image"))


def test_two_mwms_workers_small_buffer(spark, tmp_path):
    _run_matrix(spark, tmp_path, num_nodes=2, buffer_bytes=SMALL_BUFFER, kinds=("narrow", "image"))


def test_two_mwms_workers_default_buffer_image_rows(spark, tmp_path):
    _run_matrix(spark, tmp_path, num_nodes=2, buffer_bytes=64 << 20, kinds=("image",))


def test_a_repeat_stream_batches_each_epoch_on_its_own(spark, tmp_path):
    # narrow rows go through the generator several batches an item; rebatch then joined an
    # epoch's short last batch with the next epoch's first rows (ids 448..499 + 0..11)
    from tests.dataplane.loop_mains import repeat_batches_main

    args = {"dir": str(tmp_path), "batch_size": 64, "batches": 32}
    with dataplane.run(spark, repeat_batches_main, args, num_nodes=1) as cluster:
        cluster.train(spark.range(0, 500, 1, 3), 4, cache=True)
    batches = wait_json(tmp_path / "batches0.json")
    assert [len(b) for b in batches] == ([64] * 7 + [52]) * 4
    for e in range(4):
        assert sorted(i for b in batches[8 * e: 8 * e + 8] for i in b) == list(range(500)), e
