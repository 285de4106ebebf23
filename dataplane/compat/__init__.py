"""TensorFlowOnSpark 2.2.5's TF 2 API on this project's data plane: migrating is renaming imports.

::

    from tensorflowonspark import TFCluster, TFNode, compat, dfutil     # before
    from dataplane.compat import TFCluster, TFNode, compat, dfutil      # after
    from tensorflowonspark.pipeline import TFEstimator, TFModel         # before
    from dataplane.compat.pipeline import TFEstimator, TFModel          # after

Modules, as in TFoS: :mod:`~dataplane.compat.TFCluster` (``run``, ``InputMode``, the cluster's
``train`` / ``inference`` / ``shutdown``), :mod:`~dataplane.compat.TFNode` (``DataFeed``,
``hdfs_path``), :mod:`~dataplane.compat.compat` (``export_saved_model``, ``disable_auto_shard``,
``is_gpu_available``), :mod:`~dataplane.compat.TFParallel` (``run``),
:mod:`~dataplane.compat.dfutil` (``loadTFRecords``, ``saveAsTFRecords``, ``isLoadedDF``) and
:mod:`~dataplane.compat.pipeline` (``TFEstimator``, ``TFModel``).

Underneath, ``TFCluster.run`` is :func:`dataplane.run`, RDDs travel as Arrow over Flight, and
TFRecords are written and read by :mod:`formats`. TensorFlow 1-only functions raise an error
naming the TF 2 replacement. ``examples/tfos_migration/README.md`` lists every public name of
TFoS 2.2.5 and its status here.
"""

from __future__ import annotations

import importlib
from typing import Any

from dataplane.compat import TFCluster, TFNode, TFParallel, compat
from dataplane.compat.TFCluster import InputMode, rdd_to_dataframe
from dataplane.compat.TFNode import DataFeed, TFNodeContext

__all__ = [
    "TFCluster",
    "TFNode",
    "TFParallel",
    "compat",
    "dfutil",
    "pipeline",
    "InputMode",
    "DataFeed",
    "TFNodeContext",
    "rdd_to_dataframe",
]


def __getattr__(name: str) -> Any:
    # dfutil and pipeline pull in pyspark.sql / pyspark.ml: load them when asked for
    if name in ("dfutil", "pipeline"):
        module = importlib.import_module(f"dataplane.compat.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'dataplane.compat' has no attribute {name!r}")
