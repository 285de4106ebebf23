"""Batch inference over a Spark DataFrame with a saved model (``dataplane.predict``).

The model file is not broadcast as bytes: every executor Python process loads it from
``model_path`` the first time a task needs it and keeps it in a module-level cache keyed by
(path, layer, loader), so a worker that runs many tasks and many Arrow batches loads it once.
Rows travel as Arrow through ``DataFrame.mapInArrow``; each incoming Arrow batch is cut into
slices of at most ``batch_size`` rows before it reaches the model, so memory stays bounded by the
batch size, not the partition size.

Supported models: Keras 3 files (``.keras``, and legacy ``.h5``) and TensorFlow SavedModel
directories (``serving_default`` signature; what ``model.export(path)`` writes). A named
intermediate layer's output can be returned instead of the model's output (feature extraction,
Keras files only).

TensorFlow is imported only when a model is loaded (on executors, and once on the driver to learn
the output shape unless ``output_shape`` is given).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from dataplane.errors import SchemaError, StorageError, model_input_nulls
from formats.fs import download, files_stamp, through_pyarrow, write_text_atomic
from formats.schema import RaggedColumn, column_specs, to_numpy
from formats.sparkframe import map_in_arrow, not_a_spark_frame, vector_as_array, vector_columns

__all__ = ["predict", "Predictor", "load_predictor"]

logger = logging.getLogger(__name__)

# Per Python process: (path, layer, loader key, input columns) -> (the model files' stamp,
# Predictor). See _cached_predictor.
_MODELS: dict[tuple[str, str | None, str, tuple[str, ...]], tuple[Any, "Predictor"]] = {}
_MODELS_LOCK = threading.Lock()


class Predictor:
    """A loaded model reduced to what batch inference needs.

    Attributes:
        fn: maps one batch, ``dict[column -> np.ndarray]``, to one ``np.ndarray`` whose first
            dimension is the batch.
        output_shape: per-row shape of ``fn``'s output (``()`` for one value per row).
        output_dtype: numpy dtype name of the output.
        input_shape: per-row shape of a one-input model's input, when known (``(4,)``): lets
            :func:`predict` check on the driver that stacked scalar columns fill it.
    """

    def __init__(
        self,
        fn: Callable[[dict[str, np.ndarray]], np.ndarray],
        *,
        output_shape: Sequence[int | None],
        output_dtype: str = "float32",
        input_shape: Sequence[int | None] | None = None,
    ) -> None:
        self.fn = fn
        self.output_shape = tuple(output_shape)
        self.output_dtype = str(output_dtype)
        self.input_shape = None if input_shape is None else tuple(input_shape)

    def __call__(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(self.fn(arrays))


def _fit_input(x: np.ndarray, shape: Sequence[int | None], what: str) -> np.ndarray:
    """Reshape a [batch, ...] array to a model input's [None, ...] shape when sizes agree."""
    want = tuple(shape)[1:]
    have = x.shape[1:]
    if len(want) == len(have) and all(w is None or w == h for w, h in zip(want, have)):
        return x
    if all(w is not None for w in want) and math.prod(want) == math.prod(have):
        return x.reshape((x.shape[0], *want))
    raise SchemaError(
        f"predict: {what} has per-row shape {have}, but the model input expects {want}. "
        f"Pass input_cols whose values fit that shape (scalar columns are stacked side by side; "
        f"a list column must hold {math.prod(w or 1 for w in want)} values per row)."
    )


def _check_scalar_inputs(frame: Any, names: Sequence[str], cols: Sequence[str],
                         input_shape: Sequence[int | None] | None) -> None:
    """Scalar columns stacked side by side must fill a one-input model's input exactly: 3
    columns for an input of 4 failed only in the Spark job, once per task."""
    from pyspark.sql.types import ArrayType

    if input_shape is None or len(cols) < 2 or any(d is None for d in input_shape):
        return
    if any(isinstance(frame.schema[n].dataType, ArrayType) for n in names):
        return  # list lengths are known only from the rows
    want = math.prod(input_shape)  # type: ignore[arg-type]
    if want != len(cols):
        raise SchemaError(
            f"predict: input_cols {list(cols)} stack {len(cols)} scalar values a row, but the "
            f"model input takes per-row shape {tuple(input_shape)} ({want} values). Pass the "
            f"{want} columns the model was trained on, in its order."
        )


