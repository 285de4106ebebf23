"""Flow control of the push path on real Flight servers, without Spark.

The contested cases are forced, not left to timing: one task pushes an Arrow batch whose share
per worker is many times a node's buffer, to two nodes whose consumers step in lockstep (as
MultiWorkerMirroredStrategy's collectives make them). Written worker by worker, the first
worker's buffer fills while the second has nothing, and the lockstep never completes: these
tests then fail on their barrier's timeout, every run.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from dataplane.node.server import InferenceBroker, NodeServer
from feeders.buffer import EpochInfo, FeedBuffer
from feeders.protocol import chunk_bytes, split_counts
from feeders.push import _Push, push_partition
from feeders.source import iterate_epoch

SECRET = "flow-test-secret"
WIDTH = 1024  # float32 values a row: 4 KiB rows
CAPACITY = 256 * 1024


def _schema() -> pa.Schema:
    return pa.schema([("id", pa.int64()), ("img", pa.list_(pa.float32()))])


def _batch(start: int, rows: int) -> pa.RecordBatch:
    ids = np.arange(start, start + rows, dtype=np.int64)
    values = np.repeat(ids.astype(np.float32), WIDTH)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * WIDTH)
    img = pa.ListArray.from_arrays(offsets, pa.array(values))
    return pa.RecordBatch.from_arrays([pa.array(ids), img], schema=_schema())


@pytest.fixture
def nodes():
    """Two real node Flight servers with small buffers, epoch 0 announced."""
    made = []
    for node_id in range(2):
        buf = FeedBuffer(CAPACITY)
        buf.begin_epoch(EpochInfo(0, _schema()))
        server = NodeServer("grpc://127.0.0.1:0", SECRET, buffer=buf, broker=InferenceBroker(),
                            on_shutdown=lambda: None, node_id=node_id)
        made.append((buf, server))
    yield made
    for buf, server in made:
        buf.stop()
        server.shutdown()


def _job(nodes, partition: int = 0, tasks: int = 1) -> _Push:
    return _Push(
        secret=SECRET, epoch=0, partition=partition, attempt=0,
        locations=[(i, f"grpc://127.0.0.1:{s.port}") for i, (_, s) in enumerate(nodes)],
        schema=_schema(), chunk_bytes=chunk_bytes(CAPACITY, tasks, 1 << 20), timeout=30.0,
        tls_root_certs=None,
    )


def _lockstep_consumers(bufs, batch_size: int, stop_after: int | None = None):
    """One consumer thread per buffer; every batch waits on a shared barrier (a collective)."""
    barrier = threading.Barrier(len(bufs), timeout=20)
    seen: list[list[int]] = [[] for _ in bufs]
    errors: list[BaseException] = []

    def consume(k: int) -> None:
        items = iterate_epoch(bufs[k], 0, batch_size=batch_size, num_workers=len(bufs),
                              drop_remainder=False, convert=lambda t: t.column("id").to_pylist())
        try:
            for i, ids in enumerate(items):
                if len(ids) == batch_size:  # the tail batch may differ in size: no collective
                    barrier.wait()
                seen[k].extend(ids)
                if stop_after is not None and i + 1 == stop_after:
                    break
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            barrier.abort()
        finally:
            items.close()

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(len(bufs))]
    for t in threads:
        t.start()
    return threads, seen, errors


def test_a_full_buffer_never_starves_the_other_worker(nodes):
    rows = 8000  # 32 MB: each worker's share is 64x its buffer, and more than gRPC buffers
    bufs = [b for b, _ in nodes]
    threads, seen, errors = _lockstep_consumers(bufs, batch_size=16)
    result: list = []
    pusher = threading.Thread(target=lambda: result.extend(push_partition(iter([_batch(0, rows)]), _job(nodes))),
                              daemon=True)
    pusher.start()
    pusher.join(60)
    assert not pusher.is_alive(), "the push deadlocked against lockstep consumers"
    assert not errors, errors
    limit = min(b.epoch_rows(0) for b in bufs)
    for b in bufs:
        b.end_epoch(0, limit)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert [len(s) for s in seen] == [rows // 2, rows // 2]
    assert sorted(seen[0] + seen[1]) == list(range(rows))
    sent = {r[2]: r[3] for r in result}
    assert sent == {0: rows // 2, 1: rows // 2}
    for b in bufs:
        assert b.snapshot()["buffer_peak_bytes"] <= CAPACITY + _job(nodes).chunk_bytes


def test_a_null_in_one_workers_slice_is_refused_by_every_worker(nodes):
    """Batch 2 of the partition has a null id in its last rows, which fall in worker 1's
    slice; worker 0's slice of it is clean. Both nodes refuse that batch at its first chunk,
    so each holds exactly its share of batch 1, no more than the other (before: worker 0 took
    its slice of batch 2 and, from the chunks' seen counts, could yield it, rows worker 1
    never got)."""
    from formats.errors import SchemaError

    bufs = [b for b, _ in nodes]
    for b in bufs:
        b.expect_columns("train", ["id", "img"], [])
    clean = _batch(0, 40)
    dirty = _batch(40, 40)
    ids = pa.array(list(range(40, 79)) + [None], pa.int64())
    dirty = pa.RecordBatch.from_arrays([ids, dirty.column(1)], schema=_schema())
    with pytest.raises(SchemaError, match=r"column 'id' has 1 null value\(s\) in a batch of partition 0 \(epoch 0\)"):
        push_partition(iter([clean, dirty]), _job(nodes))
    assert [b.epoch_rows(0) for b in bufs] == [20, 20]
    for b in bufs:  # and no seen count promises the refused batch's rows
        assert b.take(0, num_workers=2)[1] == 20


def test_a_worker_leaving_the_epoch_is_sent_no_more_of_it(nodes):
    rows, batch, steps = 1200, 16, 3
    bufs = [b for b, _ in nodes]
    threads, seen, errors = _lockstep_consumers(bufs, batch_size=batch, stop_after=steps)
    result: list = []
    pusher = threading.Thread(target=lambda: result.extend(push_partition(iter([_batch(0, rows)]), _job(nodes))),
                              daemon=True)
    pusher.start()
    pusher.join(60)
    assert not pusher.is_alive(), "a node that left the epoch still held the push"
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert [len(s) for s in seen] == [steps * batch] * 2
    by_node = {r[2]: r for r in result}
    shares = split_counts(rows, 2, 0)
    for k, b in enumerate(bufs):
        _, _, _, sent, _, refused, _, was_refused = by_node[k]
        # the share was 2.4 MB against a 256 KiB buffer: the task finished because the node
        # refused the rest (gRPC may have taken some writes before the refusal reached it)
        assert sent + refused == shares[k]
        assert was_refused == 1  # so the driver leaves this node out of the epoch's limit
        st = b.epoch_state(0)
        assert st["closed"] and not st["complete"]
        assert st["rows"] <= sent
        assert b.snapshot()["buffer_bytes"] == 0  # what was queued was dropped


def test_a_node_whose_cache_meets_a_full_disk_fails_the_task_naming_node_file_and_fixes(tmp_path):
    """Node 1 records epoch 0 into a cache with no memory (all spilled) onto a full disk
    (its spill file is /dev/full). The task raised a FeedError that named the transport:
    "FlightServerError: [Errno 28] Error writing bytes to file. If the node died, ... check
    that executors can reach" it."""
    from formats.errors import StorageError

    made = []
    try:
        for node_id in range(2):
            (tmp_path / f"n{node_id}").mkdir()
            buf = FeedBuffer(CAPACITY, cache_dir=str(tmp_path / f"n{node_id}"), cache_bytes=0)
            buf.begin_epoch(EpochInfo(0, _schema(), record="c1"))
            made.append((buf, NodeServer("grpc://127.0.0.1:0", SECRET, buffer=buf, broker=InferenceBroker(),
                                         on_shutdown=lambda: None, node_id=node_id)))
        (tmp_path / "n1" / "cache-c1-0.arrow").symlink_to("/dev/full")
        with pytest.raises(StorageError) as info:
            push_partition(iter([_batch(0, 40)]), _job(made, partition=3))
        text = str(info.value)
        assert text.startswith(
            f"pushing partition 3 of epoch 0: node 1 could not write the cached rows beyond its "
            f"memory bound to {tmp_path / 'n1' / 'cache-c1-0.arrow'}: No space left on device; "), text
        assert "spark.local.dir" in text and "cache_bytes" in text and "reach" not in text, text
        assert made[0][0].epoch_rows(0) == 20  # the other node kept its share
    finally:
        for buf, server in made:
            buf.stop()
            server.shutdown()


