"""Spark ML stages: :class:`TFEstimator` trains on a TF cluster, :class:`TFModel` scores rows.

Both are real ``pyspark.ml`` stages (``Params``, ``Estimator`` / ``Model``), so they go inside a
``Pipeline``, take param maps in ``fit``, and save/load with the rest of the pipeline.

``TFEstimator.fit(df)`` starts a cluster (:func:`dataplane.run`), pushes ``inputCols`` +
``labelCol`` through the Flight push path (``cluster.train``) ``epochs`` times, and runs the
user's ``train_fn(args, ctx)`` on every node. ``train_fn`` reads ``ctx.dataset(...)``, trains, and
returns the Keras model; the chief saves it as ``<exportDir>/fit-<time>-<id>/model.keras``, a
directory of this fit's own, so that a later fit (another param map, a CrossValidator running
fits in parallel, a refit that fails) never changes or removes a model already fitted. The
returned :class:`TFModel` points at that file.

``TFModel.transform(df)`` appends ``predictionCol`` with :func:`dataplane.predict` and keeps every
input column (TensorFlowOnSpark's TFModel drops them).

Saving: both stages store their params as JSON metadata (``DefaultParamsWritable``). A saved
``TFModel`` (alone or inside a ``PipelineModel``) also holds a copy of its model, so it loads and
scores after ``exportDir`` is gone (a remote ``modelPath`` is kept as a reference). The
estimator's ``train_fn`` and ``args`` are Python objects, so they are written beside it with
cloudpickle (``train_fn.pkl``): load it only from a path you trust, like any pickle.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
import uuid
from typing import Any, Callable

from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReadable,
    DefaultParamsReader,
    DefaultParamsWritable,
    DefaultParamsWriter,
)

from dataplane.errors import SchemaError, StorageError

__all__ = ["TFEstimator", "TFModel", "MODEL_FILE"]

logger = logging.getLogger(__name__)

#: File name of the saved Keras model inside each fit's directory under ``exportDir``.
MODEL_FILE = "model.keras"
_PICKLE_FILE = "train_fn.pkl"
_MODEL_COPY = "model"  # a saved TFModel's copy of its model, inside the stage's directory


class _SharedParams(Params):
    """Params that both stages carry (the model inherits the estimator's values)."""

    inputCols = Param(
        Params._dummy(), "inputCols", "columns fed to the model, in the model's input order",
        typeConverter=TypeConverters.toListString,
    )
    predictionCol = Param(
        Params._dummy(), "predictionCol", "name of the output column transform() adds",
        typeConverter=TypeConverters.toString,
    )

    def getInputCols(self) -> list[str]:
        return self.getOrDefault(self.inputCols)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.predictionCol)

    def setInputCols(self, value: list[str]) -> Any:
        return self._set(inputCols=value)

    def setPredictionCol(self, value: str) -> Any:
        return self._set(predictionCol=value)


class _FitMain:
    """What every node runs during ``fit``: the user's train_fn, then the chief saves."""

    def __init__(self, train_fn: Callable[[Any, Any], Any]) -> None:
        self.train_fn = train_fn

    def __call__(self, args: argparse.Namespace, ctx: Any) -> None:
        model = self.train_fn(args, ctx)
        if model is None:
            return
        if ctx.role == "chief" and "://" not in args.model_path:
            os.makedirs(os.path.dirname(args.model_path), exist_ok=True)
        # every worker saves (the others to a discarded copy): under
        # MultiWorkerMirroredStrategy a save on the chief alone never returns
        if ctx.save_model(model, args.model_path) is not None:
            logger.info("chief saved the trained model to %s", args.model_path)


class _EstimatorWriter(DefaultParamsWriter):
    """Params as JSON (like every Python stage) plus the train_fn/args pickle."""

    def saveImpl(self, path: str) -> None:
        super().saveImpl(path)
        from pyspark import cloudpickle

        local = _local_dir(path)
        os.makedirs(local, exist_ok=True)
        with open(os.path.join(local, _PICKLE_FILE), "wb") as f:
            cloudpickle.dump({"train_fn": self.instance._train_fn, "args": self.instance._args}, f)


class _EstimatorReader(DefaultParamsReader):
    def load(self, path: str) -> "TFEstimator":
        import pickle

        instance = super().load(path)
        file = os.path.join(_local_dir(path), _PICKLE_FILE)
        if os.path.exists(file):
            with open(file, "rb") as f:
                saved = pickle.load(f)
            instance._train_fn = saved["train_fn"]
            instance._args = saved["args"]
        return instance