def _numeric_input(arrays: dict[str, np.ndarray], cols: Sequence[str], dtype: str, what: str) -> None:
    """Text cannot feed a numeric model input: numpy would parse '1.5' as a number and fail
    on anything else with a bare 'could not convert string to float'."""
    if np.dtype(dtype).kind not in "iufb":
        return
    for c in cols:
        a = arrays[c]
        if a.dtype.kind in "OSU":
            raise SchemaError(
                f"predict: column {c!r} holds text (or bytes), but {what} takes {dtype}. Turn it "
                f"into numbers first (pyspark.ml.feature.StringIndexer for categories, a cast "
                f"for numbers stored as text), or leave it out of input_cols."
            )


def _assemble(arrays: dict[str, np.ndarray], cols: Sequence[str], shape: Sequence[int | None]):
    """One model input from the input columns: a single column as is, scalars stacked."""
    if len(cols) == 1:
        x = arrays[cols[0]]
        if x.ndim == 1 and len(shape) == 2:
            x = x.reshape(-1, 1)
        return _fit_input(x, shape, f"column {cols[0]!r}")
    parts = []
    for c in cols:
        a = arrays[c]
        parts.append(a.reshape(a.shape[0], -1))
    return _fit_input(np.concatenate(parts, axis=1), shape, f"columns {list(cols)}")


