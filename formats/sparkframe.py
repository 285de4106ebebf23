"""A Spark DataFrame made fit for the ``mapInArrow`` jobs here (push, inference, predict, export).

**Spark ML vectors.** A ``VectorUDT`` column (what ``VectorAssembler``, ``StandardScaler`` and
most Spark ML stages write) reaches Arrow as a struct of (type, size, indices, values), which no
tensor can hold. Every job that reads a DataFrame's rows first turns such a column into
``array<double>`` with Spark's own ``vector_to_array``: sparse vectors become dense, values stay
exact (float64). To push half the bytes, convert the column yourself first:
``df.withColumn("features", vector_to_array("features", "float32"))``.

**Column names.** ``DataFrame.mapInArrow`` resolves every column by name, and a name with a dot
(``sepal.length``; the ``parent.child`` columns of a flattened export) resolves as a struct
field, so the job fails before it starts (pyspark 3.5 and 4). :func:`map_in_arrow` runs such a
job on positional stand-in names and gives the function its batches under the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pyarrow as pa

__all__ = ["vector_columns", "vector_as_array", "dense_vectors", "map_in_arrow", "not_a_spark_frame"]


def not_a_spark_frame(obj: Any) -> str:
    """What ``obj`` is, for an error saying a Spark DataFrame was expected, and how to get one
    from it (pandas and pandas-on-Spark frames are both called ``DataFrame``)."""
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.startswith("pyspark.pandas"):
        return f"{name} (pandas-on-Spark); pass its .to_spark()"
    if cls.__module__.startswith("pandas"):
        return f"{name}; make it a Spark DataFrame with spark.createDataFrame(pdf)"
    if cls.__module__.startswith("pyarrow"):
        return f"{name}; make it a Spark DataFrame with spark.createDataFrame(table.to_pandas())"
    if cls.__module__.startswith("pyspark") and "RDD" in cls.__name__:
        return f"{name}; pass rdd.toDF() (dataplane.compat.TFCluster takes RDDs as TFoS did)"
    return name


def vector_columns(spark_schema: Any) -> list[str]:
    """Top-level columns of ``spark_schema`` (a ``StructType``) that hold Spark ML vectors
    (``pyspark.ml.linalg.VectorUDT`` or the older ``pyspark.mllib.linalg.VectorUDT``)."""
    return [f.name for f in spark_schema.fields if type(f.dataType).__name__ == "VectorUDT"]


def vector_as_array(name: str) -> Any:
    """The Spark column expression for vector column ``name`` as ``array<double>``; a null
    vector stays null (``vector_to_array`` alone fails the task on one)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    col = F.col(f"`{name}`")
    return F.when(col.isNull(), F.lit(None)).otherwise(vector_to_array(col))


def dense_vectors(df: Any) -> Any:
    """``df`` with every vector column replaced, in place, by ``array<double>``; ``df``
    itself when it has none (no new DataFrame, no Spark call)."""
    names = vector_columns(df.schema)
    if not names:
        return df
    return df.withColumns({n: vector_as_array(n) for n in names})


@dataclass
class _RealNames:
    """The ``mapInArrow`` function ``fn``, handed its batches under ``names`` (by position)."""

    fn: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
    names: list[str]

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return self.fn(pa.RecordBatch.from_arrays(b.columns, names=self.names) for b in batches)


def map_in_arrow(df: Any, fn: Any, schema: Any, **kwargs: Any) -> Any:
    """``df.mapInArrow(fn, schema, **kwargs)``, also when a column name holds a dot or a
    backtick (see the module docstring); ``fn`` sees the real names either way."""
    names = list(df.columns)
    if not any("." in n or "`" in n for n in names):
        return df.mapInArrow(fn, schema, **kwargs)
    stand_in = df.toDF(*[f"_dataplane_col{i}" for i in range(len(names))])
    return stand_in.mapInArrow(_RealNames(fn, names), schema, **kwargs)


def read_parquet(spark: Any, path: str) -> Any:
    """``spark.read.parquet`` over the files our readers take (:func:`formats.fs.parquet_files`):
    where a non-Parquet file (a README) sits beside ``*.parquet`` files, Spark would fail on it,
    so the Parquet files are named one by one. ``basePath`` is set where needed (those named
    files, a glob) so that ``key=value`` directories give the partition columns ours give.

    Only for paths Spark's own filesystems open (local, ``file://``, ``hdfs://``, ``s3a://``).
    """
    from formats.fs import list_files, listing_root, parquet_files, resolve

    loc = resolve(path)
    listed = list_files(loc)
    files = parquet_files(loc, listed)
    if loc.scheme == "file":
        prefix = "file://"
    else:
        scheme, rest = loc.url.split("://", 1)
        netloc = rest.split("/", 1)[0]
        prefix = f"{scheme}://" if loc.scheme == "s3" else f"{scheme}://{netloc}"
    root = listing_root(loc)
    named = len(files) != len(listed)
    reader = spark.read
    if named or root != loc.path:
        reader = reader.option("basePath", prefix + root)
    if named:
        return reader.parquet(*[prefix + f for f in files])
    return reader.parquet(prefix + loc.path)
