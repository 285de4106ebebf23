"""TensorFlowOnSpark's ``TFNode`` on a dataplane node: ``ctx``, ``DataFeed``, ``hdfs_path``.

A TFoS ``map_fun(args, ctx)`` reads rows with ``TFNode.DataFeed(ctx.mgr, train_mode)`` (or
``ctx.get_data_feed()``). As in TFoS, every DataFeed of a node reads ONE input stream, which
carries what the driver sends:

- ``cluster.train`` rows: the pushed epochs in the node's feed buffer, one after another, as one
  stream of rows (TFoS has no epoch boundaries either);
- ``cluster.inference`` rows, each request followed by an end-of-partition mark. They reach the
  stream once a DataFeed with ``train_mode=False`` exists (it starts answering requests).

``train_mode`` means what it means in TFoS: with ``False`` an end of partition cuts a batch
short (so ``batch_results`` can answer that request); with ``True`` it is skipped. It does NOT
choose between training and inference data: ``next_batch`` reads whatever comes.

The stream ends when the driver shuts the cluster down: ``next_batch`` returns what is left and
``should_stop()`` turns true. ``terminate()`` tells the node's feed buffer that this node will
consume no more training rows: later pushes to it are refused (counted as unconsumed rows)
instead of filling the buffer.

Rows are rebuilt in the element shape the driver's RDD had (see ``TFCluster.rdd_to_dataframe``):
tuples, lists or single values; array fields arrive as numpy arrays, text as ``str``.
"""

from __future__ import annotations

import getpass
import logging
import os
import queue
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from dataplane.errors import FeedError

__all__ = [
    "TFNodeContext",
    "DataFeed",
    "hdfs_path",
    "release_port",
    "start_cluster_server",
    "export_saved_model",
    "next_batch",
    "batch_results",
    "terminate",
    "decode_rows",
    "column_name",
]

logger = logging.getLogger(__name__)

#: Rows per chunk read from the feed buffer; next_batch re-cuts them to any size. Only one chunk
#: waits ahead of next_batch, so ``TFCluster.train`` returning means the rows were taken.
CHUNK_ROWS = 256
_END_PARTITION = object()  # TFoS's marker.EndPartition
_END_FEED = object()  # TFoS's None: the driver shut the cluster down


# -- the row encoding shared with the driver (TFCluster.rdd_to_dataframe) -------------------------
def column_name(layout: str, index: int, kind: str) -> str:
    """Encode the RDD element layout in the pushed column names: ``tuple_0_num``, ``value_0_str``.

    ``layout`` is ``tuple`` (element is a tuple), ``list`` (element is a list) or ``value``;
    ``kind`` is ``num``, ``arr``, ``str`` or ``bin``.
    """
    return f"{layout}_{index}_{kind}"


#: What a node answers ``TFCluster.inference`` with: each ``batch_results`` value encoded by
#: :func:`encode_result`, so the driver's RDD holds the values map_fun gave (types kept, as
#: TFoS's queue kept them) and no probe batch is needed to learn their type.
RESULT_SCHEMA = pa.schema([("result", pa.binary())])


def encode_result(value: Any) -> bytes:
    """One ``batch_results`` value as bytes (nothing pickled on the network): None, bool, int,
    float, str, bytes, numeric or text numpy scalars and arrays (``.npy``, read back with
    ``allow_pickle=False``), and tuples, lists and str-keyed dicts of those.

    Raises:
        TypeError: a value of another type (its type name is the message).
    """
    import io
    import struct

    if value is None:
        return b"N"
    if type(value) is bool:
        return b"?" + (b"1" if value else b"0")
    if type(value) is int:
        return b"i" + str(value).encode()
    if type(value) is float:
        return b"f" + struct.pack("<d", value)
    if isinstance(value, str):
        return b"s" + value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"b" + bytes(value)
    if isinstance(value, (np.ndarray, np.generic)) and np.asarray(value).dtype.kind in "biufcSU":
        buf = io.BytesIO()
        np.save(buf, np.asarray(value), allow_pickle=False)
        return (b"a" if isinstance(value, np.ndarray) else b"g") + buf.getvalue()
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        tag, items = b"d", [x for kv in value.items() for x in kv]
    elif isinstance(value, (tuple, list)):
        tag, items = (b"t" if isinstance(value, tuple) else b"l"), list(value)
    else:
        raise TypeError(type(value).__name__)
    parts = [encode_result(item) for item in items]
    return tag + struct.pack("<I", len(parts)) + b"".join(struct.pack("<I", len(p)) + p for p in parts)


