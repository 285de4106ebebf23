"""Session-wide fixtures: one real SparkSession for the whole run, loopback only."""

from __future__ import annotations

import os
import sys

import pytest

# Spark binds a non-loopback address unless told otherwise; executors' Python must be this venv's
# packages: tests/executor_python.py says why it is a view of them less scikit-learn, SciPy and
# matplotlib.
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
if "PYSPARK_PYTHON" not in os.environ:
    from tests import executor_python

    os.environ["PYSPARK_PYTHON"] = executor_python.build() or sys.executable
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Every JVM the tests start (this session's, and those of the CLIs, examples and Spark Connect
# servers they run) compiles with C1 only and collects with one thread: the suite's JVMs move
# little data, and on 2 cores C2's compiler threads took the CPU the TF nodes wait for
# (test_user_programs.py: 393 s -> 304 s, the JVM's CPU 94 s -> 37 s, 2026-12-02).
if "TieredStopAtLevel" not in os.environ.get("SPARK_SUBMIT_OPTS", ""):
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(
        p for p in (os.environ.get("SPARK_SUBMIT_OPTS"), "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC") if p
    )
# Executors and TF nodes unpickle functions defined in test modules: they must import `tests.*`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


def _build_spark():
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[3,3]")  # 3 slots (a 3-node cluster); 3 tries a task
        .appName("dataplane-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )


@pytest.fixture(scope="session")
def spark():
    """The one classic SparkSession (local[3,3]) shared by every test in the run."""
    session = _build_spark()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
