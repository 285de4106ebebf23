"""The TFRecord reader's own framing: batch cutting across files and chunks, sharding, closing.

Files are written with TensorFlow's own writer (``tests.builders``); the reader frames them
itself, so these pin what it must keep from ``tf.data``'s: every record once, in file order,
exact batches, and nothing left open.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import feeders
from dataplane.errors import RecordError, SchemaError
from feeders.tfrecord import stream as reader
from tests.builders import mnist_like_table, numeric_table, row_checksum, write_tfrecord_files


@pytest.fixture(scope="module")
def three_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfr-reader") / "data"
    table = numeric_table(300).select(["id", "f0", "i0"])
    write_tfrecord_files(table, root, files=3)  # 100 rows a file
    return root, table


def test_batches_are_exact_across_files_and_in_file_order(three_files):
    root, table = three_files
    batches = list(feeders.tfrecord_dataset(root, schema=table.schema, batch_size=64))
    assert [int(b["id"].shape[0]) for b in batches] == [64, 64, 64, 64, 44]
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert ids.tolist() == list(range(300))
    f0 = np.concatenate([b["f0"].numpy() for b in batches])
    np.testing.assert_array_equal(f0, table.column("f0").to_numpy())
    assert batches[0]["i0"].dtype.name == "int32"


def test_chunks_of_many_batches_are_recut_exactly(three_files, monkeypatch):
    root, table = three_files
    # Chunks of 4 batches (48 records) that never line up with the 100-record files.
    per_record = sum(f.stat().st_size for f in root.iterdir()) / 300  # framing included
    monkeypatch.setattr(reader, "_CHUNK_BYTES", int(4.5 * 12 * per_record))
    seen: list[int] = []
    original = reader.RecordBatches.__call__

    def spy(self):
        assert self.layout is None  # ids cross 128 and i0 varies: records of many layouts
        for chunk in original(self):
            seen.append(len(chunk))
            yield chunk

    monkeypatch.setattr(reader.RecordBatches, "__call__", spy)
    batches = list(feeders.tfrecord_dataset(root, schema=table.schema, batch_size=12))
    assert seen[:-1] == [48] * (len(seen) - 1) and seen[-1] == 300 - 48 * (len(seen) - 1)
    assert [int(b["id"].shape[0]) for b in batches] == [12] * 25
    assert np.concatenate([b["id"].numpy() for b in batches]).tolist() == list(range(300))


def test_record_shards_count_records_across_files(three_files):
    root, table = three_files
    # 3 files, 4 shards: fewer files than shards, so every 4th record, counted across files.
    parts = [
        np.concatenate(
            [b["id"].numpy() for b in feeders.tfrecord_dataset(
                root, schema=table.schema, batch_size=10, shard=(i, 4))]
        )
        for i in range(4)
    ]
    for i, part in enumerate(parts):
        assert part.tolist() == list(range(i, 300, 4))
    assert row_checksum(np.concatenate(parts)) == row_checksum(np.arange(300))


def test_an_abandoned_pass_closes_its_files(three_files):
    from feeders.generator import live_iterators

    root, table = three_files
    ds = feeders.tfrecord_dataset(root, schema=table.schema, batch_size=8)
    before = live_iterators()
    first = next(iter(ds))
    assert first["id"].numpy().tolist() == list(range(8))
    del first
    import gc

    gc.collect()
    assert live_iterators() - before == set()  # this test's pass is gone


# --- records that share a layout: decoded in place (formats.example_layout) -------------------

MNIST_SCHEMA = pa.schema(
    [("id", pa.int64()), ("image", pa.list_(pa.float32(), 784)), ("label", pa.int64())]
)


@pytest.fixture(scope="module")
def mnist_files(tmp_path_factory):
    """300 MNIST-shaped rows in 3 files; ids cross 128, so records come in two lengths."""
    root = tmp_path_factory.mktemp("tfr-layout") / "data"
    table = mnist_like_table(300)
    write_tfrecord_files(table, root, files=3)
    return root, table


def _tf_parsed(files, batch_size):
    """The peer: TensorFlow's own reader and parser over the same files."""
    import tensorflow as tf

    features = {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "image": tf.io.FixedLenFeature([784], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    ds = tf.data.TFRecordDataset([str(f) for f in files]).batch(batch_size)
    return [tf.io.parse_example(b, features) for b in ds]


def _spy_decodes(monkeypatch) -> list[str]:
    """Record, per chunk, whether it came decoded in place or as serialized records."""
    seen: list[str] = []
    original = reader.RecordBatches._decode

    def spy(self, *args):
        serialized, decoded = original(self, *args)
        seen.append("parsed" if len(serialized) else "decoded")
        return serialized, decoded

    monkeypatch.setattr(reader.RecordBatches, "_decode", spy)
    return seen


def test_shared_layout_records_decode_to_what_parse_example_gives(mnist_files, monkeypatch):
    root, table = mnist_files
    seen = _spy_decodes(monkeypatch)
    ours = list(feeders.tfrecord_dataset(root, schema=MNIST_SCHEMA, batch_size=64))
    peer = _tf_parsed(sorted(root.iterdir()), 64)
    assert seen and set(seen) == {"decoded"}
    assert [int(b["id"].shape[0]) for b in ours] == [64, 64, 64, 64, 44]
    for a, b in zip(ours, peer, strict=True):
        for name in ("id", "image", "label"):
            assert a[name].dtype == b[name].dtype
            np.testing.assert_array_equal(a[name].numpy(), b[name].numpy())
    image = np.concatenate([b["image"].numpy() for b in ours])
    assert image.shape == (300, 784) and image.dtype == np.float32
    np.testing.assert_array_equal(image, np.stack(table.column("image").to_numpy(zero_copy_only=False)))


def test_the_pipeline_decodes_in_place_only_when_the_first_records_allow_it(
    three_files, mnist_files, tmp_path, monkeypatch
):
    layouts = []
    original = reader.RecordBatches.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        layouts.append(self.layout)

    monkeypatch.setattr(reader.RecordBatches, "__init__", spy)
    feeders.tfrecord_dataset(mnist_files[0], schema=MNIST_SCHEMA, batch_size=8)
    assert layouts[-1] == {"id": ("int64", ()), "image": ("float", (784,)), "label": ("int64", ())}
    # Narrow rows whose varints vary in length: no layout holds, chunks are plain records.
    feeders.tfrecord_dataset(three_files[0], schema=three_files[1].schema, batch_size=8)
    assert layouts[-1] is None
    # A first file that cannot be read fails the call itself: its first records are checked
    # against the schema when the dataset is built (issue #22).
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "part-0.tfrecord").write_bytes(b"not a tfrecord file at all")
    with pytest.raises(RecordError, match=r"part-0.tfrecord: .*corrupt record at byte offset 0"):
        feeders.tfrecord_dataset(bad, schema=MNIST_SCHEMA, batch_size=8)


def test_shared_layout_record_shards(mnist_files, monkeypatch):
    root, table = mnist_files
    seen = _spy_decodes(monkeypatch)
    labels = table.column("label").to_numpy()
    for i in range(4):  # 3 files, 4 shards: every 4th record, across files
        batches = list(feeders.tfrecord_dataset(root, schema=MNIST_SCHEMA, batch_size=10, shard=(i, 4)))
        ids = np.concatenate([b["id"].numpy() for b in batches])
        assert ids.tolist() == list(range(i, 300, 4))
        np.testing.assert_array_equal(np.concatenate([b["label"].numpy() for b in batches]), labels[ids])
    assert set(seen) == {"decoded"}


def test_batches_kept_across_passes_are_not_overwritten(mnist_files, monkeypatch):
    """Decoded values and read buffers are reused from a pool, but only once nothing refers to
    them: batches kept from the first pass (TensorFlow may hold the pool's memory without a
    copy) keep their values while later passes run, and the pool stops growing."""
    root, table = mnist_files
    pools = []

    class Pool(reader.BufferPool):
        def __init__(self):
            super().__init__()
            pools.append(self)

    monkeypatch.setattr(reader, "BufferPool", Pool)
    ds = feeders.tfrecord_dataset(root, schema=MNIST_SCHEMA, batch_size=32)
    kept = list(ds)
    expected = [b["image"].numpy().copy() for b in kept]
    for _ in range(3):
        for _batch in ds:
            pass
    assert len(pools) == 1
    sizes = [pools[0].kept()]
    for _ in range(3):
        for _batch in ds:
            pass
        sizes.append(pools[0].kept())
    for b, image in zip(kept, expected, strict=True):
        np.testing.assert_array_equal(b["image"].numpy(), image)
    assert np.concatenate([b["id"].numpy() for b in kept]).tolist() == list(range(300))
    assert sizes == [sizes[0]] * 4, sizes  # steady: later passes reuse what is free


def _write_examples(path, rows):
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as writer:
        for row in rows:
            feats = {}
            for key, value in row.items():
                if isinstance(value[0], float):
                    feats[key] = tf.train.Feature(float_list=tf.train.FloatList(value=value))
                else:
                    feats[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=value))
            writer.write(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())