def test_two_tasks_at_once_with_lockstep_consumers(nodes):
    """Two partitions pushed concurrently (chunks sized for two tasks) into the same nodes."""
    rows = 800
    bufs = [b for b, _ in nodes]
    threads, seen, errors = _lockstep_consumers(bufs, batch_size=8)
    results: list = []
    pushers = [
        threading.Thread(
            target=lambda p=p: results.extend(push_partition(iter([_batch(p * rows, rows)]), _job(nodes, p, tasks=2))),
            daemon=True,
        )
        for p in range(2)
    ]
    for t in pushers:
        t.start()
    for t in pushers:
        t.join(60)
    assert not any(t.is_alive() for t in pushers), "concurrent pushes deadlocked"
    assert not errors, errors
    limit = min(b.epoch_rows(0) for b in bufs)
    for b in bufs:
        b.end_epoch(0, limit)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(seen[0]) == len(seen[1]) == rows
    assert sorted(seen[0] + seen[1]) == list(range(2 * rows))


def test_inference_answers_keep_their_shape_and_conform_to_the_declared_types():
    import pyarrow as pa

    from dataplane.driver.inference import _spark_type
    from dataplane.node.context import _outputs_to_batch
    from feeders.push import _conform_answer
    from formats.errors import SchemaError

    mask = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    batch = _outputs_to_batch({"mask": mask, "p": np.zeros((2, 0), np.float16), "y": [1.5, 2.5]}, 2)
    assert batch.column("mask").to_pylist() == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
    assert batch.column("p").to_pylist() == [[], []] and batch.column("y").to_pylist() == [1.5, 2.5]
    assert _spark_type(batch.schema.field("mask").type) == pa.list_(pa.list_(pa.int64()))
    assert _spark_type(batch.schema.field("p").type) == pa.list_(pa.float32())
    # an output declared flat (output_schema=, as before answers kept their shape) is
    # flattened row by row, from a sliced answer too
    flat = _conform_answer(batch.column("mask").slice(1), pa.field("mask", pa.list_(pa.int64())), 3)
    assert flat.to_pylist() == [[6, 7, 8, 9, 10, 11]]
    with pytest.raises(SchemaError, match=r"node 3's predict returned output 'name' as string, which "
                                          r"does not convert to float, the type predict returned for "
                                          r"the first \(probe\) batch"):
        _conform_answer(pa.array(["a"]), pa.field("name", pa.float32()), 3)
    with pytest.raises(SchemaError, match=r"which does not convert to float, the type output_schema "
                                          r"declares .*declare another in output_schema"):
        _conform_answer(pa.array(["a"]), pa.field("name", pa.float32()), 3, "output_schema")


