"""formats.parquet_pages: fixed-length list columns decoded from their pages, checked against
pyarrow's own decoding of the same files (values bit for bit), and every case it must refuse."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from formats.parquet_pages import PagesRefused, chunk_layout, iter_page_values, unpack_bits


def _lists(values: np.ndarray, size: int, typ: pa.DataType | None = None) -> pa.Array:
    rows = len(values) // size
    offsets = pa.array(np.arange(0, (rows + 1) * size, size, dtype=np.int32))
    arr = pa.ListArray.from_arrays(offsets, pa.array(values))
    return arr if typ is None else arr.cast(typ)


def _write(path: Path, table: pa.Table, **options) -> pq.FileMetaData:
    pq.write_table(table, path, **options)
    return pq.ParquetFile(path).metadata


def _decode(path: Path, column: str, size: int, dtype) -> np.ndarray:
    meta = pq.ParquetFile(path).metadata
    with open(path, "rb") as f:

        def read(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)

        pages = []
        for g in range(meta.num_row_groups):
            pages += list(iter_page_values(read, chunk_layout(meta, g, column, dtype), size))
    return np.concatenate(pages) if pages else np.empty(0, dtype)


def _expected(path: Path, column: str) -> np.ndarray:
    return pq.read_table(path, columns=[column])[column].combine_chunks().flatten().to_numpy()


def _special_floats(n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(7)
    v = rng.standard_normal(n).astype(dtype)
    v[::97] = np.nan
    v[1::89] = -0.0
    v[2::83] = np.inf
    return v


@pytest.mark.parametrize(
    "compression,dictionary,page_version",
    list(itertools.product(["none", "snappy", "gzip", "zstd"], [False, True], ["1.0", "2.0"])),
)
def test_values_equal_pyarrow_bit_for_bit_across_codecs_encodings_and_page_versions(
    tmp_path, compression, dictionary, page_version
):
    size, rows = 7, 3001  # rows and pages do not line up: rows run across v1 page boundaries
    table = pa.table(
        {
            "f": _lists(_special_floats(rows * size, np.float32), size),
            # few distinct values: the dictionary never falls back to PLAIN
            "i": _lists(np.arange(rows * size, dtype=np.int64) % 50 - 25, size),
        }
    )
    path = tmp_path / "t.parquet"
    _write(
        path, table, compression=compression, use_dictionary=dictionary,
        data_page_version=page_version, data_page_size=2000, row_group_size=1000,
    )
    for column, dtype in (("f", np.float32), ("i", np.int64)):
        got = _decode(path, column, size, dtype)
        want = _expected(path, column)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def test_a_dictionary_that_falls_back_to_plain_midway_decodes_both_parts(tmp_path):
    size, rows = 784, 1200  # > 262,144 distinct floats: a 1 MB dictionary, then PLAIN pages
    values = np.random.default_rng(0).random(rows * size, dtype=np.float32)
    path = tmp_path / "t.parquet"
    meta = _write(path, pa.table({"image": _lists(values, size)}), row_group_size=rows)
    encodings = meta.row_group(0).column(0).encodings
    assert "PLAIN" in encodings and "RLE_DICTIONARY" in encodings
    np.testing.assert_array_equal(_decode(path, "image", size, np.float32), values)


@pytest.mark.parametrize(
    "typ,dtype",
    [
        (pa.list_(pa.float64()), np.float64),
        (pa.large_list(pa.float32()), np.float32),
        (pa.list_(pa.float32(), 5), np.float32),  # fixed_size_list
        (pa.list_(pa.int32()), np.int32),
    ],
)
def test_list_kinds_and_value_types(tmp_path, typ, dtype):
    rows, size = 500, 5
    values = (np.arange(rows * size) * 3 - 700).astype(dtype)
    path = tmp_path / "t.parquet"
    _write(path, pa.table({"x": _lists(values, size, typ)}), data_page_size=512)
    np.testing.assert_array_equal(_decode(path, "x", size, dtype), values)


def test_lists_of_one_value(tmp_path):
    values = np.arange(4000, dtype=np.float32)
    path = tmp_path / "t.parquet"
    _write(path, pa.table({"x": _lists(values, 1)}), data_page_size=1000)
    np.testing.assert_array_equal(_decode(path, "x", 1, np.float32), values)


def _refused(path: Path, column: str, size: int, dtype, match: str) -> None:
    with pytest.raises(PagesRefused, match=match):
        _decode(path, column, size, dtype)


@pytest.mark.parametrize("row", [0, 1, 150, 299])
def test_a_row_of_another_length_is_refused_wherever_it_is(tmp_path, row):
    rows, size = 300, 6
    lengths = np.full(rows, size)
    lengths[row] = size + 1 if row % 2 else size - 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], np.float32)))
    path = tmp_path / "t.parquet"
    _write(path, pa.table({"x": arr}), data_page_size=256)
    _refused(path, "x", size, np.float32, "row with another number of values|inside a row|whole rows|values")


@pytest.mark.parametrize(
    "make",
    [
        lambda: pa.array([[1.0, 2.0], None, [3.0, 4.0]], pa.list_(pa.float32())),
        lambda: pa.array([[1.0, 2.0], [None, 1.0], [3.0, 4.0]], pa.list_(pa.float32())),
        lambda: pa.array([[1.0, 2.0], [], [3.0, 4.0]], pa.list_(pa.float32())),
    ],
    ids=["null list", "null value", "empty list"],
)
def test_nulls_and_empty_lists_are_refused(tmp_path, make):
    path = tmp_path / "t.parquet"
    _write(path, pa.table({"x": make()}))
    # a null or empty list is also a row of one level: either check may see it first
    _refused(path, "x", 2, np.float32, "definition level below the maximum|another number of values")


def test_what_the_footer_shows_it_cannot_decode_is_refused_before_reading(tmp_path):
    path = tmp_path / "t.parquet"
    table = pa.table(
        {
            "nested": pa.array([[[1.0]], [[2.0]]], pa.list_(pa.list_(pa.float32()))),
            "u32": pa.array([[1], [2]], pa.list_(pa.uint32())),
            "i8": pa.array([[1], [2]], pa.list_(pa.int8())),
            "f": pa.array([[1.0], [2.0]], pa.list_(pa.float32())),
        }
    )
    meta = _write(path, table)
    with pytest.raises(PagesRefused, match="repetition level 2"):
        chunk_layout(meta, 0, "nested", np.float32)
    with pytest.raises(PagesRefused, match="logical type"):
        chunk_layout(meta, 0, "u32", np.int32)
    with pytest.raises(PagesRefused, match="logical type"):
        chunk_layout(meta, 0, "i8", np.int32)
    with pytest.raises(PagesRefused, match="stored as FLOAT, not as float64"):
        chunk_layout(meta, 0, "f", np.float64)
    with pytest.raises(PagesRefused, match="no leaf column"):
        chunk_layout(meta, 0, "missing", np.float32)


def test_other_value_encodings_are_refused(tmp_path):
    path = tmp_path / "t.parquet"
    values = np.arange(400, dtype=np.float32)
    _write(path, pa.table({"x": _lists(values, 4)}), use_dictionary=False, use_byte_stream_split=True)
    _refused(path, "x", 4, np.float32, "value encoding 9")


def test_a_damaged_or_short_chunk_is_refused_not_misread(tmp_path):
    path = tmp_path / "t.parquet"
    values = np.random.default_rng(1).random(3000, dtype=np.float32)
    meta = _write(path, pa.table({"x": _lists(values, 3)}), compression="snappy", use_dictionary=False)
    layout = chunk_layout(meta, 0, "x", np.float32)
    data = bytearray(path.read_bytes())
    short = bytes(data[: layout.start + layout.length // 2])
    with pytest.raises(PagesRefused, match="shorter than its footer"):
        list(iter_page_values(lambda o, n: short[o : o + n], layout, 3))
    data[layout.start + 40 : layout.start + 60] = b"\xff" * 20  # inside the first page's body
    with pytest.raises(PagesRefused):
        list(iter_page_values(lambda o, n: bytes(data[o : o + n]), layout, 3))


@pytest.mark.parametrize("width", list(range(1, 33)))
def test_unpack_bits_matches_a_bit_by_bit_reference(width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, 1 << width, 8 * 41, dtype=np.uint64)
    bits = ((values[:, None] >> np.arange(width, dtype=np.uint64)) & 1).astype(np.uint8).ravel()
    packed = np.packbits(bits, bitorder="little").tobytes()
    got = unpack_bits(packed, width, len(values) - 5)
    np.testing.assert_array_equal(got, values[:-5].astype(np.uint32))


@pytest.mark.parametrize("row", [3, 2000, 3996])
def test_one_row_long_and_the_next_short_inside_repeated_rows_is_refused(tmp_path, row):
    # The value count still adds up; only the walk of the levels sees it, inside the stretch
    # of byte-for-byte repeated rows that is taken without decoding.
    rows, size = 4000, 16
    lengths = np.full(rows, size)
    lengths[row] += 1
    lengths[row + 1] -= 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], np.float32)))
    path = tmp_path / "t.parquet"
    _write(path, pa.table({"x": arr}), row_group_size=rows)
    _refused(path, "x", size, np.float32, "a row with another number of values")


def test_the_repeat_shortcut_compares_bytes_and_does_not_trust_the_value_count():
    # Hand-made repetition levels: rows of 16 encoded as [bit-packed 0,1x7][RLE 1x8], and in
    # the middle a row of 17 then one of 15 encoded in the same number of bytes. The level
    # count adds up, so only the byte comparison of the repeated stretch can catch it.
    from formats.parquet_pages.rle import RowWalk

    good = bytes([0x03, 0xFE, 0x10, 0x01])
    bad = bytes([0x03, 0xFE, 0x12, 0x01, 0x03, 0xFE, 0x0E, 0x01])
    for stream in (good * 500 + bad + good * 498, good * 5 + bad + good * 993):
        walk = RowWalk(16)
        with pytest.raises(PagesRefused, match="a row with another number of values"):
            walk.walk(stream, 0, len(stream), 1000 * 16)
    walk = RowWalk(16)
    walk.walk(good * 1000, 0, 4000, 16000)
    walk.finish()


def test_dictionary_indices_mixing_long_bit_packed_and_repeated_runs(tmp_path):
    # Stretches of distinct values (long bit-packed runs, the unpacked-at-once path) broken by
    # stretches of one value (RLE runs), in one large page.
    rng = np.random.default_rng(5)
    parts = []
    for i in range(12):
        parts.append(rng.integers(0, 3000, 700 + 37 * i).astype(np.float32))
        parts.append(np.full(50 + 11 * i, float(i), np.float32))
    values = np.concatenate(parts)
    values = values[: len(values) // 8 * 8]
    path = tmp_path / "t.parquet"
    meta = _write(path, pa.table({"x": _lists(values, 8)}), data_page_size=1 << 20)
    assert "RLE_DICTIONARY" in meta.row_group(0).column(0).encodings
    np.testing.assert_array_equal(_decode(path, "x", 8, np.float32), values)


@pytest.mark.parametrize("codec", ["snappy", "gzip"])
def test_a_page_that_decompresses_short_is_refused(codec):
    # pyarrow hands back a buffer of the size asked for even when the data are shorter (its
    # tail uninitialised); the stated length is checked first.
    from formats.parquet_pages.decode import _decompress

    body = pa.Codec(codec).compress(bytes(range(100)) * 3, asbytes=True)
    page = _decompress(pa.Codec(codec), memoryview(body), 300)
    assert bytes(page) == bytes(range(100)) * 3
    with pytest.raises(PagesRefused, match=f"a {codec} page that decompresses to 300 bytes, not 320"):
        _decompress(pa.Codec(codec), memoryview(body), 320)


def test_codecs_that_do_not_state_their_length_are_left_to_arrow(tmp_path):
    path = tmp_path / "t.parquet"
    meta = _write(path, pa.table({"x": _lists(np.arange(40, dtype=np.float32), 4)}), compression="brotli")
    with pytest.raises(PagesRefused, match="compressed with BROTLI"):
        chunk_layout(meta, 0, "x", np.float32)


@pytest.mark.parametrize("fill", [b"\xff", b"\x7f", b"\x01"])
def test_garbage_in_an_uncompressed_page_is_refused_not_an_index_error(tmp_path, fill):
    path = tmp_path / "t.parquet"
    values = np.arange(3000, dtype=np.float32)
    meta = _write(path, pa.table({"x": _lists(values, 3)}), compression="none", use_dictionary=False)
    layout = chunk_layout(meta, 0, "x", np.float32)
    data = bytearray(path.read_bytes())
    for at in range(layout.start + 20, layout.start + 2000, 97):  # headers, levels and values
        damaged = bytearray(data)
        damaged[at : at + 24] = fill * 24
        try:
            got = np.concatenate(list(iter_page_values(lambda o, n: bytes(damaged[o : o + n]), layout, 3)))
        except PagesRefused:
            continue
        # accepted only if what was damaged were value bytes: then the levels still hold
        assert got.shape == values.shape


def test_a_header_nested_past_pythons_limit_is_refused():
    from formats.parquet_pages import ChunkLayout

    data = b"\x1c" * 20000  # struct field inside struct field ...: recursion, not a header
    layout = ChunkLayout(start=0, length=len(data), codec=None, num_values=4, dtype=np.dtype("<f4"), max_def=3)
    with pytest.raises(PagesRefused, match="unreadable page data \\(RecursionError"):
        list(iter_page_values(lambda o, n: data[o : o + n], layout, 2))
