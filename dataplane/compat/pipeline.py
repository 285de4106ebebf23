"""TensorFlowOnSpark's Spark ML pipeline API: ``TFEstimator`` and ``TFModel``, TFoS's params.

``TFEstimator(train_fn, tf_args).fit(df)`` starts a cluster with :func:`TFCluster.run`
(InputMode.SPARK, on :func:`dataplane.run`), feeds the columns named by ``input_mapping``
(sorted by column name) ``epochs`` times, shuts the cluster down and returns a
:class:`TFModel` carrying the same args and shared params. ``train_fn(args, ctx)`` reads the rows
with ``TFNode.DataFeed(ctx.mgr, False).next_batch`` (tuples in sorted column order) and exports
the model with ``compat.export_saved_model(model, args.export_dir, ctx.job_name == 'chief')``.

``TFModel(tf_args).transform(df)`` loads the SavedModel in ``export_dir`` once per executor
process, calls the signature ``signature_def_key`` with the columns of ``input_mapping``
(column -> input tensor name) in batches of ``batch_size``, and returns a DataFrame with one
column per ``output_mapping`` entry (output tensor name -> column), as TFoS does: the input
columns are not kept (:class:`dataplane.ml.TFModel` keeps them).

Params keep TFoS's snake_case names (``cluster_size``, ``export_dir``, ...) and setters
(``setClusterSize``, ``setExportDir``, ...). ``setInputMode(InputMode.TENSORFLOW)`` and
``export_fn`` are refused, as TFoS refuses them on TF 2.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import threading
from typing import Any, Callable, Iterator

from pyspark.ml.param.shared import Param, Params, TypeConverters
from pyspark.ml.pipeline import Estimator, Model

from dataplane.compat import TFCluster

__all__ = [
    "TFEstimator",
    "TFModel",
    "TFParams",
    "TFTypeConverters",
    "Namespace",
    "HasBatchSize",
    "HasClusterSize",
    "HasEpochs",
    "HasGraceSecs",
    "HasInputMapping",
    "HasInputMode",
    "HasMasterNode",
    "HasModelDir",
    "HasNumPS",
    "HasOutputMapping",
    "HasProtocol",
    "HasReaders",
    "HasSteps",
    "HasTensorboard",
    "HasTFRecordDir",
    "HasExportDir",
    "HasSignatureDefKey",
    "HasTagSet",
    "yield_batch",
    "single_node_env",
    "get_meta_graph_def",
]

logger = logging.getLogger(__name__)


class TFTypeConverters:
    """Param converter for dict params (Spark has none)."""

    @staticmethod
    def toDict(value: Any) -> dict:
        if isinstance(value, dict):
            return value
        raise TypeError(f"could not convert {value!r} to a dict")


def _mixin(cls_name: str, *params: tuple[str, str, str, Any]) -> type:
    """A ``Params`` mixin with one ``Param`` and a ``setX`` / ``getX`` pair per entry."""
    attrs: dict[str, Any] = {"__doc__": f"Mixin for the param(s) {[p[0] for p in params]}."}
    for name, method, doc, converter in params:
        attrs[name] = Param(Params._dummy(), name, doc, typeConverter=converter)

        def setter(self: Any, value: Any, _name: str = name) -> Any:
            return self._set(**{_name: value})

        def getter(self: Any, _name: str = name) -> Any:
            return self.getOrDefault(_name)

        attrs[f"set{method}"] = setter
        attrs[f"get{method}"] = getter
    return type(cls_name, (Params,), attrs)


_T = TypeConverters
_DICT = TFTypeConverters.toDict
HasBatchSize = _mixin(
    "HasBatchSize", ("batch_size", "BatchSize", "Number of records per batch", _T.toInt))
HasClusterSize = _mixin(
    "HasClusterSize", ("cluster_size", "ClusterSize", "Number of nodes in the cluster", _T.toInt))
HasEpochs = _mixin("HasEpochs", ("epochs", "Epochs", "Number of epochs to train", _T.toInt))
HasGraceSecs = _mixin(
    "HasGraceSecs", ("grace_secs", "GraceSecs", "Seconds to wait after feeding data", _T.toInt))
HasInputMapping = _mixin(
    "HasInputMapping",
    ("input_mapping", "InputMapping", "Input DataFrame column -> input tensor", _DICT))
HasMasterNode = _mixin(
    "HasMasterNode", ("master_node", "MasterNode", "Job name of the chief node", _T.toString))
HasModelDir = _mixin(
    "HasModelDir", ("model_dir", "ModelDir", "Path to save/load model checkpoints", _T.toString))
HasNumPS = _mixin(
    "HasNumPS", ("num_ps", "NumPS", "Number of PS nodes in cluster", _T.toInt),
    ("driver_ps_nodes", "DriverPSNodes", "Run PS nodes on the driver (refused)", _T.toBoolean))
HasOutputMapping = _mixin(
    "HasOutputMapping",
    ("output_mapping", "OutputMapping", "Output tensor -> output DataFrame column", _DICT))
HasProtocol = _mixin(
    "HasProtocol", ("protocol", "Protocol", "Network protocol for TF (grpc|rdma)", _T.toString))
HasReaders = _mixin(
    "HasReaders", ("readers", "Readers", "Number of reader/enqueue threads", _T.toInt))
HasSteps = _mixin("HasSteps", ("steps", "Steps", "Maximum number of steps to train", _T.toInt))
HasTensorboard = _mixin(
    "HasTensorboard", ("tensorboard", "Tensorboard", "Launch tensorboard process", _T.toBoolean))
HasTFRecordDir = _mixin(
    "HasTFRecordDir",
    ("tfrecord_dir", "TFRecordDir", "Path to export a DataFrame as TFRecords", _T.toString))
HasExportDir = _mixin(
    "HasExportDir", ("export_dir", "ExportDir", "Directory to export saved_model", _T.toString))
HasSignatureDefKey = _mixin(
    "HasSignatureDefKey",
    ("signature_def_key", "SignatureDefKey", "saved_model signature to call", _T.toString))
HasTagSet = _mixin(
    "HasTagSet", ("tag_set", "TagSet", "Comma-delimited tags of a saved_model", _T.toString))
_HasInputModeBase = _mixin(
    "_HasInputModeBase",
    ("input_mode", "InputMode", "Input data feeding mode (0=TENSORFLOW, 1=SPARK)", _T.toInt))


class HasInputMode(_HasInputModeBase):  # type: ignore[misc, valid-type]
    """Mixin for ``input_mode``; only InputMode.SPARK is accepted (as TFoS on TF 2)."""

    def setInputMode(self, value: int) -> Any:
        if value == TFCluster.InputMode.TENSORFLOW:
            raise ValueError(
                "InputMode.TENSORFLOW is deprecated in TFoS's pipeline API and refused here: "
                "TFEstimator feeds the DataFrame (InputMode.SPARK). For nodes that read files, "
                "use TFCluster.run(..., input_mode=InputMode.TENSORFLOW) directly."
            )
        return self._set(input_mode=value)


class Namespace:
    """A dict, argparse.Namespace or argv list as an object with attributes (TFoS's)."""

    argv: list[str] | None = None

    def __init__(self, d: Any) -> None:
        if isinstance(d, list):
            self.argv = d
        elif isinstance(d, dict):
            self.__dict__.update(d)
        elif isinstance(d, (argparse.Namespace, Namespace)):
            self.__dict__.update(vars(d))
        else:
            raise TypeError(
                f"unsupported Namespace args {d!r}: use a dict, argparse args or a list"
            )

    def __iter__(self) -> Iterator[Any]:
        yield from (self.argv if self.argv else list(self.__dict__))

    def __contains__(self, key: Any) -> bool:
        return key in (self.argv if self.argv else self.__dict__)

    def __repr__(self) -> str:
        if self.argv:
            return f"{self.argv}"
        items = ", ".join(f"{k}={self.__dict__[k]!r}" for k in sorted(self.__dict__))
        return f"Namespace({items})"

    def __eq__(self, other: Any) -> bool:
        if self.argv:
            return self.argv == other
        return isinstance(other, Namespace) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]