def test_a_ragged_inference_answer_becomes_a_list_column_and_a_misfit_names_the_output():
    # a list of lists of different lengths failed as "predict raised ValueError: setting an
    # array element with a sequence", though predict had returned; the conversion had failed
    from dataplane.node.context import _outputs_to_batch
    from formats.errors import SchemaError

    batch = _outputs_to_batch({"seq": [list(range(i % 3)) for i in range(5)]}, 5)
    assert str(batch.schema.field("seq").type) == "list<item: int64>"  # not double, from the []
    assert batch.column("seq").to_pylist() == [[], [0], [0, 1], [], [0]]
    with pytest.raises(SchemaError, match=r"predict output 's' is not an array with one entry per "
                                          r"input row .*out\[:\] = \[np\.asarray\(v\) for v in rows\]"):
        _outputs_to_batch({"s": [[1, [2, 3]], [4]]}, 2)
    with pytest.raises(SchemaError, match=r"predict output 'o' \(object array of shape \(2,\)\) does "
                                          r"not convert to a column"):
        _outputs_to_batch({"o": np.array([object(), object()])}, 2)


def test_declared_outputs_take_the_types_spark_holds_them_in():
    # output_schema with uint64 or a fixed-size list failed in Spark's Arrow conversion
    # (UNSUPPORTED_DATA_TYPE_FOR_ARROW_CONVERSION / Unsupported arrow type FixedSizeList(64));
    # a probed answer of those types was already widened
    import pyarrow as pa

    from dataplane.driver.inference import _declared_outputs

    got = _declared_outputs(pa.schema([("a", pa.uint64()), ("b", pa.list_(pa.float32(), 64)),
                                       ("c", pa.float16()), ("d", pa.large_string())]))
    assert got == pa.schema([("a", pa.int64()), ("b", pa.list_(pa.float32())), ("c", pa.float32()),
                             ("d", pa.string())])


