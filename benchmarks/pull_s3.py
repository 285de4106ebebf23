"""Pull-S3 scenario: TFRecords on a real S3 server with a real round trip, read into TF batches.

A SeaweedFS S3 server (``tests/s3server.py``) runs on 127.0.0.1 and every path reaches it
through :class:`benchmarks.latency.LatencyProxy`, which delays each forwarded chunk by
:data:`DELAY_MS` each way: every request pays a round trip of twice that, as against a real
object store (S3's first byte is typically 10-50 ms away). The table is written as
:data:`NUM_FILES` TFRecord files plus the schema file (as in ``pull-tfrecord``) and uploaded once.

* ``tfrecord`` (ours): ``feeders.tfrecord_dataset("s3://...")``, which reads each file with
  ranged reads kept in flight ahead of the framer (``feeders/readahead.py``).
* ``pyarrow-stream`` (peer): what a reader streaming through ``pyarrow.fs`` gets: each file
  opened with ``open_input_stream`` and read 1 MiB at a time, every read a ranged GET waited
  for; the same framing (``formats.tfrecord.iter_record_batches``) and a hand-written
  ``parse_example`` as ``pull-tfrecord``'s peers, behind ``Dataset.from_generator``. This is
  how ``feeders.tfrecord_dataset`` read S3 before the read-ahead; TF 2.21 itself has no
  ``s3://`` and tensorflow-io's (compat stack) aborts the process at exit, so neither is a peer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.paths import BenchPath
from benchmarks.pull_tfrecord import BATCH_SIZE, NUM_FILES, count_rows, feature_spec, write_tfrecords

__all__ = ["TABLES", "DELAY_MS", "build"]

TABLES = ("numeric", "mnist")
DELAY_MS = 10.0  # each way: a 20 ms round trip


def _streamed(s3: Any, paths: list[str], features: dict[str, Any]) -> Any:
    """The peer: pyarrow's sequential streams, our framing, TF's parse."""
    import numpy as np
    import tensorflow as tf

    from formats.tfrecord import iter_record_batches

    def records():
        for path in paths:
            with s3.open_input_stream(path, compression=None, buffer_size=1 << 20) as f:
                for batch in iter_record_batches(f, name=path, batch_records=BATCH_SIZE):
                    yield np.array(batch, dtype=object)

    ds = tf.data.Dataset.from_generator(records, output_signature=tf.TensorSpec([None], tf.string))
    ds = ds.map(lambda s: tf.io.parse_example(s, features), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def build(env: Any) -> list[BenchPath]:
    """The pull-S3 paths on ``env.table()``: starts the S3 server and the proxy (closed after)."""
    from pyarrow import fs as pafs

    import feeders
    from benchmarks.latency import LatencyProxy
    from tests.s3server import start_s3_server

    table = env.table()
    local = env.workdir / "tfrecord"
    write_tfrecords(table, local, files=NUM_FILES)
    server = start_s3_server(Path(env.workdir) / "seaweedfs")
    proxy = None
    try:
        bucket = server.make_bucket()
        url = server.upload_dir(local, bucket, "bench")
        proxy = LatencyProxy(int(server.endpoint.rsplit(":", 1)[1]), DELAY_MS / 1000)
        s3 = pafs.S3FileSystem(
            access_key=server.access_key,
            secret_key=server.secret_key,
            endpoint_override=f"127.0.0.1:{proxy.port}",
            scheme="http",
            region=server.region,
        )
        paths = sorted(
            info.path
            for info in s3.get_file_info(pafs.FileSelector(f"{bucket}/bench"))
            if info.path.endswith(".tfrecord")
        )
        ours = feeders.tfrecord_dataset(url, batch_size=BATCH_SIZE, filesystem=s3)
        peer = _streamed(s3, paths, feature_spec(table))
    except BaseException:
        if proxy is not None:
            proxy.stop()
        server.stop()
        raise

    def close() -> None:
        proxy.stop()
        server.stop()

    nbytes = table.num_rows * env.row_bytes()
    return [
        BenchPath("tfrecord", count_rows(ours), kind="ours", nbytes=nbytes),
        BenchPath("pyarrow-stream", count_rows(peer), kind="peer", nbytes=nbytes, close=close),
    ]
