"""The Arrow -> TF mapping for the types beyond plain scalars, and the errors naming the column."""

from __future__ import annotations


import pyarrow as pa
import pytest

from dataplane.errors import SchemaError, StorageError
from formats.schema import ColumnSpec, column_specs, to_numpy
from formats.schemafile import TFRecordSchema, find_schema_file, read_schema_file, write_schema_file


@pytest.mark.parametrize(
    "t, spec",
    [
        (pa.large_string(), ("string", (), 0)),
        (pa.large_binary(), ("string", (), 0)),
        (pa.large_list(pa.int16()), ("int16", (None,), 1)),
        (pa.dictionary(pa.int8(), pa.string()), ("string", (), 0)),
        (pa.timestamp("ms", tz="Europe/Paris"), ("int64", (), 0)),
        (pa.date32(), ("int32", (), 0)),
        (pa.list_(pa.list_(pa.float32())), ("float32", (None, None), 2)),
        (pa.list_(pa.list_(pa.float32(), 3)), ("float32", (None, 3), 1)),
        (pa.list_(pa.list_(pa.float64(), 2), 4), ("float64", (4, 2), 0)),
    ],
)
def test_extended_types(t, spec):
    (got,) = column_specs(pa.schema([("c", t)]))
    assert got == ColumnSpec("c", *spec)
    assert got.arrow_type == t


@pytest.mark.parametrize(
    "t, match",
    [
        (pa.map_(pa.string(), pa.int32()), r"column 'c' is a map .*map_keys\(\)"),
        (pa.struct([("a", pa.int32())]), r"column 'c' is a struct .*flatten_structs=True"),
        (pa.decimal128(10, 2), r"column 'c' has type decimal128\(10, 2\).*cast\('double'\)"),
        (pa.list_(pa.struct([("a", pa.int32())])), r"column 'c' is a struct"),
    ],
)
def test_types_tf_cannot_hold_name_the_column(t, match):
    with pytest.raises(SchemaError, match=match):
        column_specs(pa.schema([("ok", pa.int32()), ("c", t)]))


def test_nested_struct_flattening():
    schema = pa.schema([("s", pa.struct([("a", pa.int32()), ("t", pa.struct([("b", pa.string())]))]))])
    specs = column_specs(schema, flatten_structs=True)
    assert [(s.name, s.dtype) for s in specs] == [("s.a", "int32"), ("s.t.b", "string")]


def test_null_scalars_are_an_error_for_tensors_without_fill():
    from formats.schema import to_numpy

    t = pa.table({"x": pa.array([1.0, None])})
    with pytest.raises(SchemaError, match=r"column 'x' has 1 null value"):
        to_numpy(t, column_specs(t.schema))
    assert to_numpy(t, column_specs(t.schema, fill_values={"x": 0.0}))["x"].tolist() == [1.0, 0.0]


def test_null_elements_inside_lists_are_named_as_such_and_filled():
    from formats.schema import to_numpy

    t = pa.table({"x": pa.array([[1, 2], [3, None], [5, 6]], pa.list_(pa.float32()))})
    for shapes in ({}, {"x": (2,)}):  # ragged or dense
        with pytest.raises(SchemaError, match=r"column 'x' has 1 null element\(s\) inside its lists"):
            to_numpy(t, column_specs(t.schema, shapes=shapes))
    got = to_numpy(t, column_specs(t.schema, shapes={"x": (2,)}, fill_values={"x": -1.0}))["x"]
    assert got.tolist() == [[1.0, 2.0], [3.0, -1.0], [5.0, 6.0]]


