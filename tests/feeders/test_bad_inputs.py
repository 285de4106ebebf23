"""Bad inputs to the pull readers: each gives an error that names the file/column and the fix."""

from __future__ import annotations

import struct
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import feeders
from dataplane.errors import RecordError, SchemaError, StorageError
from tests.builders import numeric_table, write_tfrecord_files

ROWS = 40


def _record_offsets(path: Path) -> list[int]:
    """Byte offset of every record in an uncompressed TFRecord file."""
    raw = path.read_bytes()
    offsets, pos = [], 0
    while pos < len(raw):
        offsets.append(pos)
        (length,) = struct.unpack_from("<Q", raw, pos)
        pos += 16 + length
    return offsets


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """One good TFRecord file of numeric rows, its record offsets, and its table's schema."""
    root = tmp_path_factory.mktemp("records")
    table = numeric_table(ROWS).select(["id", "f0", "label"])
    (path,) = write_tfrecord_files(table, root / "good")
    return path, _record_offsets(path), table.schema


def _copy(src: Path, dst_dir: Path, data: bytes) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / src.name
    dst.write_bytes(data)
    return dst


def _corrupt(records, tmp_path: Path) -> tuple[Path, int]:
    path, offsets, _ = records
    raw = bytearray(path.read_bytes())
    bad = offsets[3]
    raw[bad + 14] ^= 0xFF  # a data byte of record 3: its data CRC no longer matches
    return _copy(path, tmp_path / "corrupt", bytes(raw)), bad


def _truncate(records, tmp_path: Path) -> tuple[Path, int]:
    path, offsets, _ = records
    raw = path.read_bytes()
    last = offsets[-1]
    return _copy(path, tmp_path / "truncated", raw[: last + 20]), last


# --------------------------------------------------------------------------- corrupt / truncated


def test_corrupt_crc_is_found_while_sampling_the_schema(records, tmp_path):
    bad_file, offset = _corrupt(records, tmp_path)
    with pytest.raises(RecordError, match=rf"{bad_file}: corrupt record at byte offset {offset}: "
                                          r"the CRC of its \d+ data bytes does not match"):
        feeders.tfrecord_dataset(bad_file.parent)


def test_corrupt_crc_in_the_local_pipeline_names_the_file_and_offset(records, tmp_path, monkeypatch):
    import tensorflow as tf

    # Only the first records are checked when the dataset is built (a bad one among them
    # fails the call, see the catalogue); this bad record lies past them.
    monkeypatch.setattr("feeders.tfrecord.plan._CHECK_RECORDS", 8)
    good, _, schema = records
    bad_file, offset = _corrupt(records, tmp_path)
    # The damaged file comes second, after a good one, so the error must say which file.
    (bad_file.parent / "part-0.tfrecord").write_bytes(good.read_bytes())
    ds = feeders.tfrecord_dataset(bad_file.parent, schema=schema, batch_size=8)
    ids: list[int] = []
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=rf"RecordError: {bad_file}: corrupt record at byte offset {offset}: "
              r"the CRC of its \d+ data bytes does not match",
    ):
        for batch in ds:
            ids.extend(batch["id"].numpy().tolist())
    # What arrived before the error is a prefix of the good file, in order (records are
    # checked a chunk at a time, so the good rows sharing a chunk with the bad record are
    # held back with it); nothing from the damaged file.
    assert ids == list(range(len(ids))) and len(ids) <= ROWS


@pytest.mark.s3
def test_corrupt_crc_from_s3_names_the_object_and_offset(records, tmp_path, s3_env, monkeypatch):
    import tensorflow as tf

    monkeypatch.setattr("feeders.tfrecord.plan._CHECK_RECORDS", 2)  # the bad record lies past them
    bad_file, offset = _corrupt(records, tmp_path)
    bucket = s3_env.make_bucket()
    url = s3_env.upload_dir(bad_file.parent, bucket, "corrupt")
    ds = feeders.tfrecord_dataset(url, schema=records[2], batch_size=8)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=rf"RecordError: {url}/{bad_file.name}: corrupt record at byte offset {offset}",
    ):
        list(ds)


def test_truncated_record_is_found_while_sampling(records, tmp_path):
    bad_file, offset = _truncate(records, tmp_path)
    with pytest.raises(RecordError, match=rf"{bad_file}: truncated record at byte offset {offset}: "
                                          r"it declares \d+ data bytes but the file ends after 8 of them"):
        feeders.tfrecord_dataset(bad_file.parent)


