"""The Python source of a Parquet ``tf.data`` pipeline: one shard's units as numpy chunks,
read by Arrow's scan (:mod:`feeders.parquet.scan`) or, with fixed-length list columns, from
their pages (:mod:`feeders.parquet.pages`), and shaped as the dataset's elements."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import pyarrow as pa

from feeders.elements import flatten
from feeders.parquet.pages import PagedChunks, paged_columns
from feeders.parquet.scan import exact_batches, scan_batches, to_arrays
from formats.fs import Location
from formats.hive import HiveColumns
from formats.pool import BufferPool
from formats.schema import ColumnSpec

__all__ = ["ChunkStream"]


class ChunkStream:
    """Iterates one shard's Parquet units as numpy arrays, ``chunk_rows`` rows at a time.

    Without ragged columns, chunks are a few MB (a multiple of ``batch_size`` rows; files may
    end short) and the dataset re-cuts them into exact batches with ``Dataset.rebatch``, far
    cheaper per batch than a Python generator call. With ragged columns ``chunk_rows`` is the
    batch size and the cut is done here, since ``rebatch`` of ragged tensors is slow. A small
    picklable object (filesystem + paths + specs), not a closure over driver state.
    """

    def __init__(
        self,
        loc: Location,
        units: list[tuple[str, list[int] | None]],
        specs: list[ColumnSpec],
        schema: pa.Schema,
        chunk_rows: int,
        label: str | None = None,
        hive: HiveColumns = HiveColumns(),
        window: tuple[int, int] | None = None,
        planned_rows: Mapping[str, int] | None = None,
    ) -> None:
        self.loc = loc
        self.planned_rows = planned_rows  # path -> rows when planned: a rewritten file fails
        self.window = window  # (skip, take) of the units' rows: a shard's even share
        # Without ragged columns the generator yields the final structure (no graph map).
        self.dense = not any(s.is_ragged for s in specs)
        self.label = label
        self.units = units
        self.specs = specs
        self.names = [s.name for s in specs]
        self.schema = schema
        self.chunk_rows = chunk_rows
        self.hive = hive
        self.paged = paged_columns(specs, schema) if self.dense else set()
        self.pool = BufferPool()

    def __call__(self) -> Iterator[Any]:
        for arrays in self._arrays():
            if not self.dense:
                yield flatten(arrays, self.specs)
            elif self.label is None:
                yield arrays
            else:
                y = arrays.pop(self.label)
                yield arrays, y

    def _arrays(self) -> Iterator[dict[str, Any]]:
        """The shard's rows as dicts of numpy arrays (chunks, or exact batches when ragged)."""
        if self.paged:
            chunks = PagedChunks(self.loc, self.units, self.specs, self.schema, self.paged, self.chunk_rows, self.pool, self.hive,
                                 self.planned_rows)
            for lo, hi, arrays in _windowed(chunks, self.window, lambda a: len(next(iter(a.values())))):
                yield arrays if (lo, hi) == (0, None) else {k: v[lo:hi] for k, v in arrays.items()}
            return
        # Dense: chunks of several batches, re-cut by Dataset.rebatch (cheap in C++).
        # Ragged: rebatch is slow for ragged tensors, so cut exact batches here instead.
        batches = scan_batches(self.loc, self.units, self.schema, self.names, self.chunk_rows, self.hive,
                               self.planned_rows)
        if self.window is not None:
            batches = ((where, b if (lo, hi) == (0, None) else b.slice(lo, (hi or b.num_rows) - lo))
                       for lo, hi, (where, b) in _windowed(batches, self.window, lambda wb: wb[1].num_rows))
        for where, batch in batches if self.dense else exact_batches(batches, self.chunk_rows):
            yield to_arrays(where, batch, self.specs)


def _windowed(chunks: Iterator[Any], window: tuple[int, int] | None,
              rows: Callable[[Any], int]) -> Iterator[tuple[int, int | None, Any]]:
    """``(lo, hi, chunk)`` for the chunks holding rows of ``window`` = (skip, take): the
    chunk's rows ``[lo, hi)`` are in it (``hi`` None: to its end). The chunks after the window
    are read to the end and dropped (they are the rest of its last row group), so readers
    ahead finish as they do after a whole pass."""
    if window is None:
        for c in chunks:
            yield 0, None, c
        return
    skip, take = window
    for c in chunks:
        n = rows(c)
        if take <= 0 or skip >= n:
            skip -= min(skip, n)
            continue
        lo, hi = skip, min(n, skip + take)
        skip = 0
        take -= hi - lo
        yield lo, (None if hi == n else hi), c
