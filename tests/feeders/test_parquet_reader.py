"""feeders.parquet_dataset beyond conformance: row order under read-ahead, a file rewritten
after the dataset was built, prefetch/autotune options."""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import feeders
from feeders.parquet import pages, plan
from tests.builders import numeric_table, write_parquet_files


def _ids(ds) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.concatenate([b["id"].numpy() for b in ds])


def test_rows_arrive_in_file_and_row_group_order(tmp_path, monkeypatch):
    # Small chunks and many files/row groups, so the scan's read-ahead has several files in
    # flight at once: the batches must still come out in file order, every row once.
    monkeypatch.setattr(plan, "_CHUNK_BYTES", 4096)
    write_parquet_files(numeric_table(3000), tmp_path, files=7, row_group_size=150)
    ds = feeders.parquet_dataset(tmp_path, batch_size=64)
    for _ in range(2):  # and again on the next epoch
        np.testing.assert_array_equal(_ids(ds), np.arange(3000))


def test_row_group_shards_keep_order_and_partition_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "_CHUNK_BYTES", 4096)
    write_parquet_files(numeric_table(2000), tmp_path, files=1, row_group_size=100)
    parts = [_ids(feeders.parquet_dataset(tmp_path, batch_size=50, shard=(i, 3))) for i in range(3)]
    for p in parts:
        assert np.all(np.diff(p) > 0)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(2000))


@pytest.mark.parametrize("sizes", [[2, 1], [2, 0, 1]])
def test_more_shards_than_rows_warn_on_the_empty_shards_only(tmp_path, caplog, sizes):
    # the warning named the shard being planned whether or not it got anything, and a shard
    # left empty by a file without rows was not warned about at all
    start = 0
    for k, n in enumerate(sizes):
        pq.write_table(numeric_table(start + n).slice(start), tmp_path / f"part-{k}.parquet")
        start += n
    counts = {}
    for i in range(5):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=plan.__name__):
            ds = feeders.parquet_dataset(tmp_path, batch_size=8, shard=(i, 5))
            counts[i] = sum(int(b["id"].shape[0]) for b in ds)
        said = [r.getMessage() for r in caplog.records if "nothing to read" in r.getMessage()]
        assert bool(said) == (counts[i] == 0), (i, counts[i], said)
        if said:
            assert said == [f"{tmp_path}: shard {i} of 5 has nothing to read: the data set has 3 "
                            f"rows, fewer than the shards. Use fewer shards."], said
    assert counts == {0: 0, 1: 1, 2: 0, 3: 1, 4: 1}


