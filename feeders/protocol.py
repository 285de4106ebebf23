"""What pushing tasks, the driver and a node say to each other: the push protocol's one home.

Three parties talk over Arrow Flight:

* a **pushing task** (an executor running ``mapInArrow``) opens one ``do_put`` stream per worker
  node for its partition, described by a :class:`FeedCommand`; inference tasks open a
  ``do_exchange`` stream described by an :class:`InferCommand`;
* the **driver** sends JSON control actions (:class:`Action`) to every node;
* the **node** answers, and refuses a stream with a message carrying a :class:`Refusal` marker
  that the task recognises (Flight carries only a status and a message across).

Flow control (why it cannot deadlock): every Arrow batch of a partition is split over the W
workers (contiguous slices; after every batch each worker's share of the partition is ``T // W``
or ``T // W + 1`` of the ``T`` rows seen so far), and the slices are written **interleaved**, one
chunk per worker in turn. So within one task no worker is ever more than one chunk ahead of
another, and a full buffer on one node holds back at most one chunk that another node needs.
Chunks are sized so that the chunks of every concurrently running task together stay well
under a node's buffer (:func:`chunk_bytes`): a worker whose buffer is full is then always far
enough ahead of every other worker that they all can take their next step, which is what
MultiWorkerMirroredStrategy's collectives need.

Every chunk carries, as Flight ``app_metadata``, the number of the partition's rows the task had
seen when it split them and the columns holding nulls in its Arrow batch (:class:`ChunkTag`); a
stream ends with a metadata-only message of the partition's total. Each worker ends up with at
least ``seen // W`` rows of that partition, which is how a node knows, while the epoch is still
streaming, how many rows it may yield without ever yielding more than another worker (equal
batch counts under MWMS). That trusts a chunk's siblings to arrive, so a node refuses a batch
for what any worker's slice of it holds (its nulls), never for its own slice alone; a task that
dies between two sibling chunks (cancelled) can still leave one worker ahead, which that node
warns of (its ``overran_cut`` metric).

Leaving an epoch early: when a node's pass over an epoch ends before the epoch does (``break``,
``take``, ``steps_per_epoch``, an iterator dropped), the node closes that epoch: streams of it
are refused with :attr:`Refusal.EPOCH_CLOSED` and the task stops sending that epoch to that node
and counts the rest as refused (``rows_refused``), instead of waiting for buffer space that
would never come.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

__all__ = [
    "FeedCommand",
    "InferCommand",
    "Action",
    "Refusal",
    "BeginEpoch",
    "EpochState",
    "PutReply",
    "PUSH_RESULT_SCHEMA",
    "PUSH_RESULT_FIELDS",
    "EPOCH_PROPERTY",
    "ChunkTag",
    "chunk_bytes",
    "split_counts",
]

# Spark job-local property carrying the epoch, so one push DataFrame serves every epoch.
EPOCH_PROPERTY = "dataplane.push.epoch"

# What every pushing task returns, one row per worker node.
# ``refused``: 1 when the node refused the stream at any point (its pass over the epoch had
# ended, or its main had returned), even if only its closing reply said so.
PUSH_RESULT_FIELDS = (
    "partition", "attempt", "node_id", "rows_sent", "rows_accepted", "rows_refused", "bytes_sent",
    "refused",
)
PUSH_RESULT_SCHEMA = ", ".join(f"{name} long" for name in PUSH_RESULT_FIELDS)


def _descriptor(kind: str, body: dict[str, Any]) -> bytes:
    return json.dumps(dict(body, kind=kind)).encode()


def _parse(raw: bytes | str) -> dict[str, Any]:
    try:
        return json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a dataplane stream descriptor: {raw!r:.200}") from e


@dataclass(frozen=True)
class FeedCommand:
    """Descriptor of one ``do_put`` stream: one attempt's rows of one partition for one node."""

    epoch: int
    partition: int
    attempt: int
    KIND = "feed"

    def encode(self) -> bytes:
        return _descriptor(self.KIND, asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "FeedCommand":
        d = _parse(raw)
        if d.get("kind") != cls.KIND:
            raise ValueError(f"expected a {cls.KIND!r} stream, got {d.get('kind')!r}")
        return cls(int(d["epoch"]), int(d["partition"]), int(d.get("attempt", 0)))


@dataclass(frozen=True)
class InferCommand:
    """Descriptor of one ``do_exchange`` stream of inference requests."""

    partition: int | None = None
    probe: bool = False
    KIND = "infer"

    def encode(self) -> bytes:
        return _descriptor(self.KIND, asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> "InferCommand":
        d = _parse(raw)
        if d.get("kind") != cls.KIND:
            raise ValueError(f"expected an {cls.KIND!r} stream, got {d.get('kind')!r}")
        p = d.get("partition")
        return cls(None if p is None else int(p), bool(d.get("probe", False)))


class Action(str, enum.Enum):
    """Control actions the driver sends to a node (``do_action`` types)."""

    PING = "ping"
    BEGIN_EPOCH = "begin_epoch"  # BeginEpoch, or {"epochs": [BeginEpoch, ...]} in order -> {"main"}
    EPOCH_STATE = "epoch_rows"  # {"epoch"} -> EpochState
    END_EPOCH = "end_epoch"  # {"epoch", "limit", "cut"}: rows every consuming worker yields;
    # cut: a failed train() call ended the epoch with the rows that had arrived
    METRICS = "metrics"
    SHUTDOWN = "shutdown"  # {"now"}: stop; now (shutdown(drain=False), Ctrl-C): main gets 1 s, not stop_grace
    DROP_CACHE = "drop_cache"  # {"cache"}: forget a cached DataFrame, remove its spill files
    # a failed train() call takes back its unfinished epochs no worker has begun:
    HOLD_EPOCHS = "hold_epochs"  # {"epochs"} -> {"held": the epochs no pass has claimed, now held}
    RELEASE_EPOCHS = "release_epochs"  # {"withdraw", "keep"}: held epochs to take back, to let be read


class Refusal(str, enum.Enum):
    """Why a node refused a stream: a marker in the Flight error's message."""

    CONSUMER_FINISHED = "[dataplane:consumer-finished]"  # main returned or stopped reading
    EPOCH_CLOSED = "[dataplane:epoch-closed]"  # the node's pass over this epoch has ended
    NODE_STOPPING = "[dataplane:node-stopping]"  # the node is shutting down
    SCHEMA = "[dataplane:schema]"  # the rows cannot become the node's tensors (a SchemaError)
    STORAGE = "[dataplane:storage]"  # the node could not write rows to its disk (a StorageError)

    @property
    def ends_stream_only(self) -> bool:
        """The task just stops sending to this node (the rest counts as refused)."""
        return self in (Refusal.CONSUMER_FINISHED, Refusal.EPOCH_CLOSED)

    @classmethod
    def find(cls, text: str) -> "Refusal | None":
        for r in cls:
            if r.value in text:
                return r
        return None


@dataclass(frozen=True)
class BeginEpoch:
    """``begin_epoch``: the epoch's id, Arrow schema and fixed array lengths; which split reads
    it; whether its rows come out shuffled (and the seed); ``record``: the node keeps the rows
    in its cache under this id; ``replay``: the rows come from that cache, not from Spark.
    ``carry`` (a stream's micro-batch): the rows past the epoch's limit are not dropped but
    held back for the next carry epoch; ``carry_from``: this epoch begins with the rows held
    back from that epoch (the driver counts them in its limit). ``ends_call``: the last epoch
    of its split that its ``cluster.train`` call pushes (a ``repeat=True`` stream ends after
    it). The reply carries ``cache_rows`` for a replayed epoch."""

    epoch: int
    schema_ipc: bytes
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    split: str = "train"
    shuffle: bool = False
    seed: int | None = None
    record: str | None = None
    replay: str | None = None
    carry: bool = False
    carry_from: int | None = None
    ends_call: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "schema": self.schema_ipc.hex(),
                "shapes": {k: list(v) for k, v in self.shapes.items()}, "split": self.split,
                "shuffle": self.shuffle, "seed": self.seed, "record": self.record,
                "replay": self.replay, "carry": self.carry, "carry_from": self.carry_from,
                "ends_call": self.ends_call}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "BeginEpoch":
        return cls(int(d["epoch"]), bytes.fromhex(d["schema"]),
                   {k: tuple(int(x) for x in v) for k, v in d.get("shapes", {}).items()},
                   str(d.get("split", "train")), bool(d.get("shuffle", False)), d.get("seed"),
                   d.get("record"), d.get("replay"), bool(d.get("carry", False)),
                   None if d.get("carry_from") is None else int(d["carry_from"]),
                   bool(d.get("ends_call", False)))


@dataclass(frozen=True)
class EpochState:
    """A node's view of one epoch (reply to ``epoch_rows``).

    ``rows`` received (after dedupe), ``emitted`` handed to TensorFlow so far, ``closed``: the
    node's pass over the epoch has ended (read to its limit, left early, or main returned),
    ``complete``: it ended by reaching the limit, ``main``: running | finished | failed,
    ``ended_feed``: the pass was closed because the node reads no more pushed rows
    (``ctx.end_feed()``, ``ctx.serve``), ``failure``: the pass ended with this error (a batch
    that did not convert), which the node's main raises. ``carried_in``: rows held back from
    the previous carry epoch that the pass began with (not in ``rows``); ``carried_out``: rows
    past the limit the complete pass held back for the next one (``BeginEpoch.carry``).
    ``left_early``: the pass was ended by its reader before the limit (``break``, ``take``, a
    newer pass) and main read on (a later pass), whether or not it has returned since.
    ``dataset``: the node's main has a reader for the epoch's split (a ``ctx.dataset()``
    built over it, or a pass that asked for one of its epochs); a node without one stands
    still for a reason of its own: a long set-up, or data read some other way.
    ``waits_past``: the splits over which a pass of the node's main waits while no epoch of
    theirs is announced, i.e. for a later train() call (a main that reads more passes than
    were pushed; with this epoch's pass open, one that never gets back to it).
    ``repeat``: the epoch was read by a ``repeat=True`` stream (Keras reads on past its
    ``steps_per_epoch`` within it), not by a pass of its own.
    """

    rows: int
    emitted: int
    closed: bool
    complete: bool
    main: str
    ended_feed: bool = False
    failure: str | None = None
    carried_in: int = 0
    carried_out: int = 0
    left_early: bool = False
    dataset: bool = True
    waits_past: tuple[str, ...] = ()
    repeat: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EpochState":
        return cls(int(d["rows"]), int(d.get("emitted", 0)), bool(d.get("closed", False)),
                   bool(d.get("complete", False)), str(d.get("main", "running")),
                   bool(d.get("ended_feed", False)), d.get("failure"),
                   int(d.get("carried_in", 0)), int(d.get("carried_out", 0)),
                   bool(d.get("left_early", False)), bool(d.get("dataset", True)),
                   tuple(str(x) for x in d.get("waits_past", ())), bool(d.get("repeat", False)))


@dataclass(frozen=True)
class PutReply:
    """What a node answers at the end of a ``do_put`` stream."""

    accepted: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "PutReply":
        return cls(int(json.loads(raw)["accepted"]))


_SEEN = struct.Struct("<q")
_NULLS = struct.Struct("<Iqq")  # column index, null rows, nulls inside the column's arrays


@dataclass(frozen=True)
class ChunkTag:
    """A chunk's ``app_metadata``: ``seen``, the rows of the partition the task had split when
    it sent the chunk, and ``nulls``, for each column holding nulls anywhere in the Arrow batch
    the chunk was cut from (every worker's slice, not only this one), its index in the stream's
    schema with (null rows, nulls inside its arrays). Every worker's chunks of a batch carry
    the same ``nulls``, so a node that cannot take a null refuses the whole batch, whichever
    slice holds it: one that refused only its own slice while another worker yielded its
    sibling slice would leave their passes of different lengths. Empty for a clean batch, so
    such chunks carry only ``seen``."""

    seen: int
    nulls: tuple[tuple[int, int, int], ...] = ()

    def encode(self) -> bytes:
        return _SEEN.pack(self.seen) + b"".join(_NULLS.pack(*n) for n in self.nulls)

    @classmethod
    def decode(cls, meta: Any) -> "ChunkTag | None":
        """The tag of a chunk; ``None`` for a chunk without one (or not of this form)."""
        if meta is None:
            return None
        raw = meta.to_pybytes() if hasattr(meta, "to_pybytes") else bytes(meta)
        if len(raw) < _SEEN.size or (len(raw) - _SEEN.size) % _NULLS.size:
            return None
        nulls = tuple(_NULLS.iter_unpack(raw[_SEEN.size:]))
        return cls(_SEEN.unpack_from(raw)[0], nulls)


def split_counts(total: int, workers: int, rotation: int,
                 held: Sequence[int] | None = None) -> list[int]:
    """Each worker's share of the first ``total`` rows of a partition (differ by at most 1).

    The extra rows (``total`` mod ``workers``) go to the workers in turn from ``rotation`` (the
    partition index, so partitions even each other out); given ``held`` (rows each worker holds
    back from a stream's last micro-batch), to those holding back fewest first, in that turn
    among equals, so that what a worker holds back cannot grow from batch to batch."""
    base, extra = divmod(total, workers)
    if not held:
        return [base + (1 if (k - rotation) % workers < extra else 0) for k in range(workers)]
    order = sorted(range(workers), key=lambda k: (held[k], (k - rotation) % workers))
    first = set(order[:extra])
    return [base + (1 if k in first else 0) for k in range(workers)]


def chunk_bytes(buffer_bytes: int, concurrent_tasks: int, max_chunk_bytes: int) -> int:
    """Largest chunk a task sends: the chunks of all concurrently pushing tasks together take
    at most a quarter of a node's buffer (see the module docstring), and never more than
    ``max_chunk_bytes``."""
    share = buffer_bytes // (4 * max(1, concurrent_tasks))
    return max(1, min(max_chunk_bytes, share))