def test_truncated_record_in_the_local_pipeline(records, tmp_path, monkeypatch):
    import tensorflow as tf

    monkeypatch.setattr("feeders.tfrecord.plan._CHECK_RECORDS", 8)  # the bad record lies past them
    bad_file, offset = _truncate(records, tmp_path)
    ds = feeders.tfrecord_dataset(bad_file.parent, schema=records[2], batch_size=8)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=rf"RecordError: {bad_file}: truncated record at byte offset {offset}: "
              r"it declares \d+ data bytes but the file ends after 8 of them",
    ):
        list(ds)


# --------------------------------------------------------------------------- empty / missing


def test_empty_tfrecord_file_cannot_give_a_schema(tmp_path):
    (tmp_path / "part-00000.tfrecord").write_bytes(b"")
    with pytest.raises(SchemaError, match=r"no records to infer a schema from: every file is empty"
                                          r".*part-00000\.tfrecord.*Pass schema="):
        feeders.tfrecord_dataset(tmp_path)


def test_empty_tfrecord_file_with_a_schema_reads_as_no_rows(records, tmp_path):
    (tmp_path / "part-00000.tfrecord").write_bytes(b"")
    assert list(feeders.tfrecord_dataset(tmp_path, schema=records[2])) == []


def test_empty_parquet_file(tmp_path):
    (tmp_path / "part-00000.parquet").write_bytes(b"")
    with pytest.raises(StorageError, match=r"part-00000\.parquet is not a readable Parquet file"):
        feeders.parquet_dataset(tmp_path)


def test_nonexistent_local_path(tmp_path):
    missing = tmp_path / "nope"
    for reader in (feeders.parquet_dataset, feeders.tfrecord_dataset):
        with pytest.raises(StorageError, match=rf"{missing} does not exist"):
            reader(missing)


def test_directory_without_data_files(tmp_path):
    (tmp_path / "_SUCCESS").write_bytes(b"")
    with pytest.raises(StorageError, match="is a directory with no data files"):
        feeders.parquet_dataset(tmp_path)


def test_missing_column(records, tmp_path):
    pq.write_table(numeric_table(10), tmp_path / "a.parquet")
    with pytest.raises(SchemaError, match=r"column 'nope' is not in the data; the columns are"):
        feeders.parquet_dataset(tmp_path, columns=["id", "nope"])
    with pytest.raises(SchemaError, match=r"column 'nope' is not in the records; the columns are"):
        feeders.tfrecord_dataset(records[0].parent, columns=["id", "nope"])
    with pytest.raises(SchemaError, match=r"column 'nope' is not in the data"):
        feeders.parquet_dataset(tmp_path, label="nope")


# --------------------------------------------------------------------------- types and schemas


def test_unsupported_column_types(tmp_path):
    pq.write_table(
        pa.table({"id": [1, 2], "price": pa.array([Decimal("1.50"), Decimal("2.25")])}),
        tmp_path / "dec.parquet",
    )
    with pytest.raises(SchemaError, match=r"column 'price'.*decimal.*TensorFlow has no decimal type"
                                          r".*cast\('double'\).*astype\('float64'\)"
                                          r".*scaled integer"):
        feeders.parquet_dataset(tmp_path)
    other = tmp_path / "struct"
    other.mkdir()
    pq.write_table(pa.table({"id": [1], "s": [{"a": 1, "b": "x"}]}), other / "s.parquet")
    with pytest.raises(SchemaError, match=r"column 's' is a struct.*df\.select\('s\.\*'\)"):
        feeders.parquet_dataset(other)
    # Leaving the column out is the fix.
    assert next(iter(feeders.parquet_dataset(other, columns=["id"])))["id"].numpy().tolist() == [1]


