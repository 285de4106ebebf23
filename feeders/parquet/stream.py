"""The Python source of a Parquet ``tf.data`` pipeline: one shard's units as numpy chunks,
read by Arrow's scan (:mod:`feeders.parquet.scan`) or, with fixed-length list columns, from
their pages (:mod:`feeders.parquet.pages`), and shaped as the dataset's elements."""

from __future__ import annotations

from typing import Any, Iterator

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
    ) -> None:
        self.loc = loc
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
            yield from PagedChunks(self.loc, self.units, self.specs, self.schema, self.paged, self.chunk_rows, self.pool, self.hive)
            return
        # Dense: chunks of several batches, re-cut by Dataset.rebatch (cheap in C++).
        # Ragged: rebatch is slow for ragged tensors, so cut exact batches here instead.
        batches = scan_batches(self.loc, self.units, self.schema, self.names, self.chunk_rows, self.hive)
        for where, batch in batches if self.dense else exact_batches(batches, self.chunk_rows):
            yield to_arrays(where, batch, self.specs)