def test_schema_file_round_trip(tmp_path):
    schema = pa.schema([("s", pa.string()), ("b", pa.binary()), ("t", pa.timestamp("us", tz="UTC")),
                        ("v", pa.list_(pa.list_(pa.int8())))])
    specs = column_specs(schema)
    write_schema_file(tmp_path, TFRecordSchema(specs, compression="GZIP", num_rows=4,
                                               null_counts={"s": 2}, spark_schema={"type": "struct"}))
    back = read_schema_file(tmp_path)
    assert back.specs == specs
    assert [s.arrow_type for s in back.specs] == list(schema.types)
    assert (back.compression, back.num_rows, back.null_counts["s"]) == ("GZIP", 4, 2)
    assert find_schema_file(tmp_path / "nowhere") is None
    with pytest.raises(StorageError, match="no TFRecord schema file"):
        read_schema_file(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text('{"format": "csv"}')
    with pytest.raises(SchemaError, match="not a valid TFRecord schema file"):
        read_schema_file(tmp_path / "bad.json")


def test_an_empty_list_level_without_an_offsets_buffer():
    # Spark 3.5's JVM sends an inner list level with no lists in it (every row's outer list
    # empty) without an offsets buffer; pyarrow 14 then reads garbage offsets from it.
    from formats.example import decode_examples, encode_examples

    child = pa.array([], pa.int64())
    inner = pa.Array.from_buffers(pa.list_(pa.int64()), 0, [None, None], children=[child])
    outer = pa.Array.from_buffers(
        pa.list_(pa.list_(pa.int64())), 2, [None, pa.py_buffer(bytes(12))], children=[inner])
    batch = pa.RecordBatch.from_arrays([outer], ["g"])
    specs = column_specs(batch.schema)
    got = to_numpy(batch, specs)["g"]
    assert [s.tolist() for s in got.row_splits] == [[0, 0, 0], [0]]
    assert got.values.size == 0
    assert decode_examples(encode_examples(batch, specs), specs).column("g").to_pylist() == [[], []]


def test_list_levels_count_nulls_inside_arrays_never_null_rows():
    from formats.schema import is_list_type, leaf_values, list_levels

    arr = pa.array([[[1.0, None], None], None, [[2.0]]], pa.list_(pa.list_(pa.float64())))
    levels = list_levels(arr.slice(0, 2))  # the null row (index 1) contributes nothing
    assert [lv.type for lv in levels] == [pa.list_(pa.float64()), pa.float64()]
    assert [lv.null_count for lv in levels] == [1, 1]
    assert leaf_values(arr).to_pylist() == [1.0, None, 2.0]
    fixed = pa.array([[1, 2], [3, 4]], pa.list_(pa.int32(), 2))
    assert is_list_type(fixed.type) and leaf_values(fixed).to_pylist() == [1, 2, 3, 4]
    assert list_levels(pa.array([1, None])) == [] and not is_list_type(pa.int64())
    assert leaf_values(pa.array([1, None])).null_count == 1


def test_the_fill_value_a_null_error_suggests_has_the_column_type():
    # a null in a binary image column was told fill_values={'img': 0}
    from formats.errors import SchemaError as Err
    from formats.schema import fill_example

    assert [fill_example(t) for t in (pa.binary(), pa.large_string(), pa.bool_(), pa.float32(),
                                      pa.list_(pa.string()), pa.dictionary(pa.int8(), pa.string()))] == [
        "b''", "''", "False", "0", "''", "''"]
    t = pa.table({"img": pa.array([b"\x01", None], pa.binary())})
    with pytest.raises(Err, match=r"fill_values=\{'img': b''\}"):
        to_numpy(t, column_specs(t.schema))


def test_timestamps_of_every_unit_reach_tensorflow_as_microseconds():
    # pandas writes nanoseconds, some writers milliseconds; Spark (and so every export) holds
    # microseconds: the pull readers gave the file's unit, 1000x off from the same data exported
    from formats.example import decode_examples, encode_examples

    micros = [1_704_067_200_123_456, -1, None, 0]
    for unit, values in {
        "ns": [1_704_067_200_123_456_789, -500, None, 0],  # nanoseconds floor, as in Spark
        "us": micros,
        "ms": [1_704_067_200_123, -1, None, 0],
        "s": [1_704_067_200, -1, None, 0],
    }.items():
        t = pa.table({"t": pa.array(values, pa.timestamp(unit, tz="UTC")),
                      "l": pa.array([[v, v] if v is not None else [] for v in values],
                                    pa.list_(pa.timestamp(unit)))})
        got = to_numpy(t, column_specs(t.schema, fill_values={"t": 7}))
        want = {"ns": micros, "us": micros,
                "ms": [1_704_067_200_123_000, -1000, None, 0],
                "s": [1_704_067_200_000_000, -1_000_000, None, 0]}[unit]
        filled = [7 if v is None else v for v in want]  # the fill is in microseconds too
        assert got["t"].dtype == "int64" and got["t"].tolist() == filled, unit
        assert got["l"].values.tolist() == [v for v in want if v is not None for _ in range(2)], unit
        # the TFRecord coding writes microseconds too, and restores the column's own type
        back = decode_examples(encode_examples(t, column_specs(t.schema)), column_specs(t.schema))
        assert back.schema.field("t").type == pa.timestamp(unit, tz="UTC"), unit
        assert back.column("t").cast(pa.int64()).to_pylist() == (
            [1_704_067_200_123_456_000, -1000, None, 0] if unit == "ns" else values), unit
    far = pa.table({"t": pa.array([10**17], pa.timestamp("s"))})
    with pytest.raises(SchemaError, match=r"column 't' holds timestamp 100000000000000000 \(s since "
                                          r"the epoch\), beyond what int64 microseconds"):
        to_numpy(far, column_specs(far.schema))


def test_nested_lists_declared_dense_are_checked_list_by_list():
    # only the row's total was checked: [[1, 2, 3], [4]] under shape (2, 2) read as [[1, 2], [3, 4]]
    rows = [[[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0, 3.0], [4.0]], [[5.0, 6.0], [7.0, 8.0], []]]
    t = pa.table({"v": pa.array(rows)})
    specs = column_specs(t.schema, shapes={"v": (2, 2)})
    assert to_numpy(t.slice(0, 1), specs)["v"].tolist() == [rows[0]]
    with pytest.raises(SchemaError, match=r"column 'v' is fed as dense shape \(2, 2\), but row 1 of this "
                                          r"batch has a list of 3 values at nesting level 2 \(expected 2\)"):
        to_numpy(t.slice(0, 2), specs)
    with pytest.raises(SchemaError, match=r"row 0 of this batch has a list of 3 lists at nesting level 1"):
        to_numpy(t.slice(2, 1), specs)


def test_a_column_name_twice_is_named_as_such():
    # it said "column 'a.b' is not in the data; the columns are ['a.b', 'a.b']"
    flat = pa.schema([("a", pa.struct([("b", pa.int64())])), ("a.b", pa.float32())])
    with pytest.raises(SchemaError, match=r"column name 'a.b' appears 2 times in the data \(at positions \[0, 1\]; one made by "
                                          r"flatten_structs from a struct's field\), but each column"):
        column_specs(flat, flatten_structs=True)
    with pytest.raises(SchemaError, match=r"column name 'x' appears 2 times in the data \(at positions \[0, 1\].*df.toDF\('x_1', 'x_2'\) renames by position"):
        column_specs(pa.schema([("x", pa.int64()), ("x", pa.float32())]))


def test_a_dense_column_that_meets_another_length_names_the_ragged_declaration():
    # the advice was "leave its shape undeclared", which a column made dense by the data
    # (every row of the first DataFrame or micro-batch one length) could not follow
    t = pa.table({"toks": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int64()))})
    specs = column_specs(t.schema, shapes={"toks": (3,)})
    with pytest.raises(SchemaError, match=r"row 1 of this batch has 2 values\. Declare the column ragged "
                                          r"\(shapes=\{'toks': None\}; a pushed column is dense"):
        to_numpy(t, specs)
    from formats.schema import declare_shapes

    ragged = column_specs(t.schema)
    assert declare_shapes(ragged, {"toks": None}) == ragged  # already ragged: as it was
    with pytest.raises(SchemaError, match=r"shapes\['toks'\] is None \(ragged\), but the data declares"):
        declare_shapes(specs, {"toks": None})
