"""Spark ML vector columns as arrays, so they cross into Arrow and TensorFlow like any array.

A ``VectorUDT`` column (what ``VectorAssembler``, ``StandardScaler`` and most Spark ML stages
write) reaches Arrow as a struct of (type, size, indices, values), which no tensor can hold. Every
job here that reads a DataFrame's rows (push, inference, TFRecord export) first turns such a
column into ``array<double>`` with Spark's own ``vector_to_array``: sparse vectors become dense,
values stay exact (float64). To push half the bytes, convert the column yourself first:
``df.withColumn("features", vector_to_array("features", "float32"))``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["vector_columns", "vector_as_array", "dense_vectors"]


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
