"""Node side of the TensorFlowOnSpark compatibility layer: ``ctx`` and ``DataFeed``.

A TFoS ``map_fun(args, ctx)`` reads rows with ``ctx.get_data_feed().next_batch(n)`` and, for
inference, answers with ``batch_results``. Here the rows come from this project's data plane:

- training (``train_mode=True``): the pushed epochs in the node's feed buffer, read epoch after
  epoch as one continuous stream of rows (TFoS has no epoch boundaries either). The feed ends when
  the driver shuts the cluster down; ``next_batch`` then returns what is left and
  ``should_stop()`` turns true.
- inference (``train_mode=False``): a ``ctx.serve`` thread hands each request batch to
  ``next_batch`` (a short batch ends at the request's end, like TFoS's end of partition) and
  waits for the same number of ``batch_results``.

Rows are rebuilt in the element shape the driver's RDD had (see ``dataplane.compat``): tuples,
lists, or single values; array fields arrive as numpy arrays, text as ``str``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from dataplane.errors import FeedError

__all__ = ["TFNodeContext", "DataFeed", "TFNode", "decode_rows", "column_name"]

logger = logging.getLogger(__name__)

#: Rows per chunk read from the feed buffer; next_batch re-cuts them to any size.
CHUNK_ROWS = 256
_END_OF_REQUEST = object()


def column_name(layout: str, index: int, kind: str) -> str:
    """Encode the RDD element layout in the pushed column names: ``tuple_0_num``, ``value_0_str``.

    ``layout`` is ``tuple`` (element is a tuple), ``list`` (element is a list) or ``value``;
    ``kind`` is ``num``, ``arr``, ``str`` or ``bin``.
    """
    return f"{layout}_{index}_{kind}"


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
    # numpy from ctx.serve: arrays are object arrays of rows; text is bytes
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


class DataFeed:
    """TFoS's ``TFNode.DataFeed`` over this project's feed buffer / inference requests.

    Args:
        mgr: the node context (TFoS passes ``ctx.mgr``; here ``ctx.mgr is ctx``).
        train_mode: True to read pushed training rows; False to answer ``cluster.inference``.
        qname_in, qname_out: accepted for compatibility; there is one feed per node.
        input_mapping: not supported (it belongs to TFoS's pipeline API; use ``dataplane.ml``).
    """

    def __init__(
        self,
        mgr: "TFNodeContext",
        train_mode: bool = True,
        qname_in: str = "input",
        qname_out: str = "output",
        input_mapping: Any = None,
    ) -> None:
        if input_mapping is not None:
            raise ValueError(
                "DataFeed(input_mapping=...) is TFoS's Spark ML pipeline API, which this layer "
                "does not emulate; use dataplane.ml.TFEstimator / TFModel instead."
            )
        if not isinstance(mgr, TFNodeContext):
            raise TypeError(f"DataFeed needs ctx.mgr (the node context), got {type(mgr).__name__}")
        self.mgr = mgr
        self.train_mode = bool(train_mode)
        self.done_feeding = False
        self._pending: list[Any] = []
        self._epoch_iter: Iterator[list[Any]] | None = None
        self._terminated = False
        if not self.train_mode:
            self._requests: queue.Queue = mgr._inference_queue()

    # -- training rows ---------------------------------------------------------------------
    def _next_chunk(self) -> list[Any] | None:
        """The next rows of the pushed stream, crossing epochs; None once the feed has ended."""
        from feeders.source import iterate_epoch

        ctx = self.mgr._ctx
        buffer = ctx._buffer
        while True:
            if self._epoch_iter is None:
                epoch = ctx._next_epoch()
                if buffer.wait_epoch_info(epoch) is None:
                    return None
                self._epoch_iter = iterate_epoch(
                    buffer, epoch, batch_size=CHUNK_ROWS, num_workers=ctx.num_workers,
                    drop_remainder=False,
                    convert=lambda t: decode_rows({n: t.column(n) for n in t.column_names}),
                )
            try:
                return next(self._epoch_iter)
            except StopIteration:
                self._epoch_iter = None

    def next_batch(self, batch_size: int) -> list[Any]:
        """Up to ``batch_size`` rows (fewer only at the end of the feed or of a request)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"next_batch: batch_size must be an int >= 1, got {batch_size!r}")
        if not self.train_mode:
            return self._next_request_rows(batch_size)
        while len(self._pending) < batch_size and not self.done_feeding:
            chunk = self._next_chunk()
            if chunk is None:
                self.done_feeding = True
            else:
                self._pending.extend(chunk)
        out, self._pending = self._pending[:batch_size], self._pending[batch_size:]
        return out

    # -- inference rows ----------------------------------------------------------------------
    def _next_request_rows(self, batch_size: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < batch_size:
            if self._pending:
                item = self._pending.pop(0)
            else:
                try:
                    item = self._requests.get(timeout=0.2)
                except queue.Empty:
                    if self.mgr._ctx.should_stop:
                        self.done_feeding = True
                        break
                    continue
            if item is _END_OF_REQUEST:
                if out:
                    break
                continue
            out.append(item)
        return out

    def should_stop(self) -> bool:
        """True once the feed has ended (the driver shut the cluster down)."""
        return self.done_feeding

    def batch_results(self, results: Any) -> None:
        """Answer the rows of the last inference ``next_batch``, one result per row."""
        if self.train_mode:
            raise FeedError(
                "batch_results() on a training DataFeed; create it with train_mode=False "
                "(ctx.get_data_feed(train_mode=False)) to answer cluster.inference."
            )
        self.mgr._results.put(list(results))

    def terminate(self) -> None:
        """Stop reading training rows; the rest of the pushed data is read and dropped.

        Like TFoS, Spark still sends the remaining partitions; a background thread consumes
        them so the driver's ``train`` and ``shutdown`` do not wait on this node.
        """
        if self._terminated or not self.train_mode:
            return
        self._terminated = True

        def drain() -> None:
            dropped = 0
            while True:
                chunk = self._next_chunk()
                if chunk is None:
                    break
                dropped += len(chunk)
            logger.info("terminate: dropped %d rows fed after terminate()", dropped)

        threading.Thread(target=drain, name="dataplane-tfos-terminate", daemon=True).start()
        self.done_feeding = True


class TFNodeContext:
    """TFoS's ``ctx`` (``TFNodeContext``) on top of a :class:`dataplane.NodeContext`.

    Attributes (as in TFoS): ``executor_id`` / ``worker_num`` (node id), ``job_name`` (role),
    ``task_index``, ``cluster_spec``, ``num_workers``, ``defaultFS``, ``working_dir``, ``mgr``.
    The native context is ``ctx.dataplane`` (e.g. ``ctx.dataplane.dataset(...)``).
    """

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.dataplane = ctx
        self.executor_id = ctx.node_id
        self.worker_num = ctx.node_id
        self.job_name = ctx.role
        self.task_index = ctx.index
        self.cluster_spec = dict(ctx.tf_config.get("cluster", {}))
        self.num_workers = ctx.num_workers
        self.defaultFS = ctx.default_fs
        self.working_dir = os.getcwd()
        self.mgr = self
        self._lock = threading.Lock()
        self._requests: queue.Queue | None = None
        self._results: queue.Queue = queue.Queue()

    def absolute_path(self, path: str) -> str:
        return self._ctx.absolute_path(path)

    def get_data_feed(
        self, train_mode: bool = True, qname_in: str = "input", qname_out: str = "output",
        input_mapping: Any = None,
    ) -> DataFeed:
        return DataFeed(self, train_mode, qname_in, qname_out, input_mapping)

    def release_port(self) -> None:
        """No-op: ports are bound by the node before ``map_fun`` runs."""

    def start_cluster_server(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "start_cluster_server is TFoS's TensorFlow 1.x API; with TF 2 use a "
            "tf.distribute strategy (TF_CONFIG is already set on this node)."
        )

    def export_saved_model(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "export_saved_model is TFoS's TensorFlow 1.x API; call model.save(path) or "
            "model.export(path) instead."
        )

    # -- inference plumbing ------------------------------------------------------------------
    def _inference_queue(self) -> queue.Queue:
        """Start serving cluster.inference (once per node); rows arrive on the returned queue."""
        with self._lock:
            if self._requests is None:
                self._requests = queue.Queue()
                threading.Thread(
                    target=self._ctx.serve, args=(self._answer,), name="dataplane-tfos-serve",
                    daemon=True,
                ).start()
            return self._requests

    def _answer(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = decode_rows(arrays)
        requests = self._inference_queue()
        for row in rows:
            requests.put(row)
        requests.put(_END_OF_REQUEST)
        results: list[Any] = []
        while len(results) < len(rows):
            try:
                results.extend(self._results.get(timeout=0.5))
            except queue.Empty:
                if self._ctx.should_stop:
                    raise FeedError("the node shut down before answering an inference request")
        if len(results) != len(rows):
            raise FeedError(
                f"batch_results returned {len(results)} results for {len(rows)} rows; TFoS "
                f"inference needs exactly one result per row."
            )
        return {"result": np.asarray(results)}


class TFNode:
    """Stand-in for ``tensorflowonspark.TFNode``: ``TFNode.DataFeed(ctx.mgr, train_mode)``."""

    DataFeed = DataFeed

    @staticmethod
    def hdfs_path(ctx: TFNodeContext, path: str) -> str:
        return ctx.absolute_path(path)

    @staticmethod
    def release_port(ctx: TFNodeContext) -> None:
        ctx.release_port()
