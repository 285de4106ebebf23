"""Paths and URLs to ``pyarrow.fs`` filesystems, kept importable from here.

The helpers live in :mod:`formats.fs`, the lowest package that reads files (the export jobs of
``formats`` list and open them too); this module re-exports every public name.
"""

from __future__ import annotations

from formats.fs import (
    PARQUET_SUFFIXES,
    Location,
    download,
    hdfs_filesystem,
    hdfs_problems,
    list_files,
    listing_root,
    local_copy,
    parquet_files,
    resolve,
    s3_filesystem,
    storage_error,
    through_pyarrow,
    upload,
    write_text_atomic,
)

__all__ = [
    "Location",
    "through_pyarrow",
    "upload",
    "download",
    "local_copy",
    "resolve",
    "list_files",
    "parquet_files",
    "PARQUET_SUFFIXES",
    "listing_root",
    "s3_filesystem",
    "hdfs_filesystem",
    "hdfs_problems",
    "storage_error",
    "write_text_atomic",
]
