"""The node's feed buffer without Spark: dedupe, backpressure, stop, equal batches."""

from __future__ import annotations

import sys
import threading
import time
import weakref

import numpy as np
import pyarrow as pa
import pytest

from dataplane.errors import FeedError, SchemaError
from feeders.buffer import ConsumerFinished, EpochInfo, FeedBuffer, FeedStopped
from feeders.push import split_counts
from feeders.source import iterate_epoch

SCHEMA = pa.schema([("id", pa.int64())])


def _batches(start: int, stop: int, size: int):
    for s in range(start, stop, size):
        yield pa.RecordBatch.from_arrays([pa.array(np.arange(s, min(s + size, stop)))], schema=SCHEMA)


def _drain(buf: FeedBuffer, epoch: int, *, batch_size: int = 7, workers: int = 1) -> list[int]:
    out: list[int] = []
    for t in iterate_epoch(buf, epoch, batch_size=batch_size, num_workers=workers,
                           drop_remainder=False, convert=lambda t: t.column("id").to_pylist()):
        out.extend(t)
    return out


def test_a_retried_attempt_only_adds_rows_the_first_did_not_deliver():
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))

    def dying():  # first attempt: 30 rows, then the task dies
        yield from _batches(0, 30, 10)
        raise RuntimeError("task killed")

    with pytest.raises(RuntimeError):
        buf.put_stream(0, 5, dying())
    assert buf.put_stream(0, 5, _batches(0, 100, 25)) == 70  # the retry re-sends everything
    buf.end_epoch(0, 100)
    assert _drain(buf, 0) == list(range(100))
    assert buf.snapshot()["rows_duplicate"] == 30


