"""What each of our Spark tasks does first: :func:`prepare_task`, kept importable from here.

It lives in :mod:`formats.sparktask`, the lowest package whose tasks call it (the export jobs
of ``formats``, the push tasks of ``feeders``, the prediction tasks of ``dataplane``).
"""

from __future__ import annotations

from formats.sparktask import _AFFECTED, _StableZipImporter, prepare_task  # noqa: F401

__all__ = ["prepare_task"]
