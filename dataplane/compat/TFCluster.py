"""TensorFlowOnSpark's ``TFCluster`` module: ``run``, ``InputMode`` and the ``TFCluster`` class.

``TFCluster.run(sc, map_fun, tf_args, num_executors, num_ps, tensorboard, input_mode, ...)``
starts the nodes with :func:`dataplane.run` and returns a :class:`TFCluster`, whose ``train``,
``inference`` and ``shutdown`` keep TFoS's meaning:

- ``train(rdd, num_epochs)`` turns the RDD into a DataFrame (one column per tuple field, arrays as
  array columns), pushes it ``num_epochs`` times over Arrow Flight (``cluster.train``) and, as in
  TFoS, returns once the nodes have taken every row (or ``terminate()``-d the feed, or returned).
- ``inference(rdd)`` returns a lazy RDD of the nodes' ``batch_results`` (``cluster.inference``).
- ``shutdown()`` ends the feed (``next_batch`` returns the rest, ``should_stop()`` turns true),
  waits for the nodes and raises :class:`dataplane.NodeError` if a ``map_fun`` raised. With
  ``InputMode.TENSORFLOW`` it first waits for every worker's ``map_fun`` to return.

``map_fun`` runs with ``TF_USE_LEGACY_KERAS=1`` when ``tf_keras`` is installed and the variable is
not set: TFoS 2.2.5 programs are ``tf.keras`` 2 programs (``model.save(..., save_format='tf')``,
``fit`` under ``MultiWorkerMirroredStrategy``), which Keras 3 refuses.

Refused, with the replacement named: DStreams
(:func:`dataplane.workloads.streaming.feed_stream`), ``driver_ps_nodes`` (count the ps in
``num_executors``). Every element of a fed RDD must have the layout of the first (same tuple
length and field kinds); a numeric field takes the widest type among the first
:data:`TYPE_SAMPLE` elements, and a later value that type cannot hold is refused, never cut. N-d
array fields arrive flattened.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from dataplane.compat.TFNode import TFNodeContext, column_name
from dataplane.errors import ClusterStateError, FeedError, SchemaError
from formats.staging import task_error

__all__ = ["TFCluster", "InputMode", "run", "rdd_to_dataframe"]

logger = logging.getLogger(__name__)


class InputMode:
    """How data reaches the nodes (TFoS's enum)."""

    TENSORFLOW = 0  #: the nodes read their own data (tf.data, feeders.*)
    SPARK = 1  #: the driver feeds RDDs (TFCluster.train / TFCluster.inference)


class _CompatMain:
    """Runs a TFoS ``map_fun(args, ctx)`` with a TFoS ``ctx`` on a dataplane node.

    ``map_fun`` travels pickled inside this object and is unpickled on the node only after
    ``TF_USE_LEGACY_KERAS`` is set, so a module that imports TensorFlow at its top still gets
    Keras 2 as ``tf.keras``.
    """

    def __init__(self, map_fun: Callable[[Any, Any], Any], master_node: str | None) -> None:
        from pyspark import cloudpickle

        self.payload = cloudpickle.dumps(map_fun)
        self.master_node = master_node

    def __call__(self, args: Any, ctx: Any) -> Any:
        import importlib.util
        import pickle

        if "TF_USE_LEGACY_KERAS" not in os.environ and importlib.util.find_spec("tf_keras"):
            os.environ["TF_USE_LEGACY_KERAS"] = "1"
        map_fun = pickle.loads(self.payload)
        if isinstance(args, list):
            sys.argv = args  # as TFoS: an argv list becomes the node's sys.argv
        tfos_ctx = TFNodeContext(ctx)
        if self.master_node is None:
            _as_workers_only(tfos_ctx)
        error = None
        try:
            return map_fun(args, tfos_ctx)
        except BaseException as e:
            error = e
            raise
        finally:
            tfos_ctx._close(error)


def _as_workers_only(ctx: TFNodeContext) -> None:
    """TFoS without ``master_node``: the chief is ``worker:0`` and the workers follow it."""
    spec = ctx.cluster_spec
    chief = spec.pop("chief", [])
    spec["worker"] = chief + spec.get("worker", [])
    if ctx.job_name == "chief":
        ctx.job_name, ctx.task_index = "worker", 0
    elif ctx.job_name == "worker":
        ctx.task_index += len(chief)


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
    *,
    stop_grace: float = 120.0,
) -> "TFCluster":
    """Start ``num_executors`` nodes running ``map_fun(tf_args, ctx)`` (TFoS's signature).

    Args:
        sc: the SparkContext (or a SparkSession).
        map_fun: the node program; picklable.
        tf_args: handed to ``map_fun``; a list becomes the node's ``sys.argv`` (as in TFoS).
        num_executors: all nodes, ps and evaluator included.
        num_ps: parameter servers.
        tensorboard: start TensorBoard on the chief (``tensorboard_url()``).
        input_mode: ``InputMode.SPARK`` (the driver feeds) or ``InputMode.TENSORFLOW``.
        log_dir: TensorBoard's directory.
        driver_ps_nodes: refused (``True``): every node runs on an executor here.
        master_node: ``"chief"`` (TFoS's TF 2 examples): ``ctx.job_name`` is ``chief`` on the
            first node. ``None``: as in TFoS every non-ps node is a ``worker`` (the first is
            ``worker:0``); TF_CONFIG still names it chief, as MultiWorkerMirroredStrategy needs.
        reservation_timeout: seconds for every node to register.
        queues: accepted and ignored (one input stream per node).
        eval_node: make the last node an evaluator (InputMode.TENSORFLOW only, as in TFoS).
        release_port: accepted and ignored (ports are released before ``map_fun``).
        stop_grace: (not in TFoS) seconds a node may keep running after the feed ended (to
            export the model, say) before shutdown ends it; default 120.

    Raises:
        ValueError: ``driver_ps_nodes=True``, an unknown ``input_mode``, ``eval_node`` with
            InputMode.SPARK, or no worker node.
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
    if eval_node and input_mode != InputMode.TENSORFLOW:
        raise ValueError("eval_node=True needs input_mode=InputMode.TENSORFLOW (as in TFoS).")
    if not isinstance(num_executors, int) or not isinstance(num_ps, int) or num_ps < 0:
        raise ValueError(
            f"num_executors and num_ps must be ints >= 0, got {num_executors!r}, {num_ps!r}"
        )
    if num_executors - num_ps - int(bool(eval_node)) < 1:
        raise ValueError(
            f"num_executors={num_executors} leaves no worker after {num_ps} ps and "
            f"{int(bool(eval_node))} evaluator; TFoS needs at least one worker or chief."
        )
    if master_node not in (None, "chief", "master"):
        logger.warning("master_node=%r: the first worker node is named 'chief'", master_node)
    from pyspark.sql import SparkSession

    spark = sc if hasattr(sc, "createDataFrame") else SparkSession.builder.getOrCreate()
    cluster = dataplane.run(
        spark, _CompatMain(map_fun, master_node), tf_args, num_nodes=num_executors,
        num_ps=num_ps, evaluator=bool(eval_node), tensorboard=tensorboard, log_dir=log_dir,
        reservation_timeout=float(reservation_timeout), stop_grace=stop_grace,
    )
    return TFCluster(cluster, spark, num_executors=num_executors, input_mode=input_mode)


#: Elements read on the driver to type the pushed columns; a later element whose numbers do not
#: fit those types (a float where only integers were seen) is refused, never cut.
TYPE_SAMPLE = 100

_NUMERIC_RANK = {"boolean": 0, "bigint": 1, "float": 2, "double": 3}
_NUMPY_OF = {"float": np.float32, "double": np.float64, "bigint": np.int64, "boolean": np.bool_}
_FROM_BOOL = {"boolean": bool, "bigint": int, "float": float, "double": float}


def _numeric_type(dtype: Any) -> str | None:
    """Spark simple type name of a numpy dtype's values, or None if not numeric."""
    if dtype == np.float32:
        return "float"
    if np.issubdtype(dtype, np.floating):
        return "double"
    if np.issubdtype(dtype, np.bool_):
        return "boolean"
    if np.issubdtype(dtype, np.integer):
        return "bigint"
    return None