def test_concurrent_speculative_attempts_deliver_each_row_once():
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    threads = [
        threading.Thread(target=buf.put_stream, args=(0, 1, _batches(0, 5000, size)))
        for size in (13, 64)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    buf.end_epoch(0, 5000)
    got = _drain(buf, 0, batch_size=100)
    assert sorted(got) == list(range(5000))
    assert buf.snapshot()["rows_duplicate"] == 5000


def test_producers_wait_on_a_full_buffer_and_stop_unblocks_them():
    one = next(_batches(0, 100, 100)).nbytes
    buf = FeedBuffer(3 * one)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    errors = []

    def produce():
        try:
            buf.put_stream(0, 0, _batches(0, 10_000, 100))
        except FeedStopped as e:
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    deadline = time.monotonic() + 30
    while not buf._stalled and time.monotonic() < deadline:  # the producer now waits
        time.sleep(0.01)
    time.sleep(0.5)
    snap = buf.snapshot()
    assert snap["buffer_bytes"] <= 3 * one and snap["rows_in"] == 300  # held at the limit
    assert 0.3 < snap["stall_seconds"] < 5  # only the wait counts (it is still waiting)
    t0 = time.monotonic()
    buf.stop()
    t.join(5)
    assert not t.is_alive() and errors and time.monotonic() - t0 < 2


def test_puts_that_never_wait_count_no_stall():
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    assert buf.put_stream(0, 0, _batches(0, 5000, 100)) == 5000
    snap = buf.snapshot()
    assert snap["rows_in"] == 5000 and snap["batches_in"] == 50
    assert snap["stall_seconds"] == 0.0


def test_consumer_finished_refuses_more_data():
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    buf.consumer_finished()
    with pytest.raises(ConsumerFinished):
        buf.put_stream(0, 0, _batches(0, 10, 5))


def test_data_for_an_unannounced_epoch_is_an_error():
    buf = FeedBuffer(1 << 20)
    with pytest.raises(FeedError, match="before the driver announced"):
        buf.put_stream(3, 0, _batches(0, 10, 5))


@pytest.mark.parametrize("sizes", [[1, 3, 0, 500], [7, 7, 7], [0], [1000, 1]])
def test_split_keeps_workers_within_one_row_per_partition(sizes):
    workers = 3
    totals = [0] * workers
    for p, n in enumerate(sizes):
        shares = split_counts(n, workers, p)
        assert sum(shares) == n and max(shares) - min(shares) <= (1 if n else 0)
        totals = [a + b for a, b in zip(totals, shares)]
    assert max(totals) - min(totals) <= len(sizes)


def test_a_stream_s_split_keeps_what_workers_hold_back_bounded():
    # micro-batches evened by the smallest worker's rows, the rest held back: given what each
    # holds, the extras go to those holding fewest, so it never grows, even when every
    # micro-batch's rows land in the same partition; equal workers take turns by partition
    assert split_counts(5, 3, 1) == split_counts(5, 3, 1, [0, 0, 0]) == [1, 2, 2]
    assert split_counts(5, 3, 1, [0, 4, 1]) == [2, 1, 2]
    rng = np.random.default_rng(7)
    for workers, partitions in ((2, 1), (2, 2), (3, 4), (4, 3)):
        held = [0] * workers
        for _ in range(300):
            rows = [0] * workers
            for p in range(partitions):  # one partition only, the last, or all with random rows
                n = int(rng.integers(0, 4)) if partitions > 2 else int(p == partitions - 1)
                rows = [a + b for a, b in zip(rows, split_counts(n, workers, p, held))]
            have = [a + b for a, b in zip(rows, held)]
            held = [h - min(have) for h in have]
            assert max(held) <= partitions, (workers, partitions, held)


def test_a_worker_never_yields_past_the_final_limit():
    # two workers fed 3 uneven partitions each; yields stop at the driver's limit
    bufs = [FeedBuffer(1 << 20) for _ in range(2)]
    for b in bufs:
        b.begin_epoch(EpochInfo(0, SCHEMA))
    start = 0
    for p, n in enumerate([5, 9, 1]):
        shares = split_counts(n, 2, p)
        for k, b in enumerate(bufs):
            b.put_stream(0, p, _batches(start, start + shares[k], 4))
            start += shares[k]
    limit = min(b.epoch_rows(0) for b in bufs)
    for b in bufs:
        b.end_epoch(0, limit)
    got = [_drain(b, 0, batch_size=3, workers=2) for b in bufs]
    assert len(got[0]) == len(got[1]) == limit
    assert not set(got[0]) & set(got[1])


def test_carry_epochs_hold_back_the_rows_past_the_limit_for_the_next():
    # a stream's micro-batches on two workers: rows past the limit are read first in the next
    # micro-batch (counted in its limit), so every row is read once; a carry epoch whose
    # carry_from is not the last one (the driver counted those rows as dropped) starts empty;
    # a micro-batch with other nullability flags takes them in its own schema
    bufs = [FeedBuffer(1 << 20) for _ in range(2)]
    held = [0, 0]
    start, read, pushed = 0, [[], []], [set(), set()]
    nullable = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    for e, (n, schema) in enumerate([(1, SCHEMA), (2, SCHEMA), (51, nullable), (7, SCHEMA)]):
        shares = split_counts(n, 2, 0, held)  # (extras to the worker holding back fewest)
        before = [p - {i for r in read[k] for i in r} for k, p in enumerate(pushed)]  # held back
        for k, b in enumerate(bufs):
            b.begin_epoch(EpochInfo(e, schema, carry=True, carry_from=e - 1 if e else None))
            pushed[k] |= set(range(start, start + shares[k]))
            b.put_stream(e, 0, (pa.RecordBatch.from_arrays(x.columns, schema=schema)
                                for x in _batches(start, start + shares[k], 4)))
            start += shares[k]
        limit = min(b.epoch_rows(e) + h for b, h in zip(bufs, held))
        for b in bufs:
            b.end_epoch(e, limit)
        for k, b in enumerate(bufs):
            got = _drain(b, e, batch_size=3, workers=2)
            state = b.epoch_state(e)
            assert len(got) == limit and state["carried_in"] == held[k], (e, k, got, state)
            assert state["carried_out"] == held[k] + shares[k] - limit, (e, k, state)
            assert len(before[k]) == held[k] and set(got[:held[k]]) == before[k]  # first
            read[k].append(got)
        held = [b.epoch_state(e)["carried_out"] for b in bufs]
        assert max(held) <= 1, (e, held)
    ids = [i for r in read for ep in r for i in ep]
    assert len(ids) == len(set(ids)) and len(ids) + sum(held) == start == 61 and sum(held) == 1
    # an epoch that does not name the last one as its carry_from starts without those rows
    b = bufs[max(range(2), key=lambda k: held[k])]
    b.begin_epoch(EpochInfo(9, SCHEMA, carry=True, carry_from=2))
    b.put_stream(9, 0, _batches(100, 104, 4))
    b.end_epoch(9, 4)
    assert _drain(b, 9, workers=2) == [100, 101, 102, 103]
    assert b.epoch_state(9)["carried_in"] == 0


def test_multi_batch_items_are_whole_batches_until_the_tail():
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    buf.put_stream(0, 0, _batches(0, 600, 50))
    buf.put_stream(0, 1, _batches(600, 1003, 97))
    buf.end_epoch(0, 1003)
    items = list(iterate_epoch(buf, 0, batch_size=16, num_workers=1, drop_remainder=False,
                               convert=lambda t: t.column("id").to_pylist(), batches_per_item=8))
    sizes = [len(i) for i in items]
    assert all(s % 16 == 0 and 16 <= s <= 128 for s in sizes[:-1]), sizes
    assert sizes[-1] == 1003 % 16
    assert max(sizes) == 128  # items do hold several batches
    assert sorted(v for i in items for v in i) == list(range(1003))


def test_pushed_narrow_rows_come_out_in_exact_batches():
    """The real tf.data pipeline: multi-batch generator items re-cut by Dataset.rebatch."""
    from feeders.source import push_dataset

    schema = pa.schema([("id", pa.int64()), ("x", pa.float32()), ("flag", pa.bool_())])

    def part(start: int, stop: int, size: int):
        for s in range(start, stop, size):
            ids = np.arange(s, min(s + size, stop))
            yield pa.RecordBatch.from_arrays(
                [pa.array(ids), pa.array(ids.astype(np.float32) / 2), pa.array(ids % 2 == 0)], schema=schema
            )

    buf = FeedBuffer(8 << 20)
    epochs = iter(range(2))
    ds = None
    for epoch in range(2):
        buf.begin_epoch(EpochInfo(epoch, schema))
        if ds is None:
            ds = push_dataset(buf, batch_size=32, num_workers=1, label="flag",
                              next_epoch=lambda: next(epochs))
        buf.put_stream(epoch, 0, part(0, 2500, 1000))
        buf.put_stream(epoch, 1, part(2500, 5001, 700))
        buf.end_epoch(epoch, 5001)
        sizes, ids, xs, flags = [], [], [], []
        for features, label in ds:
            sizes.append(int(features["id"].shape[0]))
            ids.append(features["id"].numpy())
            xs.append(features["x"].numpy())
            flags.append(label.numpy())
        assert sizes == [32] * (5001 // 32) + [5001 % 32]
        got = np.concatenate(ids)
        np.testing.assert_array_equal(np.sort(got), np.arange(5001))
        np.testing.assert_array_equal(np.concatenate(xs), got.astype(np.float32) / 2)
        np.testing.assert_array_equal(np.concatenate(flags), got % 2 == 0)
        assert features["x"].dtype.name == "float32" and label.dtype.name == "bool"


def test_a_wide_table_read_a_tensor_a_column_is_told_to_pack_its_columns_once(caplog):
    """1,000 one-value columns cost tf.data 1,000 tensors a batch (3.7x slower fit than one
    array column, measured): the node says how to push them as one array, once per process."""
    import feeders.source as fs
    from feeders.source import push_dataset

    fs._warned.clear()
    for width, told in ((99, False), (120, True)):
        schema = pa.schema([(f"f{i}", pa.float64()) for i in range(width)] + [("label", pa.int64())])
        rows = 50
        batch = pa.RecordBatch.from_arrays(
            [pa.array(np.full(rows, float(i))) for i in range(width)] + [pa.array(np.arange(rows))],
            schema=schema)
        for _ in range(2):  # a main that builds ctx.dataset() again for every epoch
            buf = FeedBuffer(8 << 20)
            buf.begin_epoch(EpochInfo(0, schema))
            with caplog.at_level("WARNING", logger="feeders.source"):
                caplog.clear()
                ds = push_dataset(buf, batch_size=16, num_workers=1, label="label",
                                  next_epoch=lambda: 0)
            buf.put_stream(0, 0, iter([batch]))
            buf.end_epoch(0, rows)
            got = [(f, y) for f, y in ds]
            assert sum(int(y.shape[0]) for _, y in got) == rows
            assert float(got[0][0][f"f{width - 1}"][0]) == width - 1
            hints = [r.getMessage() for r in caplog.records if "columns of one value a row" in r.getMessage()]
            if told and _ == 0:
                assert len(hints) == 1, hints
                assert f"reads {width} columns of one value a row ('f0', 'f1', 'f2', ...)" in hints[0]
                assert "F.array(*feature_cols).alias('features')" in hints[0]
                assert f"one [batch, {width}] tensor" in hints[0]
            else:
                assert hints == [], (width, hints)


def test_a_validation_split_cannot_be_one_stream():
    # Keras starts a new pass over validation_data every epoch: a repeat=True validation stream
    # would lose its read-ahead at each drop and then wait for epochs that never come (found by
    # a fit(validation_data=..., validation_steps=3) program under MWMS that hung).
    from feeders.source import push_dataset

    buf = FeedBuffer(1 << 20)
    with pytest.raises(ValueError, match=r"split='validation', repeat=True.*drop repeat=True"):
        push_dataset(buf, batch_size=8, num_workers=2, split="validation", repeat=True)
    # raised at once: nothing was announced, and the call did not wait for an epoch
    assert buf.snapshot()["epochs_begun"] == 0



def test_a_shape_for_a_column_the_feed_lacks_is_refused_like_a_fill_value():
    # ctx.dataset(shapes={"imgae": ...}) was dropped without a word, and the image then arrived
    # without its shape; fill_values with that typo were already refused
    from feeders.source import push_dataset

    schema = pa.schema([("id", pa.int64()), ("image", pa.list_(pa.float32()))])
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, schema))
    with pytest.raises(SchemaError, match=r"shapes/fill_values name column 'imgae', which the data "
                                          r"does not have; its columns are \['id', 'image'\]"):
        push_dataset(buf, batch_size=8, num_workers=1, shapes={"imgae": (2, 2)})
    # the right name, and a shape for a column this dataset leaves out, are both taken
    ds = push_dataset(buf, batch_size=8, num_workers=1, features="id", shapes={"image": (2, 2)})
    assert ds.element_spec.shape.as_list() == [None]


