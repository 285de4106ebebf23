"""Which column chunks the page reader takes: a chunk's place and storage from the footer,
and :class:`PagesRefused`, the one signal every part of the reader gives for a chunk it leaves to
pyarrow."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PagesRefused", "ChunkLayout", "chunk_layout"]

_PHYSICAL = {"FLOAT": np.dtype("<f4"), "DOUBLE": np.dtype("<f8"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8")}
# Codecs whose output length can be proven: pyarrow's ``decompress`` returns a buffer of the
# size asked for even when the data decompress to fewer bytes (the rest uninitialised), except
# for zstd, which fails. Snappy streams start with their length and a gzip member ends with it,
# and both decoders fail unless they produce exactly that. Brotli and LZ4_RAW say nothing, so
# pages compressed with them are left to Arrow.
_CODECS = {"SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd"}


class PagesRefused(Exception):
    """This column chunk is not one the page reader decodes; read it with pyarrow instead."""


@dataclass(frozen=True)
class ChunkLayout:
    """Where one column chunk lies and how it is stored (from the file's footer)."""

    start: int
    length: int
    codec: str | None  # pyarrow Codec name; None for UNCOMPRESSED
    num_values: int
    dtype: np.dtype
    max_def: int  # the repetition level's maximum is 1: checked by chunk_layout


def chunk_layout(metadata: Any, row_group: int, column: str, dtype: Any) -> ChunkLayout:
    """The layout of ``column``'s chunk in ``row_group``, if it is a one-level list of ``dtype``.

    Raises:
        PagesRefused: the column is nested deeper, has another physical type or codec.
    """
    schema = metadata.schema
    leaf = None
    for i in range(metadata.num_columns):
        path = schema.column(i).path
        if path.split(".")[0] == column:
            if leaf is not None:
                raise PagesRefused(f"column {column!r} has several leaf columns")
            leaf = i
    if leaf is None:
        raise PagesRefused(f"no leaf column for {column!r}")
    desc = schema.column(leaf)
    if desc.max_repetition_level != 1:
        raise PagesRefused(f"{desc.path} has repetition level {desc.max_repetition_level}, not 1")
    physical = _PHYSICAL.get(desc.physical_type)
    if physical is None or physical != np.dtype(dtype).newbyteorder("<"):
        raise PagesRefused(f"{desc.path} is stored as {desc.physical_type}, not as {np.dtype(dtype)}")
    logical = desc.logical_type
    if logical.type != "NONE":
        info = json.loads(logical.to_json())
        if logical.type != "INT" or not info.get("isSigned") or info.get("bitWidth") != 8 * physical.itemsize:
            raise PagesRefused(f"{desc.path} has logical type {logical}")
    col = metadata.row_group(row_group).column(leaf)
    compression = col.compression.upper()
    if compression == "UNCOMPRESSED":
        codec = None
    elif compression in _CODECS:
        codec = _CODECS[compression]
    else:
        raise PagesRefused(f"{desc.path} is compressed with {compression}")
    start = col.data_page_offset
    if col.has_dictionary_page and 0 < col.dictionary_page_offset < start:
        start = col.dictionary_page_offset
    return ChunkLayout(
        start=int(start),
        length=int(col.total_compressed_size),
        codec=codec,
        num_values=int(col.num_values),
        dtype=physical,
        max_def=int(desc.max_definition_level),
    )