def _field_kind(value: Any, where: str) -> tuple[str, str]:
    """(kind, Spark simple type name) of one field value of an RDD element."""
    if isinstance(value, (bool, np.bool_)):
        return "num", "boolean"
    if isinstance(value, (int, np.integer)):
        return "num", "bigint"
    if isinstance(value, np.float32):
        return "num", "float"
    if isinstance(value, (float, np.floating)):
        return "num", "double"
    if isinstance(value, str):
        return "str", "string"
    if isinstance(value, (bytes, bytearray)):
        return "bin", "binary"
    if isinstance(value, (list, tuple, np.ndarray)):
        arr = np.asarray(value)
        elem = _numeric_type(arr.dtype) if arr.size else "bigint"
        if elem is None:
            raise SchemaError(
                f"{where} is an array of {arr.dtype}; only numeric arrays can be fed. "
                f"Convert it to numbers in the RDD (rdd.map(...)) before cluster.train."
            )
        return "arr", elem
    raise SchemaError(
        f"{where} is a {type(value).__name__} ({value!r:.60}); feedable fields are numbers, "
        f"str, bytes and numeric lists/arrays. Map the RDD to those before cluster.train."
    )


def _wider(a: str, b: str) -> str:
    if a in _NUMERIC_RANK and b in _NUMERIC_RANK:
        if {a, b} == {"float", "bigint"}:
            return "double"  # float32 cannot hold every int64
        return a if _NUMERIC_RANK[a] >= _NUMERIC_RANK[b] else b
    return a


