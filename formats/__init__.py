"""Schemas and encodings: the Arrow <-> TF mapping, TFRecord framing, tf.train.Example coding.

Importing this package does not import TensorFlow or Spark; the functions that need them import
them when called.
"""

from __future__ import annotations

from typing import Any

from formats.schema import ColumnSpec, column_specs, tf_spec

__all__ = [
    "ColumnSpec",
    "column_specs",
    "tf_spec",
    "write_tfrecords",
    "read_tfrecords",
    "parquet_to_tfrecords",
]


def __getattr__(name: str) -> Any:
    # The export jobs pull in pyspark; load them only when asked for.
    if name in ("write_tfrecords", "read_tfrecords"):
        from formats import export

        return getattr(export, name)
    if name == "parquet_to_tfrecords":
        from formats import parquet_export

        return parquet_export.parquet_to_tfrecords
    raise AttributeError(f"module 'formats' has no attribute {name!r}")
