"""What a node has written to its log that the driver has not seen yet.

A node's stdout and stderr (the user's prints, Keras' progress lines, TensorFlow's own log)
go to ``node.log`` in its work directory, which is removed when the node exits. With
``run(log_to_driver=True)`` the node sends the new part of that file with each heartbeat, and
the rest with its last message, and the driver prints it (:mod:`dataplane.driver.control`).
"""

from __future__ import annotations

import os
import threading

__all__ = ["LogTail", "clip", "file_tail", "skipped_note"]

BEAT_BYTES = 256 << 10  # at most this much per heartbeat; a chattier node lags, losing nothing
FINAL_BYTES = 1 << 20  # at most this much in the node's last message; older text is skipped


def skipped_note(nbytes: int) -> str:
    """The line printed where ``nbytes`` of a node's log were not forwarded."""
    return (f"[... {nbytes} bytes of this node's log were not forwarded (it wrote faster than "
            f"the heartbeats carry, {BEAT_BYTES >> 10} KiB each) ...]\n")


def clip(text: str, limit: int = FINAL_BYTES) -> str:
    """``text`` cut to its last ``limit`` characters or so, from a whole line on, with a note
    of what was cut in front."""
    if len(text) <= limit:
        return text
    start = text.find("\n", len(text) - limit) + 1
    return skipped_note(start) + text[start:]


def file_tail(path: str, n: int = 4000) -> str:
    """The last ``n`` bytes or so of the file at ``path``, decoded, from a whole line on when
    it is longer; ``"(no node log)"`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no node log)"
    if size > n and "\n" in text:
        text = text[text.index("\n") + 1:]
    return text


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
            skipped = 0
            room = FINAL_BYTES - 1024  # (the note must fit beside the text)
            if final and new > room:
                skipped = new - room
                self._offset = size - room
            limit = room if final else BEAT_BYTES
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read(min(size - self._offset, limit))
            if skipped:  # from the first whole line on: no line arrives cut
                start = data.find(b"\n") + 1
                skipped += start
                self._offset += start
                data = data[start:]
            note = skipped_note(skipped) if skipped else ""
            if not final:
                cut = data.rfind(b"\n")
                if cut >= 0:
                    data = data[: cut + 1]
                elif len(data) < limit:
                    return ""  # a line still being written: it goes with the next beat
            self._offset += len(data)
            return note + data.decode("utf-8", "replace")
