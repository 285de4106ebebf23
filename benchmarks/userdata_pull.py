"""The pull scenarios on the user's data (``--data``): every reader that applies, and stages.

``pull-parquet``: ``parquet`` (ours: ``feeders.parquet_dataset``), ``pyarrow-raw`` (ceiling:
``ParquetFile.iter_batches`` to numpy in the main thread, no tensors), ``petastorm`` and
``tfio`` (peers, compat stack). ``pull-tfrecord``: ``tfrecord`` (ours:
``feeders.tfrecord_dataset``), ``tfdata-tuned`` and ``tfdata-sequential`` (peers: TF's own
``TFRecordDataset`` + ``parse_example`` pipelines, the feature spec written from the schema ours
found; TF 2.21 reads no ``s3://`` or ``hdfs://``, so there they are ``ok: false``).

Every path reads the same columns in batches of ``--batch-size`` rows and stops after
``--limit`` rows. The ``stage`` paths time ours' pipeline cut short, for the breakdown
(:mod:`benchmarks.breakdown`): ``read`` (the bytes ours reads: the selected column chunks of
each row group / the record files, through the same filesystem), then ``decode`` (ours' own
reading and decoding, iterated in Python without TensorFlow), then ours whole (``to_tf``: the
hand-over to ``tf.data``, re-batching, and for TFRecords not decoded in place ``parse_example``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from benchmarks.breakdown import Step, ladder
from benchmarks.paths import BenchPath

__all__ = ["build", "breakdown", "Counter", "rows_of"]

_COMPAT = "needs the compat stack (pyarrow 14, TF 2.16): bash .ci/setup compat"
_READ_BLOCK = 1 << 20


def rows_of(batch: Any) -> int:
    """Rows in one batch: a dict of tensors/arrays, ``(features, label)``, or a namedtuple."""
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        batch = batch[-1]
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif hasattr(batch, "_fields"):
        batch = batch[0]
    elif isinstance(batch, pa.RecordBatch):
        return batch.num_rows
    nrows = getattr(batch, "nrows", None)
    return int(nrows()) if callable(nrows) else int(batch.shape[0])


class Counter:
    """A repetition: iterate ``source()`` until ``limit`` rows, timing the waits for input.

    ``waits`` gets, per call, the seconds spent creating the iterator and blocked in ``next``:
    how long a consumer that does nothing else waited for input; ``firsts`` the seconds until
    the first batch.
    """

    def __init__(self, source: Callable[[], Iterable[Any]], limit: int | None, *,
                 count: Callable[[Any], int] = rows_of) -> None:
        self.source = source
        self.limit = limit
        self.count = count
        self.waits: list[float] = []
        self.firsts: list[float] = []

    def __call__(self) -> int:
        clock = time.perf_counter
        start = t0 = clock()
        it = iter(self.source())
        wait = clock() - t0
        rows = 0
        first = None
        try:
            while self.limit is None or rows < self.limit:
                t0 = clock()
                try:
                    batch = next(it)
                except StopIteration:
                    wait += clock() - t0
                    break
                wait += clock() - t0
                if first is None:
                    first = clock() - start
                rows += self.count(batch)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        self.waits.append(wait)
        self.firsts.append(first if first is not None else 0.0)
        return rows if self.limit is None else min(rows, self.limit)


# ------------------------------------------------------------------ Parquet


def _column_ranges(meta: Any, names: set[str], rows: int | None) -> tuple[list[tuple[int, int]], int]:
    """Byte ranges (offset, length) of the ``names`` column chunks, row groups up to ``rows``."""
    out = []
    seen = 0
    for g in range(meta.num_row_groups):
        if rows is not None and seen >= rows:
            break
        rg = meta.row_group(g)
        seen += rg.num_rows
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema.split(".")[0] not in names:
                continue
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                start = min(start, col.dictionary_page_offset)
            out.append((start, col.total_compressed_size))
    return out, seen


def _read_parquet_bytes(d: Any) -> Callable[[], int]:
    """Stage ``read``: the selected column chunks' bytes, read as ours reads them (no decoding)."""
    plan = d.plan
    names = set(d.columns)
    local = d.location.scheme == "file"
    threads = 2 if local else 16

    def run() -> int:
        left: int | None = d.rows
        jobs = []
        for path, meta in zip(plan.files, plan.metadata):
            if left is not None and left <= 0:
                break
            ranges, rows = _column_ranges(meta, names, left)
            left = None if left is None else left - rows
            jobs.append((path, ranges))

        def read_local(job: tuple[str, list[tuple[int, int]]]) -> int:
            """As ours reads local pages: plain reads into a reused buffer."""
            path, ranges = job
            n = 0
            buf = memoryview(bytearray(8 * _READ_BLOCK))
            with open(path, "rb", buffering=0) as f:
                for start, length in ranges:
                    f.seek(start)
                    for at in range(0, length, len(buf)):
                        n += f.readinto(buf[: min(len(buf), length - at)])
            return n

        def fetch(block: tuple[Any, int, int]) -> int:
            f, start, length = block
            return len(f.read_at(length, start))

        with ThreadPoolExecutor(threads) as pool:
            if local:
                sum(pool.map(read_local, jobs))
                return d.rows
            # remote: every 1 MiB block a ranged read, 16 in flight, as ours fetches pages
            opened = [d.location.filesystem.open_input_file(path) for path, _ in jobs]
            try:
                blocks = [
                    (f, start + at, min(_READ_BLOCK, length - at))
                    for f, (_, ranges) in zip(opened, jobs)
                    for start, length in ranges
                    for at in range(0, length, _READ_BLOCK)
                ]
                sum(pool.map(fetch, blocks))
            finally:
                for f in opened:
                    f.close()
        return d.rows

    return run