@pytest.mark.parametrize("row_group_size", [None, 100, 1000])
def test_shards_hold_even_rows_of_uneven_files(tmp_path, caplog, row_group_size):
    # files of 1000, 10 and 517 rows: every other file gave one worker 1517 rows and the
    # other 10, so under MWMS one trained on empty batches nearly all epoch (and a custom loop
    # hung). Shards now split the rows: 763 and 764, a boundary row group decoded by both.
    start = 0
    for k, n in enumerate([1000, 10, 517]):
        pq.write_table(numeric_table(start + n).slice(start), tmp_path / f"part-{k}.parquet",
                       row_group_size=row_group_size)
        start += n
    with caplog.at_level(logging.WARNING, logger=plan.__name__):
        for count in (2, 3):
            parts = [_ids(feeders.parquet_dataset(tmp_path, batch_size=64, shard=(i, count)))
                     for i in range(count)]
            bounds = [i * 1527 // count for i in range(count + 1)]
            assert [p.tolist() for p in parts] == [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    assert caplog.records == []
    # the paged reader (a fixed-length list column) keeps the same windows
    table = _image_table(1527, size=3)
    pq.write_table(table, tmp_path / "img.parquet", row_group_size=row_group_size)
    got = []
    for i in range(2):
        batches = list(feeders.parquet_dataset(tmp_path / "img.parquet", batch_size=64,
                                               shard=(i, 2), shapes={"image": (3,)}))
        ids = np.concatenate([b["id"].numpy() for b in batches])
        want = table["image"].combine_chunks().flatten().to_numpy().reshape(-1, 3)[ids]
        np.testing.assert_array_equal(np.concatenate([b["image"].numpy() for b in batches]), want)
        got.append(ids.tolist())
    assert got == [list(range(763)), list(range(763, 1527))]


def test_the_index_pandas_writes_for_a_filtered_frame_is_no_feature(tmp_path):
    # df[df.x > 1].to_parquet() stores the row numbers as __index_level_0__ (pandas reads them
    # back as the index); a reader yielding every column made them a feature, and a second
    # file written from an unfiltered frame (no such column) failed as "missing from" it
    import pandas as pd

    df = pd.DataFrame({"x": np.arange(6.0), "y": np.arange(6) % 2})
    df[df.x > 1].to_parquet(tmp_path / "part-0.parquet")
    df.to_parquet(tmp_path / "part-1.parquet")
    assert "__index_level_0__" in pq.read_schema(tmp_path / "part-0.parquet").names
    feats, labels = zip(*feeders.parquet_dataset(tmp_path, label="y", batch_size=100))
    assert list(feats[0]) == ["x"]
    assert np.concatenate([f["x"].numpy() for f in feats]).tolist() == [2.0, 3.0, 4.0, 5.0] + list(np.arange(6.0))
    asked = next(iter(feeders.parquet_dataset(tmp_path / "part-0.parquet", columns=["__index_level_0__", "x"])))
    assert asked["__index_level_0__"].numpy().tolist() == [2, 3, 4, 5]


def test_pandas_nanosecond_timestamps_read_as_the_microseconds_their_export_holds(spark, tmp_path):
    # pandas writes datetimes as nanoseconds; the reader gave TF those, 1000x the microseconds
    # that parquet_to_tfrecords (through Spark's unit) writes for the same file
    import pandas as pd

    import formats

    when = pd.to_datetime(["2024-01-01 00:00:00.123456", "1969-12-31 23:59:59.999999", "2030-06-30 00:00:00.000000"])
    pd.DataFrame({"t": when, "y": [1, 2, 3]}).to_parquet(tmp_path / "pandas.parquet")
    assert pq.read_schema(tmp_path / "pandas.parquet").field("t").type == pa.timestamp("ns")
    want = [1_704_067_200_123_456, -1, 1_909_008_000_000_000]
    pulled = next(iter(feeders.parquet_dataset(tmp_path / "pandas.parquet", batch_size=10)))
    assert pulled["t"].dtype.name == "int64" and pulled["t"].numpy().tolist() == want
    formats.parquet_to_tfrecords(spark, str(tmp_path / "pandas.parquet"), str(tmp_path / "tfr"))
    exported = next(iter(feeders.tfrecord_dataset(str(tmp_path / "tfr"), batch_size=10)))
    assert exported["t"].numpy().tolist() == want
    # nanoseconds below a microsecond: floored by the export as by the reader (the export
    # refused the file, "Casting from timestamp[ns] to timestamp[us] would lose data")
    (tmp_path / "ns").mkdir()
    pq.write_table(pa.table({"t": pa.array([1, 999, 4001, -1], pa.timestamp("ns"))}), tmp_path / "ns" / "a.parquet")
    formats.parquet_to_tfrecords(spark, str(tmp_path / "ns"), str(tmp_path / "tfr_ns"))
    pulled = next(iter(feeders.parquet_dataset(tmp_path / "ns", batch_size=10)))["t"].numpy().tolist()
    exported = next(iter(feeders.tfrecord_dataset(str(tmp_path / "tfr_ns"), batch_size=10)))["t"].numpy().tolist()
    assert pulled == exported == [0, 0, 4, -1]


def test_spark_int96_timestamps_beyond_nanoseconds_read_as_spark_reads_them(spark, tmp_path):
    # Spark writes timestamps as INT96 by default; pyarrow read them as nanoseconds, which wrap
    # around outside 1677-2262: 9999-12-31 (a common "no end" date) came back as 1816, silently,
    # from the reader, its TFRecord export and inspect (which said timestamp[ns])
    import formats
    from dataplane.cli.inspect import describe

    df = spark.sql(
        "SELECT id, CAST(t AS TIMESTAMP) AS t, array(CAST(t AS TIMESTAMP)) AS ts FROM VALUES "
        "(0, '9999-12-31 23:59:59'), (1, '2262-04-12 00:00:00'), (2, '1600-01-01 00:00:00'), "
        "(3, '2024-05-06 07:08:09.123456') AS v(id, t)")
    src = str(tmp_path / "src")
    keys = ("spark.sql.parquet.int96RebaseModeInWrite", "spark.sql.parquet.int96RebaseModeInRead")
    before = [spark.conf.get(k, None) for k in keys]
    for k in keys:  # Spark 3.5 refuses dates before 1900 in INT96 unless told the calendar
        spark.conf.set(k, "CORRECTED")
    try:
        df.coalesce(1).write.option("compression", "none").parquet(src)
        want = [r[0] for r in spark.read.parquet(src).orderBy("id").selectExpr("unix_micros(t)").collect()]
    finally:
        for k, v in zip(keys, before):
            spark.conf.unset(k) if v is None else spark.conf.set(k, v)
    data = [p for p in (tmp_path / "src").iterdir() if p.suffix == ".parquet"]
    meta = pq.ParquetFile(data[0]).metadata.schema
    assert [meta.column(i).physical_type for i in range(len(meta))] == ["INT32", "INT96", "INT96"]
    assert want[0] == 253_402_300_799_000_000 and want[2] == -11_676_096_000_000_000
    got = next(iter(feeders.parquet_dataset(src, batch_size=10)))
    assert got["t"].dtype.name == "int64" and got["t"].numpy().tolist() == want
    assert got["ts"].numpy().tolist() == [[w] for w in want]
    formats.parquet_to_tfrecords(spark, src, str(tmp_path / "tfr"))
    exported = next(iter(feeders.tfrecord_dataset(str(tmp_path / "tfr"), batch_size=10)))
    order = np.argsort(exported["id"].numpy())
    assert exported["t"].numpy()[order].tolist() == want
    types = {c["name"]: c["arrow_type"] for c in describe(src)["columns"]}
    assert types["t"] == "timestamp[us]" and types["ts"] == "list<element: timestamp[us]>", types


def test_text_that_is_not_utf8_arrives_as_its_bytes(tmp_path):
    # Spark and pyarrow write such strings (CAST(X'FF61' AS STRING)); the reader failed with
    # "ArrowException: Unknown error: Wrapping \xffa failed", naming no column
    raw = pa.array([b"\xffa", b"ok", "\u00e9".encode()], pa.binary()).view(pa.string())
    lists = pa.ListArray.from_arrays(pa.array([0, 1, 1, 2], pa.int32()),
                                     pa.array([b"\xfe", b"x"], pa.binary()).view(pa.string()))
    pq.write_table(pa.table({"s": raw, "l": lists}), tmp_path / "a.parquet")
    got = next(iter(feeders.parquet_dataset(tmp_path, batch_size=10)))
    assert got["s"].numpy().tolist() == [b"\xffa", b"ok", b"\xc3\xa9"]
    assert got["l"].to_list() == [[b"\xfe"], [], [b"x"]]


def test_a_file_rewritten_without_a_column_after_planning_is_named(tmp_path):
    files = write_parquet_files(numeric_table(400), tmp_path, files=2)
    ds = feeders.parquet_dataset(tmp_path, batch_size=100)
    pq.write_table(numeric_table(200).drop_columns(["f3"]), files[1])
    with pytest.raises(Exception, match=r"part-00001\.parquet: column 'f3' is no such column.*changed after"):
        _ids(ds)


def test_prefetch_is_fixed_unless_autotune_is_asked_for(tmp_path):
    import tensorflow as tf

    write_parquet_files(numeric_table(100), tmp_path)
    assert feeders.parquet_dataset(tmp_path).options().autotune.enabled is False
    tuned = feeders.parquet_dataset(tmp_path, prefetch=tf.data.AUTOTUNE)
    assert tuned.options().autotune.enabled is True
    np.testing.assert_array_equal(_ids(tuned), np.arange(100))


# --- dense list columns decoded from their pages (formats.parquet_pages) -------------------


def _image_table(rows: int, size: int = 12, *, seed: int = 3) -> pa.Table:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(rows * size).astype(np.float32)
    offsets = pa.array(np.arange(0, (rows + 1) * size, size, dtype=np.int32))
    return pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "image": pa.ListArray.from_arrays(offsets, pa.array(values)),
            "label": rng.integers(0, 10, rows, dtype=np.int32),
        }
    )