def test_records_the_decoder_refuses_fall_back_to_parse_example(tmp_path, monkeypatch):
    """Record 30 has an extra feature: another layout, still decoded in place. Record 55 has the
    length of the others but its varints split differently: refused, so its chunk (the last of
    file 2) is parsed by TensorFlow, the next file is read as plain bytes, and the one after is
    tried in place again (every ``_RETRY_LAYOUT_FILES`` files). Values exact throughout."""
    monkeypatch.setattr(reader, "_RETRY_LAYOUT_FILES", 2)
    monkeypatch.setattr(reader, "_CHUNK_BYTES", 1)  # one batch a chunk
    rng = np.random.default_rng(3)
    rows = [
        {"id": [i], "j": [5], "k": [300], "x": rng.random(5, dtype=np.float32).tolist()}
        for i in range(120)
    ]
    rows[30] = {"extra": [7], **rows[30]}
    rows[55].update(j=[300], k=[5])
    for f in range(6):
        _write_examples(tmp_path / f"part-{f}.tfrecord", rows[f * 20 : (f + 1) * 20])
    schema = pa.schema(
        [("id", pa.int64()), ("j", pa.int64()), ("k", pa.int64()), ("x", pa.list_(pa.float32(), 5))]
    )
    seen = _spy_decodes(monkeypatch)
    batches = list(feeders.tfrecord_dataset(tmp_path, schema=schema, batch_size=10))
    assert np.concatenate([b["id"].numpy() for b in batches]).tolist() == list(range(120))
    for name in ("j", "k"):
        got = np.concatenate([b[name].numpy() for b in batches])
        assert got.tolist() == [r[name][0] for r in rows], name
    x = np.concatenate([b["x"].numpy() for b in batches])
    np.testing.assert_array_equal(x, np.array([r["x"] for r in rows], dtype=np.float32))
    # Files of 2 chunks: 0-2 decoded but chunk 5; file 3 as bytes; files 4 and 5 in place.
    assert seen == ["decoded"] * 5 + ["parsed"] * 3 + ["decoded"] * 4, seen


