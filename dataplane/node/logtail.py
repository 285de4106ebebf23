"""What a node has written to its log that the driver has not seen yet.

A node's stdout and stderr (the user's prints, Keras' progress lines, TensorFlow's own log)
go to ``node.log`` in its work directory, which is removed when the node exits. With
``run(log_to_driver=True)`` the node sends the new part of that file with each heartbeat, and
the rest with its last message, and the driver prints it (:mod:`dataplane.driver.control`).
"""

from __future__ import annotations

import os
import threading

__all__ = ["LogTail"]

BEAT_BYTES = 256 << 10  # at most this much per heartbeat; a chattier node lags, losing nothing
FINAL_BYTES = 1 << 20  # at most this much in the node's last message; older text is skipped


class LogTail:
    """Reads ``path`` from where the last :meth:`take` stopped."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._offset = 0
        self._lock = threading.Lock()

    def take(self, *, final: bool = False) -> str:
        """The log's new whole lines (``final``: everything new, a last partial line
        included), as text; ``""`` when there is none."""
        with self._lock:
            try:
                size = os.path.getsize(self._path)
            except OSError:
                return ""
            new = size - self._offset
            if new <= 0:
                return ""
            note = ""
            if final and new > FINAL_BYTES:
                note = f"[... {new - FINAL_BYTES} bytes of this node's log not forwarded ...]\n"
                self._offset = size - FINAL_BYTES
            limit = FINAL_BYTES if final else BEAT_BYTES
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read(min(size - self._offset, limit))
            if not final:
                cut = data.rfind(b"\n")
                if cut >= 0:
                    data = data[: cut + 1]
                elif len(data) < limit:
                    return ""  # a line still being written: it goes with the next beat
            self._offset += len(data)
            return note + data.decode("utf-8", "replace")