def _fallbacks(caplog) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.getMessage() for r in caplog.records if "read with pyarrow" in r.getMessage()]


def test_dense_list_columns_are_decoded_from_pages_with_exact_values(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="feeders.parquet")
    monkeypatch.setattr(plan, "_CHUNK_BYTES", 20_000)  # chunks cut row groups unevenly
    table = _image_table(2500)
    files = write_parquet_files(table, tmp_path, files=3, row_group_size=300)
    ds = feeders.parquet_dataset(tmp_path, batch_size=128, label="label", shapes={"image": (3, 4)})
    for _ in range(2):
        feats, labels = zip(*[(f, y) for f, y in ds])
        image = np.concatenate([f["image"].numpy() for f in feats])
        assert image.dtype == np.float32 and image.shape == (2500, 3, 4)
        want = table["image"].combine_chunks().flatten().to_numpy().reshape(2500, 3, 4)
        np.testing.assert_array_equal(image.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(np.concatenate([f["id"].numpy() for f in feats]), np.arange(2500))
        np.testing.assert_array_equal(np.concatenate([y.numpy() for y in labels]), table["label"].to_numpy())
        assert [len(f["id"]) for f in feats] == [128] * 19 + [68]
    assert len(files) == 3 and _fallbacks(caplog) == []


def test_a_refused_page_mid_row_group_continues_with_pyarrow_from_the_next_row(tmp_path, monkeypatch, caplog):
    # A null at row 1700 (of one row group) in a column with a fill value: the pages before it
    # are decoded in place, the rest of the row group is read by pyarrow from the first row
    # not yet handed out. No row lost or repeated, the null filled.
    caplog.set_level(logging.DEBUG, logger="feeders.parquet")
    monkeypatch.setattr(plan, "_CHUNK_BYTES", 200 * 12 * 4)
    rows, size = 2000, 12
    values = np.arange(rows * size, dtype=np.float32)
    valid = np.ones(rows * size, dtype=bool)
    valid[1700 * size + 5] = False
    offsets = pa.array(np.arange(0, (rows + 1) * size, size, dtype=np.int32))
    image = pa.ListArray.from_arrays(offsets, pa.array(values, mask=~valid))
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "image": image})
    pq.write_table(table, tmp_path / "part-0.parquet", data_page_size=4096, row_group_size=rows)
    ds = feeders.parquet_dataset(tmp_path, batch_size=100, shapes={"image": (size,)}, fill_values={"image": -1.0})
    batches = list(ds)
    got = np.concatenate([b["image"].numpy() for b in batches]).ravel()
    want = np.where(valid, values, np.float32(-1.0))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.concatenate([b["id"].numpy() for b in batches]), np.arange(rows))
    (message,) = _fallbacks(caplog)
    start = int(message.split("from row ")[1].split(" ")[0])
    assert 0 < start <= 1700 and start % 100 == 0, message  # chunks hold whole batches


