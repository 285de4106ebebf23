"""TensorFlowOnSpark's ``compat``: helpers for TF 2 programs, with TFoS's meaning.

TensorFlow is imported when a function is called, not when the module is imported.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any

__all__ = ["export_saved_model", "disable_auto_shard", "is_gpu_available"]

logger = logging.getLogger(__name__)


def _is_keras2(model: Any) -> bool:
    """True for a tf_keras (Keras 2) model, which saves a SavedModel with ``save_format='tf'``."""
    return type(model).__module__.split(".")[0] == "tf_keras" or any(
        c.__module__.split(".")[0] == "tf_keras" for c in type(model).__mro__
    )


def export_saved_model(model: Any, export_dir: str, is_chief: bool = False) -> None:
    """Export a Keras model as a TensorFlow SavedModel in ``export_dir`` (chief only).

    As in TFoS every worker must call it (under MultiWorkerMirroredStrategy saving is a
    collective step): a non-chief saves to a temporary directory, removed afterwards (TFoS leaves
    a ``worker_model`` directory in the working directory).

    A Keras 2 (``tf_keras``) model is saved with ``model.save(export_dir, save_format='tf')``,
    as in TFoS; a Keras 3 model with ``model.export(export_dir)``. Both load with
    ``tf.saved_model.load(export_dir)`` and serve the ``serving_default`` signature.

    An ``s3://`` or ``hdfs://`` ``export_dir`` (``ctx.absolute_path`` on a cluster whose default
    filesystem is HDFS) is exported locally, then uploaded through ``pyarrow.fs``: TensorFlow
    2.18+, and 2.16 without tensorflow-io imported, write neither.
    """
    from formats.fs import through_pyarrow, upload

    if not isinstance(export_dir, str) or not export_dir:
        raise ValueError(f"export_saved_model: export_dir must be a path, got {export_dir!r}")
    remote = is_chief and through_pyarrow(export_dir)
    scratch = tempfile.mkdtemp(prefix="dataplane-worker-model-") if not is_chief or remote else None
    target = export_dir if scratch is None else f"{scratch}/model"
    try:
        if _is_keras2(model):
            model.save(target, save_format="tf")
        elif hasattr(model, "export"):
            model.export(target)
        else:
            import tensorflow as tf

            tf.saved_model.save(model, target)
        if remote:
            upload(target, export_dir)
        if is_chief:
            logger.info("exported the model as a SavedModel to %s", export_dir)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def disable_auto_shard(options: Any) -> None:
    """Turn tf.data auto-sharding off in ``options`` (a ``tf.data.Options``), in place.

    Use it when every node already reads only its own rows (pushed rows, or files sharded by
    ``ctx.worker_num``).
    """
    import tensorflow as tf

    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF


def is_gpu_available() -> bool:
    """True when TensorFlow sees at least one GPU on this machine."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU")) > 0
