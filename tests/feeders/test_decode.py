"""ctx.dataset(decode=...): binary columns decoded on the node inside tf.data, equal to
TensorFlow's own decoders, and a value that does not decode named by column and row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from feeders.buffer import EpochInfo, FeedBuffer
from feeders.source import push_dataset


def _images(n: int, kind: str):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(n, 8, 6, 3), dtype=np.uint8)
    enc = tf.io.encode_jpeg if kind == "jpeg" else tf.io.encode_png
    return pixels, [enc(p).numpy() for p in pixels]


def _dataset(columns: dict, decode: dict, batch_size: int = 4):  # type: ignore[no-untyped-def]
    table = pa.table(columns)
    buf = FeedBuffer(8 << 20)
    buf.begin_epoch(EpochInfo(0, table.schema))
    ds = push_dataset(buf, batch_size=batch_size, num_workers=1, decode=decode)
    buf.put_stream(0, 0, iter(table.to_batches(max_chunksize=5)))
    buf.end_epoch(0, table.num_rows)
    return ds


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_images_decode_like_tensorflow(kind):
    import tensorflow as tf

    pixels, blobs = _images(10, kind)
    ds = _dataset({"id": np.arange(10), "image": pa.array(blobs, pa.binary())}, {"image": kind})
    got = np.concatenate([b["image"].numpy() for b in ds])
    decoder = tf.io.decode_jpeg if kind == "jpeg" else tf.io.decode_png
    want = np.stack([decoder(b).numpy() for b in blobs])
    assert got.dtype == np.uint8 and got.shape == (10, 8, 6, 3)
    np.testing.assert_array_equal(got, want)
    if kind == "png":  # lossless: the very pixels
        np.testing.assert_array_equal(got, pixels)


def test_raw_bytes_decode_to_the_declared_dtype_and_shape():
    values = np.arange(9 * 12, dtype=np.float32).reshape(9, 3, 4)
    ds = _dataset({"id": np.arange(9), "t": pa.array([v.tobytes() for v in values], pa.binary())},
                  {"t": ("raw", "float32", (3, 4))})
    batches = [b for b in ds]
    assert [int(b["t"].shape[0]) for b in batches] == [4, 4, 1]
    got = np.concatenate([b["t"].numpy() for b in batches])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values)
    np.testing.assert_array_equal(np.concatenate([b["id"].numpy() for b in batches]), np.arange(9))


def test_a_corrupt_image_names_the_column_and_the_row():
    import tensorflow as tf

    _, blobs = _images(10, "jpeg")
    blobs[6] = b"this is not a jpeg"
    ds = _dataset({"id": np.arange(10), "image": pa.array(blobs, pa.binary())}, {"image": "jpeg"})
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        for _ in ds:
            pass
    text = str(info.value)
    assert "column image: a value is not a JPEG image, at row (of this pass):] [6]" in text


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_an_image_of_another_size_or_channels_than_its_batch_is_named(kind):
    # TensorFlow's "Incompatible shapes during merge: [10,6,3] vs. [9,6,3]" named neither
    import tensorflow as tf

    _, blobs = _images(10, kind)
    enc = tf.io.encode_jpeg if kind == "jpeg" else tf.io.encode_png
    blobs[5] = enc(np.zeros((9, 6, 3), np.uint8)).numpy()  # batch 1 (rows 4-7), its second
    blobs[9] = enc(np.zeros((8, 6, 1), np.uint8)).numpy()  # gray in a batch of color
    for rows, (at, shape) in ((slice(0, 8), (5, "9 6 3")), (slice(8, 10), (9, "8 6 1"))):
        ds = _dataset({"image": pa.array(blobs[rows], pa.binary())}, {"image": kind})
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            for _ in ds:
                pass
        text = " ".join(str(info.value).split())
        at = at - rows.start
        assert (f"column image: the images of a batch must share a size (resize them on the "
                f"DataFrame first); the image at row (of this pass)] [{at}] "
                f"[is (height, width, channels)] [{shape}] [but the first of its batch is] [8 6 3]") in text, text


def test_a_damaged_jpeg_gets_a_hint_where_tensorflow_names_no_row():
    import tensorflow as tf

    from dataplane.errors import known_fix

    _, blobs = _images(4, "jpeg")
    blobs[2] = blobs[2][:40]  # the signature is there, the rest is not
    ds = _dataset({"image": pa.array(blobs, pa.binary())}, {"image": "jpeg"})
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        for _ in ds:
            pass
    assert "is a damaged JPEG" in known_fix(str(info.value))


def test_raw_bytes_of_the_wrong_length_are_named():
    import tensorflow as tf

    blobs = [np.zeros(12, np.float32).tobytes()] * 5 + [b"\x00" * 7]
    ds = _dataset({"t": pa.array(blobs, pa.binary())}, {"t": ("raw", "float32", (3, 4))})
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"column t: a value is not 48 bytes of raw float32 \(3, 4\), at row \(of this pass\):\] \[5\]"):
        for _ in ds:
            pass


@pytest.mark.parametrize("decode, message", [
    ({"nope": "jpeg"}, "decode: column 'nope' is not in the pushed DataFrame"),
    ({"id": "jpeg"}, "decode: column 'id' is int64, not binary"),
    ({"image": "gif"}, "expected 'jpeg', 'png' or ('raw', dtype, shape)"),
])
def test_bad_decode_arguments_fail_when_the_dataset_is_made(decode, message):
    from dataplane.errors import SchemaError

    _, blobs = _images(2, "png")
    with pytest.raises((SchemaError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        _dataset({"id": np.arange(2), "image": pa.array(blobs, pa.binary())}, decode)



def test_one_feature_name_yields_its_tensor_ready_for_a_one_input_model():
    # a user's Sequential model takes (x, y) batches; features=["x"] gives ({"x": ...}, y),
    # which Keras 3 refuses ("The structure of `inputs` doesn't match"), and a name given as a
    # string used to be read as a list of one-letter column names
    import tensorflow as tf

    table = pa.table({"x": pa.array([[float(i), 2.0 * i] for i in range(10)], pa.list_(pa.float32(), 2)),
                      "y": pa.array(np.arange(10, dtype=np.float32)), "id": pa.array(np.arange(10))})

    def pushed(features, label):  # type: ignore[no-untyped-def]
        buf = FeedBuffer(8 << 20)
        buf.begin_epoch(EpochInfo(0, table.schema))
        ds = push_dataset(buf, batch_size=4, num_workers=1, features=features, label=label)
        buf.put_stream(0, 0, iter(table.to_batches(max_chunksize=5)))
        buf.end_epoch(0, table.num_rows)
        return ds

    ds = pushed("x", "y")
    assert ds.element_spec == (tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None], tf.float32))
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    assert len(model.fit(ds, verbose=0).history["loss"]) == 1
    pairs = list(pushed("x", "y"))
    x = np.concatenate([b[0].numpy() for b in pairs])
    np.testing.assert_array_equal(x, [[i, 2 * i] for i in range(10)])
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in pairs]), np.arange(10))
    ds = pushed("x", None)
    assert ds.element_spec == tf.TensorSpec([None, 2], tf.float32)
    assert [b.shape[0] for b in ds] == [4, 4, 2]
    assert set(pushed(["x"], "y").element_spec[0]) == {"x"}
    for bad in (b"x", [1], {"x": 1}):
        with pytest.raises(TypeError, match=r"features must be a column name or a list of column names, got"):
            push_dataset(FeedBuffer(1 << 20), batch_size=4, num_workers=1, features=bad)
    with pytest.raises(ValueError, match=r"features lists column\(s\) \['x'\] more than once"):
        push_dataset(FeedBuffer(1 << 20), batch_size=4, num_workers=1, features=["x", "y", "x"])