def test_a_list_of_labels_is_refused_with_the_multi_output_recipe():
    # a multi-output model's user tries label=["y1", "y2"]; it used to be told that the list
    # "is not in the pushed DataFrame"
    from feeders.source import push_dataset

    buf = FeedBuffer(1 << 20)
    with pytest.raises(ValueError, match=r"label must be a column name \(str\) or None, got \['y1', 'y2'\]\. "
                                         r"For a model with several outputs.*ds\.map"):
        push_dataset(buf, batch_size=8, num_workers=1, label=["y1", "y2"])
    assert buf.snapshot()["epochs_begun"] == 0


def test_a_pass_left_early_counts_little_more_than_it_read():
    # Narrow rows go to tf.data up to 64 batches at a time; a pass that left after k batches
    # (validation_steps, take, steps_per_epoch) then counted all 64 as consumed, and
    # FeedReport.rows_unconsumed said almost nothing was left. A pass's items now end at its
    # 1st, 2nd, 4th, ... 64th batch and then every 64th, so the count stays near what was read.
    from feeders.source import push_dataset

    rows, bs = 6400, 32
    schema = pa.schema([("id", pa.int64())])
    buf = FeedBuffer(16 << 20)

    def announce(epoch: int) -> None:
        buf.begin_epoch(EpochInfo(epoch, schema))
        ids = pa.array(np.arange(rows, dtype=np.int64))
        assert buf.put_stream(epoch, 0, iter([pa.RecordBatch.from_arrays([ids], schema=schema)])) == rows
        buf.end_epoch(epoch, rows)

    announce(0)
    ds = push_dataset(buf, batch_size=bs, num_workers=1, prefetch=2)
    # take(k) reads k batches and prefetch(2) two more: the item holding the last of those
    # ends at the 4th, 8th, 32nd and 64th batch
    for epoch, (k, most) in enumerate([(1, 4), (5, 8), (20, 32), (60, 64)]):
        if epoch:
            announce(epoch)
        before = buf.snapshot()["rows_out"]
        got = [int(b["id"].numpy()[0]) for b in ds.take(k)]
        assert got == [i * bs for i in range(k)]
        deadline = time.monotonic() + 10
        while buf.epoch_state(epoch)["closed"] is False and time.monotonic() < deadline:
            time.sleep(0.01)
        counted = (buf.snapshot()["rows_out"] - before) // bs
        assert k <= counted <= most, (k, counted)
    # a pass read to the end still yields every row once, in order, in whole batches
    announce(4)
    before = buf.snapshot()["rows_out"]
    batches = [b["id"].numpy() for b in ds]
    assert [len(b) for b in batches] == [bs] * (rows // bs)
    assert np.array_equal(np.concatenate(batches), np.arange(rows))
    assert buf.snapshot()["rows_out"] - before == rows


def _announce(buf: FeedBuffer, *splits: str) -> None:
    for e, split in enumerate(splits):
        buf.begin_epoch(EpochInfo(e, SCHEMA, split=split))


def _read_pass(buf: FeedBuffer, split: str = "train", **claim) -> int | None:  # type: ignore[no-untyped-def]
    """A whole pass over ``split``: claim an epoch and end the pass (no rows were pushed)."""
    epoch = buf.claim_epoch(split, **claim)
    if epoch is not None:
        buf.finish_epoch(epoch, 0)
    return epoch


def test_a_training_pass_closes_the_validation_epochs_it_has_passed():
    # Keras fit(validation_freq=2) over epochs announced train, validation, train, ...: the
    # second training pass begins without a validation pass over epoch 1, which is closed so
    # its push stops; the validation pass after it reads epoch 3.
    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "validation", "train", "validation", "train", "validation")
    assert _read_pass(buf, skip_older="validation") == 0
    assert buf.epoch_state(1)["closed"] is False
    assert _read_pass(buf, skip_older="validation") == 2
    assert buf.epoch_state(1)["closed"] is True and buf.epoch_state(3)["closed"] is False
    assert _read_pass(buf, "validation") == 3
    assert _read_pass(buf, skip_older="validation") == 4
    assert buf.epoch_state(5)["closed"] is False  # the last one may still be read
    # the next training pass finds nothing announced: the last validation epoch is closed
    # before it waits for the driver's next call
    assert _read_pass(buf, timeout=0.05, skip_older="validation") is None
    assert buf.epoch_state(5)["closed"] is True
    assert buf.snapshot()["epochs_left_early"] == 2
    # closed, not ended by ctx.end_feed(): the driver's report tells the two apart
    assert buf.epoch_state(5)["ended_feed"] is False
    buf.consumer_finished()
    buf.begin_epoch(EpochInfo(6, SCHEMA))  # announced after ctx.end_feed(): closed at once
    assert buf.epoch_state(5)["ended_feed"] is False and buf.epoch_state(6)["ended_feed"] is True


def test_a_further_pass_waiting_for_the_next_train_call_says_so_once(monkeypatch, caplog):
    # fit, then model.evaluate(ds): the evaluate pass waits for an epoch no train() call pushes
    import feeders.buffer as fb

    monkeypatch.setattr(fb, "WAIT_HINT_AFTER", 0.05)
    buf = FeedBuffer(1 << 20)
    with caplog.at_level("INFO", logger="feeders.buffer"):
        # the first pass waits for the first train() call: nothing to say
        assert buf.claim_epoch("train", timeout=0.2) is None
        assert not caplog.records
        _announce(buf, "train", "train")
        assert _read_pass(buf) == 0 and _read_pass(buf) == 1
        assert buf.claim_epoch("train", timeout=1.2) is None
    hints = [r.getMessage() for r in caplog.records]
    assert len(hints) == 1, hints
    assert "ctx.dataset(split='train') has waited" in hints[0]
    assert "all 2 train epoch(s) pushed so far" in hints[0] and "model.evaluate(ds)" in hints[0]
    assert "layer.adapt(ds)" in hints[0]


def test_a_pass_past_the_pushed_epochs_while_a_training_pass_stands_open_warns_soon(monkeypatch, caplog):
    # A custom loop that looks at val_ds.take(2) every 20 steps: the third validation pass
    # (this call pushed two) waits for a later train() call while the training pass it
    # interrupted stands open, and train() cannot return before that pass ends: main waits
    # for itself. The node warns within seconds; the driver's epoch_state shows the wait.
    import feeders.buffer as fb

    monkeypatch.setattr(fb, "STUCK_HINT_AFTER", 0.3)
    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "validation", "validation")
    train = buf.claim_epoch("train")
    buf.put_stream(train, 0, _batches(0, 10, 10))
    assert sum(b.num_rows for b in buf.take(train)[0]) == 10
    assert _read_pass(buf, "validation") == 1 and _read_pass(buf, "validation") == 2
    assert buf.epoch_state(train)["waits_past"] == []
    seen: list[list[str]] = []

    def watch() -> None:
        time.sleep(0.2)
        seen.append(buf.epoch_state(train)["waits_past"])

    with caplog.at_level("INFO", logger="feeders.buffer"):
        watcher = threading.Thread(target=watch)
        watcher.start()
        assert buf.claim_epoch("validation", timeout=1.0) is None
        watcher.join()
    assert seen == [["validation"]]
    assert buf.epoch_state(train)["waits_past"] == []  # the pass stopped waiting
    said = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and not [r for r in caplog.records if r.levelname == "INFO"], caplog.records
    msg = said[0].getMessage()
    assert "a pass over ctx.dataset(split='validation') has waited" in msg
    assert "all 2 pushed so far were read by earlier passes, while the pass over epoch 0 (train) stands open" in msg
    assert "val_ds.take(k) inside a training loop" in msg and "val_it = iter(val_ds)" in msg

    # A main whose other thread goes on reading the training pass meanwhile (an evaluation
    # thread that waits for the next call's validation epochs) is not warned: the training
    # pass moves, so the call can end and the next one come.
    caplog.clear()
    moving = threading.Event()

    def read_on() -> None:
        for part in range(1, 1000):
            if moving.is_set():
                return
            buf.put_stream(train, part, _batches(0, 1, 1))
            buf.take(train)
            time.sleep(0.05)

    with caplog.at_level("INFO", logger="feeders.buffer"):
        reader = threading.Thread(target=read_on)
        reader.start()
        assert buf.claim_epoch("validation", timeout=1.0) is None
        moving.set()
        reader.join()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.records


