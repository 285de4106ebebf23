"""One epoch as a node sees it: what the driver announced, and what has become of its rows.

:class:`EpochInfo` is the driver's announcement (``begin_epoch``); :class:`NodeEpoch` is the
node's record of it, kept by :class:`feeders.buffer.FeedBuffer` under its lock. The exceptions
are what producers and consumers of the buffer are told when they must give up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pyarrow as pa

from feeders.cache import EpochCache

__all__ = ["FeedStopped", "ConsumerFinished", "EpochClosed", "EpochInfo", "NodeEpoch"]


class FeedStopped(Exception):
    """The node is shutting down; producers and consumers give up."""


class ConsumerFinished(Exception):
    """The node's ``main`` has returned (or serves inference): it will consume no more data."""


class EpochClosed(Exception):
    """The node's pass over this epoch has ended; the rest of the epoch is not wanted."""


@dataclass
class EpochInfo:
    """What the driver announced for one epoch (``begin_epoch``).

    ``split``: which dataset reads it (``ctx.dataset(split=...)``). ``shuffle`` / ``seed``: the
    rows come out in a seeded random order. ``record``: keep the rows in the node's cache under
    this id. ``replay``: the epoch's rows come from that cache, not from Spark.
    """

    epoch: int
    schema: pa.Schema
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    split: str = "train"
    shuffle: bool = False
    seed: int | None = None
    record: str | None = None
    replay: str | None = None

    def shuffle_seed(self, *salt: int) -> list[int]:
        """The seed of this epoch's shuffles: the user's seed, the epoch id, then ``salt``."""
        return [self.seed if self.seed is not None else 0, self.epoch, *salt]


@dataclass
class NodeEpoch:
    """One announced epoch on a node: its queue, dedupe marks and where its pass stands."""

    info: EpochInfo
    queue: deque = field(default_factory=deque)
    queued_bytes: int = 0
    accepted: dict[int, int] = field(default_factory=dict)  # partition -> rows accepted
    seen: dict[int, int] = field(default_factory=dict)  # partition -> rows its task had split
    rows_in: int = 0
    limit: int | None = None  # rows every worker yields this epoch (set by the driver)
    emitted: int = 0  # rows handed to TensorFlow
    closed: bool = False  # the consumer's pass has ended
    ended_feed: bool = False  # ... closed because the node reads no more (consumer_finished)
    complete: bool = False  # ... by reaching the limit
    feeding: bool = False  # rows are still being replayed from the cache
    cache: EpochCache | None = None  # recording into it