def test_a_dense_row_of_another_length_is_the_usual_schema_error(tmp_path):
    lengths = np.full(400, 4)
    lengths[321] = 5
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    image = pa.ListArray.from_arrays(offsets, pa.array(np.ones(int(lengths.sum()), np.float32)))
    pq.write_table(pa.table({"image": image}), tmp_path / "part-0.parquet", data_page_size=1024)
    ds = feeders.parquet_dataset(tmp_path, batch_size=50, shapes={"image": (4,)})
    with pytest.raises(Exception, match=r"column 'image' is fed as dense shape \(4,\).*row 321 .* 5 values"):
        list(ds)


def test_row_group_shards_of_paged_columns_partition_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "_CHUNK_BYTES", 4096)
    table = _image_table(1000, size=3)
    write_parquet_files(table, tmp_path, files=1, row_group_size=90)
    parts = []
    for i in range(3):
        batches = list(feeders.parquet_dataset(tmp_path, batch_size=64, shard=(i, 3), shapes={"image": (3,)}))
        ids = np.concatenate([b["id"].numpy() for b in batches])
        image = np.concatenate([b["image"].numpy() for b in batches])
        want = table["image"].combine_chunks().flatten().to_numpy().reshape(-1, 3)[ids]
        np.testing.assert_array_equal(image, want)
        parts.append(ids)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(1000))


