"""The native Parquet pull reader: pyarrow straight to ``tf.data`` batches, no Petastorm.

How it reads:

* The files under the path are listed once and their footers read (in parallel threads). The
  footers give the schema every file must share, the row groups for sharding, and null counts,
  so a missing column, an unsupported type, a schema that differs between files or a null in a
  dense column is a typed error when the dataset is built, not in the middle of training.
* Sharding is by file; with fewer files than shards it falls back to row groups.
* Each iteration scans the shard's files and row groups with ``pyarrow.dataset`` (only the
  projected columns are decoded, by Arrow's threads, two files ahead of the consumer) and
  converts with :func:`formats.schema.to_numpy` (zero-copy for fixed-width columns; no per-row
  Python for numeric and list columns).
* Dense list columns of fixed-width numbers (an MNIST image declared ``shapes={"image":
  (784,)}``, a ``fixed_size_list``) are instead read page by page with
  :mod:`formats.parquet_pages`, which proves from the repetition/definition levels that every
  row holds the declared number of values rather than decoding them, and copies the values
  straight into the chunk arrays (about 3x faster than Arrow's list decoding for MNIST). The
  other columns come from pyarrow; files, footers, those columns and (on S3) the ranged reads
  are prepared ahead in threads. Pages it refuses (nulls, rows of other lengths, other
  encodings) are read by pyarrow from the first row not yet handed out.
* Without ragged columns the generator hands ``tf.data`` chunks of about 8 MB and
  ``Dataset.rebatch`` cuts them into exactly ``batch_size`` rows in C++ (across file
  boundaries; only the last batch may be short): one Python call per chunk instead of per
  batch, which is what makes the Python source (:mod:`feeders.generator`) cheap. Copies: into
  the chunk tensor, then into each batch.
* With ragged columns (``rebatch`` of ragged tensors is slow) the exact cut happens in Python,
  one batch per generator call; the columns travel as flat values plus row splits and become
  ``tf.RaggedTensor`` in a graph ``map`` (:mod:`feeders.elements`).
* A fixed ``prefetch`` (default 8 batches) overlaps reading with the consumer. tf.data's
  autotuning is off: nothing here needs tuning, and its background thread made tearing down an
  epoch's iterator take up to seconds on a busy machine (measured on the push source).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import SchemaError, StorageError
from feeders.elements import (
    assemble,
    check_representable,
    flat_signature,
    flatten,
    signature,
    validate_reader_args,
)
from formats.fs import Location, list_files, resolve, storage_error
from feeders.generator import generator_dataset
from feeders.readahead import IterAhead
from feeders.shard import normalize_shard, take_shard
from formats.parquet_pages import PagesRefused, chunk_layout, iter_page_values
from formats.pool import BufferPool
from formats.schema import ColumnSpec, column_specs, to_numpy

__all__ = ["parquet_dataset", "ParquetPlan", "plan_parquet"]

logger = logging.getLogger(__name__)

_PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
# Generator chunks: big enough that the per-call cost of the Python source vanishes,
# small enough to keep memory and first-batch latency low.
_CHUNK_BYTES = 8 << 20
_MAX_CHUNK_ROWS = 1 << 20
_DEFAULT_PREFETCH = 8
# Scan read-ahead: files decoded ahead of the consumer, and chunks buffered per file. Memory
# stays within a few row groups plus (batch read-ahead x chunk size).
_FRAGMENT_READAHEAD = 2
_BATCH_READAHEAD = 2
# Paged reading: row groups prepared ahead of the decoder, and remote ranged reads.
_GROUPS_AHEAD = 2
_CHUNKS_AHEAD = 2  # decoded chunks waiting for tf.data (decoding runs in its own thread)
_FILES_AHEAD = 3
_FETCH_BLOCK = 1 << 20
_FETCH_THREADS = 16
_POOL_UNIT = 1 << 20


class ParquetPlan:
    """What one reader will read: resolved files, their common schema and the shard's units.

    Attributes:
        location: the resolved path/URL.
        files: every data file, sorted.
        schema: the Arrow schema every file shares (without pandas/Spark metadata).
        row_counts: rows per file.
        units: this shard's ``(file, row_groups or None)`` pairs, in read order.
    """

    def __init__(
        self,
        location: Location,
        files: list[str],
        schema: pa.Schema,
        metadata: list[Any],
        units: list[tuple[str, list[int] | None]],
    ) -> None:
        self.location = location
        self.files = files
        self.schema = schema
        self.metadata = metadata
        self.row_counts = [m.num_rows for m in metadata]
        self.units = units

    @property
    def num_rows(self) -> int:
        """Rows in the whole data set (all shards)."""
        return int(sum(self.row_counts))

    def shard_rows(self) -> int:
        """Rows this shard's units hold."""
        by_file = dict(zip(self.files, self.metadata))
        total = 0
        for path, groups in self.units:
            meta = by_file[path]
            if groups is None:
                total += meta.num_rows
            else:
                total += sum(meta.row_group(g).num_rows for g in groups)
        return total