def _layout(element: Any) -> tuple[str, list[Any]]:
    if isinstance(element, tuple):
        return "tuple", list(element)
    if isinstance(element, list) and element and not all(
        isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in element
    ):
        return "list", list(element)  # a record such as [label, "text", [pixels]]
    return "value", [element]  # a scalar, or one numeric vector


class _Encoder:
    """Executor side: one RDD element -> one row tuple of plain Python values of the column types.

    Numbers are widened to the column's type (an int in a double column); a value the type cannot
    hold exactly (1.5 in a bigint column, 2 in a boolean one) raises :class:`SchemaError`.
    """

    def __init__(self, layout: str, kinds: list[str], types: list[str]) -> None:
        self.layout = layout
        self.kinds = kinds
        self.types = types

    def _refuse(self, index: int, value: Any, why: str) -> SchemaError:
        if self.kinds[index] in ("num", "arr"):
            fix = (f"Make field {index} floating point in every element (float(v), or "
                   f"np.asarray(v, np.float32) for arrays, in an rdd.map) before "
                   f"cluster.train/inference.")
        else:
            fix = f"Give field {index} the same type in every element before cluster.train."
        seen = {"bigint": "integers", "boolean": "booleans", "float": "float32 numbers",
                "double": "numbers"}.get(self.types[index], self.types[index])
        return SchemaError(
            f"field {index} of an RDD element is {value!r:.60}, but the first {TYPE_SAMPLE} "
            f"elements held only {seen} there, so field {index} was typed {self.types[index]} "
            f"and {why}. {fix}"
        )

    def _number(self, index: int, value: Any) -> Any:
        target = self.types[index]
        if isinstance(value, (bool, np.bool_)):  # True/False fit every numeric type
            return _FROM_BOOL[target](value)
        if not isinstance(value, (int, float, np.number)):
            raise self._refuse(index, value, "it is not a number")
        if target in ("float", "double"):
            return float(value)
        if target == "boolean":
            raise self._refuse(index, value, "it is not a boolean")
        if float(value).is_integer():
            return int(value)
        raise self._refuse(index, value, "it would lose its fraction")

    def _array(self, index: int, value: Any) -> list:
        target = self.types[index]
        arr = np.asarray(value)
        if arr.size and _numeric_type(arr.dtype) is None:
            raise self._refuse(index, value, f"its {arr.dtype} values are not numbers")
        out = arr.astype(_NUMPY_OF[target]).ravel()
        if arr.size and _NUMERIC_RANK[_numeric_type(arr.dtype)] > _NUMERIC_RANK[target] and not (
            np.array_equal(out, arr.ravel())
        ):
            raise self._refuse(index, value, "its values would be cut to " + (
                "integers" if target == "bigint" else "booleans"))
        return out.tolist()

    def __call__(self, element: Any) -> tuple:
        fields = list(element) if self.layout in ("tuple", "list") else [element]
        if len(fields) != len(self.kinds):
            raise SchemaError(
                f"an RDD element has {len(fields)} fields but the first element had "
                f"{len(self.kinds)}; every element fed to cluster.train needs the same layout."
            )
        out = []
        for i, (value, kind) in enumerate(zip(fields, self.kinds)):
            if kind == "arr":
                out.append(self._array(i, value))
            elif kind == "num":
                out.append(self._number(i, value))
            elif kind == "bin":
                if not isinstance(value, (bytes, bytearray)):
                    raise self._refuse(i, value, "it is not bytes")
                out.append(bytes(value))
            else:
                if not isinstance(value, str):
                    raise self._refuse(i, value, "it is not a str")
                out.append(value)
        return tuple(out)