def _parquet_stream(d: Any) -> tuple[Callable[[], Iterator[Any]], Callable[[Any], int]]:
    """Stage ``decode``: ours' Parquet reading and decoding to numpy, without TensorFlow.

    Returns the stream (a callable giving one pass) and how to count an item's rows: a dict
    of arrays, or with ragged columns the flat tuple (values, then row splits).
    """
    from feeders.parquet.plan import chunk_rows_for
    from feeders.parquet.stream import ChunkStream

    dense = not any(s.is_ragged for s in d.specs)
    chunk = chunk_rows_for(d.plan.metadata, d.columns, d.spec.batch_size) if dense else d.spec.batch_size
    stream = ChunkStream(d.plan.location, d.plan.units, d.specs, d.plan.schema, chunk, None, d.plan.hive,
                         d.plan.window)
    first = d.specs[0]

    def count(item: Any) -> int:
        if isinstance(item, dict):
            return rows_of(item)
        return len(item[1]) - 1 if first.is_ragged else len(item[0])

    return stream, count


def _to_numpy(batch: pa.RecordBatch) -> int:
    for col in batch.columns:
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
            col.flatten().to_numpy(zero_copy_only=False)
        else:
            col.to_numpy(zero_copy_only=False)
    return batch.num_rows


def _pyarrow_raw(d: Any) -> Callable[[], Iterator[pa.RecordBatch]]:
    import pyarrow.parquet as pq

    from formats.hive import add_constant_columns

    hive = d.plan.hive
    in_files = hive.in_files(d.columns)

    def batches() -> Iterator[pa.RecordBatch]:
        for path in d.plan.files:
            with d.location.filesystem.open_input_file(path) as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=d.spec.batch_size, columns=in_files):
                    if hive:  # partition columns live in the directory names
                        batch = add_constant_columns(batch, hive.values[path], d.columns)
                    _to_numpy(batch)
                    yield batch

    return batches


def _compat_unavailable(module: str) -> str | None:
    if int(pa.__version__.split(".")[0]) >= 16:
        return f"{_COMPAT} (pyarrow {pa.__version__} here)"
    try:
        __import__(module)
    except ImportError as exc:
        return f"{module} is not installed ({exc}); {_COMPAT}"
    return None


def _petastorm(d: Any) -> Callable[[], Iterator[Any]]:
    def batches() -> Iterator[Any]:
        import tensorflow as tf
        from petastorm import make_batch_reader
        from petastorm.tf_utils import make_petastorm_dataset

        url = d.spec.url if "://" in d.spec.url else "file://" + str(d.location.path)
        with make_batch_reader(url, schema_fields=d.columns, num_epochs=1, shuffle_row_groups=False,
                               workers_count=4) as reader:
            ds = make_petastorm_dataset(reader).unbatch().batch(d.spec.batch_size)
            yield from ds.prefetch(tf.data.AUTOTUNE)

    return batches


