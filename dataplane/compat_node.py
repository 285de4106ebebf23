"""Old home of the TFoS node-side names; they live in :mod:`dataplane.compat.TFNode` now."""

from __future__ import annotations

from dataplane.compat import TFNode
from dataplane.compat.TFNode import DataFeed, TFNodeContext, column_name, decode_rows

__all__ = ["TFNodeContext", "DataFeed", "TFNode", "decode_rows", "column_name"]
