"""tf.train.Example coding: what we write is what plain tf.io.parse_example reads, for every type."""

from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa
import pytest

from dataplane.errors import SchemaError
from formats.example import (
    decode_examples,
    encode_example_array,
    encode_examples,
    infer_specs,
    parse_features,
)
from formats.schema import ColumnSpec, column_specs
from tests.builders import all_types_table

ROWS = 120


@pytest.fixture(scope="module")
def table():
    return all_types_table(ROWS)


def _tf_value(v, t: pa.DataType):
    """A row value as tf.io.parse_example returns it (Example kinds: int64, float32, bytes)."""
    if pa.types.is_dictionary(t):
        return _tf_value(v, t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return [] if v is None else [_tf_value(x, t.value_type) for x in v]
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bytes):
        return v
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, datetime.datetime):
        return int((v - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)).total_seconds() * 1e6)
    if isinstance(v, datetime.date):
        return (v - datetime.date(1970, 1, 1)).days
    if isinstance(v, float):
        return float(np.float32(v))
    if isinstance(v, int) and v >= 2**63:
        return v - 2**64
    return v


def test_encoding_equals_plain_tf_parse_example_for_every_type(table):
    tf = pytest.importorskip("tensorflow")
    specs = column_specs(table.schema)
    fills = {
        s.name: (b"" if s.dtype == "string" else 0)
        for s in specs
        if not s.is_ragged and table.column(s.name).null_count
    }
    records = encode_examples(table, specs)
    assert len(records) == ROWS and all(isinstance(r, bytes) for r in records)
    parsed = tf.io.parse_example(tf.constant(records), parse_features(specs, fill_values=fills))
    for spec in specs:
        t = table.schema.field(spec.name).type
        want = []
        for v in table.column(spec.name).to_pylist():
            if v is None and not spec.is_ragged:
                v = fills[spec.name]
                want.append(
                    v if spec.dtype == "string" else _tf_value(v, t if not spec.shape else pa.int64())
                )
            else:
                want.append(_tf_value(v, t))
        got = parsed[spec.name]
        got = got.to_list() if isinstance(got, tf.RaggedTensor) else got.numpy().tolist()
        assert got == want, spec.name


def test_records_are_valid_example_protos(table):
    tf = pytest.importorskip("tensorflow")
    specs = column_specs(table.schema)
    rec = encode_examples(table.slice(5, 1), specs)[0]
    ex = tf.train.Example.FromString(rec)
    feats = ex.features.feature
    assert feats["id"].int64_list.value == [5]
    assert feats["text"].bytes_list.value == ["row-5-é".encode()]
    assert list(feats["fixed"].float_list.value) == [5.0, 5.0, 5.0]
    assert list(feats["nested"].int64_list.value) == [5, 5, 1]
    assert list(feats["nested/row_lengths_1"].int64_list.value) == [1, 2]
    assert "i32" not in feats  # null (every 5th row): an absent feature
    assert ex.SerializeToString(deterministic=True)  # round-trips through protobuf


def test_decode_restores_every_column_and_null(table):
    specs = column_specs(table.schema)
    back = decode_examples(encode_examples(table, specs), specs)
    assert back.schema == table.schema
    for name in table.column_names:
        assert back.column(name).equals(table.column(name)), name


def test_null_rule_absent_feature_vs_empty_list():
    t = pa.table({"v": pa.array([[1.0], [], None], pa.list_(pa.float32())),
                  "s": pa.array([1, None, 3], pa.int64())})
    specs = column_specs(t.schema)
    recs = encode_examples(t, specs)
    back = decode_examples(recs, specs)
    assert back.column("v").to_pylist() == [[1.0], [], None]
    assert back.column("s").to_pylist() == [1, None, 3]
    tf = pytest.importorskip("tensorflow")
    with pytest.raises(tf.errors.InvalidArgumentError, match="s"):
        tf.io.parse_example(tf.constant(recs), parse_features(specs))
    parsed = tf.io.parse_example(tf.constant(recs), parse_features(specs, fill_values={"s": -1}))
    assert parsed["s"].numpy().tolist() == [1, -1, 3]


def test_encoding_is_batch_size_independent(table):
    specs = column_specs(table.schema)
    whole = encode_examples(table, specs)
    pieces = [r for b in table.to_batches(max_chunksize=17) for r in encode_examples(b, specs)]
    assert pieces == whole
    arr = encode_example_array(table.slice(5, 10), specs)
    assert arr.to_pylist() == whole[5:15]