def test_schema_differing_between_files(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "x": [1, 2]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"id": [3, 4], "x": ["a", "b"]}), tmp_path / "part-1.parquet")
    with pytest.raises(SchemaError, match=rf"column 'x' has type int64 in {tmp_path}/part-0\.parquet "
                                          rf"but string in {tmp_path}/part-1\.parquet"):
        feeders.parquet_dataset(tmp_path)
    (tmp_path / "part-1.parquet").unlink()
    pq.write_table(pa.table({"id": [5]}), tmp_path / "part-2.parquet")
    with pytest.raises(SchemaError, match=r"column 'x' is in .*part-0\.parquet but missing from "
                                          r".*part-2\.parquet"):
        feeders.parquet_dataset(tmp_path, columns=["x"])
    # the other way round: a later file's extra column was dropped without a word
    (tmp_path / "part-0.parquet").unlink()
    pq.write_table(pa.table({"id": [6], "extra": [1.5]}), tmp_path / "part-3.parquet")
    with pytest.raises(SchemaError) as info:
        feeders.parquet_dataset(tmp_path)
    assert str(info.value) == (
        f"{tmp_path}/part-3.parquet has column(s) ['extra'] that {tmp_path}/part-2.parquet does not "
        f"have; every file of a data set must have the same columns. Rewrite the odd file, or pass "
        f"columns= naming the columns to read (those every file has: ['id']).")
    assert [b["id"].numpy().tolist() for b in feeders.parquet_dataset(tmp_path, columns=["id"])] == [[5, 6]]
    # columns= naming that extra column: it said "column 'extra' is not in the data; the columns
    # are ['id']", from the first file alone
    with pytest.raises(SchemaError, match=rf"column 'extra' is in {tmp_path}/part-3\.parquet but missing "
                                          rf"from {tmp_path}/part-2\.parquet; every file"):
        feeders.parquet_dataset(tmp_path, columns=["id", "extra"])


def test_the_columns_every_file_has_are_those_the_hint_names(tmp_path):
    # pandas files, one with an unnamed index (stored as __index_level_0__), one with a named
    # index 'rid': the hint listed __index_level_0__ as a column every file has, and reading
    # it then failed on the second file
    import pandas as pd

    df = pd.DataFrame({"id": np.arange(9), "x": np.arange(9) * 1.0})
    df[df.id % 3 == 0].to_parquet(tmp_path / "a.parquet")
    df[df.id % 3 == 1].set_index("id", drop=False).rename_axis("rid").to_parquet(tmp_path / "b.parquet")
    with pytest.raises(SchemaError, match=r"has column\(s\) \['rid'\] .* \(those every file has: \['id', 'x'\]\)"):
        feeders.parquet_dataset(tmp_path)
    got = [b["id"].numpy().tolist() for b in feeders.parquet_dataset(tmp_path, columns=["id", "x"])]
    assert sorted(sum(got, [])) == [0, 1, 3, 4, 6, 7]


def test_null_in_a_dense_parquet_column(tmp_path):
    pq.write_table(
        pa.table({"id": [0, 1, 2], "x": pa.array([1.5, None, 3.0], pa.float32())}),
        tmp_path / "nulls.parquet",
    )
    with pytest.raises(SchemaError, match=rf"column 'x' has 1 null value\(s\) in row group 0 of "
                                          rf"{tmp_path}/nulls\.parquet.*fill_values="):
        feeders.parquet_dataset(tmp_path)
    batch = next(iter(feeders.parquet_dataset(tmp_path, fill_values={"x": -1.0})))
    assert batch["x"].numpy().tolist() == [1.5, -1.0, 3.0]


