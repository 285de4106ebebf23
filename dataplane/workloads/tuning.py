"""Hyper-parameter search on Spark: one trial per Spark task (``dataplane.tune``).

Every point of the search space becomes one Spark job with exactly one task, and the driver keeps
at most ``parallelism`` of those jobs running at once, so a slow or crashing trial never holds up
or takes down the others. The training data is shipped once (a Spark broadcast, or a path each
executor reads) and kept in a per-process cache on the executors, so ten trials that land on the
same Python worker read it once.

A trial that raises is recorded as ``status="error"`` with the exception text and the tail of its
traceback; the other trials carry on. So is one that runs past ``trial_timeout``: each trial's
job has its own job group, and cancelling it makes Spark kill the trial's Python worker, which
frees the slot for the next trial. The result is a DataFrame with one row per trial, best first.

Under Spark Connect (``SparkSession.builder.remote(...)``) there is no SparkContext: a trial is a
one-row ``mapInArrow`` job under an operation tag of its own (``interruptTag`` stops it), and the
data travels inside each trial's plan (Connect has no broadcast), so it is bounded by
``CONNECT_DATA_BYTES``; larger data goes as a Parquet path every executor reads.

Nothing here imports TensorFlow: ``train_fn`` imports whatever it needs on the executor.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["tune", "grid_points", "TrialData"]

logger = logging.getLogger(__name__)

#: Result columns that a param or metric name may not take.
RESERVED_COLUMNS = ("trial", "seconds", "status", "error")
#: How many traceback lines are kept in a failed trial's ``error`` text.
TRACEBACK_LINES = 15
#: Spark Connect: the most data (in memory, as Arrow or numpy holds it) sent inside every trial's
#: plan. The server takes messages of up to 128 MiB (``spark.connect.grpc.maxInboundMessageSize``)
#: and every trial sends its own copy.
CONNECT_DATA_BYTES = 64 << 20

# Per executor Python process: data key -> loaded training data. Filled lazily by TrialData.get().
_DATA_CACHE: dict[str, Any] = {}
_DATA_LOCK = threading.Lock()


def grid_points(space: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Expand a grid (param -> list of values) into one dict per point, in a stable order.

    The last param varies fastest, like nested ``for`` loops written in the dict's order.

    Raises:
        ValueError: a param name is not a non-empty string, or its values are not a non-empty
            list/tuple.
    """
    names = list(space)
    if not names:
        raise ValueError(
            "tune: space is an empty grid (no params), so there is nothing to search; give each "
            "param the values to try, e.g. {'lr': [0.1, 0.01]}."
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tune: space key {name!r} is not a param name; use non-empty strings.")
        values = space[name]
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(
                f"tune: space[{name!r}] = {values!r} is not a non-empty list of values. "
                f"A grid maps each param to the values to try, e.g. {{{name!r}: [0.1, 0.01]}}."
            )
    return [dict(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]


@dataclass(frozen=True)
class TrialData:
    """Picklable handle to the training data, resolved once per executor process.

    Exactly one of ``broadcast`` / ``path`` is set (or neither: no data). ``key`` names the cache
    entry; it is unique per ``tune`` call for broadcast data and the path itself for path data, so
    repeated ``tune`` calls over the same files reuse what an executor has already read.
    """

    key: str
    broadcast: Any = None
    path: str | None = None
    inline: Any = None  # Spark Connect: the data itself, pickled with every trial

    def get(self) -> Any:
        """The data, loaded on first use in this process and cached after that."""
        if self.broadcast is None and self.path is None and self.inline is None:
            return None
        with _DATA_LOCK:
            if self.key not in _DATA_CACHE:
                if self.inline is not None:
                    _DATA_CACHE[self.key] = self.inline
                elif self.broadcast is not None:
                    _DATA_CACHE[self.key] = self.broadcast.value
                else:
                    _DATA_CACHE[self.key] = _read_path(self.path)
                logger.info("tune: loaded training data %s in pid %d", self.key, os.getpid())
            return _DATA_CACHE[self.key]


def _read_path(path: str) -> Any:
    """Read Parquet (file or directory, local or any pyarrow-supported URL) into a pyarrow Table."""
    import pyarrow.dataset as ds

    from dataplane.errors import StorageError

    try:
        return ds.dataset(path, format="parquet").to_table()
    except (OSError, ValueError) as exc:
        raise StorageError(
            f"tune: could not read the training data at {path!r} as Parquet on an executor: "
            f"{exc}. The path must be visible from every executor (a shared filesystem or a "
            f"URL such as s3:// or hdfs://)."
        ) from exc


def _run_trial(payload: tuple[int, dict, Callable, TrialData, str]) -> dict[str, Any]:
    """Executor side: run one trial, never raise (a failure is a result)."""
    from formats.sparktask import prepare_task

    prepare_task()
    index, params, train_fn, data, metric = payload
    start = time.perf_counter()
    clean: dict[str, Any] = {}  # kept on a failed trial: what train_fn returned still shows
    try:
        value = data.get()
        start = time.perf_counter()
        metrics = train_fn(dict(params), value)
        seconds = time.perf_counter() - start
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"train_fn returned {type(metrics).__name__}, not a dict of metrics; "
                f"return e.g. {{{metric!r}: 0.12}}."
            )
        clean = {str(k): _plain(v) for k, v in metrics.items()}
        if metric not in clean:
            raise KeyError(
                f"train_fn returned no {metric!r} metric (got {sorted(clean)}); "
                f"return it or pass tune(..., metric=<one of those>)."
            )
        ranked = clean[metric]
        if isinstance(ranked, bool) or not isinstance(ranked, (int, float)):
            raise TypeError(
                f"train_fn returned {metric!r} = {ranked!r} ({type(ranked).__name__}); the metric "
                f"that ranks the trials must be a number (a float, a numpy or tensor scalar)."
            )
        bad = [k for k in clean if k in RESERVED_COLUMNS or k in params]
        if bad:
            raise ValueError(
                f"train_fn returned metric name(s) {bad} that clash with the result columns "
                f"{list(RESERVED_COLUMNS)} or the params; rename them."
            )
        return {"trial": index, "metrics": clean, "seconds": seconds, "status": "ok", "error": None}
    except Exception as exc:  # noqa: BLE001 - a failed trial is a result, not a crash
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        tail = "\n".join(tail.rstrip().splitlines()[-TRACEBACK_LINES:])
        return {
            "trial": index,
            # the other metrics it returned; the ranked one stays null, as it did not rank
            "metrics": {k: v for k, v in clean.items()
                        if k != metric and k not in RESERVED_COLUMNS and k not in params},
            "seconds": time.perf_counter() - start,
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}\n{tail}",
        }