class TFParams(Params):
    """Mixin: namespace-style ``args`` merged with the stage's params."""

    args: Any = None

    def merge_args_params(self) -> Namespace:
        local_args = copy.copy(self.args)
        merged = vars(local_args)
        for p in self.params:
            merged[p.name] = self.getOrDefault(p.name)
        return local_args


class TFEstimator(  # type: ignore[misc, valid-type]
    Estimator, TFParams, HasInputMapping, HasClusterSize, HasNumPS, HasInputMode, HasMasterNode,
    HasProtocol, HasGraceSecs, HasTensorboard, HasModelDir, HasExportDir, HasTFRecordDir,
    HasBatchSize, HasEpochs, HasReaders, HasSteps,
):
    """Spark ML Estimator that trains ``train_fn`` on a cluster fed with the DataFrame.

    Args:
        train_fn: ``train_fn(args, ctx)``, a TFoS ``map_fun`` reading ``TFNode.DataFeed``.
        tf_args: dict, argparse args or argv list; merged with the params into ``args``.
        export_fn: refused (TF 1 only): export inside ``train_fn`` with
            ``compat.export_saved_model``.
    """

    def __init__(self, train_fn: Callable[[Any, Any], Any], tf_args: Any,
                 export_fn: Callable[..., Any] | None = None) -> None:
        super().__init__()
        if export_fn is not None:
            raise ValueError(
                "TFEstimator(export_fn=...) is TFoS's TensorFlow 1 export; with TF 2 export in "
                "train_fn: compat.export_saved_model(model, args.export_dir, "
                "ctx.job_name == 'chief')."
            )
        self.train_fn = train_fn
        self.export_fn = None
        self.args = Namespace(tf_args)
        self._setDefault(input_mapping={}, cluster_size=1, num_ps=0, driver_ps_nodes=False,
                         input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                         protocol="grpc", tensorboard=False, model_dir=None, export_dir=None,
                         tfrecord_dir=None, batch_size=100, epochs=1, readers=1, steps=1000,
                         grace_secs=30)

    def _fit(self, dataset: Any) -> "TFModel":
        local_args = self.merge_args_params()
        if not self.getInputMapping():
            raise ValueError(
                "TFEstimator: set the columns to feed with setInputMapping({col: tensor})."
            )
        missing = [c for c in self.getInputMapping() if c not in dataset.columns]
        if missing:
            raise ValueError(
                f"TFEstimator: input_mapping columns {missing} are not in the DataFrame "
                f"(columns: {dataset.columns})."
            )
        tf_args = self.args.argv if self.args.argv else local_args
        cluster = TFCluster.run(
            dataset.sparkSession, self.train_fn, tf_args, local_args.cluster_size,
            local_args.num_ps, local_args.tensorboard, TFCluster.InputMode.SPARK,
            master_node=local_args.master_node, driver_ps_nodes=local_args.driver_ps_nodes,
        )
        try:
            cluster.train(dataset.select(sorted(self.getInputMapping())).rdd, local_args.epochs)
        finally:
            cluster.shutdown(grace_secs=0)
        return self._copyValues(TFModel(self.args))


