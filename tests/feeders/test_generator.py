"""feeders.generator_dataset: a fresh Python iterator per pass, closed when the pass ends."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from feeders import generator as gen  # noqa: E402
from feeders.generator import generator_dataset, live_iterators  # noqa: E402

SIG = {"id": tf.TensorSpec((None,), tf.int64, name="id"), "x": tf.TensorSpec((None, 3), tf.float32, name="x")}


class Source:
    """A factory that records how many passes it started and how many were closed."""

    def __init__(self, chunks: int = 4, rows: int = 5) -> None:
        self.chunks, self.rows = chunks, rows
        self.started = self.closed = 0

    def __call__(self):
        self.started += 1
        try:
            for c in range(self.chunks):
                ids = np.arange(c * self.rows, (c + 1) * self.rows, dtype=np.int64)
                yield {"id": ids, "x": np.repeat(ids[:, None], 3, axis=1).astype(np.float32)}
        finally:
            self.closed += 1


def _wait_closed(src: Source, n: int, before: set[int]) -> set[int]:
    """Wait for ``src`` to see ``n`` closes; return the registry keys this test left behind.

    Keys from ``before`` are not this test's: an earlier test's pass that ended in an error
    stays registered until the collector frees the traceback holding its iterator.
    """
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        gc.collect()
        left = live_iterators() - before
        if src.closed >= n and not left:
            break
        time.sleep(0.05)
    return left


def test_uses_tensorflows_generator_op_directly_on_this_stack():
    # The private class exists on both pinned TF versions; if an upgrade removes it the reader
    # falls back to from_generator (slower per epoch), and this test says so.
    op = gen._generator_op_class()
    assert op is not None
    assert isinstance(generator_dataset(Source(), SIG), op)


def test_every_pass_reads_a_new_iterator_and_gets_every_row():
    before = live_iterators()
    src = Source()
    ds = generator_dataset(src, SIG).rebatch(3)
    for epoch in range(3):
        ids = np.concatenate([b["id"].numpy() for b in ds])
        xs = np.concatenate([b["x"].numpy() for b in ds.take(100)])
        assert ids.tolist() == list(range(20))
        assert xs.shape == (20, 3) and xs.dtype == np.float32 and float(xs.sum()) == 3 * sum(range(20))
    assert src.started == 6
    left = _wait_closed(src, 6, before)
    assert src.closed == 6 and left == set()


def test_an_abandoned_pass_closes_its_iterator():
    before = live_iterators()
    src = Source()
    ds = generator_dataset(src, SIG)
    got = [b["id"].numpy().tolist() for b in ds.take(1)]
    assert got == [[0, 1, 2, 3, 4]]
    left = _wait_closed(src, 1, before)
    assert src.closed == 1 and left == set()


def test_concurrent_passes_are_independent():
    src = Source()
    ds = generator_dataset(src, SIG)
    pairs = [(a["id"].numpy().tolist(), b["id"].numpy().tolist()) for a, b in tf.data.Dataset.zip((ds, ds))]
    assert [a for a, _ in pairs] == [b for _, b in pairs] == [list(range(c * 5, c * 5 + 5)) for c in range(4)]
    assert src.started == 2


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"id": np.arange(3, dtype=np.int32), "x": np.zeros((3, 3), np.float32)},
         "the generator yielded id as int32, but the dataset's signature says int64"),
        ({"id": np.arange(3, dtype=np.int64), "x": np.zeros((3, 4), np.float32)},
         "the generator yielded x with shape (3, 4), but the dataset's signature says (None, 3)"),
    ],
)
def test_an_element_that_does_not_match_the_signature_is_an_error_naming_it(bad, message):
    ds = generator_dataset(lambda: iter([bad]), SIG)
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        list(ds)
    assert message in str(e.value)


def test_the_iterators_error_reaches_the_consumer_with_its_message():
    def broken():
        yield {"id": np.arange(2, dtype=np.int64), "x": np.zeros((2, 3), np.float32)}
        raise ValueError("column 'x' is broken in part-00001.parquet")

    ds = generator_dataset(broken, SIG)
    it = iter(ds)
    assert next(it)["id"].numpy().tolist() == [0, 1]
    with pytest.raises(tf.errors.InvalidArgumentError, match="column 'x' is broken in part-00001.parquet"):
        next(it)


def test_strings_pass_and_ragged_signatures_fall_back_to_from_generator():
    words = generator_dataset(lambda: iter([np.array([b"a", b"bc"], dtype=object)]), tf.TensorSpec((None,), tf.string))
    assert [w.numpy().tolist() for w in words] == [[b"a", b"bc"]]

    spec = tf.RaggedTensorSpec((None, None), tf.int64)
    rag = generator_dataset(lambda: iter([tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)]), spec)
    assert not isinstance(rag, gen._generator_op_class())
    assert [r.to_list() for r in rag] == [[[1, 2], [3]]]