def _parquet_paths(d: Any, nbytes: int) -> tuple[list[BenchPath], Counter]:
    import feeders

    from benchmarks.userdata import ours_dataset

    limit = d.spec.limit
    ds = ours_dataset(d)
    ours = Counter(lambda: ds, limit)
    stream, count = _parquet_stream(d)
    paths = [
        BenchPath("parquet", ours, kind="ours", nbytes=nbytes),
        BenchPath("pyarrow-raw", Counter(_pyarrow_raw(d), limit), kind="ceiling", nbytes=nbytes),
    ]
    reason = _compat_unavailable("petastorm")
    if reason:
        paths.append(BenchPath("petastorm", lambda: 0, kind="peer", unavailable=reason))
    else:
        paths.append(BenchPath("petastorm", Counter(_petastorm(d), limit), kind="peer", nbytes=nbytes))
    reason = _compat_unavailable("tensorflow_io")
    if reason is None and d.location.scheme != "file":
        reason = f"tensorflow-io's Parquet reader is run on local files only here ({d.location.scheme}:// given)"
    if reason is None and any(s.shape for s in d.specs):
        reason = "tensorflow-io's Parquet reader cannot read list columns: " + ", ".join(
            s.name for s in d.specs if s.shape
        )
    if reason is None and any(c in d.plan.hive.names for c in d.columns):
        reason = "tensorflow-io's Parquet reader does not read partition columns (key=value directories): " + ", ".join(
            c for c in d.columns if c in d.plan.hive.names
        )
    if reason:
        paths.append(BenchPath("tfio", lambda: 0, kind="peer", unavailable=reason))
    else:
        tfio_ds = feeders.tfio_parquet_dataset(str(d.location.path), batch_size=d.spec.batch_size,
                                               columns=d.columns)
        paths.append(BenchPath("tfio", Counter(lambda: tfio_ds, limit), kind="peer", nbytes=nbytes))
    paths += [
        BenchPath("read", _read_parquet_bytes(d), kind="stage"),
        BenchPath("decode", Counter(stream, limit, count=count), kind="stage"),
    ]
    return paths, ours


# ------------------------------------------------------------------ TFRecord


def _read_record_bytes(d: Any) -> Callable[[], int]:
    """Stage ``read``: the record files' bytes, opened and read as ours opens them.

    With ``--limit`` each file is read up to the same share of its bytes as the limit is of
    the rows (the records' sizes are not known before framing them).
    """
    from feeders.tfrecord.files import open_raw

    share = d.rows / d.total_rows if d.total_rows else 1.0
    buf = memoryview(bytearray(_READ_BLOCK))  # local files: read into it, as ours' framer does

    def run() -> int:
        for path in d.plan.files:
            size = d.location.filesystem.get_file_info(path).size
            want = size if share >= 1 else int(size * share) + 1
            raw = open_raw(d.location, path, d.plan.compression)
            readinto = getattr(raw, "readinto", None) if d.location.scheme == "file" else None
            try:
                got = 0
                while got < want:
                    n = readinto(buf) if readinto is not None else len(raw.read(_READ_BLOCK))
                    if not n:
                        break
                    got += n
            finally:
                raw.close()
        return d.rows

    return run


def _record_stream(d: Any) -> tuple[Any, Callable[[Any], int]]:
    """Stage ``decode``: ours' framing (and in-place decoding where it applies), no TensorFlow."""
    from feeders.tfrecord.stream import RecordBatches, layout_holds
    from formats.example_layout import layout_columns

    specs = d.specs
    dense = not any(s.is_ragged for s in specs)
    layout = layout_columns(specs) if dense else None
    files = d.plan.files
    if layout is not None and files and not layout_holds(d.location, files[0], d.plan.compression, layout):
        layout = None
    stream = RecordBatches(d.location, files, d.plan.compression, d.spec.batch_size, None,
                           chunked=dense, layout=layout)

    def count(item: Any) -> int:
        if isinstance(item, tuple):
            serialized, decoded = item
            return len(serialized) or (len(next(iter(decoded.values()))) if decoded else 0)
        return len(item)

    return stream, count