def test_a_pass_more_than_were_pushed_ends_empty_at_shutdown_and_says_why(caplog):
    # fit(epochs=3) over train(df, num_epochs=2): Keras reports the third epoch ("13/13 -
    # loss: 0.0000e+00") although no row reached it; the node's log (shown on the driver) says why
    from feeders.source import push_dataset

    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    ds = push_dataset(buf, batch_size=4, num_workers=1)
    buf.put_stream(0, 0, _batches(0, 10, 10))
    buf.end_epoch(0, 10)
    with caplog.at_level("WARNING", logger="feeders.source"):
        assert sum(int(b["id"].shape[0]) for b in ds) == 10
        assert not caplog.records
        threading.Timer(0.3, buf.stop).start()
        assert list(ds) == []
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "ctx.dataset(split='train') ended without rows" in notes[0], notes
    assert "read all 1 train epoch(s) pushed" in notes[0] and "fit(epochs=3) over train(df, num_epochs=2)" in notes[0]
    assert "a layer.adapt(ds) or a look at a batch (next(iter(ds)), ds.take(1)) before fit" in notes[0]
    assert buf.empty_pass_note == notes[0]  # what the node sends the driver with its failure
    # a pass that never had an epoch (the cluster shut down before any train()) says nothing
    assert FeedBuffer(1 << 20).note_empty_pass("train") is None
    # nor does the last pass of a program that reads until the node stops (streaming)
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    ds = push_dataset(buf, batch_size=4, num_workers=1, reads_until_stop=lambda: True)
    buf.put_stream(0, 0, _batches(0, 10, 10))
    buf.end_epoch(0, 10)
    caplog.clear()
    with caplog.at_level("WARNING", logger="feeders.source"):
        assert sum(int(b["id"].shape[0]) for b in ds) == 10
        threading.Timer(0.3, buf.stop).start()
        assert list(ds) == []
    assert not caplog.records
    # a train() call stopped early (shutdown from another thread) took its unpushed epochs
    # back: the empty pass is not the program's miscount
    buf = FeedBuffer(1 << 20)
    for e in (0, 1, 2):
        buf.begin_epoch(EpochInfo(e, SCHEMA))
    ds = push_dataset(buf, batch_size=4, num_workers=1)
    buf.put_stream(0, 0, _batches(0, 10, 10))
    buf.end_epoch(0, 10)
    assert sum(int(b["id"].shape[0]) for b in ds) == 10
    assert buf.hold_epochs([1, 2]) == [1, 2]
    buf.release_epochs(withdraw=[1, 2])
    caplog.clear()
    with caplog.at_level("WARNING", logger="feeders.source"):
        threading.Timer(0.3, buf.stop).start()
        assert list(ds) == []
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "the last cluster.train call stopped early" in notes[0], notes
    assert "read more passes" not in notes[0], notes


def test_without_skip_older_validation_epochs_wait_for_their_pass():
    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "validation", "train", "validation")
    assert _read_pass(buf) == 0 and _read_pass(buf) == 2
    assert _read_pass(buf, "validation") == 1 and _read_pass(buf, "validation") == 3
    # skip_announced(before=) closes only older epochs
    for e in (4, 5):
        buf.begin_epoch(EpochInfo(e, SCHEMA, split="validation"))
    assert buf.skip_announced("validation", before=5) == [4]
    assert buf.claim_epoch("validation") == 5



def test_a_validation_epoch_announced_while_the_next_training_pass_waits_is_closed_at_once():
    # A cached call replays train 2, validation 3, ...: a main that never reads validation is
    # already waiting for its next training epoch when validation 1 is announced. Nothing
    # will come back for it, so it is refused as it arrives (its push or replay stops), not
    # left open until main returns. A validation pass also waiting keeps it; a repeat=True
    # stream's read-ahead claims (skip_older=None) never skip.
    bufs = [FeedBuffer(1 << 20) for _ in range(3)]
    got: list[int | None] = []

    def reader(buf: FeedBuffer, out: list, **claim) -> threading.Thread:  # type: ignore[no-untyped-def]
        t = threading.Thread(target=lambda: out.append(_read_pass(buf, **claim)), daemon=True)
        t.start()
        return t

    def waiting(buf: FeedBuffer, n: int) -> None:
        deadline = time.monotonic() + 5
        while buf.idle_waiters < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert buf.idle_waiters == n

    try:
        buf = bufs[0]
        _announce(buf, "train")
        assert _read_pass(buf, skip_older="validation") == 0
        waiter = reader(buf, got, skip_older="validation")
        waiting(buf, 1)
        buf.begin_epoch(EpochInfo(1, SCHEMA, split="validation"))
        assert buf.epoch_state(1)["closed"] is True
        assert buf.snapshot()["epochs_left_early"] == 1
        buf.begin_epoch(EpochInfo(2, SCHEMA))
        waiter.join(5)
        assert got == [2]

        # a validation pass waiting too: the epoch is its
        val: list[int | None] = []
        reader(bufs[1], [], skip_older="validation")
        v = reader(bufs[1], val, split="validation")
        waiting(bufs[1], 2)
        bufs[1].begin_epoch(EpochInfo(0, SCHEMA, split="validation"))
        v.join(5)
        assert val == [0] and bufs[1].snapshot()["epochs_left_early"] == 0

        # claims without skip_older (a repeat=True stream reading ahead) leave it for Keras
        reader(bufs[2], [])
        waiting(bufs[2], 1)
        bufs[2].begin_epoch(EpochInfo(0, SCHEMA, split="validation"))
        assert bufs[2].epoch_state(0)["closed"] is False
    finally:
        for b in bufs:
            b.stop()