def test_an_epoch_left_early_leaves_no_reading_threads(tmp_path, monkeypatch):
    import gc
    import threading

    monkeypatch.setattr(plan, "_CHUNK_BYTES", 4096)
    write_parquet_files(_image_table(3000), tmp_path, files=6, row_group_size=100)
    ds = feeders.parquet_dataset(tmp_path, batch_size=32, shapes={"image": (12,)})
    it = iter(ds)
    assert next(it)["id"].numpy().tolist() == list(range(32))
    del it
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("dataplane-parquet")]
        if not alive:
            break
        time.sleep(0.05)
    assert alive == []
    np.testing.assert_array_equal(_ids(ds), np.arange(3000))  # and the next epoch is whole


def test_a_scanned_file_removed_after_planning_is_named(tmp_path):
    # the scanner's error named only the data set ("one of its 3 files"), the file itself only
    # inside pyarrow's text
    files = write_parquet_files(numeric_table(300), tmp_path, files=3)
    ds = feeders.parquet_dataset(tmp_path, batch_size=100)
    files[2].unlink()
    with pytest.raises(Exception, match=rf"StorageError: cannot read the Parquet data of {files[2]}: "):
        list(ds)


def test_a_paged_file_rewritten_or_removed_after_planning_is_named(tmp_path):
    files = write_parquet_files(_image_table(400, size=4), tmp_path, files=2)
    ds = feeders.parquet_dataset(tmp_path, batch_size=100, shapes={"image": (4,)})
    pq.write_table(_image_table(200, size=4).drop_columns(["image"]), files[1])
    with pytest.raises(Exception, match=r"part-00001\.parquet: column 'image' is no such column.*changed after"):
        list(ds)
    files[1].unlink()
    # (errors raised inside the tf.data source reach the caller wrapped by TensorFlow)
    with pytest.raises(Exception, match=r"StorageError: cannot open .*part-00001\.parquet.*No such file"):
        list(ds)


@pytest.mark.parametrize("paged", [False, True])
def test_a_file_rewritten_with_other_rows_after_planning_is_named(tmp_path, paged):
    # a file rewritten in place between epochs (an ETL job re-run into the same path) gave a
    # short epoch (10 rows for 1000) or one cut at the planned count (2000 of 3000 new rows)
    table = (lambda n, start=0: _image_table(n, size=4)) if paged else (lambda n, start=0: numeric_table(n))
    files = write_parquet_files(table(4000), tmp_path, files=4)
    kw = {"shapes": {"image": (4,)}} if paged else {}
    ds = feeders.parquet_dataset(tmp_path, batch_size=100, shard=(0, 2), **kw)
    assert sum(int(next(iter(b.values())).shape[0]) for b in ds) == 2000
    for rows in (10, 3000):
        pq.write_table(table(rows), files[0])
        with pytest.raises(Exception, match=rf"StorageError: {files[0]} holds {rows} rows, but it held 1000 "
                                            r"when the dataset was built: the file was rewritten since"):
            list(ds)
    pq.write_table(table(1000), files[0])  # the same count again: read as planned
    assert sum(int(next(iter(b.values())).shape[0]) for b in ds) == 2000