def _feature_spec(d: Any) -> dict[str, Any]:
    """TF's own ``parse_example`` features for the columns ours found (Example kinds)."""
    import tensorflow as tf

    kinds = {"float32": tf.float32, "float64": tf.float32, "string": tf.string}
    out: dict[str, Any] = {}
    for s in d.specs:
        dtype = kinds.get(s.dtype, tf.int64)
        if s.is_ragged:
            out[s.name] = tf.io.RaggedFeature(dtype)
        elif s.fill is not None and not s.shape:  # --fill: what parse_example puts for an absent feature
            out[s.name] = tf.io.FixedLenFeature([], dtype, default_value=s.fill)
        else:
            out[s.name] = tf.io.FixedLenFeature(list(s.shape), dtype)
    return out


def _tfdata(d: Any, *, parallel_reads: bool) -> Any:
    import tensorflow as tf

    features = _feature_spec(d)
    reads = tf.data.AUTOTUNE if parallel_reads else None
    ds = tf.data.TFRecordDataset(list(d.plan.files), compression_type=d.plan.compression or "",
                                 num_parallel_reads=reads)
    ds = ds.batch(d.spec.batch_size)
    ds = ds.map(lambda s: tf.io.parse_example(s, features), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def _tfrecord_paths(d: Any, nbytes: int) -> tuple[list[BenchPath], Counter]:
    from benchmarks.userdata import ours_dataset

    limit = d.spec.limit
    ds = ours_dataset(d)
    ours = Counter(lambda: ds, limit)
    paths = [BenchPath("tfrecord", ours, kind="ours", nbytes=nbytes)]
    reason = None
    if d.location.scheme != "file":
        import tensorflow as tf

        reason = (f"TensorFlow {tf.__version__}'s TFRecordDataset reads no {d.location.scheme}:// "
                  f"(its filesystem plugins moved to tensorflow-io)")
    for name, parallel in (("tfdata-tuned", True), ("tfdata-sequential", False)):
        if reason:
            paths.append(BenchPath(name, lambda: 0, kind="peer", unavailable=reason))
        else:
            peer = _tfdata(d, parallel_reads=parallel)
            paths.append(BenchPath(name, Counter(lambda peer=peer: peer, limit), kind="peer", nbytes=nbytes))
    stream, count = _record_stream(d)
    paths += [
        BenchPath("read", _read_record_bytes(d), kind="stage"),
        BenchPath("decode", Counter(stream, limit, count=count), kind="stage"),
    ]
    return paths, ours


# ------------------------------------------------------------------ the scenario module


def build(env: Any) -> list[BenchPath]:
    """The paths for ``env.described`` (a :class:`benchmarks.userdata.Described`)."""
    d = env.described
    nbytes = d.rows * d.row_bytes
    paths, env.ours_path = (_parquet_paths if d.format == "parquet" else _tfrecord_paths)(d, nbytes)
    return paths


_WHAT = {
    "parquet": (
        "reading the selected column chunks' bytes from storage",
        "decoding Parquet pages to numpy chunks (ours' reader without TensorFlow)",
        "hand-over to TF: chunks into tf.data tensors, re-batching, prefetch",
    ),
    "tfrecord": (
        "reading the record files' bytes from storage",
        "framing and CRC checks, and decoding records in place where their layout allows",
        "hand-over to TF: chunks into tf.data, parse_example for records not decoded in place, "
        "re-batching, prefetch",
    ),
}


def breakdown(env: Any, out: dict[str, Any]) -> dict[str, Any] | None:
    """Where ours' time went: read, decode, to_tf, and the consumer's wait for input."""
    d = env.described
    ours = getattr(env, "ours_path", None)
    read, decode, to_tf = _WHAT[d.format]
    waits = ours.waits[-out["reps"]:] if ours is not None else []
    firsts = ours.firsts[-out["reps"]:] if ours is not None else []
    name = "parquet" if d.format == "parquet" else "tfrecord"
    return ladder(out, name, [
        Step("read", read, stage="read"),
        Step("decode", decode, stage="decode"),
        Step("to_tf", to_tf),
    ], waits=waits, firsts=firsts)
