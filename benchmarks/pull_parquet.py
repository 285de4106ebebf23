"""Pull-Parquet scenario: one Parquet dataset read into TF batches by ours, two peers and a ceiling.

The table (``env.table()``) is written once as :data:`NUM_FILES` Parquet files (what a Spark
job with that many partitions leaves behind) and every path reads those same files, producing
batches of :data:`BATCH_SIZE` rows; a repetition iterates the whole dataset, materialising every
batch, and returns the rows it saw.

* ``parquet`` (ours): ``feeders.parquet_dataset``, built once (like a training loop builds its
  dataset once), iterated per repetition. For ``mnist`` the image is declared
  ``shapes={"image": (784,)}`` so it arrives dense, as a model wants it.
* ``pyarrow-raw`` (ceiling): ``ParquetFile.iter_batches(batch_size)`` + ``to_numpy`` per
  column (the list column's flat values): decoding with no tensors at all, in the main thread.
* ``pyarrow-raw-thread`` (ceiling): the same in one persistent worker thread; on pyarrow 14
  it is the faster of the two for list columns (see :func:`_raw`).
* ``pyarrow-scan`` (ceiling): the files decoded by a ``pyarrow.dataset`` scan with the read-ahead
  ours uses (Arrow's threads, two files at a time) and turned into numpy, with no TensorFlow at
  all: the most Arrow's own decoding delivers on this machine. On 2 cores it is up to twice
  ``pyarrow-raw``; for the numeric table ``ours / pyarrow-scan`` is what TensorFlow's side
  costs. For ``mnist`` it is no ceiling for ours, which reads the image column's pages itself
  (``formats/parquet_pages/``) instead of decoding its list levels with Arrow.
* ``petastorm`` (peer, compat stack only): Petastorm's documented pipeline for plain Parquet:
  ``make_batch_reader`` + ``make_petastorm_dataset`` + ``unbatch().batch(batch_size)``, a new
  reader per repetition (a Petastorm reader is single-pass with ``num_epochs=1``).
* ``tfio`` (peer, compat stack only): ``tfio.IODataset.from_parquet`` per file, concatenated,
  ``.batch(batch_size)``. It cannot read list columns, so it is unavailable for ``mnist``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from benchmarks.data import IMAGE_SIZE
from benchmarks.paths import BenchPath

__all__ = ["TABLES", "BATCH_SIZE", "NUM_FILES", "build", "write_parquet"]

TABLES = ("numeric", "mnist")
BATCH_SIZE = 1024
NUM_FILES = 4
_COMPAT = "needs the compat stack (pyarrow 14, TF 2.16): bash .ci/setup compat"


def write_parquet(table: pa.Table, directory: Path, *, files: int = NUM_FILES) -> list[Path]:
    """Write ``table`` as ``files`` consecutive parts (row groups of at most 128k rows)."""
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    per = -(-table.num_rows // files)
    out = []
    for i in range(files):
        part = table.slice(i * per, per)
        if part.num_rows == 0:
            break
        path = directory / f"part-{i:05d}.parquet"
        pq.write_table(part, path, row_group_size=128 * 1024)
        out.append(path)
    return out


def _count(ds: Any, key: str = "id") -> int:
    rows = 0
    for batch in ds:
        rows += int(batch[key].shape[0])
    return rows


def _to_numpy(batch: pa.RecordBatch) -> int:
    """Every column of ``batch`` as numpy (a list column's flat values); returns its rows."""
    for col in batch.columns:
        if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
            col.flatten().to_numpy()
        else:
            col.to_numpy()
    return batch.num_rows


def _raw(files: list[Path], *, thread: bool = False) -> Callable[[], int]:
    """The ceiling: decoding with no tensors, in the main thread or in one persistent worker.

    Both placements are timed because neither is always faster. On pyarrow 14 the main thread
    took 1.3-2.4x longer for the MNIST table (about 130k minor page faults per 40k rows, a few
    thousand in a worker: the main thread's malloc arena hands freed memory back to the OS);
    for the numeric table the main thread was as fast or faster. Ours, Petastorm and tfio
    decode off the main thread.
    """
    import pyarrow.parquet as pq

    def decode() -> int:
        rows = 0
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_SIZE):
                rows += _to_numpy(batch)
        return rows

    if not thread:
        return decode
    pool = ThreadPoolExecutor(1, thread_name_prefix="pyarrow-raw")  # one thread for every rep

    def run() -> int:
        return pool.submit(decode).result()

    return run


