"""The train scenario's peers: Petastorm's Spark converter and TensorFlowOnSpark, each running
the same Keras ``fit`` as :mod:`benchmarks.train`'s paths (what each does and how it is timed is
in that module's docstring)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.tfos_util import start_tfos_cluster, stop_tfos_cluster
from benchmarks.train import _COMPAT, BATCH_SIZE, _read_json, _write_json, build_model, epochs_of

__all__ = ["PetastormConverterPath", "TFoSFitPath", "tfos_fit_main", "petastorm_unavailable",
           "tfos_unavailable"]


class PetastormConverterPath:
    """``petastorm-converter``: make_spark_converter + make_tf_dataset + the same fit."""

    def __init__(self, env: Any) -> None:
        self.spark = env.spark
        self.df = env.dataframe("mnist")
        self.rows = env.rows_of("mnist")
        self.epochs = epochs_of(env)
        self.cache_dir = Path(tempfile.mkdtemp(prefix="petastorm-", dir=env.workdir))
        self.model: Any = None

    def __call__(self) -> int:
        import tensorflow as tf
        from petastorm.spark import SparkDatasetConverter, make_spark_converter

        self.spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF,
                            self.cache_dir.as_uri())
        if self.model is None:
            self.model = build_model(tf)
        converter = make_spark_converter(self.df)  # materialised as Parquet: timed
        try:
            steps = math.ceil(self.rows / BATCH_SIZE)
            with converter.make_tf_dataset(batch_size=BATCH_SIZE) as ds:
                ds = ds.map(lambda b: ({"image": b.image}, b.label))
                history = self.model.fit(ds, steps_per_epoch=steps, epochs=self.epochs, verbose=0)
            if len(history.epoch) != self.epochs:
                raise RuntimeError(f"fit ran {len(history.epoch)} epochs, not {self.epochs}")
        finally:
            converter.delete()  # the next repetition materialises again, as a new job would
        return self.rows * self.epochs


def tfos_fit_main(args: dict[str, Any], ctx: Any) -> None:
    """TFoS ``map_fun``: one ``model.fit`` over a generator draining the data feed."""
    import numpy as np
    import tensorflow as tf

    feed = ctx.get_data_feed(train_mode=True)
    path = Path(args["file"])
    seen = {"rows": 0}

    def batches():  # type: ignore[no-untyped-def]
        while not feed.should_stop():
            rows = feed.next_batch(args["batch_size"])
            if not rows:
                continue
            image = np.asarray([r[1] for r in rows], dtype=np.float32)
            label = np.asarray([r[2] for r in rows], dtype=np.int64)
            seen["rows"] += len(rows)
            _write_json(path, {"rows": seen["rows"]})
            yield {"image": image}, label

    ds = tf.data.Dataset.from_generator(batches, output_signature=(
        {"image": tf.TensorSpec([None, 784], tf.float32)}, tf.TensorSpec([None], tf.int64),
    ))
    build_model(tf).fit(ds, epochs=1, verbose=0)


class TFoSFitPath:
    """``tfos``: tensorflowonspark InputMode.SPARK feeding one long fit, EPOCHS per repetition."""

    def __init__(self, env: Any, rows: int) -> None:
        self.sc = env.spark.sparkContext
        self.df = env.dataframe("mnist", rows=rows)
        self.rows = rows
        self.epochs = epochs_of(env)
        self.file = env.workdir / "tfos-fit-count.json"
        self.cluster: Any = None
        self.fed = 0

    def _start(self) -> None:
        self.cluster = start_tfos_cluster(
            self.sc, tfos_fit_main, {"file": str(self.file), "batch_size": BATCH_SIZE},
        )

    def __call__(self) -> int:
        if self.cluster is None:
            self._start()
        # returns once map_fun's next_batch() has taken every row off TFoS's queue
        self.cluster.train(self.df.rdd, num_epochs=self.epochs)
        self.fed += self.rows * self.epochs
        return self.rows * self.epochs

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            stop_tfos_cluster(cluster)
            deadline = time.monotonic() + 60
            got = None
            while time.monotonic() < deadline:
                got = int((_read_json(self.file) or {}).get("rows", 0))
                if got >= self.fed:
                    break
                time.sleep(0.05)
            if got != self.fed:
                raise RuntimeError(f"TFoS fit saw {got} rows, {self.fed} were fed")


def petastorm_unavailable() -> str | None:
    import pyarrow as pa

    from benchmarks.harness import stack_info

    s = stack_info()
    here = f"pyspark {s['pyspark']}, pyarrow {pa.__version__}, TF {s['tensorflow']} here"
    if int(pa.__version__.split(".")[0]) >= 16:
        return f"{_COMPAT} ({here})"
    try:
        import petastorm.spark  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the peer unavailable
        return f"petastorm cannot be imported ({type(exc).__name__}: {exc}); {_COMPAT} ({here})"
    return None


def tfos_unavailable() -> str | None:
    try:
        import tensorflowonspark  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the peer unavailable
        from benchmarks.harness import stack_info

        s = stack_info()
        return (
            f"tensorflowonspark cannot be imported on this stack (pyspark {s['pyspark']}, "
            f"TF {s['tensorflow']}): {type(exc).__name__}: {exc}; {_COMPAT}"
        )
    return None