def test_rows_of_an_epoch_read_later_are_parked_while_another_pass_starves(tmp_path):
    # Pushes come in epoch order, one job at a time. A pass that needs epoch 1 before anyone
    # reads epoch 0 (a repeat=True stream reading ahead while Keras's validation pass waits)
    # must not wedge the push of epoch 0 on a full buffer: after PARK_AFTER its rows are set
    # aside on disk, its push finishes, and they come back in order when epoch 0 is read.
    from feeders.buffer import PARK_AFTER

    buf = FeedBuffer(4096, cache_dir=str(tmp_path))  # 512 int64 rows
    buf.begin_epoch(EpochInfo(0, SCHEMA, split="validation"))
    buf.begin_epoch(EpochInfo(1, SCHEMA))
    got1: list[int] = []

    def read_epoch_1() -> None:
        got1.extend(_drain(buf, 1))

    reader = threading.Thread(target=read_epoch_1)
    reader.start()  # starves: epoch 1's rows come only after epoch 0's push
    t0 = time.monotonic()
    assert buf.put_stream(0, 0, _batches(0, 5000, 100)) == 5000  # ~10x the buffer
    took = time.monotonic() - t0
    assert PARK_AFTER <= took < 5, took
    assert buf.snapshot()["buffer_bytes"] <= 4096 and buf.snapshot()["rows_parked"] > 4000
    parked_files = list(tmp_path.iterdir())
    assert parked_files and all(p.name.startswith("parked-") for p in parked_files)
    buf.end_epoch(0, 5000)
    assert buf.put_stream(1, 0, _batches(10_000, 10_300, 100)) == 300
    buf.end_epoch(1, 300)
    reader.join(10)
    assert got1 == list(range(10_000, 10_300))
    # queued first, then parked: arrival order, handed back a buffer's worth a take (the
    # whole pile in one take, then shuffled, cost a node about twice what it had parked)
    ids: list[int] = []
    takes: list[int] = []
    while len(ids) < 5000:
        batches, _, _ = buf.take(0)
        takes.append(sum(b.nbytes for b in batches))
        ids += [i for b in batches for i in b["id"].to_pylist()]
    assert ids == list(range(5000))
    assert max(takes) <= 4096 and len(takes) >= 10, takes
    assert list(tmp_path.iterdir()) == []  # read back and removed
    assert buf.take(0)[2] == 5000  # and the pass ends at its limit
    # nothing starves now: a full buffer makes producers wait again, nothing is parked
    buf.begin_epoch(EpochInfo(2, SCHEMA))
    before = buf.snapshot()["rows_parked"]
    done = threading.Event()

    def push_epoch_2() -> None:
        try:
            buf.put_stream(2, 0, _batches(0, 2000, 100))
        except FeedStopped:
            return
        done.set()

    producer = threading.Thread(target=push_epoch_2)
    producer.start()
    assert not done.wait(3 * PARK_AFTER) and buf.snapshot()["rows_parked"] == before
    buf.stop()
    producer.join(5)
    assert not producer.is_alive() and not done.is_set()


def test_a_pass_whose_limit_arrived_no_longer_counts_as_starving(tmp_path):
    """A pass waits for its epoch's limit (the push job is over, the driver's END_EPOCH is on
    its way) and so counts as starving. Once the limit arrives it has all it needs; but until
    its thread woke to clear that, a cached replay filling the buffer parked its rows as if
    that pass starved, and, once one batch is parked, all the rest of the replay: a node's
    whole cached share was then handed to the next pass in one take (a sweep saw +620 MiB of
    RSS with 8 MB rows and a shuffle). Here the lock is held across the limit and the
    producer's check, as when the producer wins the race."""
    from feeders.buffer import PARK_AFTER

    buf = FeedBuffer(4096, cache_dir=str(tmp_path))  # 512 int64 rows
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    buf.begin_epoch(EpochInfo(1, SCHEMA))
    assert buf.put_stream(1, 0, _batches(0, 500, 100)) == 500  # nearly fills the buffer
    got0: list[int] = []
    reader = threading.Thread(target=lambda: got0.extend(_drain(buf, 0)))
    reader.start()  # epoch 0 pushed nothing yet: its pass waits, starving
    time.sleep(2 * PARK_AFTER)
    with buf._cond:
        buf.end_epoch(0, 0)
        assert not buf._parking(buf._epochs[1], 800)  # would wait for room, not park
    reader.join(10)
    assert got0 == [] and buf.snapshot()["rows_parked"] == 0
    buf.end_epoch(1, 500)
    assert _drain(buf, 1) == list(range(500)) and list(tmp_path.iterdir()) == []


def test_a_replay_waits_for_its_limit_before_it_fills_the_buffer(tmp_path):
    """A pass yields a replay's rows only up to the epoch's limit, which the driver sets once
    every worker's cache is sealed. A replay that began before it came (about 100 ms early)
    handed the pass rows it could not yet yield, and the pass kept taking them: a pile
    outside the buffer's bound, copied again by a shuffle."""
    buf = FeedBuffer(4096, cache_dir=str(tmp_path))  # 512 int64 rows
    buf.begin_epoch(EpochInfo(0, SCHEMA, record="c"))
    buf.begin_epoch(EpochInfo(1, SCHEMA, replay="c", shuffle=True, seed=3))
    reader = threading.Thread(target=lambda: got.append(_drain(buf, 0)))
    got: list[list[int]] = []
    reader.start()
    assert buf.put_stream(0, 0, _batches(0, 2000, 100)) == 2000
    buf.end_epoch(0, 2000)  # seals the cache
    reader.join(10)
    assert got == [list(range(2000))]
    time.sleep(0.5)
    assert buf.epoch_rows(1) == 0  # no limit yet: nothing replayed
    buf.end_epoch(1, 2000)
    ids = _drain(buf, 1)
    assert sorted(ids) == list(range(2000)) and ids != list(range(2000))


IMAGE_SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float32()))])
IMAGE_WIDTH = 64 * 64 * 3  # 48 KiB rows: a 1 MiB buffer holds 21


def _image_batches(rows: int, size: int = 10):
    for s in range(0, rows, size):
        k = min(size, rows - s)
        offsets = pa.array(np.arange(k + 1, dtype=np.int32) * IMAGE_WIDTH)
        x = pa.ListArray.from_arrays(offsets, pa.array(np.ones(k * IMAGE_WIDTH, np.float32)))
        yield pa.RecordBatch.from_arrays([pa.array(np.arange(s, s + k)), x], schema=IMAGE_SCHEMA)


def _pushed_image_epochs(buf: FeedBuffer, epochs: int, rows: int) -> dict[int, object]:
    """Announce ``epochs`` epochs of image rows and push each from its own thread (as Flight
    streams would); each thread records what its push ended with."""
    ends: dict[int, object] = {}

    def push(epoch: int) -> None:
        try:
            ends[epoch] = buf.put_stream(epoch, 0, _image_batches(rows))
            buf.end_epoch(epoch, rows)
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            ends[epoch] = e

    for e in range(epochs):
        buf.begin_epoch(EpochInfo(e, IMAGE_SCHEMA, shapes={"x": (IMAGE_WIDTH,)}))
    for e in range(epochs):
        threading.Thread(target=push, args=(e,), daemon=True).start()
    return ends


def _drop_inside_a_cycle(ds, batches: int):  # type: ignore[no-untyped-def]
    """Read ``batches`` batches of a pass, then drop its iterator inside a reference cycle (as
    tf_keras's first evaluate(steps=k) does): only the cyclic collector destroys it. Returns a
    weak reference to the iterator, for :func:`_why_alive`."""
    it = iter(ds)
    for _ in range(batches):
        next(it)
    holder: dict = {"it": it}
    holder["self"] = holder
    return weakref.ref(it)


