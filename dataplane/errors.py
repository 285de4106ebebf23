"""Every exception the project raises on purpose: import them from here.

The classes are defined in :mod:`formats.errors` (the lowest package, so ``formats`` and
``feeders`` raise them without importing ``dataplane``); this module re-exports every one, so
``except dataplane.errors.SchemaError`` catches exactly what ``formats`` and ``feeders`` raise.
:func:`error_summary` reads node tracebacks and is the driver's own.
"""

from __future__ import annotations

import re

from formats.errors import (
    ClusterStateError,
    DataplaneError,
    FeedError,
    NodeError,
    NotServing,
    RecordError,
    ReservationError,
    SchemaError,
    StackError,
    StorageError,
)

__all__ = [
    "DataplaneError",
    "SchemaError",
    "RecordError",
    "StorageError",
    "StackError",
    "ReservationError",
    "NodeError",
    "FeedError",
    "ClusterStateError",
    "NotServing",
    "error_summary",
]

_EXC_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Stopped|Shutdown))\b:?\s")


def error_summary(text: str) -> str:
    """The most telling line of a traceback: the last 'SomeError: message' line (TF wraps the
    Python error of a tf.data generator inside its own error text), else the last line."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _EXC_LINE.match(ln) and not ln.startswith(("tensorflow.python.framework.errors_impl",)):
            return ln
    for ln in reversed(lines):
        if _EXC_LINE.match(ln):
            return ln
    return lines[-1] if lines else ""
