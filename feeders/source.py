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
from typing import Any, Callable, Generator, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import FeedError, SchemaError
from feeders.buffer import EpochInfo, EpochWithdrawn, FeedBuffer, FeedStopped
from feeders.elements import LABELS_HINT
from feeders.generator import generator_dataset
from formats.schema import (
    ColumnSpec,
    RaggedColumn,
    column_specs,
    mapping_arg,
    names_arg,
    same_columns,
    schema_text,
    tf_spec,
    to_numpy,
)

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
    shuffle_bytes: int | None = None,
    sizes: list[int] | None = None,
) -> Generator[Any, None, bool | None]:
    """Yield converted batches of one epoch; returns when the epoch's limit is reached, and
    True, having yielded nothing, if a failed ``train()`` call took the epoch back (then the
    caller's pass goes on with the next epoch).

    With ``batches_per_item > 1`` an item holds up to that many whole batches (whatever is
    safe to emit already), for ``Dataset.rebatch(batch_size)`` to cut: every item but the
    epoch's tail is a multiple of ``batch_size`` rows, so the batches are the same. Items end
    where the pass's batch count reaches 1, 2, 4, ... up to ``batches_per_item`` and then
    each multiple of it (see :func:`_item_end`): a pass left after k batches has taken at most
    about min(2k, k + ``batches_per_item``) from the buffer, which is what
    ``FeedReport.rows_unconsumed`` counts as consumed.

    An epoch announced with ``shuffle`` is shuffled in windows: rows are gathered until they
    hold ``shuffle_bytes`` (default: the buffer's capacity) or the epoch ends, then permuted
    with a generator seeded by the epoch's seed and id, then cut into batches.

    A stream's micro-batch (an epoch announced with ``carry``) begins with the rows the
    previous one held back, ahead of its pushed rows, and a complete pass holds back the rows
    past its limit instead of dropping them (``FeedBuffer.take_carry``). The driver counts
    them in the limit; while the epoch streams, only pushed rows count as safe.

    ``sizes``: the batches the pass yields from this epoch are appended to it once known (the
    limit is set, or the epoch was taken back after the batches it yielded).
    """
    info = buffer.wait_epoch_info(epoch)
    if info is None:
        return
    pending: list[pa.RecordBatch] = buffer.take_carry(epoch)
    pending_rows = received = sum(b.num_rows for b in pending)
    pending_bytes = sum(b.nbytes for b in pending)
    emitted = 0
    limit: int | None = None
    complete = False
    failure: str | None = None
    carry: list[pa.RecordBatch] | None = None
    counted = False
    rng = None
    if info.shuffle:
        import numpy as np

        rng = np.random.default_rng(info.shuffle_seed(1))
        window = shuffle_bytes or buffer.capacity
    try:
        while True:
            batches, safe_rows, limit = buffer.take(epoch, num_workers)
            for b in batches:
                pending.append(b)
                pending_rows += b.num_rows
                pending_bytes += b.nbytes
                received += b.num_rows
            final = limit is not None
            if final and sizes is not None and not counted:
                counted = True
                sizes.append(limit // batch_size + (1 if limit % batch_size and not drop_remainder else 0))
            if final and emitted > limit:  # type: ignore[operator]
                # A failed train() call cut the epoch at the rows every worker holds, below
                # what this pass had yielded: a chunk reached this node whose sibling chunk
                # never reached another (its task failed in between). The pass ends where it
                # is; its other rows are held back (a stream) or dropped for balance. (Its
                # batch count, above, is the cut's, as on every other worker: they all decide
                # alike whether the pass goes on with the next epoch.)
                logger.warning(
                    "epoch %d (%s): a failed push (a train() call, or a stream's micro-batch) "
                    "ended it at %d row(s) per worker, but "
                    "this node's pass had already yielded %d; the workers' passes over it differ "
                    "in length (under MultiWorkerMirroredStrategy their steps may no longer "
                    "match, and a worker can wait for ever in a collective: cluster.shutdown() "
                    "then stops it once its timeout runs out).",
                    epoch, info.split, limit, emitted)
                limit = emitted
            if final and limit > received:  # type: ignore[operator]
                raise FeedError(
                    f"epoch {epoch}: the driver set {limit} rows for every worker but this node "
                    f"received only {received}; rows were lost in transit."
                )
            if rng is not None and pending_rows:
                if not final and pending_bytes < window:
                    continue  # gather a whole window first
                table = pa.Table.from_batches(pending).take(rng.permutation(pending_rows))
                pending = table.combine_chunks().to_batches() or []
                pending_bytes = 0
            safe = limit if final else (safe_rows if num_workers > 1 else received)
            while pending_rows >= batch_size and emitted + batch_size <= safe:  # type: ignore[operator]
                taken = emitted // batch_size
                k = min(_item_end(taken, batches_per_item) - taken, pending_rows // batch_size,  # type: ignore[operator]
                        (safe - emitted) // batch_size)
                rows = k * batch_size
                table, pending = _take_rows(pending, rows)
                pending_rows -= rows
                if rng is not None:
                    pending_bytes = sum(b.nbytes for b in pending)
                if buffer.stopped:  # a stop without drain (the driver is failing): end now
                    return
                item = convert(table)  # counted once converted: a batch may fail to
                if not _emit(buffer, info, emitted, rows):
                    return
                emitted += rows
                yield item
            if final:
                tail = limit - emitted  # type: ignore[operator]
                if drop_remainder and emitted == 0 and tail > 0:
                    logger.warning(
                        "ctx.dataset(batch_size=%d, drop_remainder=True): epoch %d (%s) gives this "
                        "node %d row(s), fewer than one batch, so its pass yields none. Push more "
                        "rows or use a smaller batch_size.", batch_size, epoch, info.split, tail)
                if tail > 0 and not drop_remainder:
                    table, pending = _take_rows(pending, tail)
                    item = convert(table)
                    if not _emit(buffer, info, emitted, tail):
                        return
                    emitted += tail
                    yield item
                if info.carry and received > limit:  # type: ignore[operator]
                    carry = _held_back(pending, received - limit)  # type: ignore[operator]
                complete = True
                return
    except FeedStopped:
        _check_not_overtaken(buffer, info, emitted)
        return
    except EpochWithdrawn:
        if sizes is not None:
            sizes.append(emitted // batch_size)
        return True  # the caller's pass goes on with the next epoch
    except Exception as e:
        # (a row that does not convert): the driver's train() then waits for main's error
        # instead of counting the pass as left early
        failure = f"{type(e).__name__}: {e}"
        raise
    finally:
        # Also when the pass is left early (GeneratorExit: break, take, steps_per_epoch, a
        # dropped iterator): the buffer then refuses the rest of this epoch at once.
        buffer.finish_epoch(epoch, emitted, complete=complete, failure=failure, carry=carry)


def _emit(buffer: FeedBuffer, info: EpochInfo, emitted: int, rows: int) -> bool:
    """Count ``rows`` as yielded; False when this pass was ended as abandoned (raises if a
    newer reader ended it: see :func:`_check_not_overtaken`)."""
    if buffer.emit(info.epoch, rows):
        return True
    _check_not_overtaken(buffer, info, emitted)
    return False


def _check_not_overtaken(buffer: FeedBuffer, info: EpochInfo, emitted: int) -> None:
    """Raise if a newer reader ended this pass while it was still being read: two passes read
    at once (a dropped iterator is never read again, so only its prefetch can get here, and
    nobody reads what it then holds)."""
    why = buffer.overtaken(info.epoch)
    if why is None or buffer.stopped:
        return
    raise FeedError(
        f"two passes over ctx.dataset(split={info.split!r}) were read at the same time: "
        f"{why} while this pass over epoch {info.epoch} was still being read ({emitted} "
        f"row(s) in). Each pass reads the next pushed epoch and a new pass ends the one "
        f"before, so read passes one after another: not Dataset.zip((ds, ds)), an interleave "
        f"or flat_map over ds, or two iterators advanced in turn. To read the rows twice, "
        f"keep them (ds.cache()) or push them twice (train(df, num_epochs=2))."
    )


def _held_back(pending: list[pa.RecordBatch], rows: int) -> list[pa.RecordBatch]:
    """The last ``rows`` rows of ``pending``, copied (a slice would keep whole Flight chunks
    alive until the next micro-batch)."""
    total = sum(b.num_rows for b in pending)
    table = pa.Table.from_batches(pending, schema=pending[0].schema).slice(total - rows)
    return table.take(np.arange(rows)).combine_chunks().to_batches()


def _reads_the_same(pushed: pa.Schema, built: pa.Schema, wanted: Sequence[str] | None) -> bool:
    """Whether a dataset built for ``built`` can read an epoch pushed as ``pushed``: the same
    columns, or with ``features=`` named (``wanted``), those columns the same whatever else
    the later DataFrame carries (a train() call on a frame with one more column)."""
    if wanted is None:
        return same_columns(pushed, built)
    if any(c not in pushed.names for c in wanted):
        return False
    return same_columns(pa.schema([pushed.field(c) for c in wanted]), pa.schema([built.field(c) for c in wanted]))


def _item_end(taken: int, per_item: int) -> int:
    """Where the item after ``taken`` batches of a pass ends: at the next power of two (at most
    ``per_item``), then at the next multiple of ``per_item`` (1, 2, 4, ..., 64, 128, 192, ...)."""
    if taken >= per_item:
        return (taken // per_item + 1) * per_item
    return min(1 << taken.bit_length(), per_item)


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
# conversion per column) is paid once per item instead of once per batch. 8 MiB keeps 256-row
# MNIST batches (0.8 MB) several to a call; the measurements are in docs/design.md. A pass's
# first items are smaller (_item_end), so one left early has not taken a whole 64-batch block
# (FeedReport.rows_unconsumed counts what was taken as consumed).
_ITEM_BYTES = 8 << 20
_MAX_BATCHES_PER_ITEM = 64


def _batches_per_item(specs: Sequence[ColumnSpec], signature: Mapping[str, Any], batch_size: int) -> int:
    """Whole batches per generator item: 1 for ragged columns (rebatch is slow on them) or
    when one batch already holds about ``_ITEM_BYTES`` (wide rows: the per-call cost is small
    next to the batch's)."""
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


# tf.data pays for every tensor of every batch (about 15-20 us each on 2 cores: the Python
# source hands each column over on its own, and tf.data moves each through every stage), so a
# wide table read as one tensor a column trains slowly. Measured 2026-12-07 (current stack,
# one node, Keras fit over the columns stacked in a map against the same values pushed as one
# array column): 100 columns 1.6x slower, 1,000 columns 3.7x.
_WIDE_COLUMNS = 100
_warned: set[str] = set()


def wide_columns_hint(signature: Mapping[str, Any], label: str | None) -> str | None:
    """What to do about a dataset reading many one-value-a-row columns as separate tensors,
    or None when it reads fewer than ``_WIDE_COLUMNS``."""
    scalars = [n for n, s in signature.items() if n != label and s.shape.rank == 1]
    if len(scalars) < _WIDE_COLUMNS:
        return None
    shown = ", ".join(repr(n) for n in scalars[:3])
    return (
        f"ctx.dataset() reads {len(scalars)} columns of one value a row ({shown}, ...) as "
        f"{len(scalars)} tensors; tf.data pays for each tensor of each batch, so training on "
        f"them ran 1.6x slower than on the same values as one array column at 100 columns, "
        f"3.7x at 1,000. Pack them in Spark, df.select(F.array(*feature_cols).alias('features'), "
        f"'label') (or use VectorAssembler's output column), and read "
        f"ctx.dataset(features='features', label='label'): one [batch, {len(scalars)}] tensor."
    )


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


class _PassSizes:
    """The batch counts of a dataset's passes, for the one warning that a pass differs from
    the first (see ``push_dataset``'s ``check_size``)."""

    def __init__(self) -> None:
        self.passes = 0
        self.first: int | None = None  # batches of the first pass, if it was read to its end
        self.warned = False

    def count(self) -> None:
        """Count a pass whose length says nothing (one that went on past a cut epoch on
        purpose, see ``push_dataset``'s ``goes_on``, which said why)."""
        self.passes += 1

    def differs(self, batches: int | None, complete: bool) -> int | None:
        """Count a pass; the first pass's batches if this one differs and nothing was said
        yet, else None."""
        self.passes += 1
        if self.passes == 1:
            if complete:
                self.first = batches
            return None
        if self.warned or self.first is None or batches is None or batches == self.first:
            return None
        self.warned = True
        return self.first


def push_dataset(
    buffer: FeedBuffer,
    *,
    batch_size: int,
    num_workers: int,
    features: str | Sequence[str] | None = None,
    label: str | None = None,
    drop_remainder: bool = False,
    shapes: Mapping[str, Sequence[int]] | None = None,
    fill_values: Mapping[str, Any] | None = None,
    prefetch: int = 2,
    first_epoch_timeout: float | None = None,
    next_epoch: Callable[[], int | None] | None = None,
    repeat: bool = False,
    split: str = "train",
    decode: Mapping[str, Any] | None = None,
    reads_until_stop: Callable[[], bool] | None = None,
):
    """Build the ``tf.data.Dataset`` behind ``ctx.dataset()``.

    Blocks until the driver announces the first epoch (``cluster.train``), because the tensor
    specs come from the pushed DataFrame's schema. With ``repeat=True`` one pass yields the
    epochs of one train call back to back (each epoch batched on its own, so every worker still
    yields the same batches), ending after its last (a stream's micro-batches: when the node
    shuts down).

    ``reads_until_stop``: True when the program loops over passes until the node stops (it
    polls ``ctx.should_stop``), so that a last pass ending empty at shutdown is expected.
    """
    import tensorflow as tf

    if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if label is not None and not isinstance(label, str):
        raise ValueError(f"label must be a column name (str) or None, got {label!r}. {LABELS_HINT}")
    feature_names = None if features is None else names_arg("features", features)
    if repeat and split == "validation":
        # Keras starts a new pass over validation data every epoch (a new iterator), so a
        # validation stream would lose what tf.data had read ahead at each drop and then wait
        # for epochs that were never pushed.
        raise ValueError(
            "ctx.dataset(split='validation', repeat=True): validation rows are pushed as one "
            "pass per training epoch, and Keras reads validation_data with a new pass every "
            "epoch; drop repeat=True (validation_steps= still works: the rest of that epoch's "
            "validation rows is refused)."
        )
    custom_claim = next_epoch

    def claim(first: bool, stream: int) -> int | None:
        """The epoch a pass reads next (``first``: the pass's first). A training pass that
        starts closes the validation epochs it has passed unread (Keras
        ``fit(validation_freq=2)``: nothing comes back for them). Within a repeat=True stream
        later claims are read-ahead, which may run before Keras validates: it closes those
        only when it is dropped."""
        if custom_claim is not None:
            return custom_claim()
        skip = "validation" if split == "train" and (first or not repeat) else None
        return buffer.claim_epoch(split, skip_older=skip, stream=stream)

    newest: list[int] = []  # the newest epoch a pass of this dataset claimed
    info: EpochInfo | None = buffer.peek_epoch(split, first_epoch_timeout, new_reader=True)
    if info is None:
        # the node stopped: a dataset built after the last pushed epoch (a loop that makes a
        # new ctx.dataset() per pass) is one whose passes end empty, so main goes on
        info = buffer.last_epoch_info(split)
    if info is None:
        raise FeedStopped(f"the cluster shut down before any {split!r} data was pushed")
    names = list(info.schema.names)
    if label is not None and label not in names:
        raise SchemaError(
            f"label column {label!r} is not in the pushed DataFrame"
            + (" of the validation split (train(validation=...))" if split == "validation" else "")
            + f"; its columns are {names}."
        )
    single = isinstance(features, str)  # one column: yield its tensor, not a dict
    if features is None:
        cols = [n for n in names if n != label]
    else:
        cols = feature_names
    if features is not None and label is not None and label in cols:
        raise ValueError(f"label column {label!r} is also listed in features.")
    wanted = cols + ([label] if label is not None else [])
    declared = dict(info.shapes)
    for k, v in mapping_arg("shapes", shapes).items():
        if v is None:  # ragged, whatever lengths the pushed rows had so far
            if k not in info.schema.names:
                raise SchemaError(f"shapes name column {k!r}, which the feed does not have: "
                                  f"{info.schema.names}.")
            declared.pop(k, None)
        else:
            declared[k] = v
    specs = column_specs(info.schema, columns=wanted, shapes=declared, fill_values=fill_values)
    buffer.expect_columns(split, wanted, (fill_values or {}).keys(), (decode or {}).keys())
    signature = tf_spec(info.schema, columns=wanted, shapes=declared)
    hint = wide_columns_hint(signature, label)
    if hint is not None:
        _warn_once(hint)
    convert = _tensor_converter(specs)
    epoch_schema = info.schema

    def read_epoch(epoch: int, sizes: list[int] | None = None) -> Iterator[dict[str, Any]] | None:
        """The items of a claimed epoch; None once the node is stopping."""
        got = buffer.wait_epoch_info(epoch)
        if got is None:
            return None
        if not _reads_the_same(got.schema, epoch_schema, None if features is None else wanted):
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
            sizes=sizes,
        )

    def claim_next(stream: int, first: bool) -> int | None:
        epoch = claim(first, stream)
        if epoch is None:
            expected = repeat or custom_claim is not None or (reads_until_stop is not None and reads_until_stop())
            note = None if expected else buffer.note_empty_pass(split)
            if note:  # the node's log, which the driver shows
                logger.warning("%s", note)
            return None
        newest[:] = [epoch]
        return epoch

    sizes_seen = _PassSizes()

    def check_size(batches: int | None, complete: bool) -> None:
        """Keras fit (tf_keras) takes the steps of a dataset of unknown length from its first
        epoch: a later pass of another length is cut there, or stops fit. Say so once."""
        first = sizes_seen.differs(batches, complete)
        if first is None:
            return
        logger.warning(
            "ctx.dataset(split=%r): pass %d has %d batch(es), the dataset's first pass had %d. "
            "Keras fit(ds) takes its steps per epoch from its first epoch: a longer pass is cut "
            "there (rows tf.data read ahead count as consumed), a shorter one stops fit with "
            "'Your input ran out of data'. Passes differ when train() calls push DataFrames of "
            "different sizes into one fit, or when a failed train() call cut fit's first epoch "
            "short. Push epochs of one size to one fit, or read ctx.dataset(repeat=True) with "
            "fit(steps_per_epoch=...).", split, sizes_seen.passes, batches, first)

    def goes_on(epoch: int, sizes: list[int]) -> bool:
        """Whether a pass that read ``epoch`` to its limit goes on with the next epoch: when a
        failed train() call cut that epoch and the pass is shorter than the dataset's first.
        Keras fit stops at a pass shorter than its first epoch ("Your input ran out of data"),
        so without this the next train() call, the fix, would find main returned; with it,
        the next call's first epoch completes the cut one (fit cuts that pass at its steps)."""
        first = sizes_seen.first
        if split != "train" or first is None or not buffer.was_cut(epoch) or sum(sizes) >= first:
            return False
        logger.warning(
            "ctx.dataset(split=%r): a failed train() call cut epoch %d; this pass has %d of the "
            "%d batch(es) of the dataset's first pass, so it goes on with the next pushed epoch "
            "(a Keras fit stops at a shorter pass, and takes only its steps per epoch from the "
            "longer one).", split, epoch, sum(sizes), first)
        return True

    def one_pass() -> Iterator[dict[str, Any]]:
        """One pass: one epoch (or the next, if a failed train() call took it back, or cut it
        short of the first pass: see ``goes_on``)."""
        stream = buffer.open_stream(split, repeat=False)
        sizes: list[int] = []
        complete = continued = False
        try:
            while True:
                epoch = claim_next(stream, True)
                items = None if epoch is None else read_epoch(epoch, sizes)
                if items is None:
                    return
                if (yield from items) is not True:
                    if goes_on(epoch, sizes):
                        continued = True
                        continue
                    complete = bool(sizes)
                    return
        finally:
            buffer.close_stream(stream)
            if continued:  # longer than the first on purpose: said once, in goes_on
                sizes_seen.count()
            else:
                check_size(sum(sizes) if sizes else None, complete)

    taken_back: set[int] = set()  # epochs of a repeat=True stream that a failed train() took back

    def stream_epochs() -> Iterator[np.int64]:
        """A repeat=True stream's epochs, one element each, up to the last of the train call
        it began in (a stream's micro-batches: until shutdown). flat_map asks for the next
        only once the pass has read the one before to its end, so the dataset's own prefetch
        never reads ahead into the next epoch; and ending at the call's last epoch keeps the
        read-ahead of the program's side (a distributed iterator's prefetch, one or two
        batches past fit's last step) out of an epoch pushed for its next step, which fit
        dropping the stream would otherwise close half read."""
        stream = buffer.open_stream(split, repeat=True)
        ended = False
        try:
            first = True
            while True:
                epoch = claim_next(stream, first)
                if epoch is None:
                    return
                got = buffer.wait_epoch_info(epoch)
                if got is None:
                    return
                # at its call's last epoch every epoch of the call is claimed: what else is
                # announced is the next call's, which a drop from here must leave alone
                ended = got.ends_call
                yield np.int64(epoch)
                if epoch in taken_back:
                    taken_back.discard(epoch)
                    continue
                first = False
                if ended:
                    return
        finally:
            # the stream was the node's feed: epochs pushed for it that it never reached
            # must not wait for a reader, nor validation epochs older than its last epoch
            # (fit is done; a later evaluate reads the newest); unless a newer reader of the
            # split has begun since (then the buffer did that, and what is announced now is
            # the newer reader's). A stream at its call's last epoch has reached them all.
            if buffer.close_stream(stream):
                if not ended:
                    buffer.skip_announced(split)
                if split == "train" and newest:
                    buffer.skip_announced("validation", before=newest[0])

    def stream_epoch(epoch: Any) -> Iterator[dict[str, Any]]:
        items = read_epoch(int(epoch))
        if items is not None and (yield from items) is True:
            taken_back.add(int(epoch))

    def batches(ds: Any) -> Any:
        """One epoch's items as the batches the program reads."""
        if per_item > 1:
            ds = ds.rebatch(int(batch_size))
        if decode:
            ds = decode_columns(ds, decode, info.schema, batch_size=int(batch_size))
        if single and label is not None:
            ds = ds.map(lambda d: (d[cols[0]], d[label]))
        elif single:
            ds = ds.map(lambda d: d[cols[0]])
        elif label is not None:
            ds = ds.map(lambda d: ({k: d[k] for k in cols}, d[label]))
        if drop_remainder:
            # every batch is already whole (iterate_epoch drops each epoch's short tail); this
            # only gives the batch dimension its static size, as tf.data's own
            # batch(drop_remainder=True)
            ds = ds.rebatch(int(batch_size), drop_remainder=True)
        # prefetch within the epoch: a stream's next epoch is claimed only when it is read
        return ds.prefetch(prefetch)

    per_item = _batches_per_item(specs, signature, int(batch_size))
    if repeat:
        ds = generator_dataset(stream_epochs, tf.TensorSpec((), tf.int64)).flat_map(
            lambda epoch: batches(generator_dataset(stream_epoch, signature, arg=epoch)))
    else:
        ds = batches(generator_dataset(one_pass, signature))
    opts = tf.data.Options()
    # Every worker already gets its own rows; Keras must not shard them again.
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # No tf.data autotuning: the buffer sizes here are fixed, and with autotune on, ending an
    # epoch's iterator intermittently took 1-9 s on a busy 2-core machine (the iterator's
    # teardown waits for a background thread), which stalls every epoch boundary.
    opts.autotune.enabled = False
    return ds.with_options(opts)


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _flat_and_shape(img: Any) -> Any:
    import tensorflow as tf

    return tf.reshape(img, [-1]), tf.shape(img)


_IMAGE_CHANNELS = {"jpeg": (0, 1, 3), "png": (0, 1, 3, 4)}
_DECODE_FORMS = ("expected 'jpeg', 'png', (kind, channels), (kind, channels, (height, width)) "
                 "or ('raw', dtype, shape), e.g. ('jpeg', 3, (224, 224)) or ('raw', 'float32', (28, 28))")


def _decode_plan(name: str, how: Any) -> tuple[Any, ...]:
    """``(kind, dtype, shape, channels, size)`` for one ``decode=`` entry."""
    import tensorflow as tf

    if how in ("jpeg", "png"):
        return (how, None, None, 0, None)
    if isinstance(how, (tuple, list)) and len(how) == 3 and how[0] == "raw":
        return ("raw", tf.as_dtype(how[1]), tuple(int(d) for d in how[2]), 0, None)
    if isinstance(how, (tuple, list)) and len(how) in (2, 3) and how[0] in _IMAGE_CHANNELS:
        kind, channels = how[0], how[1]
        if isinstance(channels, bool) or channels not in _IMAGE_CHANNELS[kind]:
            raise ValueError(
                f"decode[{name!r}] = {how!r}: channels must be one of {_IMAGE_CHANNELS[kind]} for "
                f"{kind} (0: as stored; 1: gray; 3: RGB{'; 4: RGBA' if kind == 'png' else ''})."
            )
        size = None
        if len(how) == 3:
            size = how[2]
            if not (isinstance(size, (tuple, list)) and len(size) == 2
                    and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in size)):
                raise ValueError(f"decode[{name!r}] = {how!r}: the size must be (height, width), two ints > 0.")
            size = (int(size[0]), int(size[1]))
        return (kind, None, None, int(channels), size)
    raise ValueError(f"decode[{name!r}] = {how!r}: {_DECODE_FORMS}.")


def decode_columns(ds: Any, decode: Mapping[str, Any], schema: pa.Schema, *, batch_size: int) -> Any:
    """Decode binary columns of a batched dict dataset on the node, inside tf.data.

    ``decode`` maps a column to ``"jpeg"``, ``"png"``, ``(kind, channels)``,
    ``(kind, channels, (height, width))`` or ``("raw", dtype, shape)``. JPEG / PNG images
    become ``uint8 [batch, h, w, c]``: as stored (every image of a batch must then share its
    size and channel count), with ``channels`` converted to that many (gray to RGB, ...; 0
    keeps the stored count), and with a size resized to it (bilinear, rounded back to
    ``uint8``). Raw bytes become ``dtype [batch, *shape]``. Batches are decoded in parallel.
    A value that is not an image of the named kind (by its signature), an image whose size or
    channels differ from its batch's first, or raw bytes of the wrong length fail the pass
    with an ``InvalidArgumentError`` naming the column, the row (counted from the pass's
    start) and that row's values in the dataset's first scalar columns (an id, say). An image
    damaged past its signature fails with TensorFlow's own decoder error, which names neither.
    """
    import os

    import tensorflow as tf

    plans = {}
    for name, how in decode.items():
        if name not in schema.names:
            raise SchemaError(f"decode: column {name!r} is not in the pushed DataFrame; its columns are {schema.names}.")
        t = schema.field(name).type
        if not (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)):
            raise SchemaError(
                f"decode: column {name!r} is {t}, not binary; decode applies to binary columns "
                f"(images or raw bytes)."
            )
        plans[name] = _decode_plan(name, how)

    def which(d, bad):  # type: ignore[no-untyped-def]
        """The failing row's values in up to three scalar columns, to find it in the data."""
        said: list[Any] = []
        for k, v in d.items():
            if k not in plans and isinstance(v, tf.Tensor) and v.shape.rank == 1 and len(said) < 6:
                said += [f"{k} =", tf.gather(v, bad)]
        return said

    def check(ok, name, what, first, d, found=None):  # type: ignore[no-untyped-def]
        """``found(bad)``: what the failing value is, said after the row."""
        bad = tf.cast(tf.argmin(tf.cast(ok, tf.int32)), tf.int64)
        return tf.debugging.Assert(
            tf.reduce_all(ok),
            [f"ctx.dataset(decode=...): column {name}: {what}, at row (of this pass):", first + bad,
             *which(d, bad), *(found(bad) if found is not None else [])],
            summarize=1,
        )

    def resized(img, size):  # type: ignore[no-untyped-def]
        out = tf.image.resize(img, size)
        return tf.cast(tf.clip_by_value(tf.round(out), 0, 255), tf.uint8)

    def fn(i, d):  # type: ignore[no-untyped-def]
        out = dict(d)
        first = i * batch_size
        for name, (kind, dtype, shape, channels, size) in plans.items():
            col = d[name]
            if kind == "raw":
                want = int(np.prod(shape)) * dtype.size
                length = tf.strings.length(col)
                ok = tf.equal(length, want)
                with tf.control_dependencies([check(
                        ok, name, f"a value is not {want} bytes of raw {dtype.name} {shape}", first, d,
                        lambda bad, length=length: ["which has", tf.gather(length, bad), "bytes"])]):
                    flat = tf.io.decode_raw(col, dtype)
                out[name] = tf.reshape(flat, (-1, *shape))
                continue
            if kind == "jpeg":
                ok = tf.map_fn(tf.io.is_jpeg, col, fn_output_signature=tf.bool)
                decoder = lambda s, c=channels: tf.io.decode_jpeg(s, channels=c)  # noqa: E731
            else:
                ok = tf.equal(tf.strings.substr(col, 0, 8), _PNG_MAGIC)
                decoder = lambda s, c=channels: tf.io.decode_png(s, channels=c)  # noqa: E731
            if size is not None:
                decoder = lambda s, inner=decoder, size=size: resized(inner(s), size)  # noqa: E731
            with tf.control_dependencies([check(ok, name, f"a value is not a {kind.upper()} image", first, d)]):
                flat, shapes = tf.map_fn(
                    lambda s, decoder=decoder: _flat_and_shape(decoder(s)), col,
                    fn_output_signature=(tf.RaggedTensorSpec([None], tf.uint8, ragged_rank=0),
                                         tf.TensorSpec([3], tf.int32)),
                )
            ref = tf.concat([shapes, tf.zeros([1, 3], tf.int32)], 0)[0]  # the batch's first
            same = tf.reduce_all(tf.equal(shapes, ref), axis=1)
            bad = tf.cast(tf.argmin(tf.cast(same, tf.int32)), tf.int64)
            differs = tf.debugging.Assert(
                tf.reduce_all(same),
                [f"ctx.dataset(decode=...): column {name}: the images of a batch must share one "
                 f"size and channel count; the image at row (of this pass)",
                 first + bad, *which(d, bad), "is (height, width, channels)", tf.gather(shapes, bad),
                 "but the first of its batch is", ref,
                 f"(decode them all to one with decode={{{name}: ({kind}, 3, (height, width))}}, names quoted)"],
                summarize=3,
            )
            with tf.control_dependencies([differs]):
                if size is not None and channels:  # every image alike: a static shape
                    out[name] = tf.reshape(flat.flat_values, (-1, *size, channels))
                else:
                    out[name] = tf.reshape(flat.flat_values, tf.concat([[-1], ref], 0))
        return out

    return ds.enumerate().map(fn, num_parallel_calls=max(2, os.cpu_count() or 2), deterministic=True)