def _scan(files: list[Path]) -> Callable[[], int]:
    """The threaded ceiling: what ``feeders.parquet_dataset`` decodes, minus TensorFlow."""
    import pyarrow.dataset as pds

    def run() -> int:
        fmt = pds.ParquetFileFormat(
            default_fragment_scan_options=pds.ParquetFragmentScanOptions(pre_buffer=False)
        )
        dataset = pds.dataset([str(f) for f in files], format=fmt)
        scanner = dataset.scanner(
            batch_size=BATCH_SIZE * 8, fragment_readahead=2, batch_readahead=2, use_threads=True
        )
        return sum(_to_numpy(batch) for batch in scanner.to_batches())

    return run


def _petastorm(directory: Path) -> Callable[[], int]:
    def run() -> int:
        import tensorflow as tf
        from petastorm import make_batch_reader
        from petastorm.tf_utils import make_petastorm_dataset

        with make_batch_reader(
            "file://" + str(directory), num_epochs=1, shuffle_row_groups=False, workers_count=4
        ) as reader:
            ds = make_petastorm_dataset(reader).unbatch().batch(BATCH_SIZE)
            ds = ds.prefetch(tf.data.AUTOTUNE)
            rows = 0
            for batch in ds:
                rows += int(batch.id.shape[0])
            return rows

    return run


def _compat_unavailable(module: str) -> str | None:
    if int(pa.__version__.split(".")[0]) >= 16:
        return f"{_COMPAT} (pyarrow {pa.__version__} here)"
    try:
        __import__(module)
    except ImportError as exc:
        return f"{module} is not installed ({exc}); {_COMPAT}"
    return None


def build(env: Any) -> list[BenchPath]:
    """The pull-Parquet paths on ``env.table()``."""
    import feeders

    table = env.table()
    directory = env.workdir / "parquet"
    files = write_parquet(table, directory)
    nbytes = table.num_rows * env.row_bytes()
    shapes = {"image": (IMAGE_SIZE,)} if "image" in table.column_names else None
    ours_ds = feeders.parquet_dataset(directory, batch_size=BATCH_SIZE, shapes=shapes)
    paths = [
        BenchPath("parquet", lambda: _count(ours_ds), kind="ours", nbytes=nbytes),
        BenchPath("pyarrow-raw", _raw(files), kind="ceiling", nbytes=nbytes),
        BenchPath("pyarrow-raw-thread", _raw(files, thread=True), kind="ceiling", nbytes=nbytes),
        BenchPath("pyarrow-scan", _scan(files), kind="ceiling", nbytes=nbytes),
    ]
    reason = _compat_unavailable("petastorm")
    if reason:
        paths.append(BenchPath("petastorm", lambda: 0, kind="peer", unavailable=reason))
    else:
        paths.append(BenchPath("petastorm", _petastorm(directory), kind="peer", nbytes=nbytes))
    reason = _compat_unavailable("tensorflow_io")
    if reason is None and "image" in table.column_names:
        reason = "tensorflow-io's Parquet reader cannot read list columns (image)"
    if reason:
        paths.append(BenchPath("tfio", lambda: 0, kind="peer", unavailable=reason))
    else:
        tfio_ds = feeders.tfio_parquet_dataset(directory, batch_size=BATCH_SIZE)
        paths.append(BenchPath("tfio", lambda: _count(tfio_ds), kind="peer", nbytes=nbytes))
    return paths