def _keras_of(path: str) -> Any:
    """The Keras that wrote ``path``: ``tf_keras`` for a ``.keras`` file whose metadata says
    Keras 2 (what multi-worker programs train with), else Keras 3, which cannot read every
    such file (a BatchNormalization layer's config, for one)."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            version = str(json.loads(z.read("metadata.json")).get("keras_version", ""))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        version = ""
    if version.startswith("2."):
        import tf_keras

        return tf_keras
    import keras

    return keras


def _keras_predictor(path: str, layer: str | None, input_cols: Sequence[str]) -> Predictor:
    import zipfile

    if path.endswith(".keras") and os.path.isfile(path) and not zipfile.is_zipfile(path):
        # Keras says "File not found" for a file that is there but is no zip archive
        raise StorageError(
            f"predict: cannot load {path!r}: it exists but is not a .keras archive (the zip "
            f"file model.save('model.keras') writes; this is {os.path.getsize(path):,} bytes "
            f"of something else). Save the model again, or pass the right file."
        )
    keras = _keras_of(path)
    try:
        model = keras.models.load_model(path, compile=False)
    except (ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageError(
            f"predict: cannot load {path!r} as a Keras model ({first}). Pass a .keras or .h5 "
            f"file (model.save('model.keras')) or a SavedModel directory (model.export(path))."
        ) from exc
    if layer is not None:
        try:
            target = model.get_layer(layer)
        except ValueError as exc:
            names = [lyr.name for lyr in model.layers]
            raise SchemaError(
                f"predict: model {path!r} has no layer {layer!r}; its layers are {names}."
            ) from exc
        model = keras.Model(inputs=model.inputs, outputs=target.output)
    outputs = model.outputs
    if len(outputs) != 1:
        raise SchemaError(
            f"predict: model {path!r} has {len(outputs)} outputs; predict writes one column. "
            f"Pick one with layer=<name of the output layer>."
        )
    inputs = model.inputs
    names = [t.name for t in inputs]
    if len(inputs) > 1:
        missing = [n for n in names if n not in input_cols]
        if missing:
            raise SchemaError(
                f"predict: model {path!r} has inputs {names}; with several inputs each must be "
                f"fed by the input column of the same name, missing {missing}. "
                f"Rename columns (df.withColumnRenamed) or pass input_cols={names}."
            )
    shapes = [tuple(t.shape) for t in inputs]
    dtypes = [_dtype_name(getattr(t, "dtype", "float32")) for t in inputs]

    def fn(arrays: dict[str, np.ndarray]) -> np.ndarray:
        if len(inputs) == 1:
            _numeric_input(arrays, input_cols, dtypes[0], f"the model input {names[0]!r}")
            x = [_assemble(arrays, input_cols, shapes[0]).astype(dtypes[0], copy=False)]
        else:
            for n, d in zip(names, dtypes):
                _numeric_input(arrays, [n], d, f"the model input {n!r}")
            x = [
                _assemble(arrays, [n], s).astype(d, copy=False)
                for n, s, d in zip(names, shapes, dtypes)
            ]
        return np.asarray(model.predict_on_batch(x[0] if len(x) == 1 else x))

    out = outputs[0]
    return Predictor(fn, output_shape=tuple(out.shape)[1:], output_dtype=_dtype_name(out.dtype),
                     input_shape=shapes[0][1:] if len(inputs) == 1 else None)


def _dtype_name(dtype: Any) -> str:
    """``"float32"`` from Keras 3's string or tf_keras' ``tf.DType``."""
    return str(getattr(dtype, "name", dtype))


def _saved_model_predictor(path: str, layer: str | None, input_cols: Sequence[str]) -> Predictor:
    import tensorflow as tf

    if layer is not None:
        raise SchemaError(
            f"predict: layer={layer!r} needs a Keras model file (.keras); {path!r} is a "
            f"SavedModel, whose layers are not addressable. Save the model with model.save("
            f"'model.keras') for feature extraction."
        )
    loaded = tf.saved_model.load(path)
    if "serving_default" not in loaded.signatures:
        raise SchemaError(
            f"predict: SavedModel {path!r} has no 'serving_default' signature (it has "
            f"{sorted(loaded.signatures)}); export it with model.export(path)."
        )
    sig = loaded.signatures["serving_default"]
    in_specs = sig.structured_input_signature[1]
    out_specs = sig.structured_outputs
    if len(out_specs) != 1:
        raise SchemaError(
            f"predict: SavedModel {path!r} has outputs {sorted(out_specs)}; predict writes one "
            f"column. Export a model with one output."
        )
    (out_name, out_spec), = out_specs.items()
    in_names = sorted(in_specs)
    if len(in_names) > 1 and sorted(input_cols) != in_names:
        raise SchemaError(
            f"predict: SavedModel {path!r} takes inputs {in_names}; pass input_cols with exactly "
            f"those names (got {list(input_cols)})."
        )

    def fn(arrays: dict[str, np.ndarray]) -> np.ndarray:
        feed = {}
        for name in in_names:
            spec = in_specs[name]
            cols = input_cols if len(in_names) == 1 else [name]
            _numeric_input(arrays, cols, spec.dtype.name, f"the SavedModel input {name!r}")
            x = _assemble(arrays, cols, tuple(spec.shape))
            feed[name] = tf.constant(x.astype(spec.dtype.as_numpy_dtype, copy=False))
        return sig(**feed)[out_name].numpy()

    return Predictor(
        fn, output_shape=tuple(out_spec.shape)[1:], output_dtype=out_spec.dtype.name,
        input_shape=tuple(in_specs[in_names[0]].shape)[1:] if len(in_names) == 1 else None,
    )


def load_predictor(model_path: str, layer: str | None, input_cols: Sequence[str]) -> Predictor:
    """The default loader: a Keras file (``.keras``/``.h5``) or a SavedModel directory.

    A custom ``loader`` passed to :func:`predict` has this same signature and returns a
    :class:`Predictor`; it may wrap this function.

    An ``s3://`` or ``hdfs://`` model is copied to a local temporary directory through
    ``pyarrow.fs``, loaded, and the copy removed (TensorFlow 2.18+ reads neither itself).

    Raises:
        StorageError: the path is neither a Keras file nor a SavedModel directory.
        SchemaError: the layer does not exist, or the model's inputs/outputs do not fit.
    """
    if through_pyarrow(model_path):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dataplane-model-") as scratch:
            try:
                local = download(model_path, scratch)
            except StorageError as exc:
                raise StorageError(f"predict: {exc}") from exc
            try:
                return load_predictor(local, layer, input_cols)
            except (StorageError, SchemaError) as exc:  # named by the URL, not the copy
                raise type(exc)(str(exc).replace(local, model_path)) from exc
    if os.path.isdir(model_path):
        if not os.path.exists(os.path.join(model_path, "saved_model.pb")):
            raise StorageError(
                f"predict: {model_path!r} is a directory without saved_model.pb, so not a "
                f"SavedModel. Pass a .keras file or the directory model.export() wrote."
            )
        return _saved_model_predictor(model_path, layer, input_cols)
    return _keras_predictor(model_path, layer, input_cols)


def _loader_key(loader: Callable) -> str:
    key = getattr(loader, "cache_key", None)
    if key is not None:
        return str(key)
    kind = loader if hasattr(loader, "__qualname__") else type(loader)
    return f"{getattr(kind, '__module__', '?')}.{kind.__qualname__}"


def _cached_predictor(
    model_path: str, layer: str | None, input_cols: Sequence[str], loader: Callable
) -> Predictor:
    """This process's Predictor for the model and columns, loaded again only when the model's
    files change: Spark reuses its Python workers, and a model retrained and saved to the same
    path must not be answered by the one loaded before."""
    key = (model_path, layer, _loader_key(loader), tuple(input_cols))
    stamp = files_stamp(model_path)
    with _MODELS_LOCK:
        cached = _MODELS.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        predictor = loader(model_path, layer, list(input_cols))
        if not isinstance(predictor, Predictor):
            raise TypeError(
                f"predict: loader {key[2]} returned {type(predictor).__name__}, not a "
                f"dataplane.workloads.batch_predict.Predictor."
            )
        for old in [k for k, (s, _) in _MODELS.items() if k[0] == model_path and s != stamp]:
            del _MODELS[old]  # an earlier save of this model: never answered again
        _MODELS[key] = (stamp, predictor)
        logger.info("predict: loaded %s (layer %s) in pid %d", model_path, layer, os.getpid())
        return predictor


def _arrow_output_type(shape: tuple[int | None, ...], dtype: str) -> pa.DataType:
    try:
        base = pa.from_numpy_dtype(np.dtype(dtype))
    except (TypeError, ValueError):
        base = pa.float32()
    if base not in (pa.float32(), pa.float64(), pa.int32(), pa.int64()):
        base = pa.float64() if pa.types.is_floating(base) else pa.int64()
    if math.prod(d or 0 for d in shape) == 1 or shape == ():
        return base
    return pa.list_(base)


def _dense_shapes(batch: pa.RecordBatch, cols: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Declared per-row shapes for list columns, taken from the first row (to_numpy checks all)."""
    shapes = {}
    for c in cols:
        t = batch.schema.field(c).type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            first = batch.column(c).slice(0, 1).to_pylist()[0] if batch.num_rows else None
            if first is not None:  # a null first row: to_numpy names the column and the fix
                shapes[c] = tuple(np.shape(first))
    return shapes