def _collect_until(done, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    """Run the cyclic collector until ``done()`` (at most ``timeout`` s). One CI run (current
    stack, 2026-11-29) saw a collection free nothing in all three tests here; a collection
    another thread is inside of makes ``gc.collect()`` return at once, so try again for a while
    and let :func:`_why_alive` say which case it was."""
    import gc

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if done() or time.monotonic() > deadline:
            return done()
        time.sleep(0.2)


def _why_alive(ref) -> str:  # type: ignore[no-untyped-def]
    """What keeps a dropped pass open after a collection: the Python iterator itself (and what
    refers to it), or TensorFlow's C++ iterator that never ran the generator's finalizer."""
    import gc

    import traceback

    class Probe:
        pass

    probe = Probe()
    probe.me = probe  # type: ignore[attr-defined]
    probe_ref = weakref.ref(probe)
    del probe
    gc.collect()
    if probe_ref() is not None:  # gc.collect() does nothing while another thread collects
        stacks = {t.name: "".join(traceback.format_stack(sys._current_frames()[t.ident], limit=6))
                  for t in threading.enumerate() if t.ident in sys._current_frames()}
        return f"another thread is inside a collection (a finalizer blocks it); threads: {stacks}"
    it = ref()
    if it is None:
        return "the Python iterator was freed, but its pass's generator was not finalized"
    held = [type(r).__name__ + (f" {sorted(r)[:8]}" if isinstance(r, dict) else "")
            for r in gc.get_referrers(it) if r is not sys._getframe()]
    return f"the Python iterator is still alive, referred to by {held}"


@pytest.fixture
def no_automatic_gc():
    import gc

    gc.disable()
    yield
    gc.enable()


def test_a_pass_dropped_inside_a_reference_cycle_ends_when_the_next_pass_begins(no_automatic_gc):
    # compat stack, found under load: fit, evaluate(steps=3), fit, evaluate(steps=3) on a 1 MiB
    # buffer; the first evaluate's iterator lived on in a cycle, its pass stayed open, and
    # train() waited out feed_timeout for it (150 s) while main had long moved on
    from feeders.generator import live_iterators
    from feeders.source import push_dataset

    before = live_iterators()
    buf = FeedBuffer(1 << 20)
    ends = _pushed_image_epochs(buf, 2, 200)
    ds = push_dataset(buf, batch_size=16, num_workers=1, features="id")
    dropped = _drop_inside_a_cycle(ds, 3)
    time.sleep(0.5)
    assert buf.epoch_state(0)["closed"] is False  # the forced case: its pass is still open
    got = np.concatenate([b.numpy() for b in ds])  # the next pass, over epoch 1
    np.testing.assert_array_equal(got, np.arange(200))
    st = buf.epoch_state(0)
    assert st["closed"] is True and st["complete"] is False and st["failure"] is None
    assert 48 <= st["emitted"] < 200 and st["emitted"] % 16 == 0, st
    m = buf.snapshot()
    assert (m["rows_out"], m["epochs_consumed"], m["epochs_left_early"]) == (st["emitted"] + 200, 2, 1)
    deadline = time.monotonic() + 10
    while 0 not in ends and time.monotonic() < deadline:
        time.sleep(0.05)
    assert type(ends[0]).__name__ == "EpochClosed", ends  # its push was refused, not left waiting
    assert ends[1] == 200
    # when the collector does destroy the iterator, its generator's own end counts nothing twice
    assert _collect_until(lambda: not live_iterators() - before), _why_alive(dropped)
    assert buf.snapshot() == m and buf.epoch_state(0) == st


def test_a_pass_dropped_inside_a_reference_cycle_ends_while_the_driver_waits(monkeypatch, no_automatic_gc):
    # the same pass as the program's last: no later pass begins, so the node runs the
    # collector while the driver's train() waits for that pass to end
    import feeders.buffer as fb
    from feeders.source import push_dataset

    monkeypatch.setattr(fb, "COLLECT_AFTER", 0.2)
    buf = FeedBuffer(1 << 20)
    _pushed_image_epochs(buf, 1, 200)
    ds = push_dataset(buf, batch_size=16, num_workers=1, features="id")
    dropped = _drop_inside_a_cycle(ds, 3)
    t0 = time.monotonic()
    while not buf.epoch_state(0)["closed"] and time.monotonic() - t0 < 30:
        buf.wait_closed(0, 0.5)  # the driver's long poll
    st = buf.epoch_state(0)
    assert st["closed"] is True and st["complete"] is False, (st, _why_alive(dropped))
    assert 48 <= st["emitted"] < 200 and st["emitted"] % 16 == 0, st
    assert buf.snapshot()["rows_out"] == st["emitted"]


def test_a_repeat_stream_dropped_inside_a_cycle_leaves_nothing_for_the_next_dataset(no_automatic_gc):
    # compat stack, with the collector off: fit(steps_per_epoch=k) on a repeat=True stream
    # stopped inside epoch 1 of 3; its iterator lived on, so epoch 2 stayed announced, and the
    # next scenario's ctx.dataset() was built from (and read) that leftover epoch
    from feeders.generator import live_iterators
    from feeders.source import push_dataset

    before = live_iterators()
    buf = FeedBuffer(1 << 20)
    ends = _pushed_image_epochs(buf, 3, 200)
    old = push_dataset(buf, batch_size=16, num_workers=1, features="id", repeat=True)
    dropped = _drop_inside_a_cycle(old, 15)  # epoch 0's 13 batches, 2 of epoch 1

    def next_train_call() -> None:  # the driver's next train(), with other columns
        buf.begin_epoch(EpochInfo(3, SCHEMA))
        buf.put_stream(3, 0, _batches(0, 10, 10))
        buf.end_epoch(3, 10)

    threading.Timer(0.3, next_train_call).start()
    new = push_dataset(buf, batch_size=4, num_workers=1)  # built from epoch 3, not epoch 2
    states = {e: buf.epoch_state(e) for e in range(3)}
    assert all(st["closed"] for st in states.values()), states
    assert states[0]["complete"] and states[0]["emitted"] == 200
    assert not (states[1]["complete"] and states[2]["complete"]), states
    # read by a repeat=True stream, not a pass of its own (the driver tells a look at a batch
    # from a stream's first epoch by it)
    assert states[0]["repeat"] is True and states[1]["repeat"] is True
    assert sorted(int(i) for b in new for i in b["id"].numpy()) == list(range(10))
    assert buf.epoch_state(3)["repeat"] is False
    deadline = time.monotonic() + 10
    while len(ends) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ends) == 3, ends  # no push is left waiting for a reader (some may be parked)
    m = buf.snapshot()
    states = {e: buf.epoch_state(e) for e in range(3)}  # (left_early of 1 is set by epoch 3's pass)
    # the superseded stream left the registry when it was superseded, not when (if ever) its
    # iterator is destroyed: over a long run, dropped readers must not pile up
    assert buf._streams == {}
    # the old stream's own end now skips nothing of the new reader's
    assert _collect_until(lambda: not live_iterators() - before), _why_alive(dropped)
    assert buf.snapshot() == m and {e: buf.epoch_state(e) for e in range(3)} == states