def rdd_to_dataframe(spark: Any, rdd: Any) -> Any:
    """Turn an RDD of TFoS-style elements into the DataFrame pushed to the nodes.

    The column names record the element layout (see ``TFNode.column_name``) so the nodes
    rebuild each element as it was: a tuple, a list, or a single value. Each column's type is
    the widest seen in the first :data:`TYPE_SAMPLE` elements (ints and floats in one field make
    it floating point); later elements that the type cannot hold exactly are refused.

    Raises:
        SchemaError: the RDD is empty or a field cannot be carried.
    """
    from pyspark.sql import types as T

    sample = rdd.take(TYPE_SAMPLE)
    if not sample:
        raise SchemaError("cluster.train/inference got an empty RDD; there is nothing to feed.")
    layout, fields = _layout(sample[0])
    if not fields:
        raise SchemaError("the first RDD element is an empty tuple/list; nothing to feed.")
    kinds, types = [], []
    for i, value in enumerate(fields):
        kind, type_name = _field_kind(value, f"field {i} of the first RDD element")
        kinds.append(kind)
        types.append(type_name)
    for n, element in enumerate(sample[1:], start=1):
        other = list(element) if layout in ("tuple", "list") and isinstance(
            element, (tuple, list)) else [element]
        if len(other) != len(fields):
            raise SchemaError(
                f"RDD element {n} has {len(other)} fields but the first element had "
                f"{len(fields)}; every element fed to cluster.train needs the same layout."
            )
        for i, value in enumerate(other):
            kind, type_name = _field_kind(value, f"field {i} of RDD element {n}")
            if kind != kinds[i]:
                raise SchemaError(
                    f"field {i} of RDD element {n} is {value!r:.60} ({type_name}) but the first "
                    f"element's field {i} is {types[i]}; every element needs the same field kinds."
                )
            types[i] = _wider(types[i], type_name)
    spark_types = {"boolean": T.BooleanType(), "bigint": T.LongType(), "float": T.FloatType(),
                   "double": T.DoubleType(), "string": T.StringType(), "binary": T.BinaryType()}
    schema = T.StructType([
        T.StructField(
            column_name(layout, i, k),
            T.ArrayType(spark_types[t], containsNull=False) if k == "arr" else spark_types[t],
            nullable=False,
        )
        for i, (k, t) in enumerate(zip(kinds, types))
    ])
    return spark.createDataFrame(rdd.map(_Encoder(layout, kinds, types)), schema)


def _result(row: Any) -> Any:
    """One ``batch_results`` value, as the node's map_fun gave it (``TFNode.RESULT_SCHEMA``)."""
    from dataplane.compat.TFNode import decode_result

    return decode_result(row[0])