def test_spark_written_array_columns_take_the_page_reader_with_exact_values(spark, tmp_path, caplog, monkeypatch):
    # parquet-mr (Spark's writer) encodes levels, dictionaries and pages its own way; with
    # small pages the rows run across page boundaries.
    caplog.set_level(logging.DEBUG, logger="feeders.parquet")
    paged: list[int] = []
    real = pages.iter_page_values

    def counted(read, layout, size):  # type: ignore[no-untyped-def]
        paged.append(size)
        return real(read, layout, size)

    monkeypatch.setattr(pages, "iter_page_values", counted)
    rng = np.random.default_rng(11)
    rows, size = 1500, 20
    image = (rng.integers(0, 300, (rows, size)) / 8).astype(np.float32)  # dictionary-friendly
    dense = rng.standard_normal((rows, size)).astype(np.float32)  # plain after the dictionary
    pdf = {"id": list(range(rows)), "image": image.tolist(), "dense": dense.tolist()}
    df = spark.createDataFrame(
        list(zip(pdf["id"], pdf["image"], pdf["dense"])), "id LONG, image ARRAY<FLOAT>, dense ARRAY<FLOAT>"
    )
    out = str(tmp_path / "spark")
    df.coalesce(2).write.option("parquet.page.size", 4096).option("parquet.dictionary.page.size", 2048).parquet(out)
    ds = feeders.parquet_dataset(out, batch_size=128, shapes={"image": (size,), "dense": (size,)})
    batches = list(ds)
    ids = np.concatenate([b["id"].numpy() for b in batches])
    order = np.argsort(ids)
    np.testing.assert_array_equal(ids[order], np.arange(rows))
    for name, want in (("image", image), ("dense", dense)):
        got = np.concatenate([b[name].numpy() for b in batches])[order]
        np.testing.assert_array_equal(got, want)
    assert _fallbacks(caplog) == [] and len(paged) >= 4  # two columns of at least two files


def test_a_short_remote_block_is_refused_not_left_uninitialised(tmp_path):
    # A ranged read that returns fewer bytes than asked (the object shrank after its footer was
    # read): the chunk is refused, so pyarrow reads the row group and reports what it finds.
    import threading
    from concurrent.futures import Future

    from formats.parquet_pages import PagesRefused, chunk_layout

    write_parquet_files(_image_table(100, size=4), tmp_path)
    from formats.fs import resolve
    from formats.pool import BufferPool

    paged = pages.PagedChunks(resolve(str(tmp_path)), [], [], pa.schema([]), {"image"}, 64, BufferPool())
    meta = pq.ParquetFile(tmp_path / "part-00000.parquet").metadata
    layout = chunk_layout(meta, 0, "image", np.float32)
    short: Future = Future()
    short.set_result(b"\x00" * (layout.length - 16))
    of = pages._OpenFile("p", "s3://b/p", None, None, None, threading.Lock())
    group = pages._Group(of, 0, 100, None, {"image": layout}, None, {"image": [(0, short)]}, True)
    with pytest.raises(PagesRefused, match=r"shorter than its footer says \(bytes \d+\+\)"):
        paged._reader(group, "image")


def test_a_parquet_file_without_a_suffix_beside_named_ones_is_read(tmp_path, caplog):
    # part-00000 (a writer adding no suffix) beside data.parquet was dropped without a word,
    # losing its rows; a README beside them is no data and is skipped, named in a warning
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "data.parquet")
    pq.write_table(pa.table({"x": [3, 4, 5]}), tmp_path / "part-00000")
    (tmp_path / "README").write_text("rows of x\n")
    with caplog.at_level(logging.WARNING, logger="formats.fs"):
        got = [b["x"].numpy().tolist() for b in feeders.parquet_dataset(tmp_path, batch_size=10)]
    assert sorted(sum(got, [])) == [1, 2, 3, 4, 5]
    assert "skipping 1 file(s) that are not Parquet: README" in caplog.text
