"""What a scenario hands the harness: the paths to time, each a callable doing one repetition,
:func:`count_partition`, the row-counting ``mapInArrow`` function several paths share, and
:func:`warm_jvm`, the Spark warm-up the scenarios that push a DataFrame run first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

__all__ = ["BenchPath", "COUNT_SCHEMA", "count_partition", "warm_jvm"]

COUNT_SCHEMA = "n long"


@dataclass
class BenchPath:
    """One way of moving the scenario's data, timed by the harness.

    Attributes:
        name: the path name fixed in shared/API.md (``flight-push``, ``tfos``, ``parquet``...).
        run: does one repetition over the whole data set and returns the rows it delivered.
        kind: ``ours``, ``peer`` (a system we compare against), ``ceiling`` (a bare lower
            layer nobody can beat) or ``stage`` (a part of ours' pipeline alone, timed only
            to say where ours' time goes: kept out of the results table).
        nbytes: payload bytes one repetition moves (for MB/s).
        unavailable: if set, the path is not run and is reported ``ok: false`` with this reason
            (a peer that cannot run on this stack).
        close: called once after all repetitions (stop servers, clusters).
    """

    name: str
    run: Callable[[], int]
    kind: Literal["ours", "peer", "ceiling", "stage"] = "ours"
    nbytes: int = 0
    unavailable: str | None = None
    close: Callable[[], None] | None = None


def count_partition(batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` function: one row, ``n`` (:data:`COUNT_SCHEMA`), the partition's row count.

    Use as ``sum(r.n for r in df.mapInArrow(count_partition, COUNT_SCHEMA).collect())``.
    """
    import pyarrow as pa

    n = 0
    for b in batches:
        n += b.num_rows
    yield pa.RecordBatch.from_pydict({"n": pa.array([n], pa.int64())})


def warm_jvm(df: Any, *, min_passes: int = 8, max_passes: int = 15) -> list[float]:
    """Run a bare row-counting ``mapInArrow`` over ``df`` until Spark's JIT has warmed up.

    The JVM compiles the code that turns cached rows into Arrow batches while the first jobs
    run: a 60,000-row MNIST pass took 0.87 s and 1.73 core-s as the second job of a session
    and 0.55-0.60 s and 1.1 core-s from about the tenth on (2026-11-25), so without this the
    first repetitions of every Spark-fed path pay compilation. Stops after ``min_passes`` once a
    pass is no faster than the median of the three before it (or after ``max_passes``).
    Returns each pass's seconds.
    """
    import statistics
    import time

    seconds: list[float] = []
    for i in range(max_passes):
        t0 = time.perf_counter()
        df.mapInArrow(count_partition, COUNT_SCHEMA).collect()
        seconds.append(time.perf_counter() - t0)
        if i + 1 >= min_passes and seconds[-1] >= statistics.median(seconds[-4:-1]):
            break
    return seconds
