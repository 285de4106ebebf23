"""The ways data reaches a TF node: Spark push, the node-side tf.data source, pull readers,
and adapters for Petastorm and tensorflow-io.

Importing this package imports neither TensorFlow nor Spark.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "parquet_dataset",
    "tfrecord_dataset",
    "petastorm_dataset",
    "tfio_parquet_dataset",
]

_LAZY = {
    "parquet_dataset": "feeders.parquet",
    "tfrecord_dataset": "feeders.tfrecord",
    "petastorm_dataset": "feeders.petastorm",
    "tfio_parquet_dataset": "feeders.tfio",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'feeders' has no attribute {name!r}")