def _read_footer(loc: Location, path: str) -> Any:
    import pyarrow.parquet as pq

    where = loc.display(path)
    try:
        with loc.filesystem.open_input_file(path) as f:
            return pq.ParquetFile(f).metadata
    except pa.ArrowInvalid as exc:
        raise StorageError(
            f"{where} is not a readable Parquet file ({exc}). Remove it from the directory or "
            f"rewrite it; empty and partially written files are the usual cause."
        ) from exc
    except OSError as exc:
        raise storage_error(exc, "read the Parquet footer of", where) from exc


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    return schema.remove_metadata()


def _check_same_schema(loc: Location, files: list[str], metas: list[Any], names: Sequence[str]) -> None:
    first = _plain_schema(metas[0].schema.to_arrow_schema())
    for path, meta in zip(files[1:], metas[1:]):
        other = _plain_schema(meta.schema.to_arrow_schema())
        for name in names:
            i, j = first.get_field_index(name), other.get_field_index(name)
            if j < 0:
                raise SchemaError(
                    f"column {name!r} is in {loc.display(files[0])} but missing from "
                    f"{loc.display(path)}; every file of a data set must have the same columns. "
                    f"Rewrite the odd file or select columns present in all files (columns=...)."
                )
            if not first.field(i).type.equals(other.field(j).type):
                raise SchemaError(
                    f"column {name!r} has type {first.field(i).type} in "
                    f"{loc.display(files[0])} but {other.field(j).type} in {loc.display(path)}; "
                    f"every file of a data set must share one schema. Rewrite the files with "
                    f"one schema (cast the column)."
                )


def _check_nulls(loc: Location, files: list[str], metas: list[Any], specs: Sequence[ColumnSpec]) -> None:
    """A null in a scalar column without a fill value is an error; find it from the footers."""
    wanted = {s.name for s in specs if not s.shape and s.fill is None}
    if not wanted:
        return
    for path, meta in zip(files, metas):
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for c in range(rg.num_columns):
                col = rg.column(c)
                name = col.path_in_schema
                if name not in wanted or not col.is_stats_set:
                    continue
                stats = col.statistics
                if stats is not None and stats.has_null_count and stats.null_count:
                    raise SchemaError(
                        f"column {name!r} has {stats.null_count} null value(s) in row group {g} "
                        f"of {loc.display(path)}; TensorFlow tensors cannot hold nulls. Pass "
                        f"fill_values={{{name!r}: 0}} or filter/impute the nulls when writing."
                    )


