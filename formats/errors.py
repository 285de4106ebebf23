"""Every exception the project raises on purpose, in one place.

Each is rooted in the built-in a caller would already catch (``ValueError`` for bad input,
``RuntimeError`` for things that went wrong at run time, ``TimeoutError`` for deadlines), so code
that predates this package keeps working. The classes live here, in the lowest package, so that
``formats``, ``feeders`` and ``dataplane`` all raise the same ones without importing upward;
users import them from :mod:`dataplane.errors` (or ``dataplane``), which re-exports every name.
"""

from __future__ import annotations

__all__ = [
    "DataplaneError",
    "SchemaError",
    "RecordError",
    "StorageError",
    "StackError",
    "ReservationError",
    "NodeError",
    "NodeSchemaError",
    "FeedError",
    "ClusterStateError",
    "NotServing",
]


class DataplaneError(Exception):
    """Base class for every error raised on purpose by spark-tf-dataplane."""


class SchemaError(DataplaneError, ValueError):
    """A column's type or value cannot be carried to TensorFlow (names the column and the fix)."""


class RecordError(DataplaneError, ValueError):
    """A TFRecord file is corrupt or truncated (names the file and byte offset).

    Attributes:
        offset: byte offset of the bad record (in the uncompressed stream), or None when the
            error is about the file as a whole.
        maybe_compressed: the bytes read look like a compressed file read as uncompressed:
            reading it with ``compression='GZIP'`` or ``'ZLIB'`` may be the fix.
    """

    def __init__(self, message: str, *, offset: int | None = None, maybe_compressed: bool = False) -> None:
        super().__init__(message)
        self.offset = offset
        self.maybe_compressed = maybe_compressed


class StorageError(DataplaneError, OSError):
    """A path or URL could not be listed or read (names the URL and what to check)."""


class StackError(DataplaneError, ImportError):
    """A feature needs a package or stack that is not installed (names the extra or stack)."""


class ReservationError(DataplaneError, TimeoutError):
    """Not every TF node registered with the driver in time.

    Attributes:
        missing: node ids that never registered.
        registered: node ids that did.
    """

    def __init__(self, message: str, *, missing: list[int], registered: list[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.registered = list(registered)


class NodeError(DataplaneError, RuntimeError):
    """A TF node failed: its ``main`` raised, or its process died.

    Attributes:
        node: the ``NodeInfo`` of the failed node (``None`` if it never registered).
        remote_traceback: the traceback text from the node process, or a description of how
            the process was lost when there is no traceback.
    """

    def __init__(self, message: str, *, node: object = None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.node = node
        self.remote_traceback = remote_traceback


class NodeSchemaError(NodeError, SchemaError):
    """A node's main raised a :class:`SchemaError` (a null without a fill value, a column TF
    cannot hold, a row of the wrong shape): ``except SchemaError`` and ``except NodeError``
    both catch it."""


class FeedError(DataplaneError, RuntimeError):
    """Pushing data into the nodes failed, or the node side received data it cannot use."""


class ClusterStateError(DataplaneError, RuntimeError):
    """The cluster is not in a state that allows the call (for example train after shutdown)."""


class NotServing(DataplaneError, RuntimeError):
    """An inference request reached a node whose main ended without ``ctx.serve`` running."""