def test_shared_layout_records_from_s3_decode_in_place(mnist_files, s3_env, monkeypatch):
    """From ``s3://`` the pooled buffers are filled by the read-ahead stream's ``readinto``."""
    root, table = mnist_files
    bucket = s3_env.make_bucket()
    url = s3_env.upload_dir(root, bucket, "mnist")
    seen = _spy_decodes(monkeypatch)
    batches = list(feeders.tfrecord_dataset(url, schema=MNIST_SCHEMA, batch_size=64))
    assert set(seen) == {"decoded"}
    assert np.concatenate([b["id"].numpy() for b in batches]).tolist() == list(range(300))
    image = np.concatenate([b["image"].numpy() for b in batches])
    np.testing.assert_array_equal(image, np.stack(table.column("image").to_numpy(zero_copy_only=False)))
    np.testing.assert_array_equal(
        np.concatenate([b["label"].numpy() for b in batches]), table.column("label").to_numpy()
    )


def test_records_from_elsewhere_read_dense_with_declared_shapes(tmp_path):
    # TFRecords written with TensorFlow's own writer have no schema file: the inferred schema
    # reads every list feature ragged, and shapes= makes an image column a dense tensor.
    import tensorflow as tf

    rng = np.random.default_rng(5)
    images = rng.random((30, 2, 3), dtype=np.float32)
    rows = [{"id": [i], "image": images[i].reshape(-1).tolist()} for i in range(30)]
    _write_examples(tmp_path / "part-0.tfrecord", rows)
    inferred = feeders.tfrecord_dataset(tmp_path, batch_size=8)
    assert isinstance(inferred.element_spec["image"], tf.RaggedTensorSpec)

    ds = feeders.tfrecord_dataset(tmp_path, batch_size=8, shapes={"image": [2, 3]}, label="id")
    assert ds.element_spec[0]["image"] == tf.TensorSpec([None, 2, 3], tf.float32)
    got = np.concatenate([x["image"].numpy() for x, _ in ds])
    np.testing.assert_array_equal(got, images)

    with pytest.raises(RecordError, match=r"record 0: feature 'image' holds 6 values, but its shape \(4,\) needs 4"):
        feeders.tfrecord_dataset(tmp_path, batch_size=8, shapes={"image": [4]})
    with pytest.raises(SchemaError, match=r"shapes name column 'img', which is not among the columns read"):
        feeders.tfrecord_dataset(tmp_path, batch_size=8, shapes={"img": [6]})
    with pytest.raises(SchemaError, match=r"column 'id' is a scalar"):
        feeders.tfrecord_dataset(tmp_path, batch_size=8, shapes={"id": [1]})


