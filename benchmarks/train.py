"""Train scenario: Keras ``fit`` for several epochs fed by push (cached or not), by the peers,
and on in-memory tensors.

Every path trains the same small Keras model (784 -> 128 relu -> 10, Adam, batch
:data:`BATCH_SIZE`) on the same MNIST-shaped rows for :data:`EPOCHS` epochs per repetition
(``--epochs``), so what a path pays once (a Spark job, a materialisation) is spread over the
epochs as in real training:

* ``flight-push-cache`` (ours): a one-node ``dataplane.run`` cluster whose ``main`` calls
  ``model.fit(ctx.dataset(features=["image"], label="label"), epochs=EPOCHS)`` once per
  repetition (each epoch of ``fit`` is one pass over the dataset: one pushed or replayed epoch); a repetition is ``cluster.train(df, EPOCHS, cache=True)``: one Spark job pushes the
  rows once, the node replays the later epochs from its cache. Each repetition trains a new
  DataFrame object over the same cached Spark data (``df.select("*")``), so every repetition
  pays its push (the cache is keyed by the DataFrame: the same one would replay with no job).
* ``flight-push`` (ours): the same with ``cluster.train(df, EPOCHS)``: one Spark job per epoch.
  Both are timed from the ``train`` call until the node has finished the last epoch's ``fit``
  (``train`` returns once the node has read the last epoch).
* ``in-memory`` (ceiling): a spawned Python process (same TF, same thread settings) holding the
  rows as NumPy arrays: ``model.fit(from_tensor_slices(...).batch(BATCH_SIZE), epochs=EPOCHS)``
  timed around ``fit``. No data movement at all: the best any feed can do.
* ``petastorm-converter`` (peer, compat stack): what Databricks users do today:
  ``make_spark_converter(df)`` (Spark writes the DataFrame as Parquet under
  ``petastorm.spark.converter.parentCacheDirUrl``, a ``file://`` temp dir), then
  ``with converter.make_tf_dataset(batch_size=BATCH_SIZE) as ds`` (an endless stream) and
  ``fit(ds, steps_per_epoch=ceil(rows / BATCH_SIZE), epochs=EPOCHS)`` in the bench process.
  The materialisation is timed (``converter.delete()`` after each repetition, so the next one
  pays it again, as every new training job does).
* ``tfos`` (peer): tensorflowonspark 2.2.5 ``InputMode.SPARK``: ``TFCluster.run`` once, then
  ``cluster.train(df.rdd, num_epochs=EPOCHS)`` per repetition; its ``map_fun`` runs one
  ``model.fit`` over a ``from_generator`` dataset draining ``next_batch(BATCH_SIZE)`` (rows to
  NumPy). TFoS moves one Python row at a time through a multiprocessing queue, so it runs on
  the first :data:`TFOS_MAX_ROWS` rows (its result carries its own row count); timed until
  TFoS's ``train`` returns (every row taken off its queue); the rows ``fit`` saw are checked at
  shutdown.

Targets (``extra``): ``flight-push-cache`` >= :data:`TARGET_RATIO` x ``in-memory`` and
>= :data:`TARGET_VS_PETASTORM` x ``petastorm-converter``, each beside what is reachable at
all: the ``bound`` (:func:`bound`: Spark's own hand-over of the rows to Python, timed as a bare
``mapInArrow`` after the repetitions, must end before the first epoch can, on the cores that
epoch's fit also needs) and ``in-memory`` / ``petastorm-converter`` (no feed beats in-memory). ``extra`` also reports the cached
node's memory (``cache_memory_bytes`` against ``cache_bytes_limit``, spilled bytes and
``buffer_peak_bytes``, from ``cluster.metrics()`` after the last repetition), the Spark jobs
each ours path ran per repetition (warm-up first) and each epoch's ``fit`` seconds on the node.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.data import make_table
from formats.fs import write_text_atomic
from benchmarks.paths import COUNT_SCHEMA, BenchPath, count_partition

__all__ = [
    "TABLES", "BATCH_SIZE", "EPOCHS", "TARGET_RATIO", "TARGET_VS_PETASTORM", "TFOS_MAX_ROWS",
    "build", "extra", "build_model",
]

TABLES = ("mnist",)
BATCH_SIZE = 256
EPOCHS = 5  # per repetition; --epochs overrides
TARGET_RATIO = 0.9  # flight-push-cache / in-memory
TARGET_VS_PETASTORM = 3.0  # flight-push-cache / petastorm-converter
TFOS_MAX_ROWS = 4_000
_COMPAT = "needs the compat stack (pyspark 3.5, pyarrow 14, TF 2.16): bash .ci/setup compat"


def epochs_of(env: Any) -> int:
    """Epochs per repetition: ``--epochs`` if given, else :data:`EPOCHS`."""
    return int(getattr(env, "epochs", None) or EPOCHS)


def build_model(tf: Any) -> Any:
    """The scenario's model: a 784-128-10 MLP taking ``{"image": [batch, 784]}``."""
    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input(shape=(784,), name="image", dtype="float32")
    hidden = tf.keras.layers.Dense(128, activation="relu")(inputs)
    outputs = tf.keras.layers.Dense(10)(hidden)
    model = tf.keras.Model(inputs={"image": inputs}, outputs=outputs)
    model.compile(
        optimizer="adam",
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(obj))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fit_main(args: dict[str, Any], ctx: Any) -> None:
    """The node's ``main``: ``model.fit(ds, epochs=E)`` per repetition, as users write it (one
    pass over ``ctx.dataset`` per epoch = one pushed or replayed epoch, and the same single
    ``fit`` call as the in-memory path); writes ``epoch<e>.json`` at the end of each epoch."""
    import tensorflow as tf

    model = build_model(tf)
    ds = ctx.dataset(batch_size=args["batch_size"], features=["image"], label="label")
    out = Path(args["dir"])
    state = {"epoch": 0, "t0": 0.0, "steps": 0}

    class Record(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            state["t0"] = time.perf_counter()
            state["steps"] = int(model.optimizer.iterations.numpy())

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            steps = int(model.optimizer.iterations.numpy()) - state["steps"]
            _write_json(out / f"epoch{state['epoch']}.json",
                        {"steps": steps, "seconds": time.perf_counter() - state["t0"]})
            state["epoch"] += 1

    while not ctx.should_stop:
        try:
            model.fit(ds, epochs=args["epochs"], verbose=0, callbacks=[Record()])
        except Exception:
            if ctx.should_stop:  # the driver shut down while fit waited for an epoch
                return
            raise


def _memory_worker(conn: Any, rows: int, seed: int, batch_size: int, epochs: int) -> None:
    """Spawned process: fit on in-memory tensors each time the parent sends ``fit``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    table = make_table("mnist", rows, seed=seed)
    image = np.asarray(table.column("image").combine_chunks().values).reshape(rows, 784)
    label = table.column("label").to_numpy()
    ds = tf.data.Dataset.from_tensor_slices(({"image": image}, label)).batch(batch_size)
    model = build_model(tf)
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg != "fit":
            break
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            model.fit(ds, epochs=epochs, verbose=0)
            conn.send(("ok", {"rows": rows * epochs, "seconds": time.perf_counter() - t0,
                              "cpu_seconds": time.process_time() - c0}))
        except Exception as exc:  # noqa: BLE001 - sent back to the parent as the error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class PushFitPath:
    """``flight-push`` / ``flight-push-cache``: one-node cluster; a repetition trains EPOCHS."""

    def __init__(self, env: Any, *, cache: bool) -> None:
        self.spark = env.spark
        self.df = env.dataframe("mnist")
        self.rows = env.rows_of("mnist")
        self.epochs = epochs_of(env)
        self.cache = cache
        self.dir = env.workdir / ("fit-cache" if cache else "fit-push")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster: Any = None
        self.epoch = 0
        self.spark_jobs: list[int] = []  # per repetition (the warm-up included)
        # per repetition: the first epoch's seconds (push included), then each later fit's
        self.epoch_seconds: list[list[float]] = []
        self.final_metrics: dict[Any, Any] | None = None

    def __call__(self) -> int:
        if self.cluster is None:
            import dataplane

            self.cluster = dataplane.run(
                self.spark, fit_main,
                {"dir": str(self.dir), "batch_size": BATCH_SIZE, "epochs": self.epochs},
                num_nodes=1, log_to_driver=False,  # the bench's tables, not TF's start-up notes
            )
        last = self.epoch + self.epochs - 1
        self.epoch += self.epochs
        # A new DataFrame object over the same cached data: the nodes' cache is keyed by the
        # DataFrame, so each repetition pushes once instead of replaying the previous one's.
        t0 = time.perf_counter()
        report = self.cluster.train(self.df.select("*"), self.epochs, cache=self.cache)
        path = self.dir / f"epoch{last}.json"
        deadline = time.monotonic() + 600
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the node did not finish fitting epoch {last} in 600 s")
            time.sleep(0.003)
        self.spark_jobs.append(int(report.spark_jobs))
        # each epoch's own fit time on the node (the first epoch of a cached repetition waits
        # for the push; the later ones replay): where the repetition's time went
        # (the first epoch's own figure also counts the node's wait for this train call, so
        # the first epoch's cost is the repetition's time less the later epochs')
        total = time.perf_counter() - t0
        seconds = [
            round(float((_read_json(self.dir / f"epoch{e}.json") or {}).get("seconds", 0.0)), 3)
            for e in range(last - self.epochs + 1, last + 1)
        ]
        self.epoch_seconds.append([round(total - sum(seconds[1:]), 3)] + seconds[1:])
        consumed = int(report.rows_consumed)
        if consumed != self.rows * self.epochs:
            raise RuntimeError(
                f"fit consumed {consumed} rows, expected {self.rows} x {self.epochs} epochs "
                f"(unconsumed {report.rows_unconsumed}, dropped {report.dropped_for_balance})"
            )
        return consumed

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            try:
                self.final_metrics = cluster.metrics()  # after the repetitions: untimed
            finally:
                cluster.shutdown()


class InMemoryFitPath:
    """``in-memory``: the same fit on ``from_tensor_slices`` tensors in a spawned process."""

    def __init__(self, env: Any) -> None:
        self.rows = env.rows_of("mnist")
        self.seed = env.seed
        self.epochs = epochs_of(env)
        self.proc: Any = None
        self.conn: Any = None
        self.runs: list[tuple[float, float]] = []  # per repetition: (seconds, CPU seconds)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_memory_worker,
            args=(child, self.rows, self.seed, BATCH_SIZE, self.epochs),
            daemon=True,
        )
        self.proc.start()
        child.close()
        self._recv(300, "start")

    def _recv(self, timeout: float, what: str) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the in-memory fit process did not {what} within {timeout:.0f} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"in-memory fit failed: {value}")
        return value

    def __call__(self) -> int:
        if self.proc is None:
            self._start()
        self.conn.send("fit")
        got = self._recv(600, "finish its epochs")
        self.runs.append((float(got["seconds"]), float(got["cpu_seconds"])))
        return int(got["rows"])

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(10)
            self.proc = None


def warm(env: Any) -> str:
    """Spark's JIT warmed on this table before any path runs (:func:`benchmarks.paths.warm_jvm`):
    every path here starts with Spark handing the cached rows to Python."""
    from benchmarks.paths import warm_jvm

    s = warm_jvm(env.dataframe("mnist"))
    return f"JVM warm-up: {len(s)} bare mapInArrow passes, {s[0]:.2f} s first, {s[-1]:.2f} s last"


def build(env: Any) -> list[BenchPath]:
    """The train scenario's paths (always on the MNIST-shaped table)."""
    from benchmarks.train_peers import (
        PetastormConverterPath, TFoSFitPath, petastorm_unavailable, tfos_unavailable,
    )

    rows = env.rows_of("mnist")
    row_bytes = env.row_bytes("mnist")
    epochs = epochs_of(env)
    nbytes = rows * row_bytes * epochs
    cached = PushFitPath(env, cache=True)
    pushed = PushFitPath(env, cache=False)
    memory = InMemoryFitPath(env)
    paths = [
        BenchPath("flight-push-cache", cached, kind="ours", nbytes=nbytes, close=cached.close),
        BenchPath("flight-push", pushed, kind="ours", nbytes=nbytes, close=pushed.close),
        BenchPath("in-memory", memory, kind="ceiling", nbytes=nbytes, close=memory.close),
    ]
    reason = petastorm_unavailable()
    if reason:
        paths.append(BenchPath("petastorm-converter", lambda: 0, kind="peer", unavailable=reason))
    else:
        paths.append(BenchPath("petastorm-converter", PetastormConverterPath(env), kind="peer",
                               nbytes=nbytes))
    reason = tfos_unavailable()
    if reason:
        paths.append(BenchPath("tfos", lambda: 0, kind="peer", unavailable=reason))
    else:
        tfos_rows = min(rows, TFOS_MAX_ROWS)
        tfos = TFoSFitPath(env, tfos_rows)
        paths.append(BenchPath("tfos", tfos, kind="peer", nbytes=tfos_rows * row_bytes * epochs,
                               close=tfos.close))
    env.train_paths = {"flight-push-cache": cached, "flight-push": pushed}
    env.train_memory = memory
    return paths


def _target(results: list[dict[str, Any]], other: str, target: float) -> dict[str, Any] | None:
    ours = next((r for r in results if r["path"] == "flight-push-cache"), None)
    ratio = (ours or {}).get("ratio_vs", {}).get(other)
    if ratio is None:
        peer = next((r for r in results if r["path"] == other), None)
        why = (peer or {}).get("error") or ("flight-push-cache failed" if peer else "not run")
        return {"ratio": None, "target": target, "within_target": None, "why": why}
    from benchmarks.harness import UNSTEADY_SPREAD

    shaky = [r["path"] for r in results if r["path"] in ("flight-push-cache", other)
             and (r.get("spread") or 1.0) >= UNSTEADY_SPREAD]
    got = {"ratio": ratio, "target": target, "within_target": ratio >= target}
    if shaky:
        got["unsteady"] = shaky  # repetitions too spread: the verdict is not to be trusted
    return got


def _median_run(env: Any, job: Callable[[], int], reps: int = 3) -> tuple[float, float] | None:
    """``job()`` (which returns the rows it moved) ``reps`` times on an idle machine: the
    median (seconds, machine core-seconds from /proc/stat), or None without /proc/stat or if
    a run moved the wrong number of rows."""
    from benchmarks.harness import cpu_times, wait_until_idle

    runs = []
    for _ in range(reps):
        wait_until_idle()
        before, t0 = cpu_times(), time.perf_counter()
        n = job()
        seconds, after = time.perf_counter() - t0, cpu_times()
        if before is None or after is None or n != env.rows_of("mnist"):
            return None
        runs.append((seconds, (after[0] - before[0]) / os.sysconf("SC_CLK_TCK")))
    runs.sort()
    return runs[len(runs) // 2]


def _spark_handoff(env: Any) -> tuple[float, float] | None:
    """Spark's own cost of handing the train DataFrame to Python as Arrow: a bare
    ``mapInArrow`` that counts rows (:func:`_median_run`)."""
    df = env.dataframe("mnist")
    return _median_run(env, lambda: sum(r.n for r in df.mapInArrow(count_partition, COUNT_SCHEMA).collect()))


def _flight_handoff(env: Any) -> tuple[float, float] | None:
    """Spark's hand-over plus the rows' trip over Flight to one other process: the same
    ``mapInArrow`` doing bare ``do_put``s into a sink that drops them
    (:class:`benchmarks.push.RawFlightPath`; :func:`_median_run`)."""
    from benchmarks.push import RawFlightPath

    path = RawFlightPath(env)
    try:
        path()  # starts the sink; its first job also warms the connections
        return _median_run(env, path)
    finally:
        path.close()


def bound(epochs: int, cores: int, handoff: tuple[float, float], epoch: tuple[float, float]) -> dict[str, float]:
    """The best ``flight-push-cache`` / ``in-memory`` ratio a feed that costs nothing could
    reach: its first epoch cannot end before Spark has handed over every row (``handoff``:
    seconds, core-seconds), and shares the cores with that epoch's own fit (``epoch``: the
    in-memory seconds and CPU seconds of one epoch); the later epochs go at in-memory pace."""
    (h_s, h_cpu), (e_s, e_cpu) = handoff, epoch
    first = max(h_s, e_s, (h_cpu + e_cpu) / cores)
    return {"first_epoch_min_seconds": first,
            "best_ratio": epochs * e_s / (first + (epochs - 1) * e_s)}


def extra(env: Any, results: list[dict[str, Any]], *, progress: Callable[[str], None]) -> dict[str, Any]:
    """The targets with verdicts, the bound on the first, the Spark jobs per repetition and
    the cached node's memory."""
    from benchmarks.harness import verdict

    label = f"train/{env.table_name}"
    targets = {
        "cache_vs_in_memory": _target(results, "in-memory", TARGET_RATIO),
        "cache_vs_petastorm_converter": _target(results, "petastorm-converter", TARGET_VS_PETASTORM),
    }
    for name, t in targets.items():
        other = "in-memory" if name.endswith("in_memory") else "petastorm-converter"
        if t["ratio"] is None:
            progress(f"[{label}] flight-push-cache vs {other}: no ratio ({t['why'][:120]})")
        else:
            said = verdict(t["within_target"], quick=getattr(env, "quick", False),
                           unsteady=t.get("unsteady"))
            progress(f"[{label}] flight-push-cache: {t['ratio']:.2f}x {other} "
                     f"(target >= {t['target']}x): {said}")
    out: dict[str, Any] = {
        "epochs": epochs_of(env), "batch_size": BATCH_SIZE, "targets": targets,
    }
    memory = getattr(env, "train_memory", None)
    if memory is not None and memory.runs and not getattr(env, "quick", False):
        epochs = epochs_of(env)
        runs = sorted(memory.runs)
        mem_s, mem_cpu = runs[len(runs) // 2]
        handoff = _spark_handoff(env)
        if handoff is not None:
            cores = os.cpu_count() or 1
            b = bound(epochs, cores, handoff, (mem_s / epochs, mem_cpu / epochs))
            ours = targets["cache_vs_in_memory"]["ratio"]
            out["bound"] = {
                "cores": cores, "spark_handoff_seconds": round(handoff[0], 3),
                "spark_handoff_core_seconds": round(handoff[1], 3),
                "in_memory_epoch_seconds": round(mem_s / epochs, 3),
                "in_memory_epoch_cpu_seconds": round(mem_cpu / epochs, 3),
                "first_epoch_min_seconds": round(b["first_epoch_min_seconds"], 3),
                "best_cache_vs_in_memory": round(b["best_ratio"], 3),
                "ours_of_best": round(ours / b["best_ratio"], 3) if ours else None,
            }
            progress(
                f"[{label}] bound: Spark alone hands the rows to Python in {handoff[0]:.2f} s "
                f"({handoff[1]:.2f} core-s on {cores} cores) and an in-memory epoch takes "
                f"{mem_s / epochs:.2f} s ({mem_cpu / epochs:.2f} CPU-s), so no feed can pass "
                f"{b['best_ratio']:.2f}x in-memory at {epochs} epochs here"
                + (f"; flight-push-cache reaches {ours / b['best_ratio']:.0%} of that" if ours else "")
            )
            # the same with the bytes' trip to another process counted: what any feed that
            # moves the rows over Flight (ours does) could reach at best
            flight = _flight_handoff(env)
            if flight is not None:
                bf = bound(epochs, cores, flight, (mem_s / epochs, mem_cpu / epochs))
                out["bound"].update({
                    "flight_handoff_seconds": round(flight[0], 3),
                    "flight_handoff_core_seconds": round(flight[1], 3),
                    "best_flight_fed_vs_in_memory": round(bf["best_ratio"], 3),
                    "ours_of_flight_best": round(ours / bf["best_ratio"], 3) if ours else None,
                })
                progress(
                    f"[{label}] bound over Flight: the same job doing bare do_puts into a sink "
                    f"takes {flight[0]:.2f} s ({flight[1]:.2f} core-s), so no Flight-fed fit can "
                    f"pass {bf['best_ratio']:.2f}x in-memory here"
                    + (f"; flight-push-cache reaches {ours / bf['best_ratio']:.0%} of that" if ours else "")
                )
    peta = next((r for r in results if r["path"] == "petastorm-converter" and r.get("rows_per_s")), None)
    mem_r = next((r for r in results if r["path"] == "in-memory" and r.get("rows_per_s")), None)
    if peta and mem_r:
        # no feed trains faster than in-memory tensors: the most any feed could be vs the peer
        ceiling = mem_r["rows_per_s"] / peta["rows_per_s"]
        out["in_memory_vs_petastorm_converter"] = round(ceiling, 3)
        progress(f"[{label}] in-memory (no feed at all) is {ceiling:.2f}x petastorm-converter: "
                 f"the most any feed can reach against it here")
    # the former single ratio, now flight-push-cache's
    if targets["cache_vs_in_memory"]["ratio"] is not None:
        out["fit"] = {**targets["cache_vs_in_memory"], "batch_size": BATCH_SIZE}
    paths = getattr(env, "train_paths", {})
    out["spark_jobs_per_rep"] = {name: p.spark_jobs for name, p in paths.items()}
    out["node_fit_seconds_per_epoch"] = {name: p.epoch_seconds for name, p in paths.items()}
    cached = paths.get("flight-push-cache")
    metrics = getattr(cached, "final_metrics", None) or {}
    nodes = {}
    for node, m in metrics.items():
        if "error" in m:
            nodes[str(node)] = {"error": m["error"]}
            continue
        nodes[str(node)] = {k: m.get(k) for k in (
            "cache_rows", "cache_memory_bytes", "cache_spilled_bytes", "cache_bytes_limit",
            "buffer_peak_bytes", "buffer_capacity",
        )}
    if nodes:
        mem = [n for n in nodes.values() if n.get("cache_bytes_limit")]
        within = all(int(n["cache_memory_bytes"] or 0) <= int(n["cache_bytes_limit"]) for n in mem)
        out["cache_memory"] = {"nodes": nodes, "within_bound": within if mem else None}
        for node, n in nodes.items():
            if "error" in n:
                continue
            progress(
                f"[{label}] cached node {node}: cache {int(n['cache_memory_bytes'] or 0) / 2**20:.1f} "
                f"MiB in memory of {int(n['cache_bytes_limit'] or 0) / 2**20:.0f} MiB bound, "
                f"{int(n['cache_spilled_bytes'] or 0) / 2**20:.1f} MiB spilled, "
                f"{n['cache_rows']} rows; feed buffer peak "
                f"{int(n['buffer_peak_bytes'] or 0) / 2**20:.1f} MiB"
            )
    return out