def test_struct_flattening_writes_parent_child_features():
    t = pa.table({"p": pa.array([{"a": 1, "b": "x"}, None, {"a": 3, "b": None}])})
    with pytest.raises(SchemaError, match="column 'p' is a struct.*flatten_structs=True"):
        column_specs(t.schema)
    specs = column_specs(t.schema, flatten_structs=True)
    assert [s.name for s in specs] == ["p.a", "p.b"]
    back = decode_examples(encode_examples(t, specs), specs)
    assert back.column("p.a").to_pylist() == [1, None, 3]
    assert back.column("p.b").to_pylist() == ["x", None, None]


@pytest.mark.parametrize(
    "arr, match",
    [
        (pa.array([[1.0, None]], pa.list_(pa.float32())), "column 'c' has 1 null element"),
        (pa.array([[[1], None]], pa.list_(pa.list_(pa.int64()))), "column 'c' has 1 null inner list"),
    ],
)
def test_nulls_inside_lists_are_schema_errors(arr, match):
    t = pa.table({"c": arr})
    with pytest.raises(SchemaError, match=match):
        encode_examples(t, column_specs(t.schema))


def test_fill_replaces_nulls_inside_lists():
    t = pa.table({"c": pa.array([[1.0, None]], pa.list_(pa.float32()))})
    specs = column_specs(t.schema, fill_values={"c": 0.5})
    assert decode_examples(encode_examples(t, specs), specs).column("c").to_pylist() == [[1.0, 0.5]]


def test_dense_declared_shape_checks_lengths():
    t = pa.table({"img": pa.array([[1.0] * 4, [2.0] * 3], pa.list_(pa.float32()))})
    specs = column_specs(t.schema, shapes={"img": (2, 2)})
    with pytest.raises(SchemaError, match=r"column 'img' is written as dense shape \(2, 2\).*row 1"):
        encode_examples(t, specs)


def test_infer_specs_looks_past_the_first_record():
    t = pa.table({
        "n": pa.array([[1], [1, 2], [3]], pa.list_(pa.int64())),  # first record: one value
        "x": pa.array([1.5, 2.5, None], pa.float32()),
        "s": pa.array(["a", "b", "c"]),
        "b": pa.array([b"a", b"\xff", b""]),
        "nn": pa.array([[[1]], [[2, 3], []], []], pa.list_(pa.list_(pa.int64()))),
    })
    recs = encode_examples(t, column_specs(t.schema))
    assert infer_specs(recs[:1])[1] == ColumnSpec("n", "int64", (), 0)  # one record: a scalar
    specs = {s.name: s for s in infer_specs(recs)}
    assert list(specs) == ["b", "n", "nn", "s", "x"]
    assert specs["n"] == ColumnSpec("n", "int64", (None,), 1)
    assert specs["x"] == ColumnSpec("x", "float32", (), 0)
    assert specs["s"].arrow_type == pa.string() and specs["b"].arrow_type == pa.binary()
    assert specs["nn"] == ColumnSpec("nn", "int64", (None, None), 2)
    back = decode_examples(recs, list(specs.values()))
    assert back.column("nn").to_pylist() == t.column("nn").to_pylist()
    assert back.column("x").to_pylist() == [1.5, 2.5, None]
    with pytest.raises(SchemaError, match="no records"):
        infer_specs([])


def test_decoding_records_written_by_tensorflow():
    tf = pytest.importorskip("tensorflow")
    ex = tf.train.Example(features=tf.train.Features(feature={
        "a": tf.train.Feature(int64_list=tf.train.Int64List(value=[-3, 2**62])),
        "f": tf.train.Feature(float_list=tf.train.FloatList(value=[0.25])),
        "s": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"q", b""])),
    }))
    recs = [ex.SerializeToString()] * 2
    back = decode_examples(recs, infer_specs(recs))
    assert back.to_pylist()[0] == {"a": [-3, 2**62], "f": 0.25, "s": ["q", ""]}


def test_corrupt_example_is_a_record_error():
    from dataplane.errors import RecordError

    with pytest.raises(RecordError, match="part-7: record 1 is not a valid tf.train.Example"):
        decode_examples([b"", b"\x0a\x05\x0a"], [ColumnSpec("a", "int64")], name="part-7")