def test_nested_lists_declared_dense_are_checked_list_by_list(tmp_path):
    # the dense parse checked only a row's total: [[1, 2, 3], [4]] under shapes (2, 2) read
    # as [[1, 2], [3, 4]]. Records written from a list<list<float>> carry each inner list's
    # length, and those must now match the declared shape.
    import tensorflow as tf

    from formats.example import encode_examples
    from formats.schema import column_specs
    from formats.tfrecord import write_records

    good = [[[float(i), i + 0.5], [i + 0.25, -1.0]] for i in range(6)]
    t = pa.table({"v": pa.array(good, pa.list_(pa.list_(pa.float32()))), "id": list(range(6))})
    with open(tmp_path / "part-0.tfrecord", "wb") as f:
        write_records(f, encode_examples(t, column_specs(t.schema)))
    ds = feeders.tfrecord_dataset(tmp_path, batch_size=4, shapes={"v": [2, 2]})
    assert ds.element_spec["v"] == tf.TensorSpec([None, 2, 2], tf.float32)
    got = np.concatenate([b["v"].numpy() for b in ds])
    np.testing.assert_array_equal(got, np.asarray(good, np.float32))

    bad = good[:3] + [[[1.0, 2.0, 3.0], [4.0]]] + good[4:]  # 4 values, as (2, 2) needs
    t = pa.table({"v": pa.array(bad, pa.list_(pa.list_(pa.float32()))), "id": list(range(6))})
    with open(tmp_path / "part-0.tfrecord", "wb") as f:
        write_records(f, encode_examples(t, column_specs(t.schema)))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"SchemaError: column v is read as dense shape \(2, 2\), but a record "
                             r"holds a list of another length at nesting level 2 \(expected 2\)"):
        list(feeders.tfrecord_dataset(tmp_path, batch_size=4, shapes={"v": [2, 2]}))
