"""``ctx``: what ``main(args, ctx)`` knows about its node and how it gets data."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa

from dataplane.errors import FeedError, SchemaError
from dataplane.node.server import InferenceBroker, SaveTally
from dataplane.topology import NodeInfo, Topology
from feeders.buffer import FeedBuffer
from formats.fs import local_copy

__all__ = ["NodeContext"]

logger = logging.getLogger(__name__)


class NodeContext:
    """Handed to ``main(args, ctx)`` on every node.

    Attributes:
        role: ``chief``, ``worker``, ``ps`` or ``evaluator``.
        index: index within the role.
        node_id: the node's id (launch partition), 0..num_nodes-1.
        num_workers: nodes that receive training data (chief + workers).
        worker_index: this node's position among them (``None`` for ps / evaluator); use it
            with ``feeders.*(shard=ctx)``.
        tf_config: the TF_CONFIG dict (also exported as the ``TF_CONFIG`` variable).
        topology: every node of the cluster.
        log_dir: directory for TensorBoard events (shared by the chief's TensorBoard), or None.
        default_fs: the cluster's default filesystem URL (``fs.defaultFS``).
    """

    def __init__(
        self,
        *,
        node: NodeInfo,
        topology: Topology,
        buffer: FeedBuffer,
        broker: InferenceBroker,
        log_dir: str | None,
        default_fs: str,
        stop_event: threading.Event,
        polls_stop: threading.Event | None = None,
        agree: Callable[[str, int, Any], tuple[int, Any]] | None = None,
        saves: SaveTally | None = None,
    ) -> None:
        self.node = node
        self.role = node.role
        self.index = node.index
        self.node_id = node.node_id
        self.topology = topology
        self.num_workers = len(topology.workers)
        self.worker_index = node.worker_index
        self.tf_config = topology.tf_config(node)
        self.log_dir = log_dir
        self.default_fs = default_fs
        self._buffer = buffer
        self._broker = broker
        self._stop = stop_event
        # set once main reads should_stop: cluster.shutdown may then stop it while it is busy
        self._polls_stop = polls_stop if polls_stop is not None else threading.Event()
        self._epoch_lock = threading.Lock()
        self._main_thread = threading.current_thread()  # made by the thread that runs main
        self._agree = agree
        self._saves = saves if saves is not None else SaveTally()
        self._agreements: dict[str, int] = {}
        self._agree_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NodeContext({self.role} {self.index}, node {self.node_id}, {self.num_workers} workers)"

    @property
    def should_stop(self) -> bool:
        """True once the driver asked the cluster to shut down.

        To wait for that, call :meth:`wait_stop`: ``cluster.shutdown()`` lets a main that is
        still busy finish first, and a loop that sleeps and polls this flag looks busy (it is
        told to stop once shutdown's ``timeout`` runs out); ``wait_stop`` tells the driver this
        main only waits, so it is stopped at once.
        """
        self._polls_stop.set()
        return self._stop.is_set()

    def wait_stop(self, timeout: float | None = None) -> bool:
        """Block until the driver asks the cluster to shut down (or ``timeout``); True once it
        has. ``cluster.shutdown()`` stops a main waiting here at once.

        Without a timeout, main is done with its data: this first ends the node's feed (see
        :meth:`end_feed`), so a ``cluster.train`` still pushing epochs this program will not
        read returns instead of waiting for them.
        """
        if timeout is None:
            self.end_feed()
        self._broker.enter_wait()  # inference then fails fast unless served
        try:
            return bool(self._buffer.waiting_for_driver(lambda: self._stop.wait(timeout)))
        finally:
            self._broker.leave_wait()

    def next_pushed_epoch(self, rows: int, convert: Callable[[Any], Any]) -> Iterator[Any] | None:
        """For adapters that consume pushed rows outside tf.data (:mod:`dataplane.compat`):
        the next pushed epoch of the train split as ``convert(table)`` of up to ``rows`` rows
        each (equal counts on every worker, as ``dataset``; leaving it mid-way leaves the epoch
        early). Waits for the driver to push one; ``None`` once the node is stopping."""
        from feeders.source import iterate_epoch

        def claim() -> int | None:
            epoch = self._buffer.claim_epoch()
            return None if epoch is None or self._buffer.wait_epoch_info(epoch) is None else epoch

        def read(epoch: int | None) -> Iterator[Any]:
            while epoch is not None:  # the next epoch if a failed train() call took this back
                if (yield from iterate_epoch(self._buffer, epoch, batch_size=rows, num_workers=self.num_workers,
                                             drop_remainder=False, convert=convert)) is not True:
                    return
                epoch = claim()

        first = claim()
        return None if first is None else read(first)

    def end_feed(self) -> None:
        """This node will read no more pushed rows: refuse later pushes, drop what waits.

        For a main that goes on after its last read of ``ctx.dataset`` (a ``fit`` that
        ``EarlyStopping`` ended before ``num_epochs``, followed by saving or evaluating on
        other data): the running ``cluster.train`` then returns instead of waiting for passes
        that will not come (returning from main does the same).
        """
        self._buffer.consumer_finished()

    def dataset(
        self,
        batch_size: int = 128,
        *,
        features: str | Sequence[str] | None = None,
        label: str | None = None,
        drop_remainder: bool = False,
        shapes: Mapping[str, Sequence[int]] | None = None,
        fill_values: Mapping[str, Any] | None = None,
        prefetch: int = 2,
        repeat: bool = False,
        split: str = "train",
        decode: Mapping[str, Any] | None = None,
    ):
        """A ``tf.data.Dataset`` of the rows the driver pushes with ``cluster.train``.

        One iteration is one pushed epoch; iterating again reads the next epoch (so
        ``model.fit(ds, epochs=n)`` matches ``cluster.train(df, num_epochs=n)``). When the
        cluster shuts down, an iteration waiting for data ends empty.

        Leaving an epoch early (``break``, ``ds.take(k)``, Keras ``steps_per_epoch`` or
        ``evaluate(steps=k)``, an iterator dropped) never blocks the feed: the node refuses the
        rest of that epoch at once, the next iteration reads the next epoch, and
        ``FeedReport.rows_unconsumed`` counts what was left. Under MultiWorkerMirroredStrategy
        every worker yields the same number of batches per epoch.

        ``repeat=True`` yields the epochs of one ``cluster.train`` call back to back as one
        dataset, for ``fit(ds, epochs=E, steps_per_epoch=k)`` (each epoch is batched on its
        own, so batch counts stay equal across workers); it ends after that call's last epoch
        (a ``feed_stream``'s micro-batches: when the cluster shuts down), so what Keras reads
        ahead past its last step never takes rows of the next call, and the next iteration
        reads the next call. When it is dropped before (``fit`` returns), the call's epochs it
        never reached are closed, so ``train`` can return.

        Blocks until the driver starts the first ``train`` (the tensor specs come from the
        pushed DataFrame's schema). A later ``train`` call may push a DataFrame with more
        columns when ``features`` names the ones read; any other change to the columns read
        needs a new ``ctx.dataset()``.

        Args:
            batch_size: rows per batch (default 128, a common Keras default). Under
                MultiWorkerMirroredStrategy Keras splits each batch over the workers (it is
                the global batch): a step trains on ``batch_size / num_workers`` rows a worker.
            features: columns to yield, as a dict of tensors (default: every column but
                ``label``). One column name (``features="image"``) yields that column's
                tensor itself, as a model with one input takes it.
            label: if given, the dataset yields ``(features, label_tensor)``: with
                ``features="image", label="label"`` that is ``(image, label)``, ready for
                ``model.fit``.
            drop_remainder: drop each epoch's last partial batch (static batch shape).
            shapes: per-row shapes for array columns, e.g. ``{"image": (28, 28)}``. Arrays
                whose shape is the same in every row are dense without this: ``[batch, n]``,
                or ``[batch, 28, 28]`` for an image given as ``array<array<float>>``.
            fill_values: values replacing nulls per column (default: a null is an error). In
                an array column it fills null elements, and a null array becomes an empty one
                where the column is ragged, or where it is dense (a declared shape, or arrays
                of one length in every row, as the driver finds them) one of that shape
                holding the value.
            prefetch: batches prepared ahead of the training step.
            repeat: one stream over a train call's epochs (see above); ``split="train"`` only,
                since Keras starts a new pass over validation data every epoch.
            split: ``"train"`` (the default) or ``"validation"``: the rows of
                ``cluster.train(..., validation=df_val)``, one pass per epoch.
            decode: binary columns to decode on the node, inside tf.data and in parallel:
                ``{"image": "jpeg"}`` or ``"png"`` (uint8 ``[batch, h, w, c]`` as stored: the
                images of a batch must share a size and channel count);
                ``("jpeg", 3)`` converts every image to 3 channels (gray to RGB; 1: gray; PNG
                also 4: RGBA); ``("jpeg", 3, (224, 224))`` also resizes every image to that
                height and width (bilinear, rounded back to uint8), for images of any size;
                ``("raw", dtype, shape)`` (e.g. ``("raw", "float32", (28, 28))``). A value
                that is not such an image, an image whose size or channels differ from its
                batch's first, or raw bytes of the wrong length fail the pass with an error
                naming the column, the row (counted from the pass's start) and that row's
                values in the first scalar columns read (an id column, say); an image damaged
                past its header fails with TensorFlow's decoder error.

        Raises:
            ValueError: ``batch_size`` not positive, ``label`` also in ``features``, or
                ``repeat=True`` with ``split="validation"``.
            SchemaError: a named column is missing or cannot be held by a tensor.
        """
        if self.worker_index is None:
            raise FeedError(
                f"ctx.dataset() called on the {self.role}: only the chief and workers receive "
                f"pushed data. Read data on this node with feeders.* instead."
            )
        from feeders.source import push_dataset

        if split not in ("train", "validation"):
            raise ValueError(f"ctx.dataset(split=...) must be 'train' or 'validation', got {split!r}")
        return push_dataset(
            self._buffer,
            batch_size=batch_size,
            num_workers=self.num_workers,
            features=features,
            label=label,
            drop_remainder=drop_remainder,
            shapes=shapes,
            fill_values=fill_values,
            prefetch=prefetch,
            repeat=repeat,
            split=split,
            decode=decode,
            reads_until_stop=self._polls_stop.is_set,
        )

    def set_metric(self, name: str, value: float) -> None:
        """Publish a number of this node's (e.g. seconds its model waited for input): it shows
        in ``cluster.metrics()[node_id][name]`` on the driver."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name must be a non-empty string, got {name!r}")
        self._buffer.metrics[f"user.{name}"] = float(value)

    def serve(self, predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
        """Answer ``cluster.inference`` until the driver shuts the cluster down.

        Args:
            predict: takes ``{column: np.ndarray}`` for one batch of rows (array columns whose
                rows all have the same shape arrive dense, ``[rows, n]`` or ``[rows, 28, 28]``
                for nested arrays) and returns
                ``{output_name: np.ndarray}`` with one entry per input row in each array.
                An output of shape ``[rows, n]`` becomes an ``array`` column, ``[rows, h, w]``
                an ``array<array<...>>`` one (a segmentation mask keeps its shape); unsigned
                and half-precision values widen to types Spark holds.

        Called in main's own thread, this also ends the node's feed, as ``wait_stop()`` does:
        main reads no more pushed rows, so a ``cluster.train`` made meanwhile returns at once
        with them refused (``FeedReport.messages`` says so) instead of waiting
        ``feed_timeout``. To go on training while serving, serve from a thread.
        """
        if threading.current_thread() is self._main_thread:
            self.end_feed()
        broker = self._broker
        broker.serving = True
        try:
            self._serve_loop(broker, predict)
        finally:
            broker.serving = False

    def _serve_loop(self, broker, predict) -> None:  # type: ignore[no-untyped-def]
        import queue

        from dataplane.errors import model_input_nulls
        from formats.schema import column_specs, to_numpy

        while not self._stop.is_set():
            try:
                batch, fut = broker.requests.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                for name, col in zip(batch.schema.names, batch.columns):
                    err = model_input_nulls(name, col, f"a request of {batch.num_rows} rows", "inference")
                    if err is not None:
                        raise err
                specs = column_specs(batch.schema)
                arrays = to_numpy(batch, specs)
                outputs = predict(
                    {k: (v if isinstance(v, np.ndarray) else _ragged_to_object(v)) for k, v in arrays.items()}
                )
                fut.set_result(_outputs_to_batch(outputs, batch.num_rows))
                broker.rows += batch.num_rows
                broker.batches += 1
            except BaseException as e:  # noqa: BLE001 - handed to the caller of inference
                fut.set_exception(e)

    def agree(self, key: str, value: Any) -> tuple[int, Any]:
        """Settle one value for every node: this node's ``n``-th call with ``key`` returns the
        value of the first node to make its ``n``-th call with ``key``, as ``(node_id, value)``.

        The readers use it with ``shard=ctx`` so that every node shards the same file listing,
        even when files arrive while the nodes list the path. ``value`` must be JSON (lists,
        dicts, strings, numbers); the driver keeps each first value for the cluster's life.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"agree needs a non-empty string key, got {key!r}")
        with self._agree_lock:
            n = self._agreements.get(key, 0)
            self._agreements[key] = n + 1
        if self._agree is None:  # a context without a driver (tests): it is the first
            return self.node_id, value
        return self._agree(key, n, value)

    def save_model(self, model: Any, path: str, **kwargs: Any) -> str | None:
        """Save a Keras model the way MultiWorkerMirroredStrategy needs: call it on every chief
        and worker. The chief writes ``path``; every other worker writes a throwaway copy to a
        temporary directory, removed at once.

        Under that strategy ``model.save`` (``.keras`` or SavedModel) reads variables with
        collective ops, so called on the chief alone it waits for the other workers forever.
        ``path`` is a local path (on a disk every reader sees) or an ``s3://`` / ``hdfs://``
        URL, which the chief saves locally and then uploads (TensorFlow 2.18+ writes neither
        itself). ``kwargs`` go to ``model.save``. Returns ``path`` on the chief, None elsewhere.
        """
        import shutil
        import tempfile

        if not isinstance(path, str) or not path:
            raise ValueError(f"save_model needs a path (str), got {path!r}")
        collective = self.num_workers > 1 and _multi_worker(model)
        self._saves.enter(collective)  # (counted: a save some workers never begin is named at shutdown)
        try:
            if self.role == "chief" or self.num_workers <= 1:
                save_whole(lambda to: model.save(to, **kwargs), path, overwrite=kwargs.get("overwrite", True))
                return path
            scratch = tempfile.mkdtemp(prefix="dataplane-discarded-save-")
            try:
                model.save(os.path.join(scratch, posixpath.basename(path.rstrip("/")) or "model"), **kwargs)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return None
        finally:
            self._saves.leave(collective)

    def local_copy(self, path: str) -> "contextlib.AbstractContextManager[str]":
        """``with ctx.local_copy(url) as p:`` a local path holding what ``url`` holds (a saved
        model, a vocabulary, pretrained weights), for loaders that read local files only:
        TensorFlow 2.18+ reads neither ``s3://`` nor ``hdfs://``. Such a URL is copied into a
        temporary directory through ``pyarrow.fs`` and the copy removed when the block ends; a
        local path (or ``file://``) is handed back as it is. ``keras.models.load_model(p)``
        inside the block loads a model ``save_model`` wrote."""
        return local_copy(path)

    def absolute_path(self, path: str) -> str:
        """Qualify ``path`` against the cluster's default filesystem.

        URLs with a scheme are returned unchanged. With a local default filesystem the path is
        made absolute against the node's working directory; with a remote one (``hdfs://nn``)
        absolute paths are prefixed with it, relative ones also with ``/user/<user>/``.
        """
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty string, got {path!r}")
        if urlparse(path).scheme:
            return path
        fs = self.default_fs.rstrip("/")
        if not fs or fs.startswith("file:"):
            return "file://" + os.path.abspath(path)
        if path.startswith("/"):
            return fs + path
        user = os.environ.get("USER") or os.environ.get("HADOOP_USER_NAME") or "root"
        return fs + posixpath.join("/user", user, path)


def _multi_worker(model: Any) -> bool:
    """Whether ``model`` was built under a multi-worker strategy (its save is a collective)."""
    extended = getattr(getattr(model, "distribute_strategy", None), "extended", None)
    probe = getattr(extended, "_in_multi_worker_mode", None)
    try:
        return bool(probe()) if callable(probe) else False
    except Exception:  # noqa: BLE001 - a strategy of another kind: not known to be collective
        return False


def save_whole(save: Callable[[str], Any], path: str, *, overwrite: bool = True) -> None:
    """``save(p)`` to a hidden sibling of a local ``path`` (same extension, which picks Keras's
    format), then renamed onto it: ``path`` holds a whole model or what it held before, never
    a half-written one (a peer lost mid-save under MultiWorkerMirroredStrategy left an empty
    SavedModel folder that looked saved).

    An ``s3://`` or ``hdfs://`` URL is saved to a local temporary copy first, then uploaded
    through ``pyarrow.fs`` (``formats.fs.upload``): TensorFlow 2.18+ cannot write to either
    itself. Other URLs (``gs://``) are TensorFlow's, saved in place."""
    import shutil
    import tempfile

    from formats.fs import through_pyarrow, upload

    scheme = urlparse(path).scheme
    if through_pyarrow(path):
        with tempfile.TemporaryDirectory(prefix="dataplane-save-") as scratch:
            local = os.path.join(scratch, posixpath.basename(urlparse(path).path.rstrip("/")) or "model")
            save(local)
            upload(local, path, overwrite=overwrite)
        return
    if scheme not in ("", "file"):
        save(path)
        return
    target = (urlparse(path).path if scheme else path).rstrip("/") or path
    if not overwrite and os.path.lexists(target):
        raise FileExistsError(f"{path} exists and save_model was given overwrite=False")
    head, name = os.path.split(os.path.abspath(target))
    stem, ext = os.path.splitext(name)
    if ext.lower() not in (".keras", ".h5", ".hdf5"):
        stem, ext = name, ""
    partial = os.path.join(head, f".{stem}.partial-{os.getpid()}{ext}")
    old = f"{partial}.old"
    try:
        save(partial)
        if not os.path.lexists(target):
            os.rename(partial, target)
            return
        os.rename(target, old)  # a folder cannot be renamed onto a folder
        try:
            os.rename(partial, target)
        except BaseException:
            os.rename(old, target)
            raise
    finally:
        for leftover in (partial, old):
            if os.path.isdir(leftover) and not os.path.islink(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
            elif os.path.lexists(leftover):
                os.unlink(leftover)


def _ragged_to_object(col) -> np.ndarray:  # type: ignore[no-untyped-def]
    """A list column for predict: dense ``[rows, n, ...]`` when every row has the same shape
    (a feature vector; an image given as nested arrays), else an object array of per-row
    arrays (nested lists for nested arrays)."""
    values, splits = col.values, col.row_splits
    rows = len(splits[0]) - 1
    dims = []
    for level in splits:
        lengths = np.diff(level)
        if not len(lengths) or not np.all(lengths == lengths[0]):
            break
        dims.append(int(lengths[0]))
    if rows and len(dims) == len(splits):
        return values.reshape(rows, *dims, *values.shape[1:])

    def row(level: int, start: int, end: int):  # type: ignore[no-untyped-def]
        if level == len(splits):
            return values[start:end]
        s = splits[level]
        return [row(level + 1, int(s[j]), int(s[j + 1])) for j in range(start, end)]

    out = np.empty(rows, dtype=object)
    for i in range(rows):
        out[i] = row(1, int(splits[0][i]), int(splits[0][i + 1]))
    return out


def _output_array(name: str, value: Any) -> np.ndarray:
    """``value`` as an array with a row per entry; a list of rows of different lengths (a
    sequence per row) as an object array of arrays, which becomes a list column."""
    try:
        return np.asarray(value)
    except ValueError as e:  # "inhomogeneous shape": rows of different lengths
        if isinstance(value, (list, tuple)):
            try:
                arrays = [np.asarray(v) for v in value]
                filled = [x for x in arrays if x.size]  # an empty row says nothing of the type
                if filled:
                    kind = np.result_type(*filled)
                    arrays = [x.astype(kind, copy=False) for x in arrays]
                out = np.empty(len(value), dtype=object)
                out[:] = arrays
                return out
            except ValueError:
                pass
        raise SchemaError(
            f"predict output {name!r} is not an array with one entry per input row ({e}). For "
            f"rows of different lengths return an object array of arrays, e.g. "
            f"out = np.empty(n, dtype=object); out[:] = [np.asarray(v) for v in rows]."
        ) from e


def _outputs_to_batch(outputs: Any, rows: int) -> pa.RecordBatch:
    if not isinstance(outputs, Mapping) or not outputs:
        raise SchemaError(
            f"predict must return a dict of output columns (name -> array with "
            f"one entry per input row), got {type(outputs).__name__}; for example "
            f"return {{'prediction': np.asarray(model(batch['x']))}}."
        )
    cols, names = [], []
    for name, value in outputs.items():
        a = _output_array(name, value)
        if a.ndim == 0 or a.shape[0] != rows:
            raise SchemaError(
                f"predict output {name!r} has shape {a.shape} for a batch of "
                f"{rows} rows; every output needs one entry per input row (shape[0] == {rows})."
            )
        try:
            col = pa.array(np.ascontiguousarray(a).reshape(-1))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
            raise SchemaError(
                f"predict output {name!r} ({a.dtype} array of shape {a.shape}) does not convert "
                f"to a column: {e}. Return numbers, strings, bytes, or arrays of them."
            ) from e
        # [rows, 2, 3] answers as nested lists (Spark array<array<...>>), as images come in
        for level in range(a.ndim - 1, 0, -1):
            width, count = int(a.shape[level]), int(np.prod(a.shape[:level]))
            offsets = pa.array(np.arange(count + 1, dtype=np.int64) * width, pa.int32())
            col = pa.ListArray.from_arrays(offsets, col)
        cols.append(col)
        names.append(str(name))
    return pa.RecordBatch.from_arrays(cols, names=names)
