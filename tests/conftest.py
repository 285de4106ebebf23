"""Session-wide fixtures: one real SparkSession for the whole run, loopback only."""

from __future__ import annotations

import os
import sys

import pytest

# Spark binds a non-loopback address unless told otherwise; executors' Python must be this venv.
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _build_spark():
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2,3]")  # 2 slots; a task may be tried 3 times
        .appName("dataplane-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )


@pytest.fixture(scope="session")
def spark():
    """The one classic SparkSession (local[2,3]) shared by every test in the run."""
    session = _build_spark()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
