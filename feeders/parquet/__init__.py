"""The native Parquet pull reader: pyarrow straight to ``tf.data`` batches, no Petastorm.

How it reads:

* The files under the path are listed once and their footers read (in parallel threads). The
  footers give the schema every file must share, the row groups for sharding, and null counts,
  so a missing column, an unsupported type, a schema that differs between files or a null in a
  dense column is a typed error when the dataset is built, not in the middle of training.
* Sharding is by rows: shard i of n reads rows [i*N//n, (i+1)*N//n) in file order, as the
  footers count them, so shards differ by one row at most; a row group at a boundary is
  decoded by both shards, each keeping its part.
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

The pieces, one module each, in the order a pass uses them:

* :mod:`feeders.parquet.plan`: files, footers, checks, the shard's units and the chunk size;
* :mod:`feeders.parquet.scan`: Arrow's threaded scan, and Arrow batches to numpy;
* :mod:`feeders.parquet.pages`: the paged reading of fixed-length list columns;
* :mod:`feeders.parquet.stream`: the generator source that uses one of the two;
* :mod:`feeders.parquet.dataset`: :func:`parquet_dataset`, the ``tf.data`` pipeline.
"""

from __future__ import annotations

from feeders.parquet.dataset import parquet_dataset
from feeders.parquet.plan import ParquetPlan, plan_parquet

__all__ = ["parquet_dataset", "ParquetPlan", "plan_parquet"]
