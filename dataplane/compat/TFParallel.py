"""TensorFlowOnSpark's ``TFParallel.run``: independent single-node TF instances on executors.

No cluster, no feed: ``map_fn(tf_args, ctx)`` runs once per task of one Spark job (a barrier
stage by default, so all of them run at the same time), typically to score files with a saved
model. ``ctx`` has TFoS's attributes: ``worker_num`` / ``executor_id`` (the task's index),
``num_workers``, ``defaultFS``, ``working_dir``, ``job_name`` (``""``), ``task_index`` (0),
``cluster_spec`` (``{}``), and ``absolute_path(path)``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Iterator

__all__ = ["run"]

logger = logging.getLogger(__name__)


class _ParallelContext:
    """The ``ctx`` of a TFParallel task (TFoS's TFNodeContext with no cluster)."""

    def __init__(self, worker_num: int, num_workers: int, default_fs: str) -> None:
        self.worker_num = worker_num
        self.executor_id = worker_num
        self.num_workers = num_workers
        self.defaultFS = default_fs
        self.working_dir = os.getcwd()
        self.job_name = ""
        self.task_index = 0
        self.cluster_spec: dict[str, list[str]] = {}
        self.mgr = None
        self.tmp_socket = None

    def absolute_path(self, path: str) -> str:
        from dataplane.compat.TFNode import hdfs_path

        return hdfs_path(self, path)


class _ParallelTask:
    """What each task runs (picklable; holds no driver state)."""

    def __init__(self, map_fn: Callable[[Any, Any], Any], tf_args: Any, num_executors: int,
                 default_fs: str, use_barrier: bool) -> None:
        self.map_fn = map_fn
        self.tf_args = tf_args
        self.num_executors = num_executors
        self.default_fs = default_fs
        self.use_barrier = use_barrier

    def __call__(self, it: Iterator[int]) -> Iterator[int]:
        import importlib.util

        from formats.sparktask import prepare_task

        prepare_task()  # TF's temp files go to Spark's scratch: the worker ends with os._exit
        worker_num = next(iter(it))
        num_workers = self.num_executors
        if self.use_barrier:
            from pyspark import BarrierTaskContext

            num_workers = len(BarrierTaskContext.get().getTaskInfos())
        if (
            "TF_USE_LEGACY_KERAS" not in os.environ
            and "tensorflow" not in sys.modules
            and importlib.util.find_spec("tf_keras")
        ):
            os.environ["TF_USE_LEGACY_KERAS"] = "1"  # TFoS programs are tf.keras 2 programs
        if isinstance(self.tf_args, list):
            sys.argv = self.tf_args
        self.map_fn(self.tf_args, _ParallelContext(worker_num, num_workers, self.default_fs))
        yield 0


def run(sc: Any, map_fn: Callable[[Any, Any], Any], tf_args: Any, num_executors: int,
        use_barrier: bool = True) -> None:
    """Run ``map_fn(tf_args, ctx)`` as ``num_executors`` parallel, independent instances.

    Args:
        sc: the SparkContext (or a SparkSession).
        map_fn: the program of every instance; picklable.
        tf_args: handed to ``map_fn``; a list becomes the task's ``sys.argv`` (as in TFoS).
        num_executors: instances; with ``use_barrier`` that many task slots must be free.
        use_barrier: run them as one Spark barrier stage (all at once, all retried together).

    Raises:
        ValueError: ``num_executors`` is not a positive int.
        Exception: whatever a ``map_fn`` raised, as Spark reports it.
    """
    if not isinstance(num_executors, int) or num_executors < 1:
        raise ValueError(
            f"TFParallel.run: num_executors must be an int >= 1, got {num_executors!r}"
        )
    if hasattr(sc, "sparkContext"):
        sc = sc.sparkContext
    default_fs = sc._jsc.hadoopConfiguration().get("fs.defaultFS")
    if default_fs.startswith("file://") and len(default_fs) > 7 and default_fs.endswith("/"):
        default_fs = default_fs[:-1]
    task = _ParallelTask(map_fn, tf_args, num_executors, default_fs, use_barrier)
    nodes = sc.parallelize(list(range(num_executors)), num_executors)
    if use_barrier:
        nodes.barrier().mapPartitions(task).collect()
    else:
        nodes.mapPartitions(task).collect()
