"""What a scenario hands the harness: the paths to time, each a callable doing one repetition,
and :func:`count_partition`, the row-counting ``mapInArrow`` function several paths share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

__all__ = ["BenchPath", "COUNT_SCHEMA", "count_partition"]

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