class _ModelWriter(DefaultParamsWriter):
    """Params as JSON plus a copy of the model, so the saved stage does not depend on
    ``exportDir`` (which the next fit, or a clean-up, may change)."""

    def saveImpl(self, path: str) -> None:
        super().saveImpl(path)
        model = self.instance.getOrDefault(self.instance.modelPath) if self.instance.isDefined(
            self.instance.modelPath) else None
        held = getattr(self.instance, "_held_files", None)
        if model and held is not None and held.root == model and not os.path.exists(model):
            # saved with overwrite onto the folder it was loaded from: the writer (this one, or
            # a PipelineModel's) deleted that folder, model included, before this ran
            held.restore()
        if not model:
            return
        if "://" in model or not os.path.exists(model):
            logger.warning("TFModel.save: %s %s; the saved stage refers to it and needs it to be "
                           "there when loaded", model,
                           "is not a local file" if "://" in model else "does not exist")
            return
        try:
            local = _local_dir(path)
        except StorageError:
            logger.warning("TFModel.save: %s is not a local path; the saved stage refers to %s "
                           "and needs it to stay there", path, model)
            return
        dest = os.path.join(local, _MODEL_COPY, os.path.basename(model.rstrip("/")))
        if os.path.abspath(dest) == os.path.abspath(model):
            return  # saved where it was loaded from: the copy is in place
        if os.path.isdir(model):
            shutil.copytree(model, dest, dirs_exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(model, dest)


class _ModelReader(DefaultParamsReader):
    def load(self, path: str) -> "TFModel":
        instance = super().load(path)
        try:
            folder = os.path.join(_local_dir(path), _MODEL_COPY)
        except StorageError:
            return instance
        if os.path.isdir(folder):
            entries = sorted(os.listdir(folder))
            if entries:
                model = os.path.abspath(os.path.join(folder, entries[0]))
                instance._set(modelPath=model)
                instance._held_files = _HeldFiles(model)
        return instance


class _HeldFiles:
    """Open descriptors of a loaded model's files (``root``: a file or a SavedModel folder).

    ``m = PipelineModel.load(p); m.write().overwrite().save(p)`` deletes ``p``, and the model
    copy inside it, before any stage writes; the model would be lost for good. An open file
    keeps its contents readable after it is deleted (POSIX), so :meth:`restore` writes them back.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.files: dict[str, Any] = {}
        try:
            if os.path.isdir(root):
                for folder, _, names in os.walk(root):
                    for name in names:
                        full = os.path.join(folder, name)
                        self.files[os.path.relpath(full, root)] = open(full, "rb")  # noqa: SIM115
            else:
                self.files[""] = open(root, "rb")  # noqa: SIM115
        except OSError:  # unreadable: nothing held, the save then warns as for a missing model
            self.close()

    def restore(self) -> None:
        for rel, f in self.files.items():
            dest = os.path.join(self.root, rel) if rel else self.root
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            f.seek(0)
            with open(dest, "wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}

    def __del__(self) -> None:  # with the last model holding it, quietly
        self.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> "_HeldFiles":
        return self  # read-only: copies of the model share them

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "files": {}}  # open files do not travel


def _without_file_scheme(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _local_dir(path: str) -> str:
    path = _without_file_scheme(path)
    if "://" in path:
        raise StorageError(
            f"TFEstimator save/load: {path!r} is not a local path; the train_fn pickle is "
            f"written with local file I/O. Save the estimator to a local or mounted path."
        )
    return path


def _check_param_names(stage: Params, params: dict[str, Any]) -> None:
    """A TypeError for a keyword that is no param of ``stage`` (as Spark's own stages raise),
    instead of pyspark's AttributeError from inside ``_set``."""
    known = {p.name for p in stage.params}
    unknown = sorted(set(params) - known)
    if unknown:
        raise TypeError(
            f"{type(stage).__name__}: unexpected keyword argument(s) {unknown}; its params are "
            f"{sorted(known)}."
        )


def _merge_args(args: Any, extra: dict[str, Any]) -> argparse.Namespace:
    if args is None:
        base: dict[str, Any] = {}
    elif isinstance(args, argparse.Namespace):
        base = dict(vars(args))
    elif isinstance(args, dict):
        base = dict(args)
    else:
        raise TypeError(
            f"TFEstimator: args must be a dict, an argparse.Namespace or None, got "
            f"{type(args).__name__}; train_fn receives them merged with the stage's params."
        )
    replaced = sorted(k for k in extra if k in base and base[k] != extra[k])
    if replaced:
        logger.warning(
            "TFEstimator: args %s are replaced by the stage's params (%s); set those as params "
            "(epochs=, batchSize=, inputCols=, labelCol=, exportDir=) instead.",
            replaced, ", ".join(f"{k}={extra[k]!r}" for k in replaced),
        )
    base.update(extra)
    return argparse.Namespace(**base)


class TFEstimator(_SharedParams, Estimator, DefaultParamsReadable, DefaultParamsWritable):
    """Train a Keras model on a TF cluster fed through the push path.

    Args:
        train_fn: ``train_fn(args, ctx) -> keras.Model | None`` run on every node. ``args`` is an
            ``argparse.Namespace`` of the user ``args`` plus ``input_cols``, ``label_col``,
            ``batch_size``, ``epochs``, ``export_dir`` and ``model_path``. Read the rows with
            ``ctx.dataset(args.batch_size, features=args.input_cols, label=args.label_col)``
            and train for ``args.epochs`` (each iteration of the dataset is one pushed epoch).
            Return the model and the chief saves it to ``args.model_path``; or save it there
            yourself and return None. Must be importable/picklable (module level).
        args: a dict or Namespace merged into ``args`` (default: nothing extra).
        **params: any of the stage's params (``inputCols``, ``labelCol``, ``exportDir``, ...).

    With ``numNodes > 1`` every worker receives a share of the rows; to train one model, create
    a ``tf.distribute.MultiWorkerMirroredStrategy`` first thing in ``train_fn`` (``TF_CONFIG`` is
    set) and build and ``fit`` the model with ``tf_keras`` (Keras 2) under it, since Keras 3's
    ``fit`` does not run under that strategy (see the README's Known limits); or train with a
    custom loop (``examples/digits_push.py`` has one). Otherwise each node trains alone and only
    the chief's model is saved. With ``numPS > 0`` train_fn runs on the parameter servers too
    (``ctx.role == "ps"``), where it should serve (``ctx.server.join()``) rather than read data.

    Every fit saves to a directory of its own under ``exportDir``
    (``fit-<time>-<id>/model.keras``, also handed to train_fn as ``args.model_path``), so the
    models of earlier fits, and pipelines saved with them, stay as they were.
    """

    labelCol = Param(Params._dummy(), "labelCol", "label column pushed with the inputs; '' for "
                     "none", typeConverter=TypeConverters.toString)
    exportDir = Param(Params._dummy(), "exportDir", "directory under which each fit's chief saves "
                      "fit-<time>-<id>/model.keras", typeConverter=TypeConverters.toString)
    batchSize = Param(Params._dummy(), "batchSize", "training batch size handed to train_fn",
                      typeConverter=TypeConverters.toInt)
    epochs = Param(Params._dummy(), "epochs", "times every row is pushed",
                   typeConverter=TypeConverters.toInt)
    numNodes = Param(Params._dummy(), "numNodes", "TF nodes in the cluster (ps included)",
                     typeConverter=TypeConverters.toInt)
    numPS = Param(Params._dummy(), "numPS", "parameter servers", typeConverter=TypeConverters.toInt)
    predictBatchSize = Param(Params._dummy(), "predictBatchSize",
                             "rows per model call in the TFModel's transform",
                             typeConverter=TypeConverters.toInt)

    def __init__(
        self,
        train_fn: Callable[[Any, Any], Any] | None = None,
        args: Any = None,
        **params: Any,
    ) -> None:
        super().__init__()
        self._train_fn = train_fn
        self._args = args
        self._setDefault(
            predictionCol="prediction", labelCol="label", batchSize=128, epochs=1, numNodes=1,
            numPS=0, predictBatchSize=1024,
        )
        _check_param_names(self, params)
        self._set(**params)

    def setParams(self, **params: Any) -> "TFEstimator":
        _check_param_names(self, params)
        return self._set(**params)

    def setTrainFn(self, train_fn: Callable[[Any, Any], Any], args: Any = None) -> "TFEstimator":
        self._train_fn, self._args = train_fn, args
        return self

    def setLabelCol(self, value: str) -> "TFEstimator":
        return self._set(labelCol=value)

    def setExportDir(self, value: str) -> "TFEstimator":
        return self._set(exportDir=value)

    def setBatchSize(self, value: int) -> "TFEstimator":
        return self._set(batchSize=value)

    def setEpochs(self, value: int) -> "TFEstimator":
        return self._set(epochs=value)

    def setNumNodes(self, value: int) -> "TFEstimator":
        return self._set(numNodes=value)

    def setNumPS(self, value: int) -> "TFEstimator":
        return self._set(numPS=value)

    def setPredictBatchSize(self, value: int) -> "TFEstimator":
        return self._set(predictBatchSize=value)

    def getNumNodes(self) -> int:
        return self.getOrDefault(self.numNodes)

    def getNumPS(self) -> int:
        return self.getOrDefault(self.numPS)

    def getPredictBatchSize(self) -> int:
        return self.getOrDefault(self.predictBatchSize)

    def getTrainFn(self) -> Callable[[Any, Any], Any] | None:
        """The train_fn (as given, or as loaded with the estimator)."""
        return self._train_fn

    def getArgs(self) -> Any:
        """The args merged into train_fn's ``args`` (as given, or as loaded)."""
        return self._args

    def getLabelCol(self) -> str:
        return self.getOrDefault(self.labelCol)

    def getExportDir(self) -> str:
        return self.getOrDefault(self.exportDir)

    def getEpochs(self) -> int:
        return self.getOrDefault(self.epochs)

    def getBatchSize(self) -> int:
        return self.getOrDefault(self.batchSize)

    @classmethod
    def read(cls) -> _EstimatorReader:
        return _EstimatorReader(cls)

    def write(self) -> _EstimatorWriter:
        return _EstimatorWriter(self)

    def _validate(self, dataset: Any) -> tuple[list[str], str | None, str]:
        if self._train_fn is None or not callable(self._train_fn):
            raise TypeError(
                "TFEstimator: no train_fn; pass TFEstimator(train_fn, ...) or setTrainFn(fn)."
            )
        if not self.isDefined(self.inputCols):
            raise SchemaError("TFEstimator: inputCols is not set; e.g. inputCols=['features'].")
        if not self.isDefined(self.exportDir):
            raise StorageError(
                "TFEstimator: exportDir is not set; the trained model is saved there "
                "(a directory visible to the driver and every executor)."
            )
        cols = self.getInputCols()
        label = self.getLabelCol() or None
        if not cols:
            raise SchemaError(
                "TFEstimator.fit: inputCols is empty; name the feature columns to push, e.g. "
                "inputCols=['features']."
            )
        if label and label in cols:
            raise SchemaError(
                f"TFEstimator.fit: labelCol {label!r} is also one of inputCols {cols}; a column "
                f"is pushed once. Drop it from inputCols, or set labelCol='' for no label."
            )
        wanted = cols + ([label] if label else [])
        missing = [c for c in wanted if c not in dataset.columns]
        if missing:
            raise SchemaError(
                f"TFEstimator.fit: column(s) {missing} are not in the DataFrame (columns: "
                f"{dataset.columns}); set inputCols/labelCol (labelCol='' for no label)."
            )
        if label:
            from pyspark.sql.types import BinaryType, StringType

            if isinstance(dataset.schema[label].dataType, (StringType, BinaryType)):
                raise SchemaError(
                    f"TFEstimator.fit: labelCol {label!r} is a {dataset.schema[label].dataType.simpleString()} "
                    f"column; Keras losses take numbers. Index it first (pyspark.ml.feature."
                    f"StringIndexer(inputCol={label!r}, outputCol='label_index')) and set "
                    f"labelCol='label_index'."
                )
        for name in ("epochs", "batchSize", "numNodes"):
            value = self.getOrDefault(getattr(self, name))
            if value < 1:
                raise ValueError(f"TFEstimator: {name} must be >= 1, got {value}.")
        # Before any node starts: a column TF cannot hold fails here, naming it.
        from formats.export import spark_arrow_schema
        from formats.schema import column_specs

        from formats.sparkframe import vector_columns

        vectors = vector_columns(dataset.schema)  # pushed as float64 arrays
        try:
            from pyspark.sql.types import StructType

            fields = StructType([f for f in dataset.schema.fields if f.name in wanted and f.name not in vectors])
            column_specs(spark_arrow_schema(fields), columns=[f.name for f in fields])
        except SchemaError as exc:
            raise SchemaError(f"TFEstimator.fit: {exc}") from exc
        export = _without_file_scheme(self.getExportDir())
        if "://" not in export:
            export = os.path.abspath(export)
            if os.path.exists(export) and not os.path.isdir(export):
                raise StorageError(
                    f"TFEstimator.fit: exportDir {export!r} is a file; the chief saves "
                    f"{MODEL_FILE} inside a directory. Give a directory path."
                )
        return cols, label, export

    def _fit(self, dataset: Any) -> "TFModel":
        import dataplane

        cols, label, export = self._validate(dataset)
        # this fit's own directory: never another fit's model, never a stale one
        fit_dir = f"fit-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        model_path = f"{export.rstrip('/')}/{fit_dir}/{MODEL_FILE}"
        args = _merge_args(self._args, {
            "input_cols": cols, "label_col": label, "batch_size": self.getBatchSize(),
            "epochs": self.getEpochs(), "export_dir": export, "model_path": model_path,
        })
        feed = dataset.select(*[f"`{c}`" for c in cols + ([label] if label else [])])
        if feed.isEmpty():
            raise ValueError(
                "TFEstimator.fit: the DataFrame has no rows; there is nothing to train on (check "
                "the filters and joins before the estimator)."
            )
        cluster = dataplane.run(
            dataset.sparkSession, _FitMain(self._train_fn), args,
            num_nodes=self.getOrDefault(self.numNodes), num_ps=self.getOrDefault(self.numPS),
            stop_grace=120.0,
        )
        with cluster:
            report = cluster.train(feed, num_epochs=self.getEpochs())
            logger.info("TFEstimator: pushed %d rows in %.1f s", report.rows, report.seconds)
        from formats.fs import files_stamp, through_pyarrow

        missing = (files_stamp(model_path) is None if through_pyarrow(model_path)
                   else "://" not in model_path and not os.path.exists(model_path))
        if missing:
            raise StorageError(
                f"TFEstimator.fit: training finished but {model_path} does not exist. "
                f"train_fn must return the Keras model (the chief saves it) or save it to "
                f"args.model_path on the chief."
            )
        model = TFModel(
            modelPath=model_path, inputCols=cols, predictionCol=self.getPredictionCol(),
            batchSize=self.getOrDefault(self.predictBatchSize),
        )
        return model


class TFModel(_SharedParams, Model, DefaultParamsReadable, DefaultParamsWritable):
    """Scores rows with a saved Keras model (or SavedModel) via :func:`dataplane.predict`.

    ``transform(df)`` returns ``df`` with ``predictionCol`` appended; every input column is kept.
    Set ``layer`` to output an intermediate layer instead (feature extraction).
    """

    modelPath = Param(Params._dummy(), "modelPath", "the .keras file or SavedModel directory",
                      typeConverter=TypeConverters.toString)
    batchSize = Param(Params._dummy(), "batchSize", "most rows per model call",
                      typeConverter=TypeConverters.toInt)
    layer = Param(Params._dummy(), "layer", "output this layer instead of the model's output "
                  "('' for the model's output)", typeConverter=TypeConverters.toString)

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self._setDefault(predictionCol="prediction", batchSize=1024, layer="")
        _check_param_names(self, params)
        self._set(**params)

    def setParams(self, **params: Any) -> "TFModel":
        _check_param_names(self, params)
        return self._set(**params)

    @classmethod
    def read(cls) -> _ModelReader:
        return _ModelReader(cls)

    def write(self) -> _ModelWriter:
        return _ModelWriter(self)

    def setModelPath(self, value: str) -> "TFModel":
        return self._set(modelPath=value)

    def getBatchSize(self) -> int:
        return self.getOrDefault(self.batchSize)

    def setLayer(self, value: str) -> "TFModel":
        return self._set(layer=value)

    def setBatchSize(self, value: int) -> "TFModel":
        return self._set(batchSize=value)

    def getModelPath(self) -> str:
        return self.getOrDefault(self.modelPath)

    def getLayer(self) -> str:
        return self.getOrDefault(self.layer)

    def _transform(self, dataset: Any) -> Any:
        from dataplane.workloads.batch_predict import predict

        if not self.isDefined(self.modelPath) or not self.isDefined(self.inputCols):
            raise SchemaError("TFModel: modelPath and inputCols must both be set.")
        return predict(
            dataset, self.getModelPath(), input_cols=self.getInputCols(),
            output_col=self.getPredictionCol(), batch_size=self.getOrDefault(self.batchSize),
            layer=self.getLayer() or None,
        )
