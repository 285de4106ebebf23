"""Bad input to the TFRecord export and import jobs: ``formats.write_tfrecords``,
``formats.read_tfrecords`` and ``formats.parquet_to_tfrecords``.

Errors a task meets (a null inside a list) come back from the call as the same type a driver
check raises, and no output is left behind.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

import formats
from dataplane.errors import RecordError, SchemaError, StorageError
from tests.badinput.catalogue import Case, Env, bad, check, params, spark_usable
from tests.builders import numeric_table

WT, RT, PT = "formats.write_tfrecords", "formats.read_tfrecords", "formats.parquet_to_tfrecords"


def _wt(sql: str | None = None, *, df=None, **kw):
    """write_tfrecords of a DataFrame made from SQL (or by ``df(spark)``) into ``out``."""

    def build(env: Env):
        frame = df(env.spark) if df else env.spark.sql(sql)
        if df is _exists:
            (env.dir("out") / "keep.txt").write_text("someone's data")
        return lambda: formats.write_tfrecords(frame, str(env.tmp / "out"), **kw)

    return build


def _rt(make, **kw):
    def build(env: Env):
        spark, src = env.spark, str(make(env))  # made before the clock starts
        return lambda: formats.read_tfrecords(spark, src, **kw)

    return build


def _pt(make, **kw):
    def build(env: Env):
        spark, src = env.spark, str(make(env))
        return lambda: formats.parquet_to_tfrecords(spark, src, str(env.tmp / "out"), **kw)

    return build


def _nothing_written(env: Env) -> None:
    assert not (env.tmp / "out").exists()
    spark_usable(env)


def _exists(spark):
    """A DataFrame to write into an ``out`` that already holds a file (found by cwd-free path
    in the builder: see ``_wt``)."""
    return spark.range(3)


def _kept(env: Env) -> None:
    assert (env.tmp / "out" / "keep.txt").read_text() == "someone's data"


NULL_ELEMENT_SQL = "SELECT id, array(1.0f, IF(id = 2, NULL, 2.0f)) AS v FROM range(4)"

CASES = [
    # ------------------------------------------------------------------ write_tfrecords
    Case(WT, "map-column", _wt("SELECT 1 AS id, map('a', 1) AS m"), SchemaError,
         ("'m'", "map", "map_keys()"), within=60, after=_nothing_written),
    Case(WT, "interval-column", _wt("SELECT 1 AS id, INTERVAL 1 DAY AS i"), SchemaError,
         ("'i'", "duration", "Cast it"), within=60, after=_nothing_written),
    Case(WT, "decimal-column", _wt("SELECT CAST(1.5 AS DECIMAL(10, 2)) AS price"), SchemaError,
         ("'price'", "decimal", "cast('double')"), within=60, after=_nothing_written),
    Case(WT, "zero-column-dataframe", _wt(df=lambda s: s.range(3).select()), SchemaError,
         ("no columns", "df.select("), within=60, after=_nothing_written),
    Case(WT, "null-inside-a-list", _wt(NULL_ELEMENT_SQL), SchemaError,
         ("partition", "'v'", "1 null element(s)", "coalesce(x, 0)"), within=180, after=_nothing_written),
    # a double beyond float32's range: an Example's floats are float32, so it would become inf
    Case(WT, "double-beyond-float32", _wt("SELECT id, IF(id = 3, 1e300D, id / 3.0D) AS price FROM range(4)"),
         SchemaError, ("partition", "column 'price' holds 1e+300, beyond float32's range", "Parquet"),
         within=180, after=_nothing_written),
    Case(WT, "unknown-compression", _wt("SELECT 1 AS id", compression="lz4"), ValueError,
         ("'lz4'", "GZIP"), within=60),
    Case(WT, "num-files-zero", _wt("SELECT 1 AS id", num_files=0), ValueError, ("num_files", "got 0"), within=60),
    Case(WT, "mode-unknown", _wt("SELECT 1 AS id", mode="append"), ValueError, ("mode", "'append'"), within=60),
    Case(WT, "output-not-empty", _wt(df=_exists), StorageError, ("out", "already exists", "overwrite"),
         within=60, after=lambda env: _kept(env)),
    Case(WT, "not-a-dataframe", lambda env: lambda: formats.write_tfrecords(numeric_table(3), str(env.tmp / "out")),
         TypeError, ("Spark DataFrame", "got pyarrow.lib.Table", "spark.createDataFrame(table.to_pandas())",
                     "parquet_to_tfrecords"), within=60),
    # ------------------------------------------------------------------ read_tfrecords
    Case(RT, "missing-path", _rt(lambda env: env.tmp / "nope"), StorageError, ("nope", "does not exist"), within=60),
    Case(RT, "corrupt-record", _rt(lambda env: bad.corrupt_tfrecord(env.dir("d"))), RecordError,
         ("part-00000.tfrecord", "corrupt record at byte offset 0", "rewrite it"), within=60),
    Case(RT, "zero-byte-file-no-schema", _rt(lambda env: bad.empty_file(env.dir("d"), "part-0.tfrecord")),
         SchemaError, ("no records to infer a schema from", "pass schema="), within=60),
    Case(RT, "corrupt-record-with-schema", _rt(lambda env: bad.corrupt_tfrecord(env.dir("d")),
                                               schema=numeric_table(1).select(["id", "f0"]).schema),
         RecordError, ("part-00000.tfrecord", "corrupt record at byte offset 0"), within=60),
    Case(RT, "schema-type-differs-from-records", _rt(lambda env: bad.tfrecords(env.dir("d"), numeric_table(3)),
                                                     schema=pa.schema([("id", pa.string())])),
         SchemaError, ("part-00000.tfrecord", "'id'", "int64_list", "bytes_list"), within=60),
    Case(RT, "ragged-rows-declared-dense", _rt(lambda env: bad.tfrecords(env.dir("d"), pa.table(
        {"v": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32()))})), schema=pa.schema([("v", pa.list_(pa.float32(), 2))])),
         RecordError, ("record 1", "'v'", "shape (2,)", "ragged"), within=60),
    Case(RT, "schema-of-wrong-type", _rt(lambda env: bad.tfrecords(env.dir("d"), numeric_table(3)), schema={"id": 1}),
         ValueError, ("schema must be", "got dict"), within=60),
    Case(RT, "schema-file-missing", _rt(lambda env: bad.tfrecords(env.dir("d"), numeric_table(3)),
                                        schema="/nonexistent/_tf_schema.json"),
         StorageError, ("/nonexistent/_tf_schema.json", "pass schema="), within=60),
    # ------------------------------------------------------------------ parquet_to_tfrecords
    Case(PT, "schema-drift-between-files", _pt(lambda env: bad.drift(env.dir("d"))), SchemaError,
         ("part-1.parquet", "'x'", "string", "bigint", "part-0.parquet", "cast the column"),
         within=60, after=_nothing_written),
    Case(PT, "double-beyond-float32", _pt(lambda env: bad.parquet(env.dir("d"), pa.table(
        {"v": pa.array([[1.0, 2.0], [3.0, -1e300]], pa.list_(pa.float64()))}))), SchemaError,
         ("a.parquet", "column 'v' holds -1e+300, beyond float32's range", "Scale the column"),
         within=60, after=_nothing_written),
    # and one too small for float32: written as 0 without a word, where 1e300 was refused
    Case(PT, "double-below-float32", _pt(lambda env: bad.parquet(env.dir("d"), pa.table(
        {"v": pa.array([0.0, 1e-50, -2.5, 0.0], pa.float64())}))), SchemaError,
         ("a.parquet", "column 'v' holds 1e-50, too small for float32", "written as 0",
          "col('v').cast('float')"), within=60, after=_nothing_written),
    Case(PT, "missing-source", _pt(lambda env: env.tmp / "nope"), StorageError, ("nope", "does not exist"), within=60),
    Case(PT, "not-a-parquet-file", _pt(lambda env: bad.not_parquet(env.dir("d"))), StorageError,
         ("a.parquet", "cannot read it as Parquet"), within=60, after=_nothing_written),
    Case(PT, "zero-column-files", _pt(lambda env: bad.parquet(env.dir("d"), pa.table({}))), SchemaError,
         ("no columns", "a.parquet"), within=60, after=_nothing_written),
    Case(PT, "map-column", _pt(lambda env: bad.parquet(env.dir("d"), pa.table(
        {"m": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64()))}))), SchemaError,
         ("'m'", "map_keys()"), within=60, after=_nothing_written),
    Case(PT, "null-inside-a-list", _pt(lambda env: bad.parquet(env.dir("d"), pa.table(
        {"id": [0, 1], "v": pa.array([[1.0], [1.0, None]], pa.list_(pa.float32()))}))), SchemaError,
         ("a.parquet", "'v'", "1 null element(s)", "coalesce(x, 0)"), within=180, after=_nothing_written),
    Case(PT, "partition-keys-differ", _pt(lambda env: (bad.parquet(env.dir("d/a=1/b=2"), numeric_table(3)),
                                                        bad.parquet(env.dir("d/a=1"), numeric_table(3)))
                                       and env.tmp / "d"),
         SchemaError, ("a.parquet", "partition keys", "must sit under the same key=value directories"),
         within=60, after=_nothing_written),
    Case(PT, "mode-unknown", _pt(lambda env: bad.parquet(env.dir("d"), numeric_table(3)), mode="append"),
         ValueError, ("mode", "'append'"), within=60),
]


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case: Case, request, tmp_path):
    check(case, Env(request, tmp_path))