def _check_equal_lengths(batch: pa.RecordBatch, cols: Sequence[str],
                         shown: dict[str, str] | None = None) -> None:
    """A null, or a list column whose rows differ in length, cannot feed a model input: name
    the column (as ``shown`` names it to the user, if given), the rows and the fix (to_numpy's
    advice, fill_values= or declaring the column ragged, is for the readers, not for predict)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    where = f"partition {ctx.partitionId()}" if ctx is not None else "this batch"
    for col in cols:
        arr = batch.column(col)
        c = (shown or {}).get(col, col)
        err = model_input_nulls(c, arr, where, "predict")
        if err is not None:
            # the row by its other scalar columns' values (an id), as the decode errors do
            from formats.schema import first_null_row, null_row_note

            others = [n for n, f in zip(batch.schema.names, batch.schema)
                      if n not in cols and not pa.types.is_nested(f.type)][:3]
            row = first_null_row(arr)
            if others and row is not None:
                err.args = (err.args[0] + null_row_note(batch, row, others),)
            raise err
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) or len(arr) < 2:
            continue
        lengths = np.asarray(arr.value_lengths().fill_null(-1))
        odd = np.flatnonzero(lengths != lengths[0])
        if odd.size:
            raise SchemaError(
                f"predict: column {c!r} holds lists of different lengths (row 0 of this batch has "
                f"{lengths[0]} values, row {int(odd[0])} has {lengths[odd[0]]}; -1 is a null "
                f"list); a model input needs the same length in every row. Pad or filter the "
                f"rows first."
            )


# A task that fails on its input (a shape, a dtype, text for numbers: SchemaError) fails the
# same way on every retry of it, and Spark retries a failed task up to spark.task.maxFailures
# times (4 on a cluster), each in a new Python worker that loads TensorFlow and the model again
# first: tens of seconds a try before the user sees the error. The first attempt leaves its
# message in the executor's SparkFiles folder (one per application, removed with it), under the
# task's SQL execution (one per action), stage and partition, and a retry on that executor raises
# it at once. A new action is a new execution, so a fixed model or input is always tried.
_FAILED_DIR = "dataplane-predict-failed"
_REPEATED = ("(this retry raised it again without loading the model: an earlier attempt of this "
             "task failed the same way on the same rows)")


def _failure_memo() -> str | None:
    """Where this task's attempts share a deterministic failure; None outside a Spark task."""
    try:
        from pyspark import SparkFiles, TaskContext

        ctx = TaskContext.get()
        if ctx is None:
            return None
        root = SparkFiles.getRootDirectory()
    except Exception:  # noqa: BLE001 - without a place to share it, every retry just runs
        return None
    # the SQL execution (one per action) too: a later job may run a failed job's stage again
    # under the same stage id
    run = ctx.getLocalProperty("spark.sql.execution.id") or "-"
    return os.path.join(root, _FAILED_DIR, f"run{run}-stage{ctx.stageId()}-partition{ctx.partitionId()}")