def decode_result(data: bytes) -> Any:
    """The value :func:`encode_result` encoded."""
    import io
    import struct

    tag, body = data[:1], data[1:]
    if tag == b"N":
        return None
    if tag == b"?":
        return body == b"1"
    if tag == b"i":
        return int(body)
    if tag == b"f":
        return struct.unpack("<d", body)[0]
    if tag == b"s":
        return body.decode("utf-8")
    if tag == b"b":
        return bytes(body)
    if tag in (b"a", b"g"):
        arr = np.load(io.BytesIO(body), allow_pickle=False)
        return arr if tag == b"a" else arr[()]
    (count,) = struct.unpack_from("<I", body)
    items, pos = [], 4
    for _ in range(count):
        (n,) = struct.unpack_from("<I", body, pos)
        items.append(decode_result(body[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    if tag == b"t":
        return tuple(items)
    if tag == b"l":
        return items
    return dict(zip(items[0::2], items[1::2]))


def _encoded(results: list[Any]) -> np.ndarray:
    out = np.empty(len(results), dtype=object)
    for i, value in enumerate(results):
        try:
            out[i] = encode_result(value)
        except TypeError as e:
            raise FeedError(
                f"batch_results value {i} holds a {e} ({value!r:.60}), which cannot be returned "
                f"to the driver; return numbers, str, bytes, numpy arrays, or tuples, lists and "
                f"str-keyed dicts of them."
            ) from None
    return out


def _parse(name: str) -> tuple[str, int, str]:
    layout, index, kind = name.rsplit("_", 2)
    return layout, int(index), kind


def _column_values(name: str, col: Any) -> list[Any]:
    """One pushed column as per-row Python values (numpy arrays for array fields)."""
    _, _, kind = _parse(name)
    if isinstance(col, (pa.ChunkedArray, pa.Array)):
        if kind == "arr":
            arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            flat = arr.flatten().to_numpy(zero_copy_only=False)
            offsets = arr.offsets.to_numpy()
            offsets = offsets - offsets[0]  # flatten() starts at the slice's first value
            return [flat[offsets[i] : offsets[i + 1]] for i in range(len(arr))]
        return col.to_pylist()
    # numpy from ctx.serve: arrays are 2-D or object arrays of rows; text is bytes
    if kind == "str":
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in col]
    if kind == "arr":
        return [np.asarray(v) for v in col]
    return [v.item() if hasattr(v, "item") else v for v in col]


def decode_rows(columns: dict[str, Any]) -> list[Any]:
    """Rebuild the RDD elements from pushed columns named by :func:`column_name`."""
    names = sorted(columns, key=lambda n: _parse(n)[1])
    if not names:
        return []
    layout = _parse(names[0])[0]
    values = [_column_values(n, columns[n]) for n in names]
    if layout == "tuple":
        return list(zip(*values))
    if layout == "list":
        return [list(r) for r in zip(*values)]
    return list(values[0])


def _decode_table(table: pa.Table) -> list[Any]:
    return decode_rows({n: table.column(n) for n in table.column_names})


# -- the node's one input stream ------------------------------------------------------------
def _until_stop(ctx: Any) -> None:
    """Wait in a background thread until shutdown. Not ``ctx.wait_stop()``: that ends the
    node's feed and marks main as only waiting, while the TFoS program may still be busy."""
    while not ctx.should_stop:
        time.sleep(0.1)


class _NodeFeed:
    """The single input stream every DataFeed of a node reads (TFoS's ``input`` queue)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self.items: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(1)  # training chunks waiting ahead of next_batch
        self.results: queue.Queue = queue.Queue()
        self.terminated = False
        self.ended = False
        self.error: BaseException | None = None  # what map_fun raised, once it has
        self._reader: threading.Thread | None = None
        self._serving = False

    # training rows: one thread moves the pushed epochs into the stream, a chunk at a time
    def start_reader(self) -> None:
        with self._lock:
            if self._reader is not None:
                return
            # a ps or evaluator receives no pushed rows: its stream only ends at shutdown
            target = self._read_training if self._ctx.worker_index is not None else self._wait_stop
            self._reader = threading.Thread(target=target, name="dataplane-tfos-feed", daemon=True)
            self._reader.start()

    def _wait_stop(self) -> None:
        _until_stop(self._ctx)
        self.items.put(_END_FEED)

    def _read_training(self) -> None:
        ctx = self._ctx
        try:
            while not self.terminated:
                chunks = ctx.next_pushed_epoch(CHUNK_ROWS, _decode_table)
                if chunks is None:
                    break  # the node is stopping
                for rows in chunks:
                    if self.terminated:
                        break
                    self._room.acquire()
                    if not self.terminated:
                        self.items.put(rows)
        except Exception as e:  # noqa: BLE001 - handed to next_batch, unless terminate() ran
            if not self.terminated:
                logger.error("reading the training feed failed: %s", e)
                self.items.put(e)
        _until_stop(ctx)  # after terminate() inference requests may still come, until shutdown
        self.items.put(_END_FEED)

    def next_item(self) -> Any:
        """The next item for ``next_batch``. A map_fun blocked here waits for the driver (more
        rows, an inference request, or the feed's end at shutdown), so it counts as idle:
        ``cluster.shutdown`` then ends the feed at once instead of waiting for main (a worker
        that called ``terminate()`` and reads on for inference rows waited out the timeout)."""
        try:
            return self.items.get_nowait()
        except queue.Empty:
            return self._ctx._buffer.waiting_for_driver(self.items.get)

    def took_chunk(self) -> None:
        self._room.release()

    # inference rows: ctx.serve's thread puts each request into the stream, then waits
    def start_serving(self) -> None:
        with self._lock:
            if self._serving:
                return
            self._serving = True
        threading.Thread(
            target=self._ctx.serve, args=(self._answer,), name="dataplane-tfos-serve", daemon=True
        ).start()

    def _answer(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = decode_rows(arrays)
        self.items.put(_Request(rows))
        self.items.put(_END_PARTITION)
        results: list[Any] = []
        while len(results) < len(rows):
            try:
                got = self.results.get(timeout=0.5)
                if isinstance(got, BaseException):
                    raise got  # batch_results refused the answers: the request fails with why
                results.extend(got)
            except queue.Empty:
                if self._ctx.should_stop or self.ended:
                    if self.error is not None:
                        raise FeedError(
                            f"the node's map_fun raised {type(self.error).__name__}: "
                            f"{self.error} (before it answered this inference request with "
                            f"batch_results)"
                        ) from self.error
                    raise FeedError(
                        "the node's map_fun stopped reading before it answered an inference "
                        "request with batch_results"
                    ) from None
        if len(results) != len(rows):
            raise FeedError(
                f"batch_results returned {len(results)} results for {len(rows)} rows; TFoS "
                f"inference needs exactly one result per row (per next_batch)."
            )
        return {"result": _encoded(results)}

    def terminate(self) -> None:
        """No more rows for this node: refuse later pushes, drop what is waiting."""
        if self.terminated:
            return
        self.terminated = True
        self._ctx.end_feed()
        dropped = 0
        while True:
            try:
                item = self.items.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, list):
                dropped += len(item)
                if not isinstance(item, _Request):
                    self._room.release()
            elif item is _END_FEED:
                self.items.put(item)
                break
        logger.info("terminate(): dropped %d rows waiting in the feed", dropped)

    def close(self, error: BaseException | None = None) -> None:
        """map_fun returned (or raised ``error``): nothing will answer inference requests any
        more."""
        self.error = error
        self.ended = True


class DataFeed:
    """TFoS's ``TFNode.DataFeed``: read the node's input stream, answer inference.

    Args:
        mgr: TFoS passes ``ctx.mgr`` (here the node context itself).
        train_mode: as in TFoS: ``False`` makes an end of partition (of an inference request)
            cut a batch short, for ``batch_results``; it also starts answering
            ``cluster.inference``. Training rows are read in both modes.
        qname_in, qname_out: accepted for compatibility; a node has one input stream.
        input_mapping: TFoS's pipeline hook (a dict of column -> tensor name); with it
            ``next_batch`` returns a dict of lists keyed by tensor name, as in TFoS.
    """

    def __init__(
        self,
        mgr: "TFNodeContext",
        train_mode: bool = True,
        qname_in: str = "input",
        qname_out: str = "output",
        input_mapping: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(mgr, TFNodeContext):
            raise TypeError(
                f"DataFeed needs ctx.mgr (the node context), got {type(mgr).__name__}"
            )
        if input_mapping is not None and not isinstance(input_mapping, dict):
            raise TypeError(f"input_mapping must be a dict, got {type(input_mapping).__name__}")
        self.mgr = mgr
        self.train_mode = bool(train_mode)
        self.qname_in = qname_in
        self.qname_out = qname_out
        self.done_feeding = False
        self.input_tensors = (
            [tensor for _, tensor in sorted(input_mapping.items())] if input_mapping else None
        )
        self._feed = mgr._node_feed()
        self._pending: list[Any] = []
        self._last_rows = 0  # rows the last next_batch returned (batch_results answers them)
        self._feed.start_reader()
        if not self.train_mode:
            self._feed.start_serving()

    def _next_item(self) -> Any:
        if self._pending:
            return self._pending.pop(0)
        item = self._feed.next_item()
        if isinstance(item, list):
            if not isinstance(item, _Request):
                self._feed.took_chunk()
            self._pending = list(item)
            return self._next_item()
        return item

    def next_batch(self, batch_size: int) -> Any:
        """Up to ``batch_size`` rows: fewer only at the end of the feed, after ``terminate()``,
        or (``train_mode=False``) at the end of an inference request.

        Returns:
            A list of rows, or with ``input_mapping`` a dict of tensor name -> list of values.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"next_batch: batch_size must be an int >= 1, got {batch_size!r}")
        rows: list[Any] = []
        while len(rows) < batch_size:
            item = self._next_item()
            if item is _END_FEED:
                self._feed.items.put(_END_FEED)  # every other DataFeed of the node ends too
                self.done_feeding = True
                break
            if item is _END_PARTITION:
                if not self.train_mode and rows:
                    break
                continue
            if isinstance(item, BaseException):
                raise FeedError(f"the node's training feed failed: {item}") from item
            rows.append(item)
        self._last_rows = len(rows)
        if self.input_tensors is None:
            return rows
        out: dict[str, list[Any]] = {t: [] for t in self.input_tensors}
        for row in rows:
            for i, tensor in enumerate(self.input_tensors):
                out[tensor].append(row[i])
        return out

    def should_stop(self) -> bool:
        """True once ``next_batch`` has met the end of the feed (the driver shut down)."""
        return self.done_feeding

    def batch_results(self, results: Any) -> None:
        """Answer the rows of the last ``next_batch`` of an inference request, one per row."""
        if not self._feed._serving:
            raise FeedError(
                "batch_results() on a node with no DataFeed(ctx.mgr, train_mode=False): create "
                "the feed with train_mode=False to answer cluster.inference."
            )
        results = list(results)
        if len(results) != self._last_rows:
            # the inference request would wait for the missing answers until feed_timeout
            err = ValueError(
                f"batch_results got {len(results)} result(s) for the {self._last_rows} row(s) "
                f"of the last next_batch; TFoS inference needs exactly one result per row."
            )
            self._feed.results.put(err)
            raise err
        self._feed.results.put(results)

    def terminate(self) -> None:
        """Stop the feed early: this node reads no more rows (TFoS's ``terminate``).

        The training rows waiting for this node are dropped; later pushes to it are refused at
        once and counted in the driver's ``FeedReport.rows_unconsumed``, so ``TFCluster.train``
        returns without waiting on this node. As in TFoS, ``should_stop()`` stays false and
        ``next_batch`` still returns inference rows, until the driver shuts down.
        """
        logger.info("terminate() invoked")
        self._pending = []
        self._feed.terminate()


class _Request(list):
    """The rows of one inference request as they wait in the stream."""


class TFNodeContext:
    """TFoS's ``ctx`` (``TFNodeContext``) on top of a :class:`dataplane.NodeContext`.

    Attributes (as in TFoS): ``executor_id`` / ``worker_num`` (node id), ``job_name`` (role),
    ``task_index``, ``cluster_spec``, ``num_workers``, ``defaultFS``, ``working_dir``, ``mgr``
    (the context itself), ``tmp_socket`` (always None). The native context is
    ``ctx.dataplane`` (e.g. ``ctx.dataplane.dataset(...)``).
    """

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.dataplane = ctx
        self.executor_id = ctx.node_id
        self.worker_num = ctx.node_id
        self.job_name = ctx.role
        self.task_index = ctx.index
        self.cluster_spec = {k: list(v) for k, v in ctx.tf_config.get("cluster", {}).items()}
        self.num_workers = ctx.num_workers
        self.defaultFS = _strip_root(ctx.default_fs)
        self.working_dir = os.getcwd()
        self.mgr = self
        self.tmp_socket = None
        self._lock = threading.Lock()
        self._feed: _NodeFeed | None = None

    def _node_feed(self) -> _NodeFeed:
        with self._lock:
            if self._feed is None:
                self._feed = _NodeFeed(self._ctx)
            return self._feed

    def _close(self, error: BaseException | None = None) -> None:
        if self._feed is not None:
            self._feed.close(error)

    def absolute_path(self, path: str) -> str:
        """``hdfs_path(ctx, path)``: qualify ``path`` against the default filesystem."""
        return hdfs_path(self, path)

    def get_data_feed(
        self, train_mode: bool = True, qname_in: str = "input", qname_out: str = "output",
        input_mapping: dict[str, str] | None = None,
    ) -> DataFeed:
        return DataFeed(self, train_mode, qname_in, qname_out, input_mapping)

    def release_port(self) -> None:
        """No-op: the node's ports are bound and released before ``map_fun`` runs."""

    def start_cluster_server(self, num_gpus: int = 1, rdma: bool = False) -> Any:
        return start_cluster_server(self, num_gpus, rdma)

    def export_saved_model(self, sess: Any, export_dir: str, tag_set: Any, signatures: Any) -> Any:
        return export_saved_model(sess, export_dir, tag_set, signatures)


def _strip_root(default_fs: str) -> str:
    """TFoS strips the root slash of ``file:///`` so ``defaultFS + "/abs/path"`` is a URL."""
    if default_fs.startswith("file://") and len(default_fs) > 7 and default_fs.endswith("/"):
        return default_fs[:-1]
    return default_fs


# -- TFoS's module-level functions -----------------------------------------------------------------
_SCHEMES = ("adl://", "file://", "hdfs://", "oss://", "s3://", "s3a://", "s3n://", "swift://",
            "viewfs://", "wasb://", "gs://", "abfs://", "abfss://")


def hdfs_path(ctx: Any, path: str) -> str:
    """An absolute, scheme-qualified path for ``path`` (TFoS's rules).

    A path with a known scheme is returned as is; ``/abs`` gets ``ctx.defaultFS`` in front; a
    relative path goes under ``/user/<user>/`` on HDFS and under the working directory on a
    local default filesystem.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"hdfs_path: path must be a non-empty string, got {path!r}")
    if path.startswith(_SCHEMES):
        return path
    fs = ctx.defaultFS
    if path.startswith("/"):
        return fs + path
    if fs.startswith(("hdfs://", "viewfs://")):
        return f"{fs}/user/{getpass.getuser()}/{path}"
    if fs.startswith("file://"):
        return f"{fs}/{ctx.working_dir[1:]}/{path}"
    logger.warning("unknown scheme %s with relative path %s", fs, path)
    return f"{fs}/{path}"


def release_port(ctx: Any) -> None:
    """No-op (TFoS closes the socket that reserved the TF port; here none is held)."""


def start_cluster_server(ctx: Any, num_gpus: int = 1, rdma: bool = False) -> Any:
    """Refused: TensorFlow 1's ``tf.train.Server`` (TFoS refuses it on TF 2 as well)."""
    raise NotImplementedError(
        "TFNode.start_cluster_server is TensorFlowOnSpark's TensorFlow 1 API. With TF 2 create "
        "a tf.distribute strategy (e.g. tf.distribute.MultiWorkerMirroredStrategy()) in map_fun: "
        "TF_CONFIG is already set on every node."
    )


def export_saved_model(sess: Any, export_dir: str, tag_set: Any, signatures: Any) -> Any:
    """Refused: TensorFlow 1's session-based export (TFoS refuses it on TF 2 as well)."""
    raise NotImplementedError(
        "TFNode.export_saved_model(sess, ...) is TensorFlowOnSpark's TensorFlow 1 API. Use "
        "compat.export_saved_model(model, export_dir, is_chief) from dataplane.compat, or "
        "model.save / model.export / tf.saved_model.save."
    )


def next_batch(mgr: Any, batch_size: int, qname: str = "input") -> Any:
    """Refused, as in TFoS 2: use ``DataFeed(ctx.mgr).next_batch``."""
    raise NotImplementedError(
        "TFNode.next_batch is deprecated: use TFNode.DataFeed(ctx.mgr).next_batch"
    )


def batch_results(mgr: Any, results: Any, qname: str = "output") -> Any:
    """Refused, as in TFoS 2: use ``DataFeed(ctx.mgr, False).batch_results``."""
    raise NotImplementedError(
        "TFNode.batch_results is deprecated: use TFNode.DataFeed(ctx.mgr, False).batch_results"
    )


def terminate(mgr: Any, qname: str = "input") -> Any:
    """Refused, as in TFoS 2: use ``DataFeed(ctx.mgr).terminate``."""
    raise NotImplementedError(
        "TFNode.terminate is deprecated: use TFNode.DataFeed(ctx.mgr).terminate"
    )
