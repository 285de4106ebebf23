"""Bad input to the pull readers, ``feeders.parquet_dataset`` and ``feeders.tfrecord_dataset``.

No Spark. The detailed behaviours these rows rest on (a corrupt record deep in a file, S3
credentials, HDFS without libhdfs) are in ``tests/feeders/test_bad_inputs.py``.
"""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pytest

import feeders
from dataplane.errors import RecordError, SchemaError, StorageError
from tests.badinput.catalogue import Case, Env, bad, check, params
from tests.builders import numeric_table

NULLS = pa.table({"id": [0, 1, 2], "x": pa.array([1.5, None, 3.0], pa.float32())})
RAGGED = pa.table({"id": [0, 1], "v": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32()))})
OK = numeric_table(10).select(["id", "f0"])


def _pq(table: pa.Table, **kw):
    def build(env: Env):
        path = bad.parquet(env.dir("d"), table)  # made before the clock starts
        return lambda: feeders.parquet_dataset(path, **kw)

    return build


def _tf(table: pa.Table, **kw):
    def build(env: Env):
        path = bad.tfrecords(env.dir("d"), table)
        return lambda: feeders.tfrecord_dataset(path, **kw)

    return build


def _at(make, reader, **kw):
    """``reader(make(env), **kw)``, the bad path made when the row is built."""

    def build(env: Env):
        path = make(env)
        return lambda: reader(path, **kw)

    return build


def _fill_fixes_it(reader, value):
    """After a null-without-fill error: the fix the message gives works."""

    def after(env: Env) -> None:
        batch = next(iter(reader(env.tmp / "d", fill_values={"x": value})))
        assert batch["x"].numpy().tolist() == [1.5, value, 3.0]

    return after


PQ = "feeders.parquet_dataset"
TF = "feeders.tfrecord_dataset"