def test_two_passes_read_at_the_same_time_fail_saying_so():
    # Dataset.zip((ds, ds)) read two epochs as one and ended after a few batches; interleave
    # over ds gave 1064 rows of 1000 and left the next pass empty; only an INFO line said why
    import tensorflow as tf

    from feeders.source import push_dataset

    buf = FeedBuffer(1 << 20)
    _pushed_image_epochs(buf, 3, 200)
    ds = push_dataset(buf, batch_size=16, num_workers=1, features="id")
    with pytest.raises(Exception, match=r"two passes over ctx.dataset\(split='train'\) were read at the same "
                                        r"time: another reader of 'train' began while this pass over epoch 0 "
                                        r"was still being read .*Dataset.zip\(\(ds, ds\)\)"):
        for _ in tf.data.Dataset.zip((ds, ds)):
            pass
    # one pass after another still reads every row of the next epoch
    assert sorted(int(i) for b in ds for i in b.numpy()) == list(range(200))


def test_the_collector_runs_for_an_idle_pass_only_and_less_often_each_time(monkeypatch):
    # a full collection with TensorFlow loaded holds the GIL for ~160 ms: a pass that is being
    # read must not pay for it, and a slow consumer (which looks idle) only rarely

    import feeders.buffer as fb

    runs: list[float] = []
    monkeypatch.setattr(fb, "_collect", lambda epoch: runs.append(time.monotonic()))
    # read all along: one item every 20 ms. The idle limit is 25 such gaps: a loaded CI machine
    # (both stacks at once) once held this loop back for over 0.1 s, which a reader is not
    monkeypatch.setattr(fb, "COLLECT_AFTER", 0.5)
    monkeypatch.setattr(fb, "COLLECT_MAX", 0.4)
    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "train")
    assert buf.claim_epoch("train") == 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        buf.emit(0, 1)
        buf.wait_closed(0, 0.02)
    assert runs == []
    buf.finish_epoch(0, 50)
    monkeypatch.setattr(fb, "COLLECT_AFTER", 0.1)
    assert buf.claim_epoch("train") == 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.6:  # never read: after 0.1 s idle, then 0.2, 0.4, 0.4, ...
        buf.wait_closed(1, 0.02)
    time.sleep(0.1)  # the collections run in threads of their own
    gaps = [b - a for a, b in zip([t0] + runs, runs)]
    assert 2 <= len(runs) <= 5, gaps  # every 0.1 s would be 16
    # each collection is decided at least 0.1, 0.2, 0.4, ... s after the one before, but runs in
    # a thread that a busy machine may start late (one late run makes the next gap look short:
    # 0.54 then 0.29 s in a CI run), so compare each run with the earliest it may be decided
    since = [r - t0 for r in runs]
    earliest = [0.1, 0.3, 0.7, 1.1, 1.5]
    assert all(t >= e - 0.01 for t, e in zip(since, earliest)), (since, gaps)
    assert set(buf._collect_after) == {1}
    buf.consumer_finished()  # closes the pass without finishing it: its schedule goes too
    assert buf._collect_after == {}


def _push(buf: FeedBuffer, epoch: int, start: int, stop: int) -> None:
    buf.put_stream(epoch, 0, _batches(start, stop, 10))
    buf.end_epoch(epoch, stop - start)


def test_a_failed_call_takes_back_its_epochs_no_pass_has_yielded_from():
    # train(df, 3) fails while pushing epoch 0: the pass over it has begun and yielded
    # nothing yet, epochs 1-2 are not claimed. All three go; the pass, still open, goes on
    # with the next call's epoch 3 and reads it whole; nothing counts as left early
    from feeders.source import push_dataset

    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "train", "train")
    buf.put_stream(0, 0, _batches(0, 5, 5))  # fewer rows than a batch: nothing yielded
    ds = push_dataset(buf, batch_size=8, num_workers=1, features="id")
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(int(i) for b in ds for i in b.numpy()))
    reader.start()
    deadline = time.monotonic() + 10
    while not buf._epochs[0].claimed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert buf.hold_epochs([0, 1, 2]) == [0, 1, 2]
    buf.release_epochs(withdraw=[0, 1, 2])
    assert [buf.epoch_state(e)["closed"] for e in range(3)] == [True] * 3
    buf.begin_epoch(EpochInfo(3, SCHEMA))  # the next call
    _push(buf, 3, 100, 120)
    reader.join(10)
    assert not reader.is_alive() and got == list(range(100, 120))
    m = buf.snapshot()
    assert (m["rows_out"], m["epochs_consumed"], m["epochs_left_early"]) == (20, 1, 0), m


def test_an_epoch_a_pass_has_yielded_from_is_not_held_and_a_released_one_is_read():
    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "train")
    buf.put_stream(0, 0, _batches(0, 20, 10))
    assert buf.claim_epoch("train") == 0
    it = iterate_epoch(buf, 0, batch_size=8, num_workers=1, drop_remainder=False,
                       convert=lambda t: t.column("id").to_pylist())
    assert next(it) == list(range(8))
    assert buf.hold_epochs([0, 1]) == [1]  # epoch 0 has given a batch to TensorFlow
    # while held, epoch 1 cannot be claimed: a pass waits (here: gives up after 0.3 s)
    assert buf.claim_epoch("train", timeout=0.3) is None
    buf.release_epochs(keep=[1])  # held on this node, begun on another: kept
    buf.end_epoch(0, 20)
    assert next(it) == list(range(8, 16)) and list(it) == [list(range(16, 20))]
    _push(buf, 1, 50, 60)
    assert buf.claim_epoch("train", timeout=5) == 1 and _drain(buf, 1) == list(range(50, 60))


def test_rows_a_pass_took_before_the_hold_are_not_yielded_from_a_withdrawn_epoch():
    # the pass had taken rows (nothing yielded yet) when the driver's hold came: its emit
    # waits for the driver's decision instead of yielding, and the withdrawal ends it
    from feeders.buffer import EpochWithdrawn

    buf = FeedBuffer(1 << 20)
    _announce(buf, "train")
    buf.put_stream(0, 0, _batches(0, 20, 10))
    assert buf.claim_epoch("train") == 0
    batches, _, _ = buf.take(0)
    assert sum(b.num_rows for b in batches) == 20
    assert buf.hold_epochs([0]) == [0]
    out: list = []

    def emit() -> None:
        try:
            out.append(buf.emit(0, 8))
        except EpochWithdrawn as e:
            out.append(e)

    t = threading.Thread(target=emit)
    t.start()
    time.sleep(0.3)
    assert out == [] and buf.epoch_state(0)["emitted"] == 0  # waiting, not yielded
    buf.release_epochs(withdraw=[0])
    t.join(5)
    assert len(out) == 1 and isinstance(out[0], EpochWithdrawn), out
    assert buf.epoch_state(0)["emitted"] == 0 and buf.snapshot()["rows_out"] == 0


def test_a_label_missing_from_the_validation_split_names_that_split():
    # train(df, validation=df_val) where df_val lacks the label: the node's error says which
    # DataFrame it is, not just "the pushed DataFrame"
    from feeders.source import push_dataset
    from formats.errors import SchemaError

    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "validation")
    with pytest.raises(SchemaError) as info:
        push_dataset(buf, batch_size=4, num_workers=1, label="y", split="validation")
    msg = str(info.value)
    assert "label column 'y' is not in the pushed DataFrame of the validation split" in msg, msg
    assert "train(validation=...)" in msg and "['id']" in msg, msg
    with pytest.raises(SchemaError) as info:
        push_dataset(buf, batch_size=4, num_workers=1, label="y")
    assert "validation" not in str(info.value), str(info.value)


