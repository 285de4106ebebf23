"""spark-tf-dataplane: TensorFlow on Spark with an Arrow Flight data plane.

Importing this package is cheap: it imports neither TensorFlow nor Spark. The names below are
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from dataplane.errors import (
    ClusterStateError,
    DataplaneError,
    FeedError,
    NodeError,
    NodeSchemaError,
    RecordError,
    ReservationError,
    SchemaError,
    StackError,
    StorageError,
)
from dataplane.topology import NodeInfo

__all__ = [
    "run",
    "Cluster",
    "NodeInfo",
    "FeedReport",
    "NodeContext",
    "tune",
    "predict",
    "ml",
    "compat",
    "DataplaneError",
    "SchemaError",
    "RecordError",
    "StorageError",
    "StackError",
    "ReservationError",
    "NodeError",
    "NodeSchemaError",
    "FeedError",
    "ClusterStateError",
]

_LAZY = {
    "run": ("dataplane.driver.startup", "run"),
    "Cluster": ("dataplane.driver.cluster", "Cluster"),
    "FeedReport": ("dataplane.driver.feed", "FeedReport"),
    "NodeContext": ("dataplane.node.context", "NodeContext"),
    "tune": ("dataplane.workloads.tuning", "tune"),
    "predict": ("dataplane.workloads.batch_predict", "predict"),
    "ml": ("dataplane.ml", None),
    "compat": ("dataplane.compat", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dataplane' has no attribute {name!r}")