def plan_parquet(
    path_or_url: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
    shard: Any = None,
    filesystem: Any = None,
) -> ParquetPlan:
    """List the files, read and check their footers, and choose this shard's units.

    Raises:
        StorageError: the path does not exist, cannot be read, or a file is not Parquet.
        SchemaError: the files' schemas differ in a selected column.
        ValueError: a malformed ``shard``.
    """
    shard_t = normalize_shard(shard)
    loc = resolve(path_or_url, filesystem=filesystem)
    files = list_files(loc)
    parquet_files = [f for f in files if f.endswith(_PARQUET_SUFFIXES)]
    if parquet_files:
        files = parquet_files
    if len(files) == 1:
        metas = [_read_footer(loc, files[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
            metas = list(pool.map(lambda p: _read_footer(loc, p), files))
    schema = _plain_schema(metas[0].schema.to_arrow_schema())
    names = list(columns) if columns is not None else list(schema.names)
    _check_same_schema(loc, files, metas, [n for n in names if n in schema.names])

    units: list[tuple[str, list[int] | None]]
    if shard_t is None:
        units = [(f, None) for f in files]
    elif len(files) >= shard_t[1]:
        units = [(f, None) for f in take_shard(files, shard_t)]
    else:
        groups = [(f, [g]) for f, m in zip(files, metas) for g in range(m.num_row_groups)]
        if len(groups) < shard_t[1]:
            logger.warning(
                "%s has %d file(s) and %d row group(s) for %d shards: shard %d may be empty. "
                "Write more files or smaller row groups.",
                loc.url, len(files), len(groups), shard_t[1], shard_t[0],
            )
        units = take_shard(groups, shard_t)
    return ParquetPlan(loc, files, schema, metas, units)


class _ChunkStream:
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
        self.paged = _paged_columns(specs, schema) if self.dense else set()
        self.pool = BufferPool()

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The shard's record batches of (up to) ``chunk_rows`` rows, in unit order.

        A ``pyarrow.dataset`` scan over the shard's units: row groups are decoded by Arrow's
        own threads, :data:`_FRAGMENT_READAHEAD` files ahead of the consumer, with the GIL
        released, so decoding overlaps with TensorFlow on another core. Batches arrive in
        unit order (``scan_batches`` keeps it).
        """
        import pyarrow.dataset as pds

        remote = self.loc.scheme != "file"
        fmt = pds.ParquetFileFormat(
            default_fragment_scan_options=pds.ParquetFragmentScanOptions(pre_buffer=remote)
        )
        fs = self.loc.filesystem
        frags = []
        for path, groups in self.units:
            try:
                frags.append(fmt.make_fragment(path, filesystem=fs, row_groups=groups))
            except OSError as exc:
                raise storage_error(exc, "open", self.loc.display(path)) from exc
        dataset = pds.FileSystemDataset(frags, schema=self.schema, format=fmt, filesystem=fs)
        scanner = dataset.scanner(
            columns=self.names,
            batch_size=self.chunk_rows,
            batch_readahead=_BATCH_READAHEAD,
            fragment_readahead=_FRAGMENT_READAHEAD,
            use_threads=True,
        )
        checked: set[str] = set()
        tagged = iter(scanner.scan_batches())
        while True:
            try:
                item = next(tagged)
            except StopIteration:
                return
            except (OSError, pa.ArrowInvalid) as exc:
                # The scanner reads files ahead and does not say which one failed.
                files = sorted({p for p, _ in self.units})
                where = self.loc.display(files[0]) if len(files) == 1 else (
                    f"{self.loc.url} (one of its {len(files)} files)")
                err = storage_error(exc, "read the Parquet data of", where)
                if isinstance(exc, pa.ArrowInvalid) or "orrupt" in str(exc):
                    err = StorageError(
                        f"{err} A file whose footer reads but whose pages do not is damaged (or "
                        f"was changed while being read); rewrite it."
                    )
                raise err from exc
            path = item.fragment.path
            if path not in checked:
                self._check_file(path, item.fragment.physical_schema)
                checked.add(path)
            if item.record_batch.num_rows:
                yield item.record_batch

    def _check_file(self, path: str, physical: pa.Schema) -> None:
        """A file must still have the planned columns and types (it may have been rewritten)."""
        got = _plain_schema(physical)
        for name in self.names:
            j = got.get_field_index(name)
            want = self.schema.field(name).type
            if j < 0 or not got.field(j).type.equals(want):
                seen = got.field(j).type if j >= 0 else "no such column"
                raise SchemaError(
                    f"{self.loc.display(path)}: column {name!r} is {seen}, but the data set was "
                    f"planned with {want}; the file changed after the dataset was built. Build "
                    f"the dataset again."
                )

    def exact(self) -> Iterator[pa.RecordBatch | pa.Table]:
        """The batches re-cut to exactly ``chunk_rows`` rows across files (last may be short)."""
        size = self.chunk_rows
        pending: list[pa.RecordBatch] = []
        have = 0
        for b in self.batches():
            if have == 0 and b.num_rows == size:
                yield b
                continue
            pending.append(b)
            have += b.num_rows
            while have >= size:
                table = pa.Table.from_batches(pending)
                yield table.slice(0, size)
                have -= size
                pending = table.slice(size).to_batches() if have else []
        if have:
            yield pa.Table.from_batches(pending)

    def _arrays(self) -> Iterator[dict[str, Any]]:
        """The shard's rows as dicts of numpy arrays (chunks, or exact batches when ragged)."""
        if self.paged:
            yield from self._paged()
            return
        # Dense: chunks of several batches, re-cut by Dataset.rebatch (cheap in C++).
        # Ragged: rebatch is slow for ragged tensors, so cut exact batches here instead.
        for batch in self.batches() if self.dense else self.exact():
            yield self._convert(batch)

    def _convert(self, batch: pa.RecordBatch | pa.Table, specs: Sequence[ColumnSpec] | None = None) -> dict[str, Any]:
        try:
            return to_numpy(batch, self.specs if specs is None else specs)
        except SchemaError as exc:
            raise SchemaError(f"reading {self.loc.url}: {exc}") from exc

    def _paged(self) -> Iterator[dict[str, Any]]:
        """Dense chunks with the :attr:`paged` columns decoded by :mod:`formats.parquet_pages`.

        Reading is prepared ahead of the decoding, in threads: files are opened and their
        footers read :data:`_FILES_AHEAD` files ahead, and for each row group, up to
        :data:`_GROUPS_AHEAD` ahead, the other columns are read with pyarrow and, on remote
        storage, the ranged reads of the paged column chunks are started (in
        :data:`_FETCH_BLOCK` blocks). So on S3 the decoder waits for neither round trips nor
        small columns; locally it reads the pages itself, into reused buffers.

        A row group whose pages are refused (nulls, rows of other lengths, an encoding the
        module does not know) is read with pyarrow from the first row not yet handed out, so
        such data gets the usual errors and values, and no row is lost or repeated.
        """
        io = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="dataplane-parquet-io")

        def decoded() -> Iterator[dict[str, Any]]:
            groups = IterAhead(self._prepared(io), depth=_GROUPS_AHEAD, name="dataplane-parquet-ahead")
            try:
                for group in groups:
                    yield from self._decoded(group)
            finally:
                groups.close()

        chunks = IterAhead(decoded(), depth=_CHUNKS_AHEAD, name="dataplane-parquet-decode")
        try:
            yield from chunks
        finally:
            chunks.close()
            io.shutdown(wait=True, cancel_futures=True)

    def _opened(self, path: str) -> "_OpenFile":
        import pyarrow.parquet as pq

        where = self.loc.display(path)
        remote = self.loc.scheme != "file"
        try:
            f = self.loc.filesystem.open_input_file(path)
        except OSError as exc:
            raise storage_error(exc, "open", where) from exc
        pages = None
        try:
            pf = pq.ParquetFile(f, pre_buffer=remote)
            self._check_file(path, pf.schema_arrow)
            pages = None if remote else self.loc.filesystem.open_input_file(path)
        except BaseException as exc:
            f.close()
            if isinstance(exc, (OSError, pa.ArrowInvalid)):
                raise storage_error(exc, "read the Parquet footer of", where) from exc
            raise
        return _OpenFile(path, where, f, pf, pages, threading.Lock())

    def _prepared(self, io: ThreadPoolExecutor) -> Iterator["_Group"]:
        remote = self.loc.scheme != "file"
        others = [s.name for s in self.specs if s.name not in self.paged]
        pending: deque[tuple[list[int] | None, Future]] = deque()
        units = iter(self.units)
        for path, groups in itertools.islice(units, _FILES_AHEAD):
            pending.append((groups, io.submit(self._opened, path)))
        try:
            while pending:
                groups, opening = pending.popleft()
                for path, more in itertools.islice(units, 1):
                    pending.append((more, io.submit(self._opened, path)))
                yield from self._file_groups(opening.result(), groups, others, remote, io)
        finally:  # a pass left early: close the files opened ahead
            for _, opening in pending:
                if not opening.cancel():
                    try:
                        opening.result().close()
                    except Exception:  # noqa: BLE001 - nobody will read that file now
                        pass

    def _file_groups(
        self, of: "_OpenFile", groups: list[int] | None, others: list[str], remote: bool, io: ThreadPoolExecutor
    ) -> Iterator["_Group"]:
        meta = of.pf.metadata
        todo = list(range(meta.num_row_groups)) if groups is None else list(groups)
        if not todo:
            of.close()
        for i, g in enumerate(todo):
            rest = io.submit(of.read_row_group, g, others) if others else None
            try:
                layouts = {s.name: chunk_layout(meta, g, s.name, s.dtype) for s in self.specs if s.name in self.paged}
            except PagesRefused as exc:
                layouts, refused = {}, str(exc)
            else:
                refused = None
            blocks = {}
            if remote:
                for name, layout in layouts.items():
                    blocks[name] = [
                        (at, io.submit(of.file.read_at, min(_FETCH_BLOCK, layout.length - at), layout.start + at))
                        for at in range(0, layout.length, _FETCH_BLOCK)
                    ]
            last = i == len(todo) - 1  # its decoder closes the file
            yield _Group(of, g, meta.row_group(g).num_rows, rest, layouts, refused, blocks, last)

    def _reader(self, group: "_Group", name: str) -> Callable[[int, int], Any]:
        """``read(offset, nbytes)`` for one paged column chunk of ``group``."""
        layout = group.layouts[name]
        if group.file.pages is not None:  # local: read on demand into reused buffers
            f = group.file.pages

            def read(offset: int, nbytes: int) -> np.ndarray:
                # whole MiBs, so the pool keeps a few sizes of buffer, not one per read
                buf = self.pool.take(-(-nbytes // _POOL_UNIT) * _POOL_UNIT)[:nbytes]
                f.seek(offset)
                return buf[: f.readinto(buf)]

            return read
        # Not pooled: column chunks come in any size, and a pool keeps one buffer per size.
        data = np.empty(layout.length, dtype=np.uint8)
        for at, block in group.blocks[name]:
            try:
                got = block.result()
            except OSError as exc:
                raise storage_error(exc, f"read bytes {layout.start + at}+ of", group.file.where) from exc
            want = min(_FETCH_BLOCK, layout.length - at)
            if len(got) != want:
                raise PagesRefused(f"the file is shorter than its footer says (bytes {layout.start + at}+)")
            data[at : at + want] = np.frombuffer(got, dtype=np.uint8)

        def read_fetched(offset: int, nbytes: int) -> np.ndarray:
            at = offset - layout.start
            return data[at : at + nbytes]

        return read_fetched

    def _decoded(self, group: "_Group") -> Iterator[dict[str, Any]]:
        try:
            yield from self._decoded_rows(group)
        finally:
            if group.last:
                group.file.close()

    def _decoded_rows(self, group: "_Group") -> Iterator[dict[str, Any]]:
        rows = group.rows
        done = 0
        try:
            if group.refused is not None:
                raise PagesRefused(group.refused)
            others = [s for s in self.specs if s.name not in self.paged]
            rest = self._convert(self._waited(group, group.rest), others) if others else {}
            feeds = {
                s.name: _PageFeed(
                    s.name, iter_page_values(self._reader(group, s.name), group.layouts[s.name], math.prod(s.shape))
                )
                for s in self.specs
                if s.name in self.paged
            }
            while done < rows:
                n = min(self.chunk_rows, rows - done)
                out: dict[str, Any] = {}
                for s in self.specs:
                    feed = feeds.get(s.name)
                    if feed is None:
                        out[s.name] = rest[s.name][done : done + n]
                    else:
                        # a full chunk's buffer even for a short chunk: one size per column
                        arr = self.pool.take_array((self.chunk_rows, *s.shape), s.dtype)[:n]
                        feed.fill(arr.reshape(-1), last=done + n == rows)
                        out[s.name] = arr
                yield out
                done += n
        except PagesRefused as exc:
            logger.debug("%s row group %d: read with pyarrow from row %d (%s)", group.file.where, group.g, done, exc)
            yield from self._arrow_rows(group, done)

    @staticmethod
    def _waited(group: "_Group", future: Future) -> Any:
        try:
            return future.result()
        except (OSError, pa.ArrowInvalid) as exc:
            raise storage_error(exc, "read the Parquet data of", group.file.where) from exc

    def _arrow_rows(self, group: "_Group", skip: int) -> Iterator[dict[str, Any]]:
        """Row group ``group.g`` from row ``skip`` on, read and converted by pyarrow."""
        import pyarrow.parquet as pq

        try:
            table = group.file.read_row_group(group.g, self.names).slice(skip)
        except (OSError, pa.ArrowInvalid) as exc:
            raise storage_error(exc, "read the Parquet data of", group.file.where) from exc
        for start in range(0, table.num_rows, self.chunk_rows):
            yield self._convert(table.slice(start, self.chunk_rows))

    def __call__(self) -> Iterator[Any]:
        for arrays in self._arrays():
            if not self.dense:
                yield flatten(arrays, self.specs)
            elif self.label is None:
                yield arrays
            else:
                y = arrays.pop(self.label)
                yield arrays, y


class _OpenFile(NamedTuple):
    """A Parquet file opened for paged reading (see ``_ChunkStream._paged``)."""

    path: str
    where: str
    file: Any  # what pyarrow reads the footer and other columns from; ranged reads (remote)
    pf: Any
    pages: Any  # local: a second handle, the decoder's alone, for reading pages
    lock: threading.Lock  # one pyarrow read of this file at a time

    def read_row_group(self, g: int, columns: list[str]) -> pa.Table:
        with self.lock:
            return self.pf.read_row_group(g, columns=columns)

    def close(self) -> None:
        with self.lock:
            self.file.close()
            if self.pages is not None:
                self.pages.close()


class _Group(NamedTuple):
    """One row group prepared for decoding."""

    file: _OpenFile
    g: int
    rows: int
    rest: Future | None  # the columns not decoded from pages, read by pyarrow
    layouts: dict[str, Any]  # paged column -> formats.parquet_pages.ChunkLayout
    refused: str | None  # why the footer alone rules the pages out
    blocks: dict[str, list[tuple[int, Future]]]  # remote: ranged reads of each paged chunk
    last: bool  # the last of its file's row groups in this pass


class _PageFeed:
    """Flat values of one column chunk, page by page, cut to fill the chunks' arrays.

    A chunk is handed out only after the page past its last value was checked (or the column
    chunk's end was), so a row that runs on is refused before any of it is used.
    """

    def __init__(self, name: str, pages: Iterator[np.ndarray]) -> None:
        self._name = name
        self._pages = pages
        self._left: np.ndarray = np.empty(0)

    def _next(self) -> np.ndarray | None:
        try:
            return next(self._pages, None)
        except PagesRefused as exc:
            raise PagesRefused(f"column {self._name!r}: {exc}") from None

    def fill(self, dest: np.ndarray, *, last: bool) -> None:
        at = 0
        while at < len(dest):
            if not len(self._left):
                page = self._next()
                if page is None:
                    raise PagesRefused("fewer values than the row group's rows hold")
                self._left = page
            take = min(len(self._left), len(dest) - at)
            dest[at : at + take] = self._left[:take]
            self._left = self._left[take:]
            at += take
        if last:
            if len(self._left) or self._next() is not None:
                raise PagesRefused("more values than the row group's rows hold")
        elif not len(self._left):
            page = self._next()
            if page is None:
                raise PagesRefused("fewer values than the row group's rows hold")
            self._left = page


_PAGED_VALUES = {pa.float32(), pa.float64(), pa.int32(), pa.int64()}


def _paged_columns(specs: Sequence[ColumnSpec], schema: pa.Schema) -> set[str]:
    """Dense columns stored as one-level lists of a fixed-width number (see ``_paged``)."""
    out = set()
    for spec in specs:
        if spec.is_ragged or not spec.shape:
            continue
        t = schema.field(spec.name).type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
            continue
        if t.value_type in _PAGED_VALUES and np.dtype(t.value_type.to_pandas_dtype()) == np.dtype(spec.dtype):
            out.add(spec.name)
    return out


def chunk_rows_for(metadata: Sequence[Any], names: Sequence[str], batch_size: int) -> int:
    """Rows per generator chunk: a multiple of ``batch_size`` holding about ``_CHUNK_BYTES``."""
    wanted = set(names)
    nbytes = rows = 0
    for meta in metadata[:8]:
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            rows += rg.num_rows
            for c in range(rg.num_columns):
                col = rg.column(c)
                if col.path_in_schema.split(".")[0] in wanted:
                    nbytes += col.total_uncompressed_size
    row_bytes = max(1.0, nbytes / rows) if rows else 64.0
    per_chunk = int(_CHUNK_BYTES / row_bytes) // batch_size
    return batch_size * max(1, min(per_chunk, _MAX_CHUNK_ROWS // batch_size))


def parquet_dataset(
    path_or_url: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
    batch_size: int = 1024,
    label: str | None = None,
    shard: Any = None,
    filesystem: Any = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    fill_values: Mapping[str, Any] | None = None,
    prefetch: int | None = None,
):
    """A ``tf.data.Dataset`` of batches read from Parquet files with pyarrow.

    Args:
        path_or_url: a Parquet file or a directory of them: local path, ``file://``, ``s3://``
            (endpoint and keys from the AWS variables, or ``filesystem=``) or ``hdfs://``.
            Files whose names start with ``_`` or ``.`` are skipped.
        columns: columns to read, in this order (default: all). Only these are decoded.
        batch_size: rows per batch; every batch has exactly this many rows except the last.
        label: a column to yield apart: batches become ``(features, label)``.
        shard: ``None``, ``(index, count)`` or a node ``ctx``: read every ``count``-th file
            starting at ``index`` (every ``count``-th row group when there are fewer files
            than shards).
        filesystem: a ``pyarrow.fs`` (or fsspec) filesystem to read with instead of the one the
            URL implies.
        shapes: declared per-row shapes for list columns (dense instead of ragged).
        fill_values: per-column value for nulls (default: a null is a ``SchemaError``).
        prefetch: batches to prefetch (default 8; ``tf.data.AUTOTUNE`` turns tf.data's
            autotuning back on for this dataset).

    Returns:
        A ``tf.data.Dataset`` of ``dict[str, tf.Tensor | tf.RaggedTensor]`` (or
        ``(features, label)``). Each iteration reads the shard once, in file order.

    Raises:
        StorageError: the path does not exist or cannot be read (names the URL and the fix).
        SchemaError: a missing column, a type TF cannot hold, schemas that differ between
            files, or a null in a column without a fill value.
    """
    import tensorflow as tf

    validate_reader_args(batch_size, label, columns)
    plan = plan_parquet(path_or_url, columns=columns, shard=shard, filesystem=filesystem)
    wanted = list(columns) if columns is not None else list(plan.schema.names)
    if label is not None and label not in wanted:
        wanted.append(label)
    if not wanted:
        raise SchemaError(
            f"{plan.location.url}: the Parquet files have no columns "
            f"({plan.location.display(plan.files[0])} and the rest), so there is nothing to read. "
            f"Rewrite them with at least one column (a DataFrame with no columns writes such files)."
        )
    if prefetch is not None and (
        isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < tf.data.AUTOTUNE
    ):
        raise ValueError(
            f"prefetch must be an int >= 0 or tf.data.AUTOTUNE (-1), got {prefetch!r}."
        )
    try:
        specs = column_specs(plan.schema, columns=wanted, shapes=shapes, fill_values=fill_values)
    except SchemaError as exc:
        raise SchemaError(f"{plan.location.url}: {exc}") from exc
    check_representable(specs)
    _check_nulls(plan.location, plan.files, plan.metadata, specs)
    dense = not any(s.is_ragged for s in specs)
    chunk = chunk_rows_for(plan.metadata, wanted, int(batch_size)) if dense else int(batch_size)
    stream = _ChunkStream(plan.location, plan.units, specs, plan.schema, chunk, label)
    if dense:
        sig = signature(plan.schema, wanted, label, shapes)
        ds = generator_dataset(stream, sig)
        ds = ds.rebatch(int(batch_size))
    else:
        ds = generator_dataset(stream, flat_signature(specs))
        ds = ds.map(lambda *flat: assemble(flat, specs, label))
    opts = tf.data.Options()
    if shard is not None:
        # Sharded here by file/row group; a distribution strategy must not shard again.
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    depth = _DEFAULT_PREFETCH if prefetch is None else int(prefetch)
    opts.autotune.enabled = depth == tf.data.AUTOTUNE
    return ds.with_options(opts).prefetch(depth)
