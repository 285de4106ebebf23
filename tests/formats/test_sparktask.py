"""formats.sparktask.prepare_task: zip importers stop re-reading their archive on every task."""

from __future__ import annotations

import importlib
import os
import sys
import zipfile
import zipimport

import pytest

from formats import sparktask


@pytest.fixture
def zipped_modules(tmp_path, monkeypatch):
    archive = tmp_path / "mods.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("dp_zip_mod_a.py", "VALUE = 'a'\n")
        z.writestr("dp_zip_mod_b.py", "VALUE = 'b'\n")
    monkeypatch.syspath_prepend(str(archive))
    yield str(archive)
    for name in ("dp_zip_mod_a", "dp_zip_mod_b"):
        sys.modules.pop(name, None)
    sys.path_importer_cache.pop(str(archive), None)


def test_invalidation_no_longer_rereads_a_zip_on_the_path(zipped_modules, monkeypatch):
    import dp_zip_mod_a

    assert dp_zip_mod_a.VALUE == "a"
    reads: list[str] = []
    real = zipimport._read_directory

    def counting(path):
        reads.append(path)
        return real(path)

    monkeypatch.setattr(zipimport, "_read_directory", counting)
    importlib.invalidate_caches()
    before = reads.count(zipped_modules)

    sparktask.prepare_task()
    reads.clear()
    importlib.invalidate_caches()
    import dp_zip_mod_b  # still importable from the same archive after the swap

    assert dp_zip_mod_b.VALUE == "b"
    finder = sys.path_importer_cache[zipped_modules]
    if sparktask._AFFECTED:  # Python 3.10 / 3.11: the eager re-read this works around
        assert before == 1
        assert type(finder) is sparktask._StableZipImporter
        assert reads.count(zipped_modules) == 0
    else:  # 3.12+ invalidates lazily; nothing is swapped
        assert type(finder) is zipimport.zipimporter


def test_spark_worker_zip_importers_are_swapped(spark):
    """In a real PySpark worker (pyspark.zip, py4j and the spark-core jar on its path)."""

    def task(_rows):
        import sys
        import zipimport

        from formats.sparktask import prepare_task

        def plain() -> int:
            return sum(type(f) is zipimport.zipimporter for f in sys.path_importer_cache.values())

        before = plain()
        prepare_task()
        yield before, plain(), sys.version_info[:2]

    rows = spark.sparkContext.parallelize(range(2), 2).mapPartitions(task).collect()
    assert len(rows) == 2
    for before, after, version in rows:
        if (3, 10) <= tuple(version) < (3, 12):
            # a reused Python worker may have run prepare_task for an earlier task already
            # (CI saw before == 0 once); what must hold is that none is left plain after it
            assert after == 0 and before >= after
        else:
            assert after == before


def test_spark_worker_temp_files_go_to_spark_scratch(spark):
    # PySpark's workers end with os._exit: TensorFlow's autograph modules, written to the temp
    # directory and removed only at exit, piled up in the executors' /tmp
    def task(_rows):
        import os
        import tempfile

        from formats.sparktask import prepare_task

        prepare_task()
        with tempfile.NamedTemporaryFile() as f:
            yield os.environ["SPARK_LOCAL_DIRS"], tempfile.gettempdir(), f.name, os.getpid()

    rows = spark.sparkContext.parallelize(range(2), 2).mapPartitions(task).collect()
    assert len(rows) == 2
    for local_dirs, where, name, pid in rows:
        scratch = local_dirs.split(",")[0]
        assert where == os.path.join(scratch, f"dataplane-tmp-{pid}"), (where, local_dirs)
        assert os.path.dirname(name) == where
        assert os.path.basename(scratch).startswith("blockmgr-")  # Spark removes it at stop


def test_outside_spark_the_temp_directory_is_left_alone(monkeypatch):
    import tempfile

    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    before = tempfile.gettempdir()
    sparktask.prepare_task()
    assert tempfile.gettempdir() == before
