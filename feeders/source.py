"""The node-side tf.data source: pushed Arrow batches out of the feed buffer as tensors.

Each iteration of the returned dataset reads the next pushed epoch. Batches are cut to exactly
``batch_size`` rows across Arrow batch boundaries; converting the Arrow slice to numpy
(``formats.schema.to_numpy``) is the one copy out of the Flight buffers.

Equal batch counts (MultiWorkerMirroredStrategy hangs otherwise): the pushing tasks split every
partition over the workers so that per partition the workers' row counts differ by at most one;
after the epoch the driver sends each worker the minimum (the "limit") and every worker yields
exactly that many rows. While the epoch is still streaming a worker only yields rows it is sure to
keep (see ``FeedBuffer.take``): all but one row per partition it has seen.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import FeedError, SchemaError
from feeders.buffer import EpochInfo, FeedBuffer, FeedStopped
from feeders.generator import generator_dataset
from formats.schema import ColumnSpec, RaggedColumn, column_specs, same_columns, schema_text, tf_spec, to_numpy

__all__ = ["push_dataset", "iterate_epoch"]

logger = logging.getLogger(__name__)


def _take_rows(pending: list[pa.RecordBatch], n: int) -> tuple[pa.Table, list[pa.RecordBatch]]:
    """Split the first ``n`` rows off ``pending`` (zero-copy slices)."""
    out, left, need = [], [], n
    for i, b in enumerate(pending):
        if need == 0:
            left = pending[i:]
            break
        if b.num_rows <= need:
            out.append(b)
            need -= b.num_rows
        else:
            out.append(b.slice(0, need))
            left = [b.slice(need)] + pending[i + 1 :]
            need = 0
            break
    return pa.Table.from_batches(out, schema=pending[0].schema), left


def iterate_epoch(
    buffer: FeedBuffer,
    epoch: int,
    *,
    batch_size: int,
    num_workers: int,
    drop_remainder: bool,
    convert: Callable[[pa.Table], Any],
    batches_per_item: int = 1,
) -> Iterator[Any]:
    """Yield converted batches of one epoch; returns when the epoch's limit is reached.

    With ``batches_per_item > 1`` an item holds up to that many whole batches (whatever is
    safe to emit already), for ``Dataset.rebatch(batch_size)`` to cut: every item but the
    epoch's tail is a multiple of ``batch_size`` rows, so the batches are the same.
    """
    info = buffer.wait_epoch_info(epoch)
    if info is None:
        return
    pending: list[pa.RecordBatch] = []
    pending_rows = received = emitted = 0
    limit: int | None = None
    complete = False
    try:
        while True:
            batches, safe_rows, limit = buffer.take(epoch, num_workers)
            for b in batches:
                pending.append(b)
                pending_rows += b.num_rows
                received += b.num_rows
            final = limit is not None
            if final and limit > received:  # type: ignore[operator]
                raise FeedError(
                    f"epoch {epoch}: the driver set {limit} rows for every worker but this node "
                    f"received only {received}; rows were lost in transit."
                )
            safe = limit if final else (safe_rows if num_workers > 1 else received)
            while pending_rows >= batch_size and emitted + batch_size <= safe:  # type: ignore[operator]
                k = min(batches_per_item, pending_rows // batch_size, (safe - emitted) // batch_size)  # type: ignore[operator]
                rows = k * batch_size
                table, pending = _take_rows(pending, rows)
                pending_rows -= rows
                emitted += rows
                yield convert(table)
            if final:
                tail = limit - emitted  # type: ignore[operator]
                if tail > 0 and not drop_remainder:
                    table, pending = _take_rows(pending, tail)
                    emitted += tail
                    yield convert(table)
                complete = True
                return
    except FeedStopped:
        return
    finally:
        # Also when the pass is left early (GeneratorExit: break, take, steps_per_epoch, a
        # dropped iterator): the buffer then refuses the rest of this epoch at once.
        buffer.finish_epoch(epoch, emitted, complete=complete)


def _tensor_converter(specs: Sequence[ColumnSpec]) -> Callable[[pa.Table], dict[str, Any]]:
    ragged = [s for s in specs if s.is_ragged]

    def convert(table: pa.Table) -> dict[str, Any]:
        arrays = to_numpy(table, specs)
        if not ragged:
            return arrays  # type: ignore[return-value]
        import tensorflow as tf

        out: dict[str, Any] = {}
        for name, a in arrays.items():
            if isinstance(a, RaggedColumn):
                r = a.values
                for splits in reversed(a.row_splits):
                    r = tf.RaggedTensor.from_row_splits(r, splits, validate=False)
                out[name] = r
            else:
                out[name] = a
        return out

    return convert


# Narrow rows: the generator hands tf.data several batches at once (up to this many bytes) and
# Dataset.rebatch cuts them in C++, so the per-call cost of the Python source (a py_func and a
# conversion per column) is paid once per item instead of once per batch.
_ITEM_BYTES = 1 << 20
_MAX_BATCHES_PER_ITEM = 64


def _batches_per_item(specs: Sequence[ColumnSpec], signature: Mapping[str, Any], batch_size: int) -> int:
    """Whole batches per generator item: 1 for ragged columns (rebatch is slow on them) or
    when one batch already holds about ``_ITEM_BYTES`` (wide rows: an extra copy would cost
    more than the per-call overhead it saves)."""
    if any(s.is_ragged for s in specs):
        return 1
    row_bytes = 0
    for spec in signature.values():
        width = 1
        for d in spec.shape[1:]:
            if d is None:
                return 1
            width *= int(d)
        if spec.dtype.name == "string":
            return 1
        row_bytes += width * spec.dtype.size
    per_batch = max(1, row_bytes * batch_size)
    return max(1, min(_MAX_BATCHES_PER_ITEM, _ITEM_BYTES // per_batch))


def push_dataset(
    buffer: FeedBuffer,
    *,
    batch_size: int,
    num_workers: int,
    features: Sequence[str] | None = None,
    label: str | None = None,
    drop_remainder: bool = False,
    shapes: Mapping[str, Sequence[int]] | None = None,
    fill_values: Mapping[str, Any] | None = None,
    prefetch: int = 2,
    first_epoch_timeout: float | None = None,
    next_epoch: Callable[[], int],
    repeat: bool = False,
):
    """Build the ``tf.data.Dataset`` behind ``ctx.dataset()``.

    Blocks until the driver announces the first epoch (``cluster.train``), because the tensor
    specs come from the pushed DataFrame's schema. With ``repeat=True`` one pass yields the
    pushed epochs back to back (each epoch batched on its own, so every worker still yields the
    same batches), ending when the node shuts down.
    """
    import tensorflow as tf

    if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    info: EpochInfo | None = buffer.wait_epoch_info(buffer.next_epoch, first_epoch_timeout)
    if info is None:
        raise FeedStopped("the cluster shut down before any data was pushed")
    names = list(info.schema.names)
    if label is not None and label not in names:
        raise SchemaError(
            f"label column {label!r} is not in the pushed DataFrame; its columns are {names}."
        )
    if features is None:
        cols = [n for n in names if n != label]
    else:
        cols = list(features)
        if label is not None and label in cols:
            raise ValueError(f"label column {label!r} is also listed in features.")
    wanted = cols + ([label] if label is not None else [])
    declared = dict(info.shapes)
    declared.update({k: tuple(v) for k, v in (shapes or {}).items()})
    declared = {k: v for k, v in declared.items() if k in wanted}
    specs = column_specs(info.schema, columns=wanted, shapes=declared, fill_values=fill_values)
    signature = tf_spec(info.schema, columns=wanted, shapes=declared)
    convert = _tensor_converter(specs)
    epoch_schema = info.schema

    def one_epoch() -> Iterator[dict[str, Any]] | None:
        epoch = next_epoch()
        got = buffer.wait_epoch_info(epoch)
        if got is None:
            return None
        if not same_columns(got.schema, epoch_schema):
            raise FeedError(
                f"epoch {epoch} was pushed with columns ({schema_text(got.schema)}), but this "
                f"dataset was built for ({schema_text(epoch_schema)}); call ctx.dataset() again "
                f"for a differently shaped feed."
            )
        return iterate_epoch(
            buffer,
            epoch,
            batch_size=int(batch_size),
            num_workers=num_workers,
            drop_remainder=drop_remainder,
            convert=convert,
            batches_per_item=per_item,
        )

    def generator() -> Iterator[dict[str, Any]]:
        if not repeat:
            items = one_epoch()
            if items is not None:
                yield from items
            return
        try:
            while True:
                items = one_epoch()
                if items is None:
                    return
                yield from items
        finally:
            # the stream was the node's feed: epochs pushed for it that it never reached
            # must not wait for a reader
            buffer.skip_announced()

    per_item = _batches_per_item(specs, signature, int(batch_size))
    ds = generator_dataset(generator, signature)
    if per_item > 1:
        ds = ds.rebatch(int(batch_size))
    if label is not None:
        ds = ds.map(lambda d: ({k: d[k] for k in cols}, d[label]))
    opts = tf.data.Options()
    # Every worker already gets its own rows; Keras must not shard them again.
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # No tf.data autotuning: the buffer sizes here are fixed, and with autotune on, ending an
    # epoch's iterator intermittently took 1-9 s on a busy 2-core machine (the iterator's
    # teardown waits for a background thread), which stalls every epoch boundary.
    opts.autotune.enabled = False
    ds = ds.with_options(opts)
    return ds.prefetch(prefetch)
