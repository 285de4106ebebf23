"""Every exception the project raises on purpose: import them from here.

The classes are defined in :mod:`formats.errors` (the lowest package, so ``formats`` and
``feeders`` raise them without importing ``dataplane``); this module re-exports every one, so
``except dataplane.errors.SchemaError`` catches exactly what ``formats`` and ``feeders`` raise.
:func:`error_summary` reads node tracebacks and :func:`spark_job_error` a failed Spark job's
error; both are the driver's own, as is :func:`jvm_gone` (has the session's JVM exited?), which
the CLI uses too. :func:`model_input_nulls` words a null sent to a model
(inference and ``dataplane.predict``). :data:`TF_STARTUP_NOISE` matches what TensorFlow logs at
start-up, some of it as errors, that is not one (the console script leaves it out of its own
stderr); :func:`drop_tf_noise` also drops TF 2.16's end-of-pass warnings (the driver uses it on
the node logs it shows).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from formats.errors import (
    ClusterStateError,
    DataplaneError,
    FeedError,
    NodeError,
    NodeSchemaError,
    NotServing,
    RecordError,
    ReservationError,
    SchemaError,
    StackError,
    StorageError,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
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
    "NotServing",
    "error_summary",
    "known_fix",
    "spark_job_error",
    "spark_jvm_exited",
    "jvm_gone",
    "JVM_EXITED",
    "SPARK_OOM_FIX",
    "model_input_nulls",
    "TF_STARTUP_NOISE",
    "drop_tf_noise",
]

#: What TensorFlow prints at start-up on a machine without a GPU that means nothing to a user,
#: whatever ``TF_CPP_MIN_LOG_LEVEL`` says (TF 2.21 logs these through absl before its log level
#: is read; TF 2.16 logs its "factory" lines as errors): absl's note on early messages, the
#: oneDNN and missing-CUDA-driver notices, ``cuInit`` failing the way it does with no driver
#: (303), TF 2.16's three "Unable to register cuDNN/cuBLAS/cuFFT factory" lines per process,
#: and MultiWorkerMirroredStrategy's "Coordination agent has successfully connected"; the two
#: lines of the CPU-instructions notice; and what TensorFlow logs once per process about the
#: generator op ``ctx.dataset()`` and the pull readers are built on (its graph rewrites skipped,
#: its malloc trim setting: ours, and nothing a user can act on; see ``feeders.generator``).
#: Matched anywhere in a line, so prefixed lines (``[node 0 chief] ...``) match too.
TF_STARTUP_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|\] oneDNN custom operations are on\."
    r"|\] Could not find cuda drivers on your machine, GPU will not be used\."
    r"|\] This TensorFlow binary is optimized to use available CPU instructions in "
    r"performance-critical operations\."
    r"|^(?:\[node [^]]*\] )?To enable the following instructions: [A-Z0-9_ ,]+ in other operations, "
    r"rebuild TensorFlow with the appropriate compiler flags\."
    r"|\] Input of GeneratorDatasetOp::Dataset will not be optimized because the dataset does not "
    r"implement the AsGraphDefInternal\(\) method"
    r"|\] Memory patch applied: M_TRIM_THRESHOLD=\d+ kb was set\."
    r"|\] TF-TRT Warning: Could not find TensorRT$"
    r"|\] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR \(303\)"
    r"|Unable to register cu(?:DNN|BLAS|FFT) factory: Attempting to register factory"
    r"|\] Coordination agent has successfully connected\."
)

#: TF 2.16's warning at the end of every pass over a dataset (tensorflow#62963), with the op it
#: names on the next line(s), which start with a tab: ``\t [[{{node IteratorGetNext}}]]``.
_END_OF_SEQUENCE = re.compile(
    r"\] Local rendezvous is aborting with status: OUT_OF_RANGE: End of sequence$"
)


def drop_tf_noise(lines: list[str]) -> list[str]:
    """``lines`` without :data:`TF_STARTUP_NOISE` and TF 2.16's "Local rendezvous is aborting
    with status: OUT_OF_RANGE: End of sequence" warnings (each with its ``[[{{node ...}}]]``
    lines), which TensorFlow logs whenever a pass over a dataset ends normally."""
    out: list[str] = []
    after_end = False
    for line in lines:
        if after_end and line.startswith("\t [["):
            continue
        after_end = bool(_END_OF_SEQUENCE.search(line.rstrip("\r")))
        if not after_end and not TF_STARTUP_NOISE.search(line):
            out.append(line)
    return out


_EXC_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Stopped|Shutdown))\b:?\s")


_ROOT_ERRORS = re.compile(r"^\d+ root error\(s\) found\.$")  # TF's header over "(0) ..." lines
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_summary(text: str, *, max_lines: int = 8, max_chars: int = 1500) -> str:
    """The most telling part of a traceback: the last 'SomeError: message' (TF wraps the Python
    error of a tf.data generator inside its own error text), else the last line.

    A message that goes on over more lines (Keras says which layer failed on the first line and
    why on the next ones) keeps them, up to ``max_lines`` lines and ``max_chars`` characters.
    """
    text = _ANSI.sub("", str(text))  # Keras sets parts of its messages in bold
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    first = None
    for i in reversed(range(len(lines))):
        ln = lines[i].strip()
        if _EXC_LINE.match(ln) and not ln.startswith(("tensorflow.python.framework.errors_impl",)):
            first = i
            break
    if first is None:
        for i in reversed(range(len(lines))):
            if _EXC_LINE.match(lines[i].strip()):
                first = i
                break
    if first is None:
        return lines[-1].strip() if lines else ""
    out = [lines[first].strip()]
    where = False  # inside TF's "Detected at node X defined at (most recent call last):" stack
    for ln in lines[first + 1:]:
        if ln.lstrip().startswith(_TF_NOISE):
            where = where or ln.lstrip().startswith("Detected at node ")
            continue
        if where and ln.lstrip().startswith('File "'):
            continue  # where the op was made; the message follows it ("Cast string to float...")
        where = False
        if _ROOT_ERRORS.match(ln.strip()):
            continue
        inside = _IN_DATASET.match(ln.strip())
        if inside:  # a tf.data function's failure (an Assert's text): its message, not its place
            ln = inside.group(1)
        if len(out) >= max_lines or ln.lstrip().startswith(_NOT_MESSAGE) or _EXC_LINE.match(ln.strip()):
            break
        out.append(ln)
    summary = "\n".join(out)
    return summary if len(summary) <= max_chars else summary[: max_chars - 3] + "..."


def spark_job_error(e: BaseException, *, max_lines: int = 8) -> str:
    """What a failed Spark job's error says went wrong, without the stacks around it.

    One of our own errors raised in a task (a FeedError, a SchemaError, a node that failed to
    start) is its line; a Python error in a task (a UDF computing the rows) is the end of the
    Python traceback PySpark quotes after "An exception was thrown from the Python worker:"; a
    JVM error (a file read fails) is the message that follows Py4J's "An error occurred while
    calling o85.collectToPython." line, up to the Java stack. Spark Connect's errors already
    start with their message.
    """
    try:
        text = str(e).strip()
    except Exception:  # noqa: BLE001 - a Py4JJavaError whose JVM has exited cannot say
        return f"{type(e).__name__} (its text could not be read: Spark's JVM no longer answers)"
    return spark_error_text(text, max_lines=max_lines) if text else repr(e)


def spark_error_text(text: str, *, max_lines: int = 8) -> str:
    """:func:`spark_job_error` of an error's text, read once (a Py4JJavaError fetches it from
    the JVM each time, which may have exited since)."""
    text = text.strip()
    for line in text.splitlines():
        if any(f"{name}: " in line for name in _OURS_IN_TASKS) or "failed to start" in line:
            return line.strip()
    if "Traceback (most recent call last)" in text:
        return error_summary(text, max_lines=max_lines)
    lines = text.splitlines()
    if len(lines) > 1 and _PY4J_CALL.match(lines[0]):
        said = []
        for line in lines[1:]:
            if line.lstrip().startswith("at ") or len(said) == max_lines:
                break
            said.append(line.strip())
        message = re.sub(r"\s*SQLSTATE: \w+", "", " ".join(said).lstrip(": "))
        return re.sub(r"^(?:[a-z_]\w*\.)+(?=[A-Z])", "", message)[:2000]  # org.apache.spark.
    return lines[0][:2000] if lines else ""


#: What follows a Spark job's error that names an ``OutOfMemoryError`` (its JVM lived on).
SPARK_OOM_FIX = (
    "Spark ran out of memory: give it more (spark.executor.memory; in local mode, where the "
    "tasks run inside the driver's JVM, spark.driver.memory, set before the session starts) "
    "or have each task hold fewer bytes at once (spark.sql.execution.arrow.maxRecordsPerBatch)."
)

#: What follows "Spark's JVM has exited" in every message that says so.
JVM_EXITED = (
    "pyspark cannot start another JVM in this process, so no Spark job can run from it any "
    "more. The driver's stderr shows why it exited; in local mode, where the tasks run inside "
    "the driver's JVM, it is most often java.lang.OutOfMemoryError: run the program again with "
    "more memory (spark.driver.memory, e.g. spark-submit --driver-memory 4g, or "
    ".config('spark.driver.memory', '4g') on the first session built) or with tasks that hold "
    "fewer bytes at once (spark.sql.execution.arrow.maxRecordsPerBatch)."
)


def jvm_gone(spark: Any = None) -> bool:
    """True once a classic session's JVM has exited (killed by the OS, or out of memory: in
    local mode the tasks run in it, and an ``OutOfMemoryError`` in one ends it): py4j reaches
    it no more. False while it answers, after ``spark.stop()`` (its JVM lives on) and for
    Spark Connect (whose server's failures arrive as errors that say so). ``spark`` None: the
    process's active SparkContext, if pyspark has started one."""
    if spark is None:
        import sys

        pyspark = sys.modules.get("pyspark")
        sc = getattr(getattr(pyspark, "SparkContext", None), "_active_spark_context", None)
    elif type(spark).__module__.startswith("pyspark.sql.connect"):
        return False
    else:
        sc = getattr(spark, "_sc", None)
    if getattr(sc, "_jsc", None) is None:  # none started, or stopped (spark.stop())
        return False
    from py4j.protocol import Py4JNetworkError

    try:
        sc._jsc.sc().isStopped()  # type: ignore[union-attr]
    except (Py4JNetworkError, OSError):
        return True
    except Exception:  # noqa: BLE001 - it answered, with an error
        return False
    return False


def spark_jvm_exited(what: str, said: str = "") -> str:
    """The message for a call whose Spark JVM exited under it (``what``: "pushing epoch 0
    (train, 1 of 2)"); ``said``: the job's error, when Spark could still say it (a job aborted
    for an ``OutOfMemoryError`` just before the JVM went)."""
    return (f"{what} failed: Spark's JVM has exited{f' ({said})' if said else ''}: {JVM_EXITED} "
            f"The TF nodes stop at shutdown (leaving the `with` block) or when this process exits.")


_OURS_IN_TASKS = ("FeedError", "SchemaError", "NotTextError", "RecordError", "StorageError")
_PY4J_CALL = re.compile(r"^An error occurred while calling [\w.:$]+\.?$")  # o85.collect, z:org.x.Y.m


_DICT_OF_COLUMNS = (
    "The model got a dict of columns: without features=, ctx.dataset() yields every column but "
    "the label. Name the model's input: features='x' yields that column's tensor itself (for a "
    "one-input model); a list of names yields a dict keyed like the model's Inputs."
)

_RAGGED_INPUT = (
    "A list column reached the model as a tf.RaggedTensor, which a fixed-size input (a Dense "
    "layer) cannot take: a list column is ragged when its arrays differ in length or, read "
    "from files by feeders.parquet_dataset or tfrecord_dataset, when its length is not "
    "declared. Declare the per-row shape, shapes={'image': (784,)}, on the reader or on "
    "ctx.dataset (`dataplane inspect PATH` prints it for files); a row of another length then "
    "fails naming its row. Variable-length data needs padding or a model that takes ragged input."
)

_BY_NAME_IN_A_CHILD = (
    "main handed a function (or class) of the driver's script to another process "
    "(multiprocessing, a process pool, Keras' use_multiprocessing=True): main reaches the node "
    "by value, but a child process finds what it runs by module and name, and the node's "
    "__main__ is not your script. Define it in a module the executors can import "
    "(spark-submit --py-files, or spark.sparkContext.addPyFile(path)) and import it in main; "
    "or use threads, or tf.data's map(..., num_parallel_calls=tf.data.AUTOTUNE). (A node's "
    "child processes start from a clean process, multiprocessing's 'forkserver', since a "
    "fork of a node's threads can hang.)"
)

# the causes of an empty pass the traceback cannot tell apart; a node that knows why its
# pass was empty says so instead (known_fix's note)
EMPTY_FIRST_EPOCH = (
    "fit's first epoch got no batch from its dataset: the pass was empty. The DataFrame had "
    "no rows, fewer rows than workers (each worker yields the smallest worker's share), or, "
    "with ctx.dataset(drop_remainder=True), fewer rows per worker than one batch (the node's "
    "log says so): push more rows or use a smaller batch_size.")

# TensorFlow errors whose message does not say what the program should do differently here:
# (every text the traceback must hold, the fix)
_KNOWN_FIXES = (
    (("Collective ops must be configured at program startup",),
     "Create tf.distribute.MultiWorkerMirroredStrategy() first thing in main, before "
     "ctx.dataset() or any other TensorFlow op (TF_CONFIG is already set when main starts)."),
    (("Attempt to convert a value (PerReplica", "/keras/src/"),
     "Keras 3's fit does not run under MultiWorkerMirroredStrategy on this TensorFlow: use "
     "Keras 2 (import tf_keras as keras; installed with this package), or set "
     "TF_USE_LEGACY_KERAS=1 before TensorFlow is imported."),
    # Keras 3's fit on a dataset that yields features only (ctx.dataset(...) without label=)
    (("None values not supported", "/keras/src/backend/tensorflow/core.py", ".fit("),
     "Keras met None where it expected a tensor: most often the labels, when fit's dataset "
     "yields features only. Name the label column (ctx.dataset(..., label='y'), or the "
     "reader's label=) so that it yields (features, label) pairs."),
    # a one-input model given ctx.dataset(..., label='y') without features=: Keras 3, tf_keras
    (("The structure of `inputs` doesn't match the expected structure", "Received: inputs={"),
     _DICT_OF_COLUMNS),
    (("Missing data for input", "You passed a data dictionary with keys"), _DICT_OF_COLUMNS),
    # a list column yielded as a tf.RaggedTensor into a Dense layer: Keras 3, tf_keras
    (("may not be ragged in their innermost dimension", "RaggedMatMul"), _RAGGED_INPUT),
    (("only supports RaggedTensors when the innermost dimension is non-ragged",), _RAGGED_INPUT),
    # tf_keras fit whose first epoch got no batch at all
    (("Unexpected result of `train_function` (Empty logs)",), EMPTY_FIRST_EPOCH),
    # ctx.dataset(decode=...) on an image whose bytes break off after a valid signature
    (("jpeg::Uncompress failed",),
     "A value of a ctx.dataset(decode={...: 'jpeg'}) column is a damaged JPEG (it starts like "
     "one but does not decode): find it on the DataFrame, e.g. with a UDF calling "
     "tf.io.decode_jpeg, or drop the rows whose image is shorter than it should be."),
    # multiprocessing in main with a function of the driver's script (by value, not by name)
    (("Can't pickle <function", "on __main__ failed"), _BY_NAME_IN_A_CHILD),
    (("Can't get attribute", "on <module '__main__'"), _BY_NAME_IN_A_CHILD),
    # fit(ds, validation_split=0.2): Keras 3 and tf_keras split in-memory arrays only
    (("validation_split", "only supported for"),
     "Keras splits only in-memory arrays, not a dataset. Split the DataFrame instead: "
     "train_df, val_df = df.randomSplit([0.8, 0.2], seed=1); cluster.train(train_df, epochs, "
     "validation=val_df); and in main, fit(ctx.dataset(...), validation_data="
     "ctx.dataset(..., split='validation'))."),
    # a text column (labels such as 'cat') into a loss or a layer
    (("Cast string to", "is not supported"),
     "A text column reached an op that takes numbers, most often the label ('cat', 'dog'). "
     "Make it numbers on the DataFrame first (pyspark.ml.feature.StringIndexer, or F.when), "
     "or leave it out of what the model gets (ctx.dataset(features=[...]))."),
    # model.save / load_model / a callback writing to s3:// or hdfs:// on TensorFlow 2.18+
    (("File system scheme", "not implemented"),
     "This TensorFlow has no such filesystem (s3:// and hdfs:// moved to tensorflow-io, "
     "which adds them when imported on TensorFlow 2.16 and does not load on 2.18+). Save models with "
     "ctx.save_model(model, url), which saves locally and uploads through pyarrow.fs; load "
     "one in main with `with ctx.local_copy(url) as p: keras.models.load_model(p)`, or score "
     "with dataplane.predict(df, url); read data with "
     "feeders.parquet_dataset or tfrecord_dataset. Point checkpoints and TensorBoard logs at a "
     "local directory (ctx.absolute_path gives a remote one when the cluster's default "
     "filesystem is remote) and copy them up with pyarrow.fs when done."),
    (("DecodePng",), "A value of a ctx.dataset(decode={...: 'png'}) column is a damaged PNG (it "
     "starts like one but does not decode): find it on the DataFrame, e.g. with a UDF calling "
     "tf.io.decode_png."),
)


def known_fix(traceback_text: str, note: str | None = None) -> str | None:
    """What to do about a failure TensorFlow explains poorly, from its traceback; else None.

    ``note``: what the node saw of its data that may be why (a pass that ended empty, and
    the reason it knows): it replaces the guesses at why a pass was empty."""
    text = str(traceback_text)
    fix = next((fix for needles, fix in _KNOWN_FIXES if all(n in text for n in needles)), None)
    if not note:
        return fix
    return "\n".join([*([fix] if fix and fix != EMPTY_FIRST_EPOCH else []), f"The data may be why: {note}"])


# lines of TensorFlow's graph errors that only say where, never what
_TF_NOISE = ("Detected at node ", "<stack traces unavailable>")
# "Error in user-defined function passed to ParallelMapDatasetV2:4 transformation with
# iterator: Iterator::Root::...::ParallelMapV2: assertion failed: [...]": the part after it
_IN_DATASET = re.compile(r"Error in user-defined function passed to .*? transformation with iterator: \S+: (.+)$")
# lines after an error's first line that are not its message: a chained traceback, TF's
# op annotations, the JVM's stack around a failed Spark job
_NOT_MESSAGE = ("Traceback (most recent call last)", 'File "', "During handling", "The above exception",
                "[[", "Error in user-defined function", "at ", "... ", "Caused by", "Driver stacktrace",
                "JVM stacktrace", "SQLSTATE")


def model_input_nulls(name: str, arr: "pa.Array", where: str, who: str) -> SchemaError | None:
    """The error for nulls in ``arr``, a model input column (``who`` calls the model:
    ``"inference"`` or ``"predict"``), with the fix to make on the DataFrame; None if it has
    none. A null row and a null inside a row's array are cleaned differently (``fillna`` does
    not fill arrays)."""
    import numpy as np

    from formats.schema import is_list_type, list_levels

    if arr.null_count:
        first = int(np.argmax(np.asarray(arr.is_null())))
        if is_list_type(arr.type):
            # an empty array would not fit the model's input: fill with one of the rows' length
            valid = arr.drop_null()
            # (a batch of null rows only shows no length: say what to put there, not 1)
            n = len(valid[0].as_py()) if len(valid) else "<values per row>"
            fill = f"F.coalesce(F.col({name!r}), F.array_repeat(F.lit(0.0), {n}))"
        else:
            fill = f"df.fillna({{{name!r}: 0}})"
        return SchemaError(
            f"{who}: column {name!r} has {arr.null_count} null value(s) in {where} (the first in "
            f"row {first} of its batch); a model input cannot hold nulls. Fill them before "
            f"{who} ({fill}) or drop those rows (df.na.drop(subset=[{name!r}]))."
        )
    for inner in list_levels(arr):
        if inner.null_count:
            return SchemaError(
                f"{who}: column {name!r} has {inner.null_count} null element(s) inside its arrays "
                f"in {where}; a model input cannot hold nulls. Fill them before {who} "
                f"(df.withColumn({name!r}, F.transform({name!r}, lambda v: F.coalesce(v, F.lit(0))))) "
                f"or drop those rows (df.where(~F.exists({name!r}, lambda v: v.isNull())))."
            )
    return None
