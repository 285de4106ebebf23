"""Which part of a data set one reader takes: ``None``, ``(index, count)`` or a node ``ctx``."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["Shard", "normalize_shard", "balanced_shards", "agreed", "left_out"]


#: ``(index, count)``: this reader is shard ``index`` of ``count``.
Shard = tuple[int, int]


def _as_int(value: Any, what: str, given: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"shard {what} must be an integer, got {value!r} (shard={given!r}).")
    return int(value.__index__())


def normalize_shard(shard: Any) -> Shard | None:
    """Validate a ``shard=`` argument and return ``(index, count)`` or ``None``.

    Args:
        shard: ``None`` (read everything), ``(index, count)`` with ``0 <= index < count``, or a
            node context: an object with ``num_workers`` and ``worker_index`` (preferred, the
            index among the nodes that receive data) or ``index``.

    Raises:
        ValueError: the tuple is malformed or out of range, or the object lacks the attributes.
    """
    if shard is None:
        return None
    if isinstance(shard, (tuple, list)):
        if len(shard) != 2:
            raise ValueError(
                f"shard must be (index, count), got {shard!r} with {len(shard)} item(s)."
            )
        index = _as_int(shard[0], "index", shard)
        count = _as_int(shard[1], "count", shard)
    elif hasattr(shard, "num_workers") and (hasattr(shard, "worker_index") or hasattr(shard, "index")):
        raw_index = shard.worker_index if hasattr(shard, "worker_index") else shard.index
        index = _as_int(raw_index, "index (ctx.worker_index / ctx.index)", shard)
        count = _as_int(shard.num_workers, "count (ctx.num_workers)", shard)
    else:
        raise ValueError(
            f"shard must be None, (index, count) or a node ctx with num_workers and "
            f"worker_index/index; got {type(shard).__name__} {shard!r}."
        )
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count} (shard={shard!r}).")
    if not 0 <= index < count:
        raise ValueError(
            f"shard index must be in [0, {count}), got {index} (shard={shard!r}). A ctx whose "
            f"role receives no data (ps, evaluator) cannot read a training shard."
        )
    return index, count


def agreed(shard: Any, key: str, value: Any) -> tuple[int | None, Any]:
    """The listing every reader of a cluster shards: ``(first node's id, its value)`` when
    ``shard`` is a node ctx (its ``agree`` settles one value for the n-th call of every node),
    ``(None, value)`` for a tuple or ``None`` shard, which have no cluster to agree with.

    Each node lists the path itself, so a file written between two nodes' listings would make
    their shards cut different row ranges: rows read twice or never, without a word."""
    agree = getattr(shard, "agree", None)  # (a tuple has none)
    if agree is None:
        return None, value
    first, settled = agree(key, value)
    return int(first), settled


def left_out(display: Any, mine: Sequence[str], settled: Sequence[str]) -> str:
    """What a node whose own listing held more files than the agreed one says about them
    ("" when none): they are not read until the dataset is made again."""
    extra = sorted(set(mine) - set(settled))
    if not extra:
        return ""
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    return (f" Files written since it listed ({display(extra[0])}{more}) are not read by this "
            f"dataset; build it again to read them.")


def balanced_shards(sizes: Sequence[int], count: int) -> list[int]:
    """The shard of each item when ``count`` shards take contiguous runs of items holding
    about as many rows each: an item goes to the shard whose even slice of the total holds
    the item's middle row, except that with at least ``count`` items every shard gets one
    (files of 1000, 1 and 1 rows over 3 shards: one each, not 0 / 1000 / 2). Items keep their
    order, so every shard reads its files front to back; no item is split, so shards differ
    by up to about one item's rows."""
    total, n = sum(sizes), len(sizes)
    out: list[int] = []
    start = 0
    for j, size in enumerate(sizes):
        middle = start + size / 2
        want = min(count - 1, int(middle * count / total)) if total else 0
        if j == 0:
            want = 0
        else:  # one shard further at most, never so far behind the rest go without an item
            want = min(max(want, out[-1], count - (n - j)), out[-1] + 1)
        out.append(want)
        start += size
    return out