def test_a_dataset_naming_its_features_reads_a_later_frame_with_more_columns():
    # fit carried on across train() calls, the second DataFrame with one more column: a
    # dataset built with features= reads what it names and ignores the rest; a change to a
    # column it reads (or to any column, for a dataset of every column) is still refused
    from feeders.source import push_dataset

    base = pa.schema([("id", pa.int64()), ("x", pa.float32())])
    wider = base.append(pa.field("z", pa.int32()))
    recast = pa.schema([("id", pa.int64()), ("x", pa.float64())])

    def push(buf, epoch, schema):  # type: ignore[no-untyped-def]
        ids = np.arange(epoch * 100, epoch * 100 + 6)
        cols = [pa.array(ids), pa.array(ids * 0.5).cast(schema.field("x").type)]
        cols += [pa.array(ids.astype(np.int32))] if "z" in schema.names else []
        buf.begin_epoch(EpochInfo(epoch, schema))
        buf.put_stream(epoch, 0, iter([pa.RecordBatch.from_arrays(cols, schema=schema)]))
        buf.end_epoch(epoch, 6)

    buf = FeedBuffer(1 << 20)
    for epoch, schema in enumerate((base, wider, recast)):
        push(buf, epoch, schema)
    ds = push_dataset(buf, batch_size=4, num_workers=1, features=["x"], label="id")
    assert [i for _, y in ds for i in y.numpy().tolist()] == list(range(6))
    got = [(x, y) for xs, ys in ds for x, y in zip(xs["x"].numpy().tolist(), ys.numpy().tolist())]
    assert got == [(0.5 * i, i) for i in range(100, 106)]
    with pytest.raises(Exception, match="FeedError: epoch 2 was pushed with columns .id: int64, x: double."):
        list(ds)

    buf = FeedBuffer(1 << 20)
    for epoch, schema in enumerate((base, wider)):
        push(buf, epoch, schema)
    ds = push_dataset(buf, batch_size=4, num_workers=1)
    assert sum(int(b["id"].shape[0]) for b in ds) == 6
    with pytest.raises(Exception, match="FeedError: epoch 1 was pushed .* call ctx.dataset.. again"):
        list(ds)


def test_a_collection_that_cannot_run_says_so(caplog):
    # gc.collect() returns at once while another thread is inside a collection (a finalizer
    # blocks it there): the node's collector for a stood-still pass then frees nothing
    import gc

    import feeders.buffer as fb

    release = threading.Event()

    class BlocksInFinalizer:
        def __del__(self) -> None:
            release.wait(10)

    held = BlocksInFinalizer()
    held.me = held  # type: ignore[attr-defined]
    del held
    stuck = threading.Thread(target=gc.collect)
    stuck.start()
    time.sleep(0.2)
    with caplog.at_level("WARNING", logger="feeders.buffer"):
        fb._collect(7)
        release.set()
        stuck.join(10)
        fb._collect(8)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("epoch 7's pass has stood still"), said
    assert "another thread is inside a collection" in said[0]


def test_a_pass_of_another_length_than_fit_s_first_epoch_is_named(caplog):
    """tf_keras fixes fit's steps per epoch from its first epoch over a dataset of unknown
    length: after 10 batches in the first pass, a pass of 13 is cut at 10 (three batches
    never trained, yet handed to TensorFlow). The node says so, once, naming both lengths;
    passes of one length say nothing."""
    import os

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tf_keras as keras

    from feeders.source import push_dataset

    bs, rows = 16, [160, 208, 160, 160]
    buf = FeedBuffer(8 << 20)
    schema = pa.schema([("x", pa.float32()), ("y", pa.float32())])
    for e, n in enumerate(rows):
        buf.begin_epoch(EpochInfo(e, schema))
        x = np.arange(n, dtype=np.float32)
        buf.put_stream(e, 0, iter(pa.table({"x": x, "y": 2 * x}, schema=schema).to_batches(max_chunksize=50)))
        buf.end_epoch(e, n)
    ds = push_dataset(buf, batch_size=bs, num_workers=1, features="x", label="y")
    model = keras.Sequential([keras.layers.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    steps: list[int] = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            steps.append(0)

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            steps[-1] += 1

    with caplog.at_level("WARNING", logger="feeders.source"):
        model.fit(ds, epochs=4, verbose=0, callbacks=[Steps()])
    assert steps == [10, 10, 10, 10]
    said = [r.getMessage() for r in caplog.records if r.name == "feeders.source"]
    assert len(said) == 1 and said[0].startswith(
        "ctx.dataset(split='train'): pass 2 has 13 batch(es), the dataset's first pass had 10. "
        "Keras fit(ds) takes its steps per epoch from its first epoch: a longer pass is cut there"), said

    caplog.clear()
    buf = FeedBuffer(8 << 20)
    for e in range(3):
        buf.begin_epoch(EpochInfo(e, SCHEMA))
        _push(buf, e, 0, 100)
    ds = push_dataset(buf, batch_size=bs, num_workers=1, features="id")
    with caplog.at_level("WARNING", logger="feeders.source"):
        assert [sum(1 for _ in ds) for _ in range(3)] == [7, 7, 7]
    assert [r.getMessage() for r in caplog.records if r.name == "feeders.source"] == []


def test_a_pass_with_fewer_rows_than_one_dropped_batch_says_so(caplog):
    """ctx.dataset(1000, drop_remainder=True) over 25 rows: the pass yields nothing, and Keras
    only says 'Empty logs'; the node's log says why."""
    buf = FeedBuffer(1 << 20)
    buf.begin_epoch(EpochInfo(0, SCHEMA))
    _push(buf, 0, 0, 25)
    with caplog.at_level("WARNING", logger="feeders.source"):
        got = list(iterate_epoch(buf, 0, batch_size=1000, num_workers=1, drop_remainder=True,
                                 convert=lambda t: t.column("id").to_pylist()))
    assert got == []
    assert [r.getMessage() for r in caplog.records if r.name == "feeders.source"] == [
        "ctx.dataset(batch_size=1000, drop_remainder=True): epoch 0 (train) gives this node 25 "
        "row(s), fewer than one batch, so its pass yields none. Push more rows or use a smaller "
        "batch_size."]


def test_a_pass_left_early_stays_left_early_once_main_returns():
    # take(3) of epoch 0, all of epoch 1, return: the driver, asking after main returned, took
    # epoch 0's unread rows for rows main left by returning ('returned from main while data
    # was still being pushed'); the pass main was in when it returned is the one it left so
    buf = FeedBuffer(1 << 20)
    _announce(buf, "train", "train", "train")
    assert buf.claim_epoch("train") == 0
    buf.finish_epoch(0, 0, complete=False)  # left early
    assert buf.claim_epoch("train") == 1
    buf.finish_epoch(1, 0)  # read whole
    assert buf.claim_epoch("train") == 2
    buf.finish_epoch(2, 0, complete=False)  # main breaks out of this pass and returns
    # decided by the passes alone: a driver asking while main's error is still being reported
    # (main failed, consumer not yet finished) must not take the last pass for one left early
    assert [buf.epoch_state(e)["left_early"] for e in range(3)] == [True, False, False]
    buf.consumer_finished()
    assert [buf.epoch_state(e)["left_early"] for e in range(3)] == [True, False, False]