class TFCluster:
    """A running TFoS cluster (returned by :func:`run`).

    Attributes: ``sc``, ``num_executors``, ``input_mode``, ``cluster_id``, ``defaultFS``,
    ``working_dir``, and ``cluster`` (the underlying :class:`dataplane.Cluster`).
    """

    def __init__(self, cluster: Any, spark: Any, *, num_executors: int, input_mode: int) -> None:
        self.cluster = cluster
        self.spark = spark
        self.sc = spark.sparkContext
        self.num_executors = num_executors
        self.input_mode = input_mode
        self.cluster_id = cluster.cluster_id
        self.defaultFS = self.sc._jsc.hadoopConfiguration().get("fs.defaultFS")
        self.working_dir = os.getcwd()

    def _require_spark_mode(self, what: str) -> None:
        if self.input_mode != InputMode.SPARK:
            raise ClusterStateError(
                f"TFCluster.{what}() requires input_mode=InputMode.SPARK; this cluster was "
                f"started with InputMode.TENSORFLOW (the nodes read their own data)."
            )

    def train(self, dataRDD: Any, num_epochs: int = 0, feed_timeout: float = 600,
              qname: str = "input") -> None:
        """Feed every element of ``dataRDD`` to the workers ``num_epochs`` times (0: 10, as
        TFoS) and return once they have taken it all (or terminated the feed, or returned).

        As in TFoS, every element reaches a worker: workers may get a few rows more or fewer
        than each other (``dataplane.Cluster.train`` instead drops up to one row per partition
        so that every worker yields the same batches). A MultiWorkerMirroredStrategy program
        bounds its steps (``fit(steps_per_epoch=...)``), as TFoS's examples do.

        Raises:
            NodeError: a node's ``map_fun`` raised (the cluster is shut down).
            FeedError: the nodes took no rows for ``feed_timeout`` seconds.
            SchemaError: an element does not fit the layout or types of the first elements.
        """
        self._require_spark_mode("train")
        if hasattr(dataRDD, "foreachRDD"):
            raise TypeError(
                "DStreams are not supported; feed a Structured Streaming query with "
                "dataplane.workloads.streaming.feed_stream(cluster.cluster, stream_df)."
            )
        if not isinstance(num_epochs, int) or num_epochs < 0:
            raise ValueError(f"num_epochs cannot be negative, got {num_epochs!r}")
        if hasattr(dataRDD, "schema") and hasattr(dataRDD, "rdd"):
            dataRDD = dataRDD.rdd  # a DataFrame: its Rows are tuples, as TFoS's pipeline feeds
        df = rdd_to_dataframe(self.spark, dataRDD)
        self.cluster._check_running("train")
        try:
            report = self.cluster._feeder.train(df, num_epochs=num_epochs or 10,
                                                feed_timeout=feed_timeout, balance=False)
        except FeedError as exc:
            # (the push stood still: a node stopped reading, or never began)
            if "no row moved" not in str(exc) and "nothing moved" not in str(exc):
                raise
            raise FeedError(
                f"{exc} In a TensorFlowOnSpark program: every worker's map_fun reads its "
                f"DataFeed until next_batch returns an empty batch or should_stop() is True, or "
                f"calls feed.terminate() once it wants no more rows."
            ) from exc
        except Exception as exc:
            refused = task_error(exc)  # an element _Encoder refused, raised in a Spark task
            if refused is None:
                raise
            raise refused from exc
        # Cluster.train returns once every worker's pass over each epoch has ended: TFoS's
        # train returned once the nodes had taken every row, so there is nothing more to wait for.
        logger.info("TFCluster.train: pushed %d rows in %.1f s", report.rows, report.seconds)

    def inference(self, dataRDD: Any, feed_timeout: float = 600, qname: str = "input") -> Any:
        """A lazy RDD of the nodes' ``batch_results`` for every element of ``dataRDD``, in
        order within each partition: each result is the value map_fun gave, types kept (as TFoS's
        pickled queue kept them; see ``TFNode.encode_result`` for what a result may hold), and
        map_fun sees every element once (no probe batch is sent)."""
        from dataplane.compat.TFNode import RESULT_SCHEMA

        self._require_spark_mode("inference")
        df = rdd_to_dataframe(self.spark, dataRDD)
        out = self.cluster.inference(df, passthrough=(), feed_timeout=feed_timeout,
                                     output_schema=RESULT_SCHEMA)
        return out.rdd.map(_result)

    def tensorboard_url(self) -> str | None:
        """``http://host:port`` of the chief's TensorBoard, or None."""
        return self.cluster.tensorboard_url

    def shutdown(self, ssc: Any = None, grace_secs: float = 0, timeout: float = 259200) -> None:
        """Stop the cluster (TFoS's signature).

        With InputMode.TENSORFLOW, first wait until every chief/worker ``map_fun`` has returned
        (up to ``timeout`` s; -1: no limit), as TFoS does. ``grace_secs``: seconds to wait after
        that before the nodes are stopped (their ``map_fun`` also gets ``stop_grace`` seconds
        after the feed ends). A ``map_fun`` still busy when ``timeout`` runs out is stopped
        then (TFoS ended the whole application), its process ``stop_grace`` seconds later.

        Raises:
            NodeError: a node's ``map_fun`` raised.
        """
        if ssc is not None:
            raise TypeError(
                "Spark Streaming contexts are not supported; see "
                "dataplane.workloads.streaming.feed_stream."
            )
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        if self.input_mode == InputMode.TENSORFLOW:
            self._wait_for_workers(deadline)
        if grace_secs:
            time.sleep(grace_secs)
        remaining = 300.0 if deadline is None else max(deadline - time.monotonic(), 10.0)
        # as in TFoS, timeout bounds the shutdown: a map_fun still busy then (one that never
        # reads its DataFeed again) is stopped, after stop_grace seconds with its process
        self.cluster.shutdown(timeout=remaining, _stop_busy=deadline is not None)

    def _wait_for_workers(self, deadline: float | None) -> None:
        workers = {n.node_id for n in self.cluster.nodes if n.role in ("chief", "worker")}
        while True:
            states = self.cluster.metrics()
            if any(states.get(i, {}).get("main") == "failed" for i in workers):
                return  # cluster.shutdown raises the node's error
            running = [i for i in workers if states.get(i, {}).get("main") == "running"]
            if not running:
                return
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("TFCluster.shutdown: node(s) %s still running at the timeout",
                               running)
                return
            time.sleep(0.5)
