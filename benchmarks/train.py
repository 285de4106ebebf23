"""Train scenario: Keras ``fit`` throughput fed by push vs the same fit on in-memory tensors.

Both sides train the same small Keras model (784 -> 128 relu -> 10, Adam, batch
:data:`BATCH_SIZE`) on the same MNIST-shaped rows, one epoch per repetition:

* ``flight-push`` (ours): a one-node ``dataplane.run`` cluster whose ``main`` calls
  ``model.fit(ctx.dataset(features=["image"], label="label"), epochs=1)`` once per pushed
  epoch and writes the epoch's step count when ``fit`` returns. A repetition is timed from
  ``cluster.train(df)`` until the node reports the epoch: the push, the conversion to tensors
  and the training steps, overlapped as they are in real use.
* ``in-memory`` (ceiling): a spawned Python process (same TF, same thread settings) that holds
  the rows as NumPy arrays and runs ``model.fit`` on
  ``tf.data.Dataset.from_tensor_slices(...).batch(BATCH_SIZE)`` once per repetition, timed
  around ``fit``. No data movement at all: the best any feed can do.

Target: ours >= 0.9x the in-memory fit (``extra`` reports the ratio and the verdict).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.data import make_table
from benchmarks.paths import BenchPath

__all__ = ["TABLES", "BATCH_SIZE", "TARGET_RATIO", "build", "extra", "build_model"]

TABLES = ("mnist",)
BATCH_SIZE = 256
TARGET_RATIO = 0.9


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


def fit_main(args: dict[str, Any], ctx: Any) -> None:
    """The node's ``main``: one ``model.fit`` per pushed epoch; writes ``epoch<e>.json``."""
    import tensorflow as tf

    model = build_model(tf)
    ds = ctx.dataset(batch_size=args["batch_size"], features=["image"], label="label")
    out = Path(args["dir"])
    epoch = 0
    while not ctx.should_stop:
        steps_before = int(model.optimizer.iterations.numpy())
        t0 = time.perf_counter()
        try:
            model.fit(ds, epochs=1, verbose=0)
        except Exception:
            if ctx.should_stop:  # the driver shut down while fit waited for an epoch
                return
            raise
        steps = int(model.optimizer.iterations.numpy()) - steps_before
        if steps == 0 and ctx.should_stop:
            return
        tmp = out / f"epoch{epoch}.json.tmp"
        tmp.write_text(json.dumps({"steps": steps, "seconds": time.perf_counter() - t0}))
        os.replace(tmp, out / f"epoch{epoch}.json")
        epoch += 1


def _memory_worker(conn: Any, rows: int, seed: int, batch_size: int) -> None:
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
            t0 = time.perf_counter()
            model.fit(ds, epochs=1, verbose=0)
            conn.send(("ok", {"rows": rows, "seconds": time.perf_counter() - t0}))
        except Exception as exc:  # noqa: BLE001 - sent back to the parent as the error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class PushFitPath:
    """``flight-push``: one-node cluster; each repetition pushes one epoch that ``fit`` eats."""

    def __init__(self, env: Any) -> None:
        self.spark = env.spark
        self.df = env.dataframe("mnist")
        self.dir = env.workdir / "fit-epochs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster: Any = None
        self.epoch = 0
        self.last: dict[str, Any] = {}

    def __call__(self) -> int:
        if self.cluster is None:
            import dataplane

            self.cluster = dataplane.run(
                self.spark, fit_main, {"dir": str(self.dir), "batch_size": BATCH_SIZE},
                num_nodes=1,
            )
        epoch = self.epoch
        self.epoch += 1
        report = self.cluster.train(self.df)
        path = self.dir / f"epoch{epoch}.json"
        deadline = time.monotonic() + 600
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the node did not finish fitting epoch {epoch} in 600 s")
            time.sleep(0.005)
        self.last = json.loads(path.read_text())
        return int(report.rows)

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.shutdown()


class InMemoryFitPath:
    """``in-memory``: the same fit on ``from_tensor_slices`` tensors in a spawned process."""

    def __init__(self, env: Any) -> None:
        self.rows = env.rows_of("mnist")
        self.seed = env.seed
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_memory_worker, args=(child, self.rows, self.seed, BATCH_SIZE), daemon=True
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
        return int(self._recv(600, "finish an epoch")["rows"])

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


def build(env: Any) -> list[BenchPath]:
    """The train scenario's two paths (always on the MNIST-shaped table)."""
    nbytes = env.rows_of("mnist") * env.row_bytes("mnist")
    push = PushFitPath(env)
    memory = InMemoryFitPath(env)
    return [
        BenchPath("flight-push", push, kind="ours", nbytes=nbytes, close=push.close),
        BenchPath("in-memory", memory, kind="ceiling", nbytes=nbytes, close=memory.close),
    ]


def extra(env: Any, results: list[dict[str, Any]], *, progress: Callable[[str], None]) -> dict[str, Any]:
    """The fit ratio against its 0.9x target."""
    ours = next((r for r in results if r["path"] == "flight-push"), None)
    ratio = (ours or {}).get("ratio_vs", {}).get("in-memory")
    if ratio is None:
        return {}
    progress(f"[train/{env.table_name}] fit fed by push: {ratio:.2f}x in-memory "
             f"(target >= {TARGET_RATIO}x)")
    return {"fit": {"ratio": ratio, "target": TARGET_RATIO, "within_target": ratio >= TARGET_RATIO,
                    "batch_size": BATCH_SIZE}}