CASES = [
    # ------------------------------------------------------------------ parquet: types
    Case(PQ, "decimal-column", _pq(pa.table({"id": [1], "price": pa.array([Decimal("1.50")])})),
         SchemaError, ("'price'", "decimal", "cast('double')")),
    Case(PQ, "map-column", _pq(pa.table({"id": [1], "m": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64()))})),
         SchemaError, ("'m'", "map", "map_keys()")),
    Case(PQ, "struct-column", _pq(pa.table({"id": [1], "s": [{"a": 1}]})),
         SchemaError, ("'s'", "struct", "df.select('s.*')")),
    # how Spark writes a VectorAssembler column to Parquet: the struct's fields are no features
    Case(PQ, "spark-ml-vector-column", _pq(pa.table({"id": [1], "features": pa.array(
        [{"type": 1, "size": None, "indices": None, "values": [0.5, 1.5]}],
        pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                   ("values", pa.list_(pa.float64()))]))})),
         SchemaError, ("'features'", "Spark ML vector", "vector_to_array('features', 'float32')")),
    Case(PQ, "duration-column", _pq(pa.table({"id": [1], "t": pa.array([1], pa.duration("s"))})),
         SchemaError, ("'t'", "duration[s]", "Cast it")),
    # ------------------------------------------------------------------ parquet: nulls
    Case(PQ, "null-without-fill", _pq(NULLS), SchemaError,
         ("'x'", "1 null value(s)", "a.parquet", "fill_values={'x': 0}"),
         after=_fill_fixes_it(feeders.parquet_dataset, -1.0)),
    # accepted, then the read failed with "Value 1099511627776 too large to fit in C integer type"
    Case(PQ, "null-fill-beyond-the-column-s-type",
         _pq(pa.table({"i": pa.array([1, None], pa.int32())}), fill_values={"i": 2**40}), SchemaError,
         ("fill value 1099511627776", "'i'", "beyond its type int32", "-2147483648 to 2147483647")),
    Case(PQ, "null-fill-of-wrong-type", _pq(NULLS, fill_values={"x": "abc"}), SchemaError,
         ("'abc'", "'x'", "float32", "give a number")),
    Case(PQ, "fill-for-unknown-column", _pq(NULLS, fill_values={"nope": 0}), SchemaError,
         ("'nope'", "['id', 'x']")),
    Case(PQ, "fill-values-not-a-dict", _pq(NULLS, fill_values=0), ValueError,
         ("fill_values must be a dict", "int 0")),
    # ------------------------------------------------------------------ parquet: empty
    Case(PQ, "zero-column-file", _pq(pa.table({})), SchemaError,
         ("no columns", "a.parquet", "at least one column")),
    Case(PQ, "columns-empty-list", _pq(OK, columns=[]), ValueError, ("columns=[]", "columns=None")),
    Case(PQ, "zero-byte-file",
         _at(lambda env: bad.empty_file(env.dir("d"), "part-00000.parquet"), feeders.parquet_dataset),
         StorageError, ("part-00000.parquet", "not a readable Parquet file", "Remove it")),
    # ------------------------------------------------------------------ parquet: shapes
    Case(PQ, "ragged-rows-declared-dense", _pq(RAGGED, shapes={"v": [2]}), Exception,
         ("SchemaError", "'v'", "dense shape (2,)", "row 1", "ragged"), stage="iterate"),
    Case(PQ, "shape-not-a-list", _pq(RAGGED, shapes={"v": 2}), ValueError, ("shapes['v']", "2", "[28, 28]")),
    Case(PQ, "shape-on-a-scalar", _pq(RAGGED, shapes={"id": [3]}), SchemaError,
         ("'id'", "is a scalar", "(3,)")),
    # ------------------------------------------------------------------ parquet: files
    Case(PQ, "schema-drift-between-files", _at(lambda env: bad.drift(env.dir("d")), feeders.parquet_dataset),
         SchemaError, ("'x'", "int64", "part-0.parquet", "string", "part-1.parquet", "cast the column")),
    Case(PQ, "missing-path", _at(lambda env: env.tmp / "nope", feeders.parquet_dataset),
         StorageError, ("nope", "does not exist", "check the path")),
    Case(PQ, "directory-without-data", _at(lambda env: bad.empty_file(env.dir("d"), "_SUCCESS"), feeders.parquet_dataset),
         StorageError, ("no data files", "check the path")),
    Case(PQ, "not-a-parquet-file", _at(lambda env: bad.not_parquet(env.dir("d")), feeders.parquet_dataset),
         StorageError, ("a.parquet", "not a readable Parquet file")),
    Case(PQ, "parquet-cut-short", _at(lambda env: bad.cut_short(env.dir("d"), OK), feeders.parquet_dataset),
         StorageError, ("a.parquet", "not a readable Parquet file", "no footer", "partially written")),
    Case(PQ, "tfrecord-directory", _at(lambda env: bad.tfrecords(env.dir("d"), OK), feeders.parquet_dataset),
         StorageError, ("part-00000.tfrecord", "not a readable Parquet file", "It is a TFRecord file",
                        "feeders.tfrecord_dataset")),
    Case(PQ, "corrupt-page-data", _at(lambda env: _damaged_pages(env.dir("d")), feeders.parquet_dataset),
         Exception, ("StorageError", "a.parquet", "damaged", "rewrite it"), stage="iterate"),
    Case(PQ, "unsupported-url-scheme", lambda env: lambda: feeders.parquet_dataset("gs://bucket/data"),
         StorageError, ("'gs'", "gs://bucket/data", "filesystem=")),
    # ------------------------------------------------------------------ parquet: arguments
    Case(PQ, "label-not-a-column", _pq(OK, label="nope"), SchemaError, ("'nope'", "not in the data", "['id', 'f0']")),
    Case(PQ, "column-not-in-data", _pq(OK, columns=["id", "nope"]), SchemaError, ("'nope'", "not in the data")),
    Case(PQ, "batch-size-zero", _pq(OK, batch_size=0), ValueError, ("batch_size", "got 0")),
    Case(PQ, "shard-out-of-range", _pq(OK, shard=(2, 2)), ValueError, ("shard index", "[0, 2)", "got 2")),
    Case(PQ, "prefetch-negative", _pq(OK, prefetch=-5), ValueError, ("prefetch", "-5", "AUTOTUNE")),
    # ------------------------------------------------------------------ tfrecord: records
    Case(TF, "corrupt-record", _at(lambda env: bad.corrupt_tfrecord(env.dir("d")), feeders.tfrecord_dataset),
         RecordError, ("part-00000.tfrecord", "corrupt record at byte offset 0", "rewrite it")),
    Case(TF, "truncated-file", _at(lambda env: bad.corrupt_tfrecord(env.dir("d"), truncate=True), feeders.tfrecord_dataset),
         RecordError, ("part-00000.tfrecord", "truncated record", "rewrite it")),
    Case(TF, "corrupt-record-with-schema",
         _at(lambda env: bad.corrupt_tfrecord(env.dir("d")), feeders.tfrecord_dataset, schema=OK.schema),
         RecordError, ("part-00000.tfrecord", "corrupt record at byte offset 0")),
    Case(TF, "zero-byte-file-no-schema",
         _at(lambda env: bad.empty_file(env.dir("d"), "part-00000.tfrecord"), feeders.tfrecord_dataset),
         SchemaError, ("every file is empty", "part-00000.tfrecord", "Pass schema=")),
    Case(TF, "missing-path", _at(lambda env: env.tmp / "nope", feeders.tfrecord_dataset),
         StorageError, ("nope", "does not exist")),
    Case(TF, "gzip-declared-for-plain-file", _tf(OK, compression="GZIP"), RecordError,
         ("part-00000.tfrecord", "not GZIP-compressed", "Not a gzipped file", "pass compression=None")),
    # ------------------------------------------------------------------ tfrecord: schema vs records
    Case(TF, "null-without-fill", _tf(NULLS, schema=NULLS.schema), SchemaError,
         ("part-00000.tfrecord", "record 1", "'x'", "fill_values={'x': 0}"),
         after=_fill_fixes_it(lambda p, **kw: feeders.tfrecord_dataset(p, schema=NULLS.schema, **kw), -1.0)),
    Case(TF, "null-without-fill-inferred", _tf(NULLS), SchemaError, ("record 1", "'x'", "fill_values=")),
    Case(TF, "null-fill-of-wrong-type", _tf(NULLS, schema=NULLS.schema, fill_values={"x": "abc"}),
         SchemaError, ("'abc'", "'x'", "give a number")),
    Case(TF, "schema-column-not-in-records", _tf(OK, schema=pa.schema([("id", pa.int64()), ("zz", pa.float32())])),
         SchemaError, ("'zz'", "absent from all", "['f0', 'id']", "columns=")),
    Case(TF, "schema-type-differs-from-records", _tf(OK, schema=pa.schema([("id", pa.string())])),
         SchemaError, ("'id'", "int64_list", "bytes_list", "right schema")),
    Case(TF, "ragged-rows-declared-dense", _tf(RAGGED, schema=pa.schema([("id", pa.int64()), ("v", pa.list_(pa.float32(), 2))])),
         RecordError, ("record 1", "'v'", "holds 1 values", "shape (2,)", "ragged")),
    Case(TF, "schema-drift-between-files", _at(lambda env: _tf_drift(env), feeders.tfrecord_dataset),
         SchemaError, ("'x'", "float_list", "bytes_list", "explicit schema")),
    Case(TF, "schema-of-wrong-type", _tf(OK, schema={"id": "int64"}), ValueError, ("pyarrow.Schema", "got dict")),
    # ------------------------------------------------------------------ tfrecord: arguments
    Case(TF, "label-not-a-column", _tf(OK, label="nope"), SchemaError, ("'nope'", "not in the records", "['f0', 'id']")),
    Case(TF, "columns-empty-list", _tf(OK, columns=[]), ValueError, ("columns=[]",)),
    Case(TF, "unknown-compression", _tf(OK, compression="LZ4"), ValueError, ("'LZ4'", "GZIP")),
    Case(TF, "sample-zero", _tf(OK, sample=0), ValueError, ("sample", "got 0")),
]


def _damaged_pages(d):
    """A Parquet file whose footer reads but whose first data pages are zeroed."""
    import pyarrow.parquet as pq

    pq.write_table(numeric_table(500), d / "a.parquet", compression="snappy")
    raw = bytearray((d / "a.parquet").read_bytes())
    raw[200:1200] = bytes(1000)
    (d / "a.parquet").write_bytes(bytes(raw))
    return d


def _tf_drift(env: Env):
    """Two TFRecord files whose feature 'x' is float in one and bytes in the other."""
    d = env.dir("drift")
    for i, table in enumerate([pa.table({"id": [0, 1], "x": [1.0, 2.0]}), pa.table({"id": [2], "x": ["s"]})]):
        sub = bad.tfrecords(env.dir(f"drift-src{i}"), table)
        for f in sub.iterdir():
            f.rename(d / f"{i}-{f.name}")
    return d


@pytest.fixture(scope="module", autouse=True)
def _tensorflow_loaded():
    """Import TensorFlow once, so the time bound measures the call, not the import."""
    import tensorflow  # noqa: F401


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case: Case, request, tmp_path):
    check(case, Env(request, tmp_path))