def test_a_null_found_only_while_reading_names_its_file_without_the_readers_traceback(tmp_path):
    # a file written without statistics shows its nulls only when read: the error came as a
    # 2.5 KB tf.errors message of our reader's frames, naming the directory, not the file
    import tensorflow as tf

    pq.write_table(pa.table({"x": [1.0, 2.0]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": [3.0, None]}), tmp_path / "b.parquet", write_statistics=False)
    ds = feeders.parquet_dataset(tmp_path, batch_size=2)  # the footers show no null
    seen: list[float] = []
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        for batch in ds:
            seen.extend(batch["x"].numpy().tolist())
    message = str(info.value)
    assert f"SchemaError: reading {tmp_path}/b.parquet: column 'x' has 1 null value(s)" in message
    assert "fill_values={'x': 0}" in message
    assert "feeders/parquet" not in message, message  # no frames of the reader's internals
    assert seen == [1.0, 2.0]
    with_fill = [b["x"].numpy().tolist() for b in feeders.parquet_dataset(tmp_path, batch_size=2,
                                                                          fill_values={"x": 0.0})]
    assert with_fill == [[1.0, 2.0], [3.0, 0.0]]


def test_a_parquet_directory_given_to_the_tfrecord_reader_is_named_as_parquet(tmp_path):
    # it said "is a directory with no data files"
    for i in range(2):
        pq.write_table(numeric_table(4), tmp_path / f"part-{i}.parquet")
    with pytest.raises(StorageError, match=rf"^{tmp_path} holds Parquet files \({tmp_path}/part-0\.parquet "
                                           r"and 1 more\), no TFRecord files; read it with feeders\.parquet_dataset\.$"):
        feeders.tfrecord_dataset(tmp_path)


def test_null_arrays_in_parquet_take_the_fill_value(tmp_path):
    # fill_values filled only null elements; a null list still failed mid-iteration
    pq.write_table(pa.table({
        "id": [0, 1, 2, 3],
        "img": pa.array([[1.0, 2.0, 3.0, 4.0], None, [5.0, None, 7.0, 8.0], [9.0] * 4], pa.list_(pa.float32())),
        "tags": pa.array([[1], None, [2, 3], []], pa.list_(pa.int64())),
    }), tmp_path / "arrays.parquet")
    ds = feeders.parquet_dataset(tmp_path, shapes={"img": (2, 2)}, fill_values={"img": 0.0, "tags": -1})
    b = next(iter(ds))
    assert b["img"].numpy().tolist() == [[[1, 2], [3, 4]], [[0, 0], [0, 0]], [[5, 0], [7, 8]], [[9, 9], [9, 9]]]
    assert b["tags"].to_list() == [[1], [], [2, 3], []]
    with pytest.raises(Exception, match=r"column 'img' has null lists \(1 in the batch being converted, not "
                                        r"counting later ones\); .*Give a fill value "
                                        r"\(fill_values=\{'img': 0\}: a null list becomes an empty one"):
        list(feeders.parquet_dataset(tmp_path, columns=["img"], shapes={"img": (2, 2)}))


def test_null_in_a_dense_tfrecord_column(tmp_path):
    table = pa.table({"id": [0, 1, 2], "x": pa.array([1.5, None, 3.0], pa.float32())})
    write_tfrecord_files(table, tmp_path)  # the null is an absent feature
    # Found in the records checked when the dataset is built, so the call itself fails.
    with pytest.raises(SchemaError, match=r"record 1 has no feature 'x' .* fill_values=\{'x': 0\}"):
        feeders.tfrecord_dataset(tmp_path, schema=table.schema)
    batch = next(iter(feeders.tfrecord_dataset(tmp_path, schema=table.schema, fill_values={"x": -1.0})))
    assert batch["x"].numpy().tolist() == [1.5, -1.0, 3.0]


def test_a_missing_text_feature_gets_a_text_fill_value_in_its_fix(tmp_path):
    # the fix said fill_values={'s': 0}, which the reader then refused for a string column
    table = pa.table({"id": [0, 1, 2], "s": pa.array(["a", None, "c"])})
    write_tfrecord_files(table, tmp_path)
    with pytest.raises(SchemaError, match=r"record 1 has no feature 's' .* fill_values=\{'s': ''\}"):
        feeders.tfrecord_dataset(tmp_path, schema=table.schema)
    batch = next(iter(feeders.tfrecord_dataset(tmp_path, schema=table.schema, fill_values={"s": ""})))
    assert batch["s"].numpy().tolist() == [b"a", b"", b"c"]


def test_one_fill_values_dict_serves_reads_of_different_columns(tmp_path):
    # Parquet refused a fill value for a column left out by columns=, where the TFRecord reader
    # took it; both now take it, and both refuse a name the data does not have (a typo)
    table = pa.table({"id": [0, 1, 2], "x": pa.array([1.5, None, 3.0], pa.float32())})
    pq.write_table(table, tmp_path / "a.parquet")
    write_tfrecord_files(table, tmp_path / "tfr")
    fills = {"x": -1.0}
    assert next(iter(feeders.parquet_dataset(tmp_path / "a.parquet", columns=["id"], fill_values=fills)))["id"].numpy().tolist() == [0, 1, 2]
    assert next(iter(feeders.tfrecord_dataset(tmp_path / "tfr", schema=table.schema, columns=["id"], fill_values=fills)))["id"].numpy().tolist() == [0, 1, 2]
    with pytest.raises(SchemaError, match=r"shapes/fill_values name column 'xx', which the data does not have; its columns are \['id', 'x'\]"):
        feeders.parquet_dataset(tmp_path / "a.parquet", columns=["id"], fill_values={"xx": 0})
    with pytest.raises(SchemaError, match=r"column 'xx' is not in the records"):
        feeders.tfrecord_dataset(tmp_path / "tfr", schema=table.schema, columns=["id"], fill_values={"xx": 0})


def test_bad_arguments(tmp_path):
    pq.write_table(numeric_table(4), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        feeders.parquet_dataset(tmp_path, batch_size=0)
    with pytest.raises(ValueError, match=r"shard index must be in \[0, 2\), got 2"):
        feeders.parquet_dataset(tmp_path, shard=(2, 2))
    with pytest.raises(ValueError, match="columns must be a list of column names"):
        feeders.tfrecord_dataset(tmp_path, columns="id")
    with pytest.raises(ValueError, match="unknown TFRecord compression 'LZ4'"):
        feeders.tfrecord_dataset(tmp_path, compression="LZ4")


# --------------------------------------------------------------------------- remote stores


@pytest.mark.s3
def test_wrong_s3_credentials_are_refused(s3_server, tmp_path, monkeypatch):
    bucket = s3_server.make_bucket()
    pq.write_table(numeric_table(10), tmp_path / "a.parquet")
    url = s3_server.upload_dir(tmp_path, bucket, "data")
    for key, value in s3_server.env(secret_key="not-the-secret").items():
        monkeypatch.setenv(key, value)
    for reader in (feeders.parquet_dataset, feeders.tfrecord_dataset):
        with pytest.raises(StorageError, match=rf"cannot read {url}: .*ACCESS_DENIED.*refused the "
                                               r"credentials: check AWS_ACCESS_KEY_ID"):
            reader(url)


@pytest.mark.s3
def test_an_export_to_s3_that_cannot_write_says_why(spark, s3_server, monkeypatch):
    # write_tfrecords / parquet_to_tfrecords raised pyarrow's bare OSError here, and for a
    # missing bucket named an option of pyarrow's S3FileSystem the user never set
    import formats

    df = spark.range(3)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    with pytest.raises(StorageError) as info:
        formats.write_tfrecords(df, "s3://no-such-bucket-x/out")
    assert str(info.value) == (
        "cannot write to s3://no-such-bucket-x/out: Bucket 'no-such-bucket-x' not found. The bucket "
        "does not exist: check the bucket name in the URL (nothing here creates buckets; create "
        "it first).")
    bucket = s3_server.make_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=rf"^cannot write to s3://{bucket}/out: .*ACCESS_DENIED.*"
                                           r"refused the credentials: check AWS_ACCESS_KEY_ID"):
        formats.write_tfrecords(df, f"s3://{bucket}/out")


@pytest.mark.s3
def test_nonexistent_s3_key(s3_env):
    bucket = s3_env.make_bucket()
    with pytest.raises(StorageError, match=rf"s3://{bucket}/nothing/here does not exist"):
        feeders.parquet_dataset(f"s3://{bucket}/nothing/here")


def test_hdfs_without_libhdfs(monkeypatch):
    for var in ("ARROW_LIBHDFS_DIR", "HADOOP_HOME", "JAVA_HOME", "CLASSPATH"):
        monkeypatch.delenv(var, raising=False)
    for reader in (feeders.parquet_dataset, feeders.tfrecord_dataset):
        with pytest.raises(StorageError) as info:
            reader("hdfs://namenode:8020/data/train")
        msg = str(info.value)
        assert "cannot open hdfs://namenode:8020/data/train" in msg
        assert "ARROW_LIBHDFS_DIR" in msg and "HADOOP_HOME" in msg
        assert "JAVA_HOME is not set" in msg
        assert "export CLASSPATH=$(hadoop classpath --glob)" in msg


def test_values_survive_the_error_paths(tmp_path):
    """After all that: a clean file reads back exactly (guards against over-eager checks)."""
    table = numeric_table(50)
    pq.write_table(table, tmp_path / "ok.parquet", row_group_size=7)
    got = np.concatenate([b["id"].numpy() for b in feeders.parquet_dataset(tmp_path, batch_size=16)])
    assert got.tolist() == list(range(50))