class TFModel(  # type: ignore[misc, valid-type]
    Model, TFParams, HasInputMapping, HasOutputMapping, HasBatchSize, HasModelDir, HasExportDir,
    HasSignatureDefKey, HasTagSet,
):
    """Spark ML Model scoring rows with a SavedModel on every executor (TFoS's TFModel)."""

    def __init__(self, tf_args: Any) -> None:
        super().__init__()
        self.args = Namespace(tf_args)
        self._setDefault(input_mapping={}, output_mapping={}, batch_size=100, model_dir=None,
                         export_dir=None, signature_def_key=None, tag_set=None)

    def _transform(self, dataset: Any) -> Any:
        input_cols = [col for col, _ in sorted(self.getInputMapping().items())]
        output_cols = [col for _, col in sorted(self.getOutputMapping().items())]
        if not input_cols or not output_cols:
            raise ValueError("TFModel: set both setInputMapping and setOutputMapping.")
        local_args = self.merge_args_params()
        if not local_args.export_dir:
            raise ValueError("TFModel: inference needs export_dir (a SavedModel); setExportDir().")
        tf_args = self.args.argv if self.args.argv else local_args
        rows = dataset.select(input_cols).rdd.mapPartitions(_RunModel(local_args, tf_args))
        schema = _output_schema(local_args, output_cols)
        return dataset.sparkSession.createDataFrame(rows, schema)


# -- executor side -------------------------------------------------------------------------------
_MODEL_LOCK = threading.Lock()
_MODELS: dict[tuple[str, str | None, str], Any] = {}


def _signature(export_dir: str, tag_set: str | None, key: str | None) -> Any:
    """The SavedModel's signature, loaded once per executor process and again when its files
    change (a model retrained and exported to the same directory)."""
    from formats.fs import files_stamp

    cache_key = (export_dir, tag_set, key or "serving_default")
    stamp = files_stamp(export_dir)
    with _MODEL_LOCK:
        if cache_key not in _MODELS or _MODELS[cache_key][2] != stamp:
            import tensorflow as tf

            tags = tag_set.split(",") if tag_set else None
            loaded = _load_saved_model(export_dir, tags)
            name = key or "serving_default"
            if name not in loaded.signatures:
                raise KeyError(
                    f"TFModel: SavedModel {export_dir} has no signature {name!r}; it has "
                    f"{sorted(loaded.signatures)}. setSignatureDefKey to one of them."
                )
            _MODELS[cache_key] = (loaded, loaded.signatures[name], stamp)
        return _MODELS[cache_key][1]


def _load_saved_model(export_dir: str, tags: list[str] | None) -> Any:
    """``tf.saved_model.load``, through a local copy for an ``s3://`` or ``hdfs://``
    directory (TensorFlow 2.18+, and 2.16 without tensorflow-io imported, read neither)."""
    import tensorflow as tf

    from formats.fs import local_copy

    with local_copy(export_dir) as local:
        return tf.saved_model.load(local, tags=tags)