def _remember_failure(memo: str, message: str) -> None:
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        write_text_atomic(memo, message)
    except OSError:  # the retries then run in full, as they would anyway
        logger.debug("could not record a failed predict task at %s", memo, exc_info=True)


class _PredictBatches:
    """The mapInArrow function: picklable state only; the model comes from the process cache."""

    def __init__(
        self,
        *,
        model_path: str,
        input_cols: list[str],
        output_col: str,
        output_type: pa.DataType,
        batch_size: int,
        layer: str | None,
        loader: Callable,
        sources: dict[str, str] | None = None,
        output_shape: Sequence[int | None] = (),
        shape_given: bool = False,
    ) -> None:
        self.model_path = model_path
        # the per-row shape the output column was declared with, and whether the caller gave
        # it (output_shape=) or the driver's copy of the model did
        self.output_shape = tuple(output_shape)
        self.shape_given = shape_given
        self.input_cols = input_cols
        # input column -> the column holding its values as an array (a Spark ML vector's
        # vector_to_array copy, dropped from the output); the others hold their own values
        self.sources = dict(sources or {})
        self.output_col = output_col
        self.output_type = output_type
        self.batch_size = batch_size
        self.layer = layer
        self.loader = loader

    def _column(self, out: np.ndarray, rows: int) -> pa.Array:
        if out.shape[0] != rows:
            raise SchemaError(
                f"predict: the model returned {out.shape[0]} rows for a batch of {rows}; it "
                f"must return one output row per input row."
            )
        t = self.output_type
        per_row = out.shape[1:]
        declared = self.output_shape
        if all(d is not None for d in declared) and math.prod(per_row) != math.prod(declared):  # type: ignore[arg-type]
            how = ("output_shape=" + repr(list(declared)) + " was given" if self.shape_given
                   else f"the model on the driver declared {declared}")
            raise SchemaError(
                f"predict: the model returned per-row shape {per_row} for column "
                f"{self.output_col!r}, but {how}. Pass output_shape={list(per_row)!r}, or leave "
                f"output_shape out and the driver learns it from the model."
            )
        if pa.types.is_list(t):
            flat = out.reshape(rows, -1)
            width = flat.shape[1]
            offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
            values = pa.array(flat.ravel().astype(t.value_type.to_pandas_dtype(), copy=False))
            return pa.ListArray.from_arrays(offsets, values, type=t)
        return pa.array(out.reshape(rows).astype(t.to_pandas_dtype(), copy=False), type=t)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        memo = _failure_memo()
        if memo is not None and os.path.exists(memo):
            with open(memo, encoding="utf-8") as f:
                raise SchemaError(f"{f.read()} {_REPEATED}")
        try:
            yield from self._predict(batches)
        except SchemaError as e:
            if memo is not None:
                _remember_failure(memo, str(e))
            raise

    def _predict(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from formats.sparktask import prepare_task

        prepare_task()
        predictor = _cached_predictor(self.model_path, self.layer, self.input_cols, self.loader)
        field = pa.field(self.output_col, self.output_type)
        feed = [self.sources.get(c, c) for c in self.input_cols]
        named = dict(zip(feed, self.input_cols))
        hidden = set(self.sources.values())
        for batch in batches:
            keep = [i for i, name in enumerate(batch.schema.names) if name not in hidden]
            schema = pa.schema([batch.schema.field(i) for i in keep]).append(field)
            for start in range(0, batch.num_rows, self.batch_size):
                chunk = batch.slice(start, self.batch_size)
                _check_equal_lengths(chunk, feed, named)
                specs = column_specs(chunk.schema, columns=feed, shapes=_dense_shapes(chunk, feed))
                arrays = {named[k]: a for k, a in to_numpy(chunk, specs).items()}
                for name, a in arrays.items():
                    if isinstance(a, RaggedColumn):
                        raise SchemaError(
                            f"predict: column {name!r} holds lists of different lengths; a "
                            f"model input needs the same length in every row. Pad or filter "
                            f"the rows first."
                        )
                out = predictor(arrays)
                yield pa.RecordBatch.from_arrays(
                    [*(chunk.column(i) for i in keep), self._column(out, chunk.num_rows)],
                    schema=schema,
                )


def _check_input_types(df: Any, cols: list[str]) -> None:
    """A column TF cannot hold (map, decimal, struct, interval...) fails ``predict`` itself, not
    the first action on its result."""
    from formats.export import spark_arrow_schema

    try:
        from pyspark.sql.types import StructType

        fields = StructType([f for f in df.schema.fields if f.name in cols])
        column_specs(spark_arrow_schema(fields), columns=cols)
    except SchemaError as exc:
        raise SchemaError(f"predict: input {exc}") from exc


def predict(
    df: Any,
    model_path: str,
    *,
    input_cols: Sequence[str],
    output_col: str = "prediction",
    batch_size: int = 1024,
    layer: str | None = None,
    loader: Callable[[str, str | None, list[str]], Predictor] | None = None,
    output_shape: Sequence[int] | None = None,
    output_dtype: str = "float32",
) -> Any:
    """Add a column with the model's output for every row of ``df``; keep every input column.

    How columns feed the model: a model with one input gets the one input column as is (a list
    column is reshaped to the input's shape when the sizes agree, e.g. 784 floats -> 28x28x1), or
    several scalar columns stacked side by side into ``[batch, len(input_cols)]``. A model with
    several inputs gets each from the column of the same name.

    Args:
        df: the Spark DataFrame to score.
        model_path: a Keras ``.keras``/``.h5`` file or a SavedModel directory, readable at the
            same path on the driver and every executor: a shared or local filesystem, or an
            ``s3://`` / ``hdfs://`` URL (each process copies the model to a local temporary
            directory to load it).
        input_cols: the columns that feed the model, in the order the model expects.
        output_col: name of the added column (default ``"prediction"``); must not exist yet.
            One value per row becomes a numeric column, more become ``array<float>`` (flattened).
        batch_size: most rows per model call (default 1024: small enough for a few MB of input
            per call, large enough to amortise the call overhead).
        layer: return this layer's output instead of the model's (feature extraction); Keras
            files only.
        loader: ``loader(model_path, layer, input_cols) -> Predictor`` replacing
            :func:`load_predictor`, e.g. for another model format; must be picklable.
        output_shape: per-row output shape; when given, the driver does not load the model to
            learn it (with ``output_dtype``, default float32).

    Returns:
        ``df`` with ``output_col`` appended, same rows.

    Raises:
        SchemaError: a column is missing or of a type TensorFlow cannot hold, the output column
            exists, or the model's inputs and outputs do not fit (checked on the driver,
            which loads the model unless ``output_shape`` is given).
        StorageError: the model path does not exist on the driver, or is not a model.

    The output is lazy: what only the rows can show (a list of the wrong length, a null, text
    for a numeric input, an output of another shape than ``output_shape``) fails the Spark
    action that computes it (``count()``, ``write``), as a Spark ``PythonException`` whose
    message carries this module's ``SchemaError`` text, naming the column and the fix. Spark's
    retries of such a task raise the first attempt's error at once, without loading the model
    again (the same rows fail the same way), so the action fails after one load, not
    ``spark.task.maxFailures`` of them.
    """
    if not hasattr(df, "mapInArrow"):
        raise TypeError(f"predict: df must be a Spark DataFrame, got {not_a_spark_frame(df)}.")
    if isinstance(input_cols, str) or not input_cols or not all(
        isinstance(c, str) for c in input_cols
    ):
        raise ValueError(
            f"predict: input_cols must be a non-empty list of column names, got {input_cols!r}."
        )
    missing = [c for c in input_cols if c not in df.columns]
    if missing:
        raise SchemaError(
            f"predict: input column(s) {missing} are not in the DataFrame (columns: "
            f"{df.columns}); fix input_cols."
        )
    if not isinstance(output_col, str) or not output_col or output_col in df.columns:
        raise SchemaError(
            f"predict: output_col {output_col!r} is empty or already a column of the DataFrame "
            f"({df.columns}); pick a new name, e.g. output_col='prediction_1'."
        )
    cols = list(input_cols)
    # Spark ML vector inputs (VectorAssembler's) reach the model as float64 arrays, from hidden
    # vector_to_array copies; the vector columns themselves come back unchanged.
    sources = {c: f"__dataplane_array_{c}" for c in cols if c in vector_columns(df.schema)}
    frame = df
    if sources:
        frame = df.withColumns({h: vector_as_array(c) for c, h in sources.items()})
    _check_input_types(frame, [sources.get(c, c) for c in cols])
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"predict: batch_size must be an int >= 1, got {batch_size!r}.")
    if output_shape is not None and (
        isinstance(output_shape, (str, bytes))
        or not isinstance(output_shape, Sequence)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in output_shape)
    ):
        raise ValueError(
            f"predict: output_shape must be the per-row output shape as a list of ints >= 1 "
            f"(e.g. (10,) for ten scores, () for one), got {output_shape!r}."
        )
    try:
        numeric = np.dtype(output_dtype).kind in "iuf"
    except TypeError:
        numeric = False
    if not numeric:
        raise ValueError(
            f"predict: output_dtype must name a numeric dtype such as 'float32' or 'int64', "
            f"got {output_dtype!r}."
        )
    if layer is not None and (not isinstance(layer, str) or not layer):
        raise ValueError(f"predict: layer must be a layer name or None, got {layer!r}.")
    model_path = os.fspath(model_path)
    if "://" not in model_path:
        if not os.path.exists(model_path):
            raise StorageError(
                f"predict: model_path {model_path!r} does not exist on the driver. Pass a "
                f".keras file or a SavedModel directory on a filesystem every executor sees."
            )
        model_path = os.path.abspath(model_path)
    loader = loader or load_predictor
    shape_given = output_shape is not None
    if output_shape is None:
        probe = _cached_predictor(model_path, layer, cols, loader)
        output_shape, output_dtype = probe.output_shape, probe.output_dtype
        _check_scalar_inputs(frame, [sources.get(c, c) for c in cols], cols,
                             getattr(probe, "input_shape", None))
    out_type = _arrow_output_type(tuple(output_shape), output_dtype)

    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField, StructType

    schema = StructType([*df.schema.fields, StructField(output_col, from_arrow_type(out_type))])
    fn = _PredictBatches(
        model_path=model_path,
        input_cols=cols,
        output_col=output_col,
        output_type=out_type,
        batch_size=batch_size,
        layer=layer,
        loader=loader,
        sources=sources,
        output_shape=tuple(output_shape),
        shape_given=shape_given,
    )
    _bound_batches(frame)
    return map_in_arrow(frame, fn, schema)


def _bound_batches(frame: Any) -> None:
    """On Spark 3.5, rows too wide for its default Arrow batches (images, audio) lower the
    session's rows per batch (``formats.sparkframe.bound_session_batches``), from a sample."""
    from formats.export import spark_arrow_schema
    from formats.sparkframe import arrow_batches_by_rows, bound_session_batches, sampled_row_bytes

    spark = frame.sparkSession
    if getattr(frame, "isStreaming", False) or not arrow_batches_by_rows(spark):
        return
    bound_session_batches(spark, sampled_row_bytes(frame, spark_arrow_schema(frame.schema)), "dataplane.predict")
