"""The layout decoder against ``tf.io.parse_example``: same values wherever it decodes, and a
refusal (so that TensorFlow parses) wherever the records' layout is not one it takes."""

from __future__ import annotations

import numpy as np
import pytest

from formats.example_layout import LayoutDecoder, layout_columns, layout_of
from formats.schema import ColumnSpec


def _tf():
    import tensorflow as tf

    return tf


def _example(features: dict) -> bytes:
    """A serialized Example built with TensorFlow's protobuf classes (the reference writer)."""
    tf = _tf()
    feats = {}
    for key, (kind, values) in features.items():
        if kind == "float":
            feats[key] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
        elif kind == "int64":
            feats[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        else:
            feats[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString()


SPECS = [
    ColumnSpec("id", "int64", ()),
    ColumnSpec("image", "float32", (4, 3)),
    ColumnSpec("pair", "int32", (2,)),
    ColumnSpec("score", "float64", ()),
]


def _records(n: int, rng: np.random.Generator, *, first_id: int = 0) -> list[bytes]:
    out = []
    for i in range(n):
        out.append(
            _example(
                {
                    "id": ("int64", [first_id + i]),
                    "image": ("float", rng.standard_normal(12).astype(np.float32).tolist()),
                    # one small and one negative int: 1- and 10-byte varints
                    "pair": ("int64", [int(rng.integers(0, 100)), -int(rng.integers(1, 2**40))]),
                    "score": ("float", [float(np.float32(rng.random()))]),
                    "note": ("bytes", [rng.bytes(3)]),  # not asked for; differs per record
                }
            )
        )
    return out


def _framed(records: list[bytes], gap: int = 16) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The records laid out as in a read buffer, ``gap`` bytes apart (framing)."""
    begins, buf, pos = [], bytearray(), 0
    for r in records:
        buf += b"\xee" * 12
        begins.append(len(buf))
        buf += r + b"\xee" * (gap - 12)
    lengths = [len(r) for r in records]
    return bytes(buf), np.array(begins, dtype=np.int64), np.array(lengths, dtype=np.int64)


def _parsed(records: list[bytes], specs=SPECS) -> dict[str, np.ndarray]:
    tf = _tf()
    from formats.example import parse_features

    out = tf.io.parse_example(tf.constant(records), parse_features(specs))
    return {k: v.numpy() for k, v in out.items()}


def _decode(records: list[bytes], specs=SPECS, decoder=None, gap=16):
    wanted = layout_columns(specs)
    assert wanted is not None
    decoder = decoder or LayoutDecoder(wanted)
    buf, begins, lengths = _framed(records, gap)
    out = {
        name: np.full((len(records), *shape), -7, dtype=np.float32 if kind == "float" else np.int64)
        for name, (kind, shape) in wanted.items()
    }
    return decoder.decode(buf, begins, lengths, out, 0), out


def test_decoded_values_equal_tensorflows_parse():
    rng = np.random.default_rng(1)
    # ids cross 128 and 16384: the records change length (and layout) twice
    records = _records(40, rng, first_id=100) + _records(40, rng, first_id=16_370)
    ok, out = _decode(records)
    assert ok
    want = _parsed(records)
    for name in want:
        assert out[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(out[name], want[name], err_msg=name)
    assert out["id"].tolist() == list(range(100, 140)) + list(range(16_370, 16_410))
    assert (out["pair"][:, 1] < 0).all()


def test_runs_with_a_constant_step_other_than_one_record():
    # every other record of a buffer (a record shard): the strides double
    rng = np.random.default_rng(2)
    records = _records(30, rng)
    wanted = layout_columns(SPECS)
    buf, begins, lengths = _framed(records)
    out = {n: np.zeros((15, *s), np.float32 if k == "float" else np.int64) for n, (k, s) in wanted.items()}
    assert LayoutDecoder(wanted).decode(buf, begins[1::2], lengths[1::2], out, 0)
    want = _parsed(records[1::2])
    for name in want:
        np.testing.assert_array_equal(out[name], want[name], err_msg=name)


def test_floats_keep_their_bits():
    values = np.array([np.nan, -0.0, np.inf, 1e-45, -3.4e38] + [0.0] * 7, dtype=np.float32)
    rec = _example({"id": ("int64", [1]), "image": ("float", values.tolist()),
                    "pair": ("int64", [0, 0]), "score": ("float", [0.0])})
    ok, out = _decode([rec])
    assert ok
    assert out["image"].reshape(-1).view(np.uint32).tolist() == values.view(np.uint32).tolist()


def test_int64_extremes():
    recs = [
        _example({"id": ("int64", [v]), "image": ("float", [0.0] * 12), "pair": ("int64", [0, 0]),
                  "score": ("float", [0.0])})
        for v in (-(2**63), 2**63 - 1)
    ]
    # different varint widths (10 and 9 bytes): two layouts, one run each
    ok, out = _decode(recs)
    assert ok and out["id"].tolist() == [-(2**63), 2**63 - 1]


@pytest.mark.parametrize(
    "change",
    ["missing", "wrong kind", "too many values", "duplicate"],
)
def test_layouts_it_does_not_take_are_refused(change):
    base = {"id": ("int64", [3]), "image": ("float", [0.5] * 12), "pair": ("int64", [1, 2]),
            "score": ("float", [0.25])}
    if change == "missing":
        del base["score"]
        rec = _example(base)
    elif change == "wrong kind":
        base["score"] = ("int64", [1])
        rec = _example(base)
    elif change == "too many values":
        base["image"] = ("float", [0.5] * 13)
        rec = _example(base)
    else:  # the same key twice in the map: protobuf keeps the last, the decoder refuses
        rec = _example(base) + _example({"score": ("float", [0.75])})
    assert layout_of(rec, layout_columns(SPECS)) is None
    ok, _ = _decode([rec])
    assert not ok


def test_unpacked_values_are_refused():
    # float_list { value: 1.0 value: 2.0 } written unpacked (field 1, wire type 5, twice)
    import struct

    floats = b"".join(b"\x0d" + struct.pack("<f", v) for v in (1.0, 2.0))
    feature = b"\x12" + bytes([len(floats)]) + floats  # Feature.float_list
    entry = b"\x0a\x01v" + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    rec = b"\x0a" + bytes([len(features)]) + features
    tf = _tf()
    parsed = tf.io.parse_example([rec], {"v": tf.io.FixedLenFeature([2], tf.float32)})
    assert parsed["v"].numpy().tolist() == [[1.0, 2.0]]  # valid for TF ...
    assert layout_of(rec, {"v": ("float", (2,))}) is None  # ... but not one layout decodes


def test_records_of_one_length_but_another_layout_are_refused():
    # id 200 (2-byte varint) + pair[0] 5 (1 byte) vs id 5 + pair[0] 200: same length, values
    # split differently. The second record's bytes would decode to wrong values if trusted.
    def rec(i, p):
        return _example({"id": ("int64", [i]), "image": ("float", [0.0] * 12),
                         "pair": ("int64", [p, 1]), "score": ("float", [0.0])})

    a, b = rec(200, 5), rec(5, 200)
    assert len(a) == len(b)
    ok, _ = _decode([a, a, b])
    assert not ok
    ok, out = _decode([a, a])
    assert ok and out["id"].tolist() == [200, 200]


def test_a_different_unselected_payload_is_ignored_but_its_length_is_not():
    specs = [ColumnSpec("id", "int64", ())]
    recs = [_example({"id": ("int64", [i]), "note": ("bytes", [bytes([65 + i]) * 3])}) for i in range(5)]
    ok, out = _decode(recs, specs)
    assert ok and out["id"].tolist() == list(range(5))
    longer = _example({"id": ("int64", [9]), "note": ("bytes", [b"abcd"])})
    ok, out = _decode(recs + [longer], specs)  # another length: its own layout, still decoded
    assert ok and out["id"].tolist() == [0, 1, 2, 3, 4, 9]


def test_records_that_change_length_often_are_not_tried():
    specs = [ColumnSpec("id", "int64", ())]
    recs = [_example({"id": ("int64", [i]), "note": ("bytes", [b"n" * (i % 5)])}) for i in range(64)]
    ok, _ = _decode(recs, specs)
    assert not ok  # 64 runs of one record: left to TensorFlow


def test_string_and_ragged_columns_are_not_taken():
    assert layout_columns([ColumnSpec("s", "string", ())]) is None
    assert layout_columns([ColumnSpec("v", "float32", (None,))]) is None
    assert layout_columns([ColumnSpec("x", "int8", (2, 2))]) == {"x": ("int64", (2, 2))}


def test_not_an_example_is_refused_not_raised():
    assert layout_of(b"\x0a\xff", {"id": ("int64", ())}) is None
    assert layout_of(b"garbage", {"id": ("int64", ())}) is None
    assert layout_of(b"", {"id": ("int64", ())}) is None