def _plain(value: Any) -> Any:
    """numpy scalars, 0-d arrays and scalar tensors (``tf.reduce_mean(...)``, a Keras metric's
    ``result()``) -> Python scalars, so the result DataFrame gets plain types."""
    to_numpy = getattr(value, "numpy", None)
    if callable(to_numpy) and getattr(value, "shape", None) is not None and len(value.shape) == 0:
        value = to_numpy()
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return item()
    return value


def _spark_failure_text(exc: BaseException) -> str:
    """The informative lines of a failed Spark job (the messages, not the JVM stack frames)."""
    lines = [
        ln.strip() for ln in str(exc).splitlines()
        if ln.strip() and not ln.lstrip().startswith(("at ", "... "))
    ]
    if len(lines) > TRACEBACK_LINES:  # the first line says what failed, the tail why
        lines = lines[:1] + ["..."] + lines[-(TRACEBACK_LINES - 2):]
    return "\n".join(lines) or type(exc).__name__


def _check_picklable(train_fn: Callable[..., Any]) -> None:
    """A train_fn the executors cannot receive fails here, once, not as every trial's error."""
    from pyspark import cloudpickle

    try:
        cloudpickle.dumps(train_fn)
    except Exception as exc:  # noqa: BLE001 - pickling raises TypeError, PicklingError, ...
        raise TypeError(
            f"tune: train_fn cannot be pickled for the executors ({type(exc).__name__}: {exc}); "
            f"it or something it refers to (a lock, a SparkSession, an open file) must stay on "
            f"the driver. Create such things inside train_fn."
        ) from exc