def _output_schema(args: Namespace, output_cols: list[str]) -> Any:
    """The output columns' Spark types, from the signature (loaded here on the driver).

    TFoS lets Spark infer them by running the model over the first partition an extra time;
    the types are the same: floats -> double, ints -> bigint, strings -> binary, one array
    level per dimension past the batch.
    """
    from pyspark.sql import types as T

    fn = _signature(args.export_dir, args.tag_set, args.signature_def_key)
    specs = fn.structured_outputs
    out_names = [tensor for tensor, _ in sorted(args.output_mapping.items())]
    missing = [n for n in out_names if n not in specs]
    if missing:
        raise KeyError(
            f"TFModel: the signature has no output(s) {missing}; it has {sorted(specs)}."
        )
    fields = []
    for name, col in zip(out_names, output_cols):
        spec = specs[name]
        if spec.dtype.is_floating:
            kind: Any = T.DoubleType()
        elif spec.dtype.is_integer or spec.dtype.is_bool:
            kind = T.BooleanType() if spec.dtype.is_bool else T.LongType()
        else:
            kind = T.BinaryType()
        for _ in range(max(len(spec.shape) - 1, 0)):
            kind = T.ArrayType(kind)
        fields.append(T.StructField(col, kind, True))
    return T.StructType(fields)


class _RunModel:
    """mapPartitions function: rows of the input columns -> tuples of the output columns."""

    def __init__(self, args: Namespace, tf_args: Any) -> None:
        self.args = args
        self.tf_args = tf_args

    def __call__(self, rows: Iterator[Any]) -> Iterator[tuple]:
        import numpy as np
        import tensorflow as tf

        from formats.sparktask import prepare_task

        prepare_task()
        single_node_env(self.tf_args)
        args = self.args
        in_names = [tensor for _, tensor in sorted(args.input_mapping.items())]
        out_names = [tensor for tensor, _ in sorted(args.output_mapping.items())]
        fn = _signature(args.export_dir, args.tag_set, args.signature_def_key)
        specs = fn.structured_input_signature[1]
        unknown = [n for n in in_names if n not in specs]
        if unknown:
            raise KeyError(
                f"TFModel: the signature has no input(s) {unknown}; it has {sorted(specs)}."
            )
        for tensors in yield_batch(rows, args.batch_size, len(in_names)):
            inputs = {}
            for name, values in zip(in_names, tensors):
                spec = specs[name]
                t = tf.constant(np.asarray(values, dtype=spec.dtype.as_numpy_dtype))
                want = [len(values)] + list(spec.shape)[1:]
                if None not in want and list(t.shape) != want:
                    t = tf.reshape(t, want)
                inputs[name] = t
            outputs = fn(**inputs)
            missing = [n for n in out_names if n not in outputs]
            if missing:
                raise KeyError(
                    f"TFModel: the signature has no output(s) {missing}; it has {sorted(outputs)}."
                )
            columns = [outputs[n].numpy().tolist() for n in out_names]
            yield from zip(*columns)


def yield_batch(
    iterable: Iterator[Any], batch_size: int, num_tensors: int = 1
) -> Iterator[list[list[Any]]]:
    """Cut an iterator of rows into batches of ``num_tensors`` column lists (TFoS's helper)."""
    tensors: list[list[Any]] = [[] for _ in range(num_tensors)]
    for item in iterable:
        if item is None:
            break
        for i in range(num_tensors):
            value = item[i]
            tensors[i].append(str(value) if isinstance(value, bytearray) else value)
        if len(tensors[0]) >= batch_size:
            yield tensors
            tensors = [[] for _ in range(num_tensors)]
    if tensors[0]:
        yield tensors


def single_node_env(args: Any) -> None:
    """Prepare a single-node TF run in this process: an argv list becomes ``sys.argv``.

    TFoS also picks GPUs and sets Hadoop's CLASSPATH here; this project reads HDFS through
    pyarrow and leaves GPU visibility to the executor's resources.
    """
    if isinstance(args, list):
        sys.argv = args
    elif getattr(args, "argv", None):
        sys.argv = args.argv


def get_meta_graph_def(saved_model_dir: str, tag_set: str) -> Any:
    """Refused: TF 1 (``tf.contrib``) API, refused by TFoS on TF 2 as well."""
    raise NotImplementedError(
        "get_meta_graph_def is TFoS's TensorFlow 1 helper; with TF 2 use "
        "tf.saved_model.load(saved_model_dir, tags=...).signatures."
    )
