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
        assert (f"column image: the images of a batch must share one size and channel count; "
                f"the image at row (of this pass)] [{at}] "
                f"[is (height, width, channels)] [{shape}] [but the first of its batch is] [8 6 3] "
                f"[(decode them all to one with decode={{image: ({kind}, 3, (height, width))}}, "
                f"names quoted)]") in text, text


@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_images_of_mixed_sizes_and_channels_decode_to_the_ones_asked_for(kind):
    """A folder of photos as users have them: gray and color, of several sizes. (kind, 3)
    converts the channels as TensorFlow's decoder does; (kind, 3, (h, w)) also resizes each
    image as tf.image.resize does, rounded back to uint8, with a static shape."""
    import tensorflow as tf

    rng = np.random.default_rng(5)
    enc = tf.io.encode_jpeg if kind == "jpeg" else tf.io.encode_png
    dec = tf.io.decode_jpeg if kind == "jpeg" else tf.io.decode_png
    shapes = [(8, 6, 3), (8, 6, 1), (5, 9, 3), (12, 4, 1), (8, 6, 3), (7, 7, 3), (3, 10, 1)]
    blobs = [enc(rng.integers(0, 256, size=s, dtype=np.uint8)).numpy() for s in shapes]
    ds = _dataset({"id": np.arange(2), "image": pa.array(blobs[:2], pa.binary())}, {"image": (kind, 3)})
    got = np.concatenate([b["image"].numpy() for b in ds])
    np.testing.assert_array_equal(got, np.stack([dec(b, channels=3).numpy() for b in blobs[:2]]))
    assert got.shape == (2, 8, 6, 3)

    ds = _dataset({"id": np.arange(7), "image": pa.array(blobs, pa.binary())}, {"image": (kind, 1, (6, 5))})
    assert ds.element_spec["image"].shape.as_list() == [None, 6, 5, 1]
    got = np.concatenate([b["image"].numpy() for b in ds])
    want = np.stack([
        np.clip(np.round(tf.image.resize(dec(b, channels=1), (6, 5)).numpy()), 0, 255).astype(np.uint8)
        for b in blobs])
    assert got.dtype == np.uint8 and got.shape == (7, 6, 5, 1)
    np.testing.assert_array_equal(got, want)


def test_a_bad_image_is_named_by_its_row_s_id_and_a_null_image_by_its_column():
    """The row counted from the pass's start is no place in the DataFrame; its id is. A null
    in a decoded column is refused where it is pushed, without suggesting an empty fill
    value (b'' is no image either)."""
    import tensorflow as tf

    from dataplane.errors import SchemaError

    _, blobs = _images(6, "jpeg")
    blobs[4] = b""
    ds = _dataset({"id": np.arange(100, 106), "name": [f"img{i}.jpg" for i in range(6)],
                   "image": pa.array(blobs, pa.binary())}, {"image": ("jpeg", 3)})
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        for _ in ds:
            pass
    assert ("column image: a value is not a JPEG image, at row (of this pass):] [4] [id =] [104] "
            "[name =] [img4.jpg]") in str(info.value), str(info.value)

    blobs[4] = None
    with pytest.raises(SchemaError) as info2:
        _dataset({"id": np.arange(6), "image": pa.array(blobs, pa.binary())}, {"image": "jpeg"})
    assert str(info2.value) == (
        "column 'image' has 1 null value(s) in a batch of partition 0 (epoch 0), and the node "
        "decodes it (ctx.dataset(decode=...)): a null is no image or array to decode. Drop those "
        "rows first (df.na.drop(subset=['image'])), or fill them with valid encoded bytes of the "
        "decoded size (fill_values={'image': ...}).")


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
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"column t: a value is not 48 bytes of raw float32 \(3, 4\), at row \(of this pass\):\] \[5\] \[which has\] \[7\] \[bytes\]"):
        for _ in ds:
            pass


@pytest.mark.parametrize("decode, message", [
    ({"nope": "jpeg"}, "decode: column 'nope' is not in the pushed DataFrame"),
    ({"id": "jpeg"}, "decode: column 'id' is int64, not binary"),
    ({"image": "gif"}, "expected 'jpeg', 'png', (kind, channels), (kind, channels, (height, width)) or ('raw', dtype, shape)"),
    ({"image": ("jpeg", 4)}, "channels must be one of (0, 1, 3) for jpeg"),
    ({"image": ("png", 3, (0, 5))}, "the size must be (height, width), two ints > 0"),
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