def test_an_inference_answer_beyond_float32_is_an_error_not_infinity():
    import pyarrow as pa

    from feeders.push import _conform_answer
    from formats.errors import SchemaError

    # a float64 answer cast to a float32 output: 1e300 became inf without a word
    with pytest.raises(SchemaError, match=r"output 'y' as double with the value 1e\+300, beyond the "
                                          r"range of float, the type output_schema declares"):
        _conform_answer(pa.array([0.0, 1e300]), pa.field("y", pa.float32()), 1, "output_schema")
    with pytest.raises(SchemaError, match=r"output 'v' as list<item: double> with the value -3e\+39"):
        _conform_answer(pa.array([[1.0], [2.0, -3e39]]).slice(1), pa.field("v", pa.list_(pa.float32())), 1)
    # infinities and NaN that predict returned stay as they are; in-range values are cast
    same = _conform_answer(pa.array([float("inf"), float("nan"), 1.5, 3e38]), pa.field("y", pa.float32()), 1)
    assert same.type == pa.float32() and str(same.to_pylist()[:3]) == "[inf, nan, 1.5]"
    assert abs(same.to_pylist()[3] - 3e38) < 1e32


@pytest.mark.parametrize("want, fix", [
    (pa.float32(), "(e.g. pa.float64())"),
    (pa.list_(pa.float32()), "(e.g. pa.list_(pa.float64()))"),
    (pa.list_(pa.list_(pa.float32())), "(e.g. pa.list_(pa.list_(pa.float64())))"),
])
def test_an_answer_beyond_its_declared_float_range_suggests_the_wider_type_at_its_depth(want, fix):
    # a list output that overflows float32 was told to declare pa.float64(), a scalar
    from dataplane.errors import SchemaError
    from feeders.push import _conform_answer

    value: object = 1e300
    for _ in range(str(want).count("list")):
        value = [value]
    col = pa.array([value], pa.from_numpy_dtype(np.float64) if want == pa.float32() else None)
    with pytest.raises(SchemaError) as info:
        _conform_answer(col, pa.field("y", want), 0, "output_schema")
    assert "with the value 1e+300, beyond the range of" in str(info.value)
    assert str(info.value).endswith(f"return that type, or declare another in output_schema {fix}.")
