"""TensorFlowOnSpark's ``dfutil``: DataFrames to and from TFRecords of ``tf.train.Example``.

``saveAsTFRecords`` is :func:`formats.write_tfrecords` (files ``part-NNNNN.tfrecord`` plus a
schema file, written by a Spark job without the Hadoop TFRecord jar TFoS needs).
``loadTFRecords`` reads with :func:`formats.read_tfrecords` and types the columns by TFoS's rules,
from the first record: ``int64_list`` -> bigint, ``float_list`` -> double, ``bytes_list`` ->
string (binary for the names in ``binary_features``); a feature with more than one value in that
record -> an array of that type; columns sorted by name.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Sequence

__all__ = [
    "isLoadedDF",
    "saveAsTFRecords",
    "loadTFRecords",
    "toTFExample",
    "infer_schema",
    "fromTFExample",
]

logger = logging.getLogger(__name__)

#: DataFrames made by loadTFRecords -> the directory they were read from (TFoS's ``loadedDF``).
loadedDF: dict[Any, str] = {}


def isLoadedDF(df: Any) -> bool:
    """True if ``df`` was returned by :func:`loadTFRecords` (TFoS's pipeline uses it)."""
    return df in loadedDF


def saveAsTFRecords(df: Any, output_dir: str) -> None:
    """Write ``df`` as TFRecord files of ``tf.train.Example`` in ``output_dir``.

    Raises:
        StorageError: ``output_dir`` exists and is not empty (as Hadoop's output format refuses).
        SchemaError: a column TF cannot hold.
    """
    from dataplane.errors import StorageError
    from formats.export import write_tfrecords

    try:
        result = write_tfrecords(df, output_dir)
    except StorageError as exc:
        if "already exists and is not empty" not in str(exc):
            raise
        # write_tfrecords' own fix (mode='overwrite') is no argument of this TFoS function
        raise StorageError(
            f"saveAsTFRecords: {output_dir} already exists and is not empty; as in TFoS (Hadoop's "
            f"output format), it is not overwritten. Remove it first or choose a new path, or "
            f"replace it with formats.write_tfrecords(df, path, mode='overwrite')."
        ) from exc
    logger.info("saveAsTFRecords: %s", result)


def _first_record(input_dir: str) -> bytes:
    from formats.export import _compression_of
    from formats.fs import list_files, resolve
    from formats.tfrecord import iter_records, open_compressed

    loc = resolve(input_dir)
    for path in list_files(loc):
        with loc.filesystem.open_input_stream(path, compression=None) as raw:
            for rec in iter_records(open_compressed(raw, _compression_of(path, None)), name=path):
                return rec
    from dataplane.errors import SchemaError

    raise SchemaError(
        f"loadTFRecords: {input_dir} holds no record to infer the columns from; TFoS needs one "
        f"too. Read an empty export with formats.read_tfrecords(spark, path)."
    )


def loadTFRecords(sc: Any, input_dir: str, binary_features: Sequence[str] = ()) -> Any:
    """Read TFRecords of ``tf.train.Example`` into a DataFrame, typed by TFoS's rules.

    Args:
        sc: the SparkContext (or a SparkSession).
        input_dir: a directory of TFRecord files (or one file); local, ``file://``, ``s3://``,
            ``hdfs://``.
        binary_features: ``bytes_list`` features to load as binary instead of string.
    """
    from pyspark.sql import SparkSession

    from formats.export import read_tfrecords, spark_arrow_schema

    from formats.example_decode import NotTextError

    spark = sc if hasattr(sc, "createDataFrame") else SparkSession.builder.getOrCreate()
    schema = _schema_of_record(_first_record(input_dir), list(binary_features))
    try:
        df = read_tfrecords(spark, input_dir, schema=spark_arrow_schema(schema))
    except NotTextError as exc:  # read_tfrecords' fix (schema=) is no argument here
        raise exc.with_fix(f"loadTFRecords(sc, path, binary_features=[{exc.column!r}])") from exc
    loadedDF[df] = input_dir
    return df


def _schema_of_record(record: bytes, binary_features: Sequence[str]) -> Any:
    """:func:`infer_schema` of one serialized Example, decoded without TensorFlow."""
    from pyspark.sql import types as T

    from formats.example_decode import infer_specs

    base = {"int64": T.LongType(), "float32": T.FloatType(), "string": T.StringType()}
    fields = []
    for spec in sorted(infer_specs([record], name="the first record"), key=lambda s: s.name):
        if spec.name in binary_features:
            fields.append(T.StructField(spec.name, T.BinaryType(), True))
            continue
        kind = base.get(spec.dtype, T.StringType())
        kind = T.DoubleType() if isinstance(kind, T.FloatType) else kind
        kind = kind if spec.shape == () else T.ArrayType(kind)
        fields.append(T.StructField(spec.name, kind, True))
    return T.StructType(fields)


def infer_schema(example: Any, binary_features: Sequence[str] = ()) -> Any:
    """The Spark ``StructType`` TFoS gives a ``tf.train.Example`` (see the module docstring)."""
    from pyspark.sql import types as T

    fields = []
    for name, feature in sorted(example.features.feature.items()):
        if name in binary_features:
            fields.append(T.StructField(name, T.BinaryType(), True))
            continue
        if feature.int64_list.value:
            values, base = feature.int64_list.value, T.LongType()
        elif feature.float_list.value:
            values, base = feature.float_list.value, T.DoubleType()
        else:
            values, base = feature.bytes_list.value, T.StringType()
        fields.append(T.StructField(name, T.ArrayType(base) if len(values) > 1 else base, True))
    return T.StructType(fields)


def fromTFExample(iter: Iterable[Any], binary_features: Sequence[str] = ()) -> list[Any]:
    """``mapPartitions`` function: ``(serialized Example, None)`` pairs (or plain bytes) -> Rows."""
    import tensorflow as tf
    from pyspark.sql import Row

    def value(name: str, feature: Any) -> Any:
        if feature.int64_list.value:
            values = list(feature.int64_list.value)
        elif feature.float_list.value:
            values = list(feature.float_list.value)
        elif name in binary_features:
            return bytearray(feature.bytes_list.value[0])
        elif feature.bytes_list.value:
            return feature.bytes_list.value[0].decode("utf-8")
        else:
            return None
        return values if len(values) > 1 else values[0]

    rows = []
    for record in iter:
        data = record[0] if isinstance(record, tuple) else record
        example = tf.train.Example()
        example.ParseFromString(bytes(data))
        rows.append(Row(**{k: value(k, f) for k, f in sorted(example.features.feature.items())}))
    return rows


def toTFExample(dtypes: Sequence[tuple[str, str]]) -> Any:
    """A ``mapPartitions`` function: Rows of a DataFrame with ``dtypes`` -> ``(bytearray of a
    serialized Example, None)`` pairs, TFoS's record layout."""
    return _ToExample(list(dtypes))


class _ToExample:
    _FLOAT = ("float", "double")
    _INT = ("boolean", "tinyint", "smallint", "int", "bigint", "long")
    _BYTES = ("binary", "string")

    def __init__(self, dtypes: list[tuple[str, str]]) -> None:
        self.dtypes = dtypes

    def _feature(self, tf: Any, dtype: str, value: Any) -> Any:
        base = dtype[len("array<"):-1] if dtype.startswith("array<") else dtype
        values = list(value) if dtype.startswith("array<") else [value]
        if base in self._FLOAT:
            return tf.train.Feature(float_list=tf.train.FloatList(value=values))
        if base in self._INT:
            return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        if base in self._BYTES and not dtype.startswith("array<"):
            data = bytes(value) if base == "binary" else str(value).encode("utf-8")
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
        from dataplane.errors import SchemaError

        raise SchemaError(
            f"toTFExample: column type {dtype} has no tf.train.Feature (numbers, strings, "
            f"binary and arrays of numbers do); cast the column first."
        )

    def __call__(self, rows: Iterator[Any]) -> list[tuple[bytearray, None]]:
        import tensorflow as tf

        out = []
        for row in rows:
            features = {n: self._feature(tf, d, row[n]) for n, d in self.dtypes}
            example = tf.train.Example(features=tf.train.Features(feature=features))
            out.append((bytearray(example.SerializeToString()), None))
        return out