def _spark_context(spark: Any) -> Any:
    """The SparkContext of a classic session (or the context itself); None for Spark Connect."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return None
    try:
        sc = getattr(spark, "sparkContext", spark)
    except Exception:  # noqa: BLE001
        sc = None
    if not hasattr(sc, "parallelize"):
        raise TypeError(
            f"tune: spark must be a SparkSession (classic or Spark Connect) or a SparkContext, "
            f"got {type(spark).__module__}.{type(spark).__name__}."
        )
    return sc


def _connect_slots(spark: Any) -> int:
    """Spark Connect has no ``defaultParallelism`` to ask: a range without a partition count
    gets that many partitions, so the highest partition id of one says it."""
    from pyspark.sql import functions as F

    ids = spark.range(0, 1 << 16).select(F.spark_partition_id().alias("p"))
    return int(ids.agg(F.max("p")).first()[0]) + 1


def _connect_trial(spark: Any, payload: tuple[Any, ...]) -> dict[str, Any]:
    """One trial as a one-row ``mapInArrow`` job (Spark Connect: no RDDs); its result comes
    back pickled in a binary column."""
    def run(batches: Any) -> Any:
        import pickle

        import pyarrow as pa

        for _ in batches:
            pass
        result = _run_trial(payload)
        yield pa.RecordBatch.from_pydict({"result": [pickle.dumps(result)]},
                                         schema=pa.schema([("result", pa.binary())]))

    import pickle

    row = spark.range(0, 1, numPartitions=1).mapInArrow(run, "result binary").collect()[0]
    return pickle.loads(row["result"])


def _data_bytes(data: Any) -> int:
    """About how many bytes ``data`` holds in memory (pyarrow, pandas, a dict of arrays)."""
    if hasattr(data, "nbytes") and not callable(data.nbytes):
        return int(data.nbytes)
    if hasattr(data, "memory_usage"):
        return int(data.memory_usage(deep=True).sum())
    if isinstance(data, Mapping):
        return sum(_data_bytes(v) for v in data.values())
    return 0


def _build_trials(
    space: Any, num_trials: int | None, seed: int | None
) -> list[dict[str, Any]]:
    if isinstance(space, Mapping):
        if num_trials is not None:
            raise ValueError(
                f"tune: num_trials={num_trials} applies to a sampled space only; a grid "
                f"(dict) runs every point once. Drop num_trials or pass a sampler."
            )
        return grid_points(space)
    if callable(space):
        if not isinstance(num_trials, int) or isinstance(num_trials, bool) or num_trials < 1:
            raise ValueError(
                f"tune: a sampled space (a callable rng -> dict) needs num_trials >= 1, got "
                f"{num_trials!r}; e.g. tune(spark, fn, sampler, num_trials=20)."
            )
        import numpy as np

        rng = np.random.default_rng(seed)
        points = []
        for i in range(num_trials):
            point = space(rng)
            if not isinstance(point, Mapping) or not point:
                raise ValueError(
                    f"tune: the sampler returned {point!r} for trial {i}; it must return a "
                    f"non-empty dict of param -> value."
                )
            points.append({str(k): _plain(v) for k, v in point.items()})
        return points
    if isinstance(space, Sequence) and not isinstance(space, (str, bytes)):
        points = list(space)
        if not points or not all(isinstance(p, Mapping) and p for p in points):
            raise ValueError(
                "tune: a list space must be a non-empty list of non-empty param dicts, one per "
                "trial."
            )
        return [dict(p) for p in points]
    raise TypeError(
        f"tune: space must be a dict of param -> list of values (a grid), a callable "
        f"rng -> dict (a sampler, with num_trials), or a list of param dicts; got "
        f"{type(space).__name__}."
    )


def _ship_data(sc: Any, data: Any) -> TrialData:
    """``sc`` None: Spark Connect, where the data goes inline (no broadcast there)."""
    if data is None:
        return TrialData(key="none")
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if path.startswith("file://"):
            path = path[len("file://"):]
        if "://" not in path and not os.path.exists(path):
            from dataplane.errors import StorageError

            raise StorageError(
                f"tune: data path {path!r} does not exist. Pass a Parquet file or directory "
                f"that every executor can read, or the data itself (pyarrow Table, pandas "
                f"DataFrame, dict of numpy arrays)."
            )
        if "://" not in path:
            path = os.path.abspath(path)
            _check_parquet_data(path)
        # the files as they are now: an executor reads them again once they were rewritten
        return TrialData(key=f"path:{path}:{_files_stamp(path)}", path=path)
    if hasattr(data, "sparkSession") and hasattr(data, "schema") and hasattr(data, "select"):
        # A Spark DataFrame: collect it once on the driver as Arrow, then broadcast the table
        # (Spark ML vector columns as float64 lists, as every other path hands them over).
        import pyarrow as pa

        from formats.sparkframe import dense_vectors

        _no_columns_check(list(data.columns), "the data DataFrame")
        data = dense_vectors(data)
        if hasattr(data, "toArrow"):
            table = data.toArrow()
        else:  # pyspark 3.5: Arrow batches straight from the JVM, not through pandas (which
            # turned a nullable int column into float64 and dropped timestamps' time zone)
            from formats.export import spark_arrow_schema

            batches = data._collect_as_arrow()
            table = (pa.Table.from_batches(batches) if batches
                     else spark_arrow_schema(data.schema).empty_table())
        data = table
    if sc is None:
        size = _data_bytes(data)
        if size > CONNECT_DATA_BYTES:
            raise ValueError(
                f"tune: under Spark Connect the data travels inside every trial's plan (Connect "
                f"has no broadcast), and this data holds {size / (1 << 20):.0f} MiB, over "
                f"{CONNECT_DATA_BYTES >> 20} MiB. Write it as Parquet where every executor can "
                f"read it and pass the path: df.write.parquet('s3://bucket/tune-data'), then "
                f"tune(spark, fn, space, data='s3://bucket/tune-data')."
            )
        return TrialData(key=f"inline:{uuid.uuid4().hex}", inline=data)
    return TrialData(key=f"broadcast:{uuid.uuid4().hex}", broadcast=sc.broadcast(data))


def _files_stamp(path: str) -> str:
    """A short digest of the files at ``path`` as they are now; a fresh one when they cannot be
    listed from the driver (never reuse a cached copy then; the executors will say why)."""
    import hashlib

    from formats.fs import files_stamp

    stamp = files_stamp(path)
    return hashlib.sha1(repr(stamp).encode()).hexdigest()[:16] if stamp else uuid.uuid4().hex


def _no_columns_check(columns: list[str], what: str) -> None:
    if not columns:
        from dataplane.errors import SchemaError

        raise SchemaError(
            f"tune: {what} has no columns, so every trial would get empty data. Select the "
            f"columns train_fn reads (df.select('features', 'label')), or pass data=None."
        )


def _check_parquet_data(path: str) -> None:
    """Read a local data path's Parquet footers on the driver: a file that is not Parquet, or
    data with no columns, fails ``tune`` itself instead of every trial on the executors."""
    import pyarrow.dataset as ds

    from dataplane.errors import StorageError

    try:
        schema = ds.dataset(path, format="parquet").schema
    except (OSError, ValueError) as exc:
        raise StorageError(
            f"tune: the data at {path!r} is not readable as Parquet ({exc}). Pass a Parquet "
            f"file or directory (only Parquet files in it), or the data itself."
        ) from exc
    _no_columns_check(list(schema.names), f"the data at {path!r}")


def _value_type(values: list[Any]) -> str:
    """The Spark SQL type for one result column, from the values seen (nulls ignored)."""
    seen = [v for v in values if v is not None]
    if not seen:
        return "string"
    if all(isinstance(v, bool) for v in seen):
        return "boolean"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in seen):
        return "bigint"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in seen):
        return "double"
    return "string"


def _cast(value: Any, kind: str) -> Any:
    if value is None:
        return None
    if kind == "double":
        return float(value)
    if kind == "string" and not isinstance(value, str):
        return repr(value)
    return value


def _sort_key(metric: str, mode: str) -> Callable[[dict], tuple]:
    def key(row: dict) -> tuple:
        value = row["metrics"].get(metric)
        if row["status"] != "ok":
            return (2, 0.0, row["trial"])  # failed trials last
        if not isinstance(value, (int, float)) or math.isnan(value):
            return (1, 0.0, row["trial"])  # ran, but its metric is NaN (a diverged run)
        return (0, value if mode == "min" else -value, row["trial"])

    return key


def tune(
    spark: Any,
    train_fn: Callable[[dict, Any], Mapping[str, Any]],
    space: Any,
    *,
    data: Any = None,
    metric: str = "loss",
    mode: str = "min",
    parallelism: int | None = None,
    num_trials: int | None = None,
    seed: int | None = 0,
    trial_timeout: float | None = None,
) -> Any:
    """Run one training trial per point of ``space``, each as its own Spark task.

    Args:
        spark: a ``SparkSession``, classic or Spark Connect (``builder.remote(...)``), or a
            ``SparkContext``.
        train_fn: ``train_fn(params, data) -> dict of metrics``, run on an executor. Must be
            picklable (a module-level function, or a closure cloudpickle can ship).
        space: what to try, one of
            - a grid: ``{"lr": [0.1, 0.01], "units": [16, 32]}`` -> every combination (4 trials);
            - a sampler: a callable ``rng -> dict`` given a ``numpy.random.Generator``, called
              ``num_trials`` times on the driver (seeded by ``seed``, so runs repeat);
            - a list of param dicts, one per trial.
        data: training data handed to every trial, shipped once: a pyarrow Table, pandas
            DataFrame or dict of numpy arrays is broadcast and arrives as the same type; a Spark
            DataFrame is collected once on the driver and arrives as a pyarrow Table; a path
            (Parquet file or directory, local or URL) is read by each executor process once and
            arrives as a pyarrow Table. Under Spark Connect, which has no broadcast, data
            that is not a path goes with every trial, up to 64 MiB (``CONNECT_DATA_BYTES``).
            ``None`` (default): ``train_fn`` gets ``None``.
        metric: the metric that ranks trials (default ``"loss"``); each ``train_fn`` must return
            it, or that trial is recorded as an error.
        mode: ``"min"`` (default, for losses) or ``"max"`` (for accuracies).
        parallelism: trials running at once (default: Spark's default parallelism, i.e. the
            executor slots, so every slot holds one trial).
        num_trials: how many points to draw from a sampler (required for a sampler only).
        seed: seed for the sampler's generator (default 0: the same points every run).
        trial_timeout: seconds a trial may take, counted from its Spark job's submission (a
            worker's first TensorFlow import counts); one that runs longer is cancelled, its Python
            worker killed, and it is recorded as ``status="error"`` saying so, while the other
            trials carry on. ``None`` (default): no limit.

    Returns:
        A Spark DataFrame, one row per trial, best first (a NaN metric after every number,
        failed trials last, keeping the other metrics they returned): ``trial`` (index
        in the order the space produced the points), one column per param, one per metric,
        ``seconds`` (time inside ``train_fn``; an executor process's first trial also pays for
        the imports it makes, TensorFlow's 5-20 s), ``status`` (``"ok"``/``"error"``) and ``error``
        (exception text and traceback tail, null when ok). Params/metrics that are not numbers,
        booleans or strings appear as their ``repr``.

    Raises:
        ValueError / TypeError: bad ``space``, ``metric``, ``mode`` or ``parallelism``, before
            anything runs.
        StorageError: ``data`` is a local path that does not exist.
    """
    if not callable(train_fn):
        raise TypeError(
            f"tune: train_fn must be callable as train_fn(params: dict, data) -> dict of "
            f"metrics, got {type(train_fn).__name__}."
        )
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"tune: metric must be a metric name such as 'loss', got {metric!r}.")
    if mode not in ("min", "max"):
        raise ValueError(f"tune: mode must be 'min' or 'max', got {mode!r}.")
    if parallelism is not None and (
        not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1
    ):
        raise ValueError(f"tune: parallelism must be an int >= 1 or None, got {parallelism!r}.")
    if trial_timeout is not None and (
        isinstance(trial_timeout, bool) or not isinstance(trial_timeout, (int, float))
        or not trial_timeout > 0 or math.isinf(trial_timeout)
    ):
        raise ValueError(
            f"tune: trial_timeout must be a number of seconds > 0 or None (no limit), got "
            f"{trial_timeout!r}."
        )
    sc = _spark_context(spark)
    _check_picklable(train_fn)
    points = _build_trials(space, num_trials, seed)
    param_names: list[str] = []
    for point in points:
        for name in point:
            if name not in param_names:
                param_names.append(name)
    clash = [n for n in param_names if n in RESERVED_COLUMNS]
    if clash:
        raise ValueError(
            f"tune: param name(s) {clash} clash with the result columns "
            f"{list(RESERVED_COLUMNS)}; rename them."
        )
    if metric in param_names:
        raise ValueError(f"tune: metric {metric!r} is also a param name; rename one of them.")

    shipped = _ship_data(sc, data)
    if parallelism is None:
        parallelism = _connect_slots(spark) if sc is None else sc.defaultParallelism
    workers = min(parallelism, len(points))
    group = f"dataplane-tune-{uuid.uuid4().hex[:8]}"
    logger.info("tune: %d trials, %d at a time (job group %s)", len(points), workers, group)

    def one(index: int) -> dict[str, Any]:
        payload = (index, points[index], train_fn, shipped, metric)
        # a job group (Connect: an operation tag) per trial, so that a trial past its time is
        # cancelled alone (Spark then kills its task's Python worker: checked by the tests)
        tag = f"{group}-{index}"
        if sc is None:
            spark.addTag(tag)  # this thread's operations only
        else:
            sc.setJobGroup(tag, f"tune trial {index}: {points[index]}", interruptOnCancel=True)
        expired = threading.Event()
        timer = None
        if trial_timeout is not None:
            def expire() -> None:
                expired.set()
                if sc is None:
                    spark.interruptTag(tag)
                else:
                    sc.cancelJobGroup(tag)

            timer = threading.Timer(trial_timeout, expire)
            timer.daemon = True
            timer.start()
        started = time.perf_counter()
        try:
            if sc is None:
                return _connect_trial(spark, payload)
            return sc.parallelize([payload], 1).map(_run_trial).collect()[0]
        except Exception as exc:  # noqa: BLE001 - the task itself died (worker crash, OOM...)
            if expired.is_set():
                error = (f"trial_timeout: the trial ran past trial_timeout={trial_timeout:g} s "
                         f"and was cancelled (its Python worker was stopped)")
            else:
                error = "Spark task failed: " + _spark_failure_text(exc)
            return {
                "trial": index,
                "metrics": {},
                "seconds": time.perf_counter() - started if expired.is_set() else float("nan"),
                "status": "error",
                "error": error,
            }
        finally:
            if timer is not None:
                timer.cancel()
            if sc is None:
                spark.removeTag(tag)

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dataplane-tune") as pool:
            results = list(pool.map(one, range(len(points))))
    finally:
        if shipped.broadcast is not None:
            shipped.broadcast.unpersist(blocking=False)

    results.sort(key=_sort_key(metric, mode))
    failed = sum(r["status"] != "ok" for r in results)
    if failed:
        logger.warning("tune: %d of %d trials failed; see the 'error' column", failed, len(results))
    return _to_dataframe(spark, results, points, param_names, metric)


def _to_dataframe(
    spark: Any,
    results: list[dict[str, Any]],
    points: list[dict[str, Any]],
    param_names: list[str],
    metric: str,
) -> Any:
    from pyspark.sql import SparkSession

    session = spark if hasattr(spark, "createDataFrame") else SparkSession.builder.getOrCreate()
    metric_names = [metric]
    for r in results:
        for name in r["metrics"]:
            if name not in metric_names:
                metric_names.append(name)
    columns: dict[str, list[Any]] = {"trial": [r["trial"] for r in results]}
    for name in param_names:
        columns[name] = [points[r["trial"]].get(name) for r in results]
    for name in metric_names:
        columns[name] = [r["metrics"].get(name) for r in results]
    columns["seconds"] = [float(r["seconds"]) for r in results]
    columns["status"] = [r["status"] for r in results]
    columns["error"] = [r["error"] for r in results]
    kinds = {name: _value_type(values) for name, values in columns.items()}
    kinds["seconds"] = "double"
    if all(v is None for v in columns[metric]):
        kinds[metric] = "double"  # every trial failed: keep the metric numeric
    schema = ", ".join(f"`{name}` {kind}" for name, kind in kinds.items())
    rows = [
        tuple(_cast(columns[name][i], kinds[name]) for name in columns) for i in range(len(results))
    ]
    return session.createDataFrame(rows, schema=schema)
