"""Reusable memory for buffers handed to code that may keep them: reuse by reference count.

A fresh buffer of a megabyte or more per read, or per batch of decoded values, is mapped and
unmapped by glibc each time when it is allocated on one of TensorFlow's threads, and its page
faults cost more than the work done in it (measured on these VMs: about 16,000 faults and 30 ms
more per pass over 20,000 MNIST records, 2 cores). A :class:`BufferPool` keeps the buffers and
hands one out again only when nothing outside the pool refers to it any more.

Every array handed out is a view of one of the pool's buffers, and numpy points every view of a
view (slices, ``view``, ``reshape``, ``frombuffer`` of a ``memoryview``) at the buffer that owns
the memory, so the buffer's reference count includes every view alive anywhere: a tensor that
TensorFlow made from it without copying (it holds a reference for as long as the tensor lives),
a batch still in a prefetch queue, records still to be decoded. Memory is never written while a
view of it is alive.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

__all__ = ["BufferPool"]

_ALIGN = 64  # TensorFlow wraps numpy arrays aligned this way without copying them


class BufferPool:
    """Byte buffers (and arrays over them), reused once unreferenced. Thread-safe; picklable
    (a pickled pool arrives empty)."""

    LIMIT = 64  # buffers kept per size; beyond that, buffers are allocated and not kept

    def __init__(self) -> None:
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, 64-byte aligned uint8 array of ``nbytes`` (contents undefined)."""
        with self._lock:
            kept = self._buffers.setdefault(nbytes, [])
            buffer = None
            for candidate in kept:
                # Unused: referred to only by the list, this loop variable and the argument.
                if sys.getrefcount(candidate) <= 3:
                    buffer = candidate
                    break
            if buffer is None:
                buffer = np.empty(nbytes + _ALIGN, dtype=np.uint8)
                if len(kept) < self.LIMIT:
                    kept.append(buffer)
        skip = -buffer.ctypes.data % _ALIGN
        return buffer[skip : skip + nbytes]

    def take_array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A writable, 64-byte aligned C-contiguous array (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.take(nbytes).view(dtype).reshape(shape)

    def kept(self) -> int:
        """Buffers the pool holds, in use or not."""
        with self._lock:
            return sum(map(len, self._buffers.values()))
