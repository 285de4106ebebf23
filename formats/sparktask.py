"""What each of our Spark tasks does first in its Python worker: :func:`prepare_task`.

PySpark 3.5's Python worker calls ``importlib.invalidate_caches()`` at the start of every
task (PySpark 4 only when the worker's path changed). On Python 3.10 and 3.11 that re-reads
the central directory of every zip archive the import system has looked into (CPython
gh-103200, fixed in 3.12). A Spark worker's path holds
``pyspark.zip``, py4j's zip and the ``spark-core`` jar (5,000 entries, no Python in it), and
the import cache holds one zip importer per package imported from them. Measured on 2 cores
with PySpark 3.5, every task paid about 60 ms before running any code of ours (a ``mapInArrow``
job of two small tasks: 424 ms, 375 ms with the swap).

:func:`prepare_task` swaps those zip importers for ones whose ``invalidate_caches`` does
nothing, so from the second task in a (reused) worker on, the call is cheap again. Imports
behave exactly as before: the archives are read once and Spark never rewrites them while a
worker runs (``addPyFile`` does not overwrite a file of the same name). The swap stays for the
life of the worker process, so any later task in it, ours or not, gains too.

It also points the worker's temp directory (``tempfile.tempdir``) into the executor's Spark
scratch (a ``dataplane-tmp-<pid>`` directory in the first of ``SPARK_LOCAL_DIRS``, the block
manager directories Spark removes when the executor stops). PySpark's workers end with
``os._exit``, so exit-time cleanups never run, and TensorFlow's autograph writes a module file
per function it converts (a model's call in ``dataplane.predict``, a trial's training in
``dataplane.tune``) to the temp directory and removes it only at exit: each worker that ran
one left a few files in the executor's ``/tmp``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipimport

__all__ = ["prepare_task"]

_AFFECTED = (3, 10) <= sys.version_info[:2] < (3, 12)


class _StableZipImporter(zipimport.zipimporter):
    """A zip importer that keeps its directory listing when import caches are invalidated."""

    def invalidate_caches(self) -> None:  # noqa: D102 - see the class docstring
        return None


def prepare_task() -> None:
    """Make the per-task import-cache reset of this Spark Python worker cheap again.

    Call it at the start of a task function. It costs microseconds once the swap is done (a
    scan of ``sys.path_importer_cache``) and does nothing on Python 3.12+ or outside a worker
    with zip archives on its path. Also moves the worker's temp files into Spark's scratch
    (the module's docstring says why); outside a Spark worker that part does nothing.
    """
    _temp_in_spark_scratch()
    if not _AFFECTED:
        return
    cache = sys.path_importer_cache
    for path, finder in list(cache.items()):
        if type(finder) is not zipimport.zipimporter:
            continue
        try:
            # The archive's directory is already in zipimport's cache: no re-read here.
            cache[path] = _StableZipImporter(path)
        except (zipimport.ZipImportError, OSError):
            continue


def _temp_in_spark_scratch() -> None:
    local = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0].strip()
    if not local or not os.path.isdir(local):
        return
    mine = os.path.join(local, f"dataplane-tmp-{os.getpid()}")  # a forked worker: its own
    if tempfile.tempdir == mine:
        return
    try:
        os.makedirs(mine, exist_ok=True)
    except OSError:  # a read-only or full scratch disk: keep the system temp directory
        return
    tempfile.tempdir = mine
