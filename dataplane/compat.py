"""TensorFlowOnSpark's API on this project's data plane, so TFoS programs move with few edits.

Migrating a TFoS program means changing its imports::

    from tensorflowonspark import TFCluster, TFNode     # before
    from dataplane.compat import TFCluster, TFNode      # after

and nothing else in the usual case: ``TFCluster.run(sc, map_fun, tf_args, num_executors, num_ps,
tensorboard, input_mode)``, ``cluster.train(rdd, num_epochs)``, ``cluster.inference(rdd)``,
``cluster.shutdown()`` on the driver; ``ctx.get_data_feed()`` / ``TFNode.DataFeed(ctx.mgr, ...)``
with ``next_batch``, ``batch_results``, ``should_stop`` and ``terminate`` on the nodes.

Underneath: ``run`` is :func:`dataplane.run`; ``train`` turns the RDD into a DataFrame (one column
per tuple field, arrays as array columns) and pushes it with ``cluster.train`` over Arrow Flight;
``inference`` goes through ``cluster.inference`` and returns an RDD of the node's results.

Differences from TFoS, each raising a clear error: no DStreams (use
:func:`dataplane.streaming.feed_stream`), no ``driver_ps_nodes``, no ``input_mapping``, no TF 1.x
helpers (``start_cluster_server``). Every element of a fed RDD must have the layout of the first
(same tuple length and field kinds); N-d array fields arrive flattened.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from dataplane.compat_node import DataFeed, TFNode, TFNodeContext, column_name
from dataplane.errors import ClusterStateError, SchemaError

__all__ = ["TFCluster", "TFNode", "TFNodeContext", "DataFeed", "InputMode"]

logger = logging.getLogger(__name__)


class InputMode:
    """How data reaches the nodes (TFoS's enum)."""

    TENSORFLOW = 0  #: the nodes read their own data (feeders.*, tf.data)
    SPARK = 1  #: the driver pushes RDD rows (cluster.train / cluster.inference)


class _CompatMain:
    """Runs a TFoS ``map_fun(args, ctx)`` with a TFoS-style ctx on a dataplane node."""

    def __init__(self, map_fun: Callable[[Any, Any], Any]) -> None:
        self.map_fun = map_fun

    def __call__(self, args: Any, ctx: Any) -> Any:
        return self.map_fun(args, TFNodeContext(ctx))


def _field_kind(value: Any, where: str) -> tuple[str, Any]:
    """(kind, Spark type) of one field value of an RDD element."""
    from pyspark.sql import types as T

    if isinstance(value, (bool, np.bool_)):
        return "num", T.BooleanType()
    if isinstance(value, (int, np.integer)):
        return "num", T.LongType()
    if isinstance(value, np.float32):
        return "num", T.FloatType()
    if isinstance(value, (float, np.floating)):
        return "num", T.DoubleType()
    if isinstance(value, str):
        return "str", T.StringType()
    if isinstance(value, (bytes, bytearray)):
        return "bin", T.BinaryType()
    if isinstance(value, (list, tuple, np.ndarray)):
        arr = np.asarray(value)
        if arr.dtype == np.float32:
            elem = T.FloatType()
        elif np.issubdtype(arr.dtype, np.floating):
            elem = T.DoubleType()
        elif np.issubdtype(arr.dtype, np.bool_):
            elem = T.BooleanType()
        elif np.issubdtype(arr.dtype, np.integer):
            elem = T.LongType()
        else:
            raise SchemaError(
                f"{where} is an array of {arr.dtype}; only numeric arrays can be fed. "
                f"Convert it to numbers in the RDD (rdd.map(...)) before cluster.train."
            )
        return "arr", T.ArrayType(elem, containsNull=False)
    raise SchemaError(
        f"{where} is a {type(value).__name__} ({value!r:.60}); feedable fields are numbers, "
        f"str, bytes and numeric lists/arrays. Map the RDD to those before cluster.train."
    )


class _Encoder:
    """Executor side: one RDD element -> one row tuple of plain Python values."""

    def __init__(self, layout: str, kinds: list[str], dtypes: list[Any]) -> None:
        self.layout = layout
        self.kinds = kinds
        self.dtypes = dtypes

    def __call__(self, element: Any) -> tuple:
        fields = list(element) if self.layout in ("tuple", "list") else [element]
        if len(fields) != len(self.kinds):
            raise SchemaError(
                f"an RDD element has {len(fields)} fields but the first element had "
                f"{len(self.kinds)}; every element fed to cluster.train needs the same layout."
            )
        out = []
        for value, kind, dtype in zip(fields, self.kinds, self.dtypes):
            if kind == "arr":
                out.append(np.asarray(value, dtype=dtype).ravel().tolist())
            elif kind == "num":
                out.append(value.item() if hasattr(value, "item") else value)
            elif kind == "bin":
                out.append(bytes(value))
            else:
                out.append(value)
        return tuple(out)


_NUMPY_OF = {"float": np.float32, "double": np.float64, "bigint": np.int64, "boolean": np.bool_}


def rdd_to_dataframe(spark: Any, rdd: Any) -> Any:
    """Turn an RDD of TFoS-style elements into the DataFrame pushed to the nodes.

    The column names record the element layout (see ``compat_node.column_name``) so the nodes
    rebuild each element as it was: a tuple, a list, or a single value.

    Raises:
        SchemaError: the RDD is empty or a field cannot be carried.
    """
    from pyspark.sql import types as T

    sample = rdd.take(1)
    if not sample:
        raise SchemaError("cluster.train/inference got an empty RDD; there is nothing to feed.")
    first = sample[0]
    if isinstance(first, tuple):
        layout, fields = "tuple", list(first)
    elif isinstance(first, list) and first and not all(
        isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in first
    ):
        layout, fields = "list", list(first)  # a record such as [label, "text", [pixels]]
    else:
        layout, fields = "value", [first]  # a scalar, or one numeric vector
    if not fields:
        raise SchemaError("the first RDD element is an empty tuple/list; nothing to feed.")
    kinds, types, dtypes = [], [], []
    for i, value in enumerate(fields):
        kind, spark_type = _field_kind(value, f"field {i} of the first RDD element")
        kinds.append(kind)
        types.append(spark_type)
        elem = spark_type.elementType if isinstance(spark_type, T.ArrayType) else None
        dtypes.append(_NUMPY_OF.get(elem.simpleString()) if elem is not None else None)
    schema = T.StructType([
        T.StructField(column_name(layout, i, k), t, nullable=False)
        for i, (k, t) in enumerate(zip(kinds, types))
    ])
    return spark.createDataFrame(rdd.map(_Encoder(layout, kinds, dtypes)), schema)


def _first_column(row: Any) -> Any:
    return row[0]


class TFCluster:
    """TFoS's ``TFCluster`` module and class in one: ``TFCluster.run(...)`` returns an instance.

    Attributes: ``sc``, ``num_executors``, ``input_mode``, ``cluster_id``, ``defaultFS``, and
    ``cluster`` (the underlying :class:`dataplane.Cluster`).
    """

    InputMode = InputMode

    def __init__(self, cluster: Any, spark: Any, *, num_executors: int, input_mode: int) -> None:
        self.cluster = cluster
        self.spark = spark
        self.sc = spark.sparkContext
        self.num_executors = num_executors
        self.input_mode = input_mode
        self.cluster_id = cluster.cluster_id
        self.defaultFS = self.sc._jsc.hadoopConfiguration().get("fs.defaultFS")

    @staticmethod
    def run(
        sc: Any,
        map_fun: Callable[[Any, Any], Any],
        tf_args: Any,
        num_executors: int,
        num_ps: int,
        tensorboard: bool = False,
        input_mode: int = InputMode.TENSORFLOW,
        log_dir: str | None = None,
        driver_ps_nodes: bool = False,
        master_node: str | None = None,
        reservation_timeout: float = 600,
        queues: Any = None,
        eval_node: bool = False,
        release_port: bool = True,
        stop_grace: float = 120.0,
    ) -> "TFCluster":
        """Start ``num_executors`` nodes running ``map_fun(tf_args, ctx)`` (TFoS signature).

        ``master_node``, ``queues`` and ``release_port`` are accepted and ignored (the chief is
        always ``chief``; there is one feed per node; ports are bound before ``map_fun``).
        ``stop_grace`` (not in TFoS) is how long a node may keep running after the feed ends
        (e.g. to save the model) before shutdown ends it.

        Raises:
            ValueError: ``driver_ps_nodes=True`` or an unknown ``input_mode``.
        """
        import dataplane

        if driver_ps_nodes:
            raise ValueError(
                "driver_ps_nodes=True is not supported: every node, ps included, runs on an "
                "executor. Count the ps in num_executors instead."
            )
        if input_mode not in (InputMode.TENSORFLOW, InputMode.SPARK):
            raise ValueError(
                f"input_mode must be InputMode.TENSORFLOW (0) or InputMode.SPARK (1), got "
                f"{input_mode!r}."
            )
        if master_node not in (None, "chief", "master"):
            logger.warning("master_node=%r ignored: the first worker node is always 'chief'",
                           master_node)
        from pyspark.sql import SparkSession

        spark = sc if hasattr(sc, "createDataFrame") else SparkSession.builder.getOrCreate()
        cluster = dataplane.run(
            spark, _CompatMain(map_fun), tf_args, num_nodes=num_executors, num_ps=num_ps,
            evaluator=eval_node, tensorboard=tensorboard, log_dir=log_dir,
            reservation_timeout=float(reservation_timeout), stop_grace=stop_grace,
        )
        return TFCluster(cluster, spark, num_executors=num_executors, input_mode=input_mode)

    def _require_spark_mode(self, what: str) -> None:
        if self.input_mode != InputMode.SPARK:
            raise ClusterStateError(
                f"TFCluster.{what}() requires input_mode=InputMode.SPARK; this cluster was "
                f"started with InputMode.TENSORFLOW (the nodes read their own data)."
            )

    def train(self, dataRDD: Any, num_epochs: int = 0, feed_timeout: float = 600,
              qname: str = "input") -> None:
        """Push every element of ``dataRDD`` into the workers ``num_epochs`` times (0: 10, as
        TFoS). Returns when all of it is in the nodes' buffers."""
        self._require_spark_mode("train")
        if hasattr(dataRDD, "foreachRDD"):
            raise TypeError(
                "DStreams are not supported; feed a Structured Streaming query with "
                "dataplane.streaming.feed_stream(cluster.cluster, stream_df)."
            )
        if not isinstance(num_epochs, int) or num_epochs < 0:
            raise ValueError(f"num_epochs cannot be negative, got {num_epochs!r}")
        df = rdd_to_dataframe(self.spark, dataRDD)
        report = self.cluster.train(df, num_epochs=num_epochs or 10, feed_timeout=feed_timeout)
        logger.info("TFCluster.train: pushed %d rows in %.1f s", report.rows, report.seconds)

    def inference(self, dataRDD: Any, feed_timeout: float = 600, qname: str = "input") -> Any:
        """An RDD with the nodes' ``batch_results`` for every element of ``dataRDD``, in order
        within each partition (lazy, like TFoS)."""
        self._require_spark_mode("inference")
        df = rdd_to_dataframe(self.spark, dataRDD)
        out = self.cluster.inference(df, passthrough=(), feed_timeout=feed_timeout)
        return out.rdd.map(_first_column)

    def tensorboard_url(self) -> str | None:
        return self.cluster.tensorboard_url

    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Stop the cluster. With InputMode.TENSORFLOW, first wait until every chief/worker
        ``map_fun`` has returned (up to ``timeout`` s; -1: no limit), as TFoS does.

        Raises:
            NodeError: a node's ``map_fun`` raised.
        """
        if ssc is not None:
            raise TypeError("Spark Streaming contexts are not supported; see dataplane.streaming.")
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        if self.input_mode == InputMode.TENSORFLOW:
            self._wait_for_workers(deadline)
        if grace_secs:
            time.sleep(grace_secs)
        remaining = 60.0 if deadline is None else max(deadline - time.monotonic(), 10.0)
        self.cluster.shutdown(timeout=remaining)

    def _wait_for_workers(self, deadline: float | None) -> None:
        workers = {n.node_id for n in self.cluster.nodes if n.role in ("chief", "worker")}
        while True:
            states = self.cluster.metrics()
            running = [i for i in workers if states.get(i, {}).get("main") == "running"]
            if not running:
                return
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("TFCluster.shutdown: node(s) %s still running at the timeout",
                               running)
                return
            time.sleep(0.5)
