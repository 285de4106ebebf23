"""Background Spark jobs (dataplane.driver.sparkjobs) on the real session."""

from __future__ import annotations

import threading
import time

import pytest


def _slow(rows):  # a task that would run for half a minute unless interrupted
    for row in rows:
        time.sleep(30)
        yield row


def test_a_cancel_before_spark_has_registered_the_job_still_cancels_it(spark):
    # Ctrl-C while the push was still being planned: cancelJobGroup found no job, and the job
    # Spark registered a moment later ran beside the next train() call's.
    from dataplane.driver.sparkjobs import SparkJob

    planning = threading.Event()

    def fn():
        planning.set()
        time.sleep(1.0)  # planning: no job is registered yet when cancel() comes
        return spark.sparkContext.parallelize(range(2), 2).mapPartitions(_slow).collect()

    job = SparkJob(spark, "test: cancelled while planning", fn)
    assert planning.wait(10)
    job.cancel()
    t0 = time.monotonic()
    with pytest.raises(Exception, match="cancelled"):
        job.future.result(timeout=20)
    assert time.monotonic() - t0 < 10
    tracker = spark.sparkContext.statusTracker()
    ids = tracker.getJobIdsForGroup(job.tag)
    assert len(ids) == 1
    assert tracker.getJobInfo(ids[0]).status == "FAILED"
    assert not set(tracker.getActiveJobsIds()) & set(ids)
