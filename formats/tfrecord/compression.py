"""TFRecord compression: the names TensorFlow accepts, and GZIP / ZLIB streams read and written
as TensorFlow does (one stream covering the whole file)."""

from __future__ import annotations

import gzip
import io
import zlib
from typing import BinaryIO

__all__ = ["COMPRESSIONS", "normalize_compression", "compression_suffix", "open_compressed"]

COMPRESSIONS = ("GZIP", "ZLIB")
_READ_CHUNK = 1 << 20  # compressed bytes read at a time, and the buffered streams' size


def normalize_compression(compression: str | None) -> str | None:
    """``"GZIP"``, ``"ZLIB"`` or ``None`` from any spelling (``"gzip"``, ``""``, ``"NONE"``).

    Raises:
        ValueError: an unknown compression name.
    """
    if compression is None:
        return None
    if not isinstance(compression, str):
        raise ValueError(f"compression must be a string or None, got {compression!r}.")
    name = compression.strip().upper()
    if name in ("", "NONE"):
        return None
    if name in ("GZ", "GZIP"):
        return "GZIP"
    if name == "ZLIB":
        return "ZLIB"
    raise ValueError(
        f"unknown TFRecord compression {compression!r}; use one of None, 'GZIP' or 'ZLIB' "
        f"(the names tf.data.TFRecordDataset accepts)."
    )


def compression_suffix(compression: str | None) -> str:
    """File name suffix for a compression: ``".gz"``, ``".zlib"`` or ``""``."""
    return {None: "", "GZIP": ".gz", "ZLIB": ".zlib"}[normalize_compression(compression)]


class _ZlibReader(io.RawIOBase):
    """Read side of one zlib stream (what TF writes for compression_type="ZLIB")."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._dec = zlib.decompressobj()
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        while not self._pending:
            if self._dec.eof:
                return 0
            chunk = self._raw.read(_READ_CHUNK)
            if not chunk:
                self._pending = self._dec.flush()
                if not self._pending:
                    if not self._dec.eof and self._dec.unused_data == b"":
                        # stream ended before the zlib trailer
                        raise EOFError("ZLIB stream ended before its end-of-stream marker")
                    return 0
                break
            self._pending = self._dec.decompress(chunk)
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


class _ZlibWriter(io.RawIOBase):
    """Write side of one zlib stream; ``close`` writes the trailer but leaves ``raw`` open."""

    def __init__(self, raw: BinaryIO, level: int = 6) -> None:
        self._raw = raw
        self._comp = zlib.compressobj(level)

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self._raw.write(self._comp.compress(b))
        return len(b)

    def close(self) -> None:
        if not self.closed:
            self._raw.write(self._comp.flush())
        super().close()


def open_compressed(raw_stream: BinaryIO, compression: str | None, *, mode: str = "rb") -> BinaryIO:
    """Wrap a binary stream so that reads decompress / writes compress as TF does.

    Args:
        raw_stream: an open binary file-like (local file, ``pyarrow.fs`` stream...).
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None`` (any case).
        mode: ``"rb"`` or ``"wb"``.

    Returns:
        A binary file-like. Closing it finishes the compressed stream but does not close
        ``raw_stream`` (except for ``None``, where ``raw_stream`` itself is returned).
    """
    if mode not in ("rb", "wb"):
        raise ValueError(f"mode must be 'rb' or 'wb', got {mode!r}.")
    comp = normalize_compression(compression)
    if comp is None:
        return raw_stream
    if comp == "GZIP":
        return gzip.GzipFile(fileobj=raw_stream, mode=mode)  # type: ignore[return-value]
    if mode == "rb":
        return io.BufferedReader(_ZlibReader(raw_stream), buffer_size=_READ_CHUNK)  # type: ignore[return-value]
    return io.BufferedWriter(_ZlibWriter(raw_stream), buffer_size=_READ_CHUNK)  # type: ignore[return-value]
