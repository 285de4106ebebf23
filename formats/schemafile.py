"""The schema file written beside TFRecord output: ``_tf_schema.json``.

It tells readers how to parse the records without guessing: per column the TF dtype, per-row
shape (``null`` for ragged dimensions; a list column whose lists all had one length is written
dense, see :mod:`formats.staging`), ragged rank, the Example feature kind, the original Arrow
type (readable text plus the exact type in the serialized Arrow schema) and how many nulls were
written (absent features, see the null rule in :mod:`formats.example`). With it,
``formats.read_tfrecords`` restores Spark types (``string`` vs ``binary``, timestamps, dates,
narrow ints) and plain TensorFlow can build its ``tf.io.parse_example`` spec::

    {"format": "tf.train.Example", "version": 1, "compression": "GZIP",
     "num_rows": 1000, "files": [{"path": "part-00000.tfrecord.gz", "rows": 500, "bytes": 9000}],
     "columns": [{"name": "image", "dtype": "float32", "shape": [784], "ragged_rank": 0,
                  "feature": "float", "arrow_type": "fixed_size_list<item: float>[784]",
                  "null_count": 0}, ...],
     "arrow_schema": "<base64 Arrow IPC schema>", "spark_schema": {...}}

The file lives with the data, so it is read and written through the same ``pyarrow.fs``
filesystem (local, S3, HDFS).
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import pyarrow as pa

from formats.errors import SchemaError, StorageError
from formats.features import feature_kind
from formats.schema import ColumnSpec

__all__ = [
    "SCHEMA_FILE_NAME",
    "TFRecordSchema",
    "write_schema_file",
    "read_schema_file",
    "find_schema_file",
    "empty_export",
]

SCHEMA_FILE_NAME = "_tf_schema.json"
_VERSION = 1


@dataclass
class TFRecordSchema:
    """What the schema file holds.

    Attributes:
        specs: one :class:`ColumnSpec` per column, each with its ``arrow_type``.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``None`` for every data file.
        num_rows: rows in all files (``None`` when unknown).
        files: ``{"path": name relative to the directory, "rows": n, "bytes": n}`` per file.
        null_counts: nulls written per column (absent features).
        spark_schema: the Spark ``StructType.jsonValue()`` of the exported DataFrame, if any.
    """

    specs: list[ColumnSpec]
    compression: str | None = None
    num_rows: int | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    null_counts: dict[str, int] = field(default_factory=dict)
    spark_schema: dict[str, Any] | None = None

    @property
    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema of the columns (their original types)."""
        return pa.schema(
            [pa.field(s.name, s.arrow_type if s.arrow_type is not None else pa.null()) for s in self.specs]
        )

    def to_json(self) -> dict[str, Any]:
        columns = []
        for s in self.specs:
            columns.append(
                {
                    "name": s.name,
                    "dtype": s.dtype,
                    "shape": list(s.shape),
                    "ragged_rank": s.ragged_rank,
                    "feature": feature_kind(s.dtype),
                    "arrow_type": str(s.arrow_type) if s.arrow_type is not None else None,
                    "null_count": int(self.null_counts.get(s.name, 0)),
                }
            )
        typed = pa.schema([pa.field(s.name, s.arrow_type) for s in self.specs if s.arrow_type is not None])
        out: dict[str, Any] = {
            "format": "tf.train.Example",
            "version": _VERSION,
            "compression": self.compression,
            "num_rows": self.num_rows,
            "files": list(self.files),
            "columns": columns,
            "arrow_schema": base64.b64encode(typed.serialize().to_pybytes()).decode("ascii"),
        }
        if self.spark_schema is not None:
            out["spark_schema"] = self.spark_schema
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any], *, where: str = "schema file") -> "TFRecordSchema":
        try:
            if doc.get("format") != "tf.train.Example":
                raise ValueError(f"format is {doc.get('format')!r}, expected 'tf.train.Example'")
            if int(doc.get("version", 0)) > _VERSION:
                raise ValueError(
                    f"version {doc['version']} is newer than this reader ({_VERSION}); upgrade "
                    f"spark-tf-dataplane"
                )
            types: dict[str, pa.DataType] = {}
            if doc.get("arrow_schema"):
                schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(doc["arrow_schema"])))
                types = {f.name: f.type for f in schema}
            specs = []
            nulls = {}
            for col in doc["columns"]:
                shape = tuple(None if d is None else int(d) for d in col.get("shape", []))
                specs.append(
                    ColumnSpec(
                        str(col["name"]),
                        str(col["dtype"]),
                        shape,
                        int(col.get("ragged_rank", 0)),
                        None,
                        types.get(col["name"]),
                    )
                )
                nulls[col["name"]] = int(col.get("null_count", 0))
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise SchemaError(
                f"{where} is not a valid TFRecord schema file: {exc}. Rewrite the data with "
                f"formats.write_tfrecords, or delete the file to let the schema be inferred."
            ) from exc
        return cls(
            specs=specs,
            compression=doc.get("compression"),
            num_rows=doc.get("num_rows"),
            files=list(doc.get("files", [])),
            null_counts=nulls,
            spark_schema=doc.get("spark_schema"),
        )


def _fs_path(path: str | os.PathLike, filesystem: Any) -> tuple[Any, str]:
    from pyarrow import fs as pafs

    path = os.fspath(path)
    if filesystem is not None:
        if "://" in path:
            path = path.split("://", 1)[1]
        return filesystem, path
    if "://" in path and not path.startswith("file://"):
        return pafs.FileSystem.from_uri(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _file_path(fs: Any, path: str) -> str:
    from pyarrow import fs as pafs

    if path.endswith(".json"):
        return path
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return path
    return path.rstrip("/") + "/" + SCHEMA_FILE_NAME


def write_schema_file(
    path: str | os.PathLike, schema: TFRecordSchema | Sequence[ColumnSpec], *, filesystem: Any = None
) -> str:
    """Write the schema file into directory ``path`` (or to ``path`` if it ends in ``.json``).

    Args:
        path: the TFRecord output directory (local path or URL), or the file itself.
        schema: a :class:`TFRecordSchema`, or just the column specs.
        filesystem: a ``pyarrow.fs.FileSystem`` to write with (default: from the path).

    Returns:
        The path written (on the filesystem).
    """
    if not isinstance(schema, TFRecordSchema):
        schema = TFRecordSchema(specs=list(schema))
    fs, p = _fs_path(path, filesystem)
    target = _file_path(fs, p)
    data = json.dumps(schema.to_json(), indent=1).encode("utf-8")
    try:
        with fs.open_output_stream(target, compression=None) as out:
            out.write(data)
    except OSError as exc:
        raise StorageError(f"cannot write the schema file {target}: {exc}") from exc
    return target


def read_schema_file(path: str | os.PathLike, *, filesystem: Any = None) -> TFRecordSchema:
    """Read the schema file in directory ``path`` (or the ``.json`` file ``path`` itself).

    Raises:
        StorageError: there is no schema file there.
        SchemaError: the file is not a valid schema file.
    """
    fs, p = _fs_path(path, filesystem)
    target = _file_path(fs, p)
    try:
        with fs.open_input_stream(target, compression=None) as f:
            raw = f.read()
    except (OSError, FileNotFoundError) as exc:
        raise StorageError(
            f"no TFRecord schema file at {target} ({exc}). Write the data with "
            f"formats.write_tfrecords (it writes {SCHEMA_FILE_NAME}), or pass schema=."
        ) from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"schema file {target} is not JSON: {exc}") from exc
    return TFRecordSchema.from_json(doc, where=target)


def find_schema_file(directory: str | os.PathLike, *, filesystem: Any = None) -> TFRecordSchema | None:
    """The schema file in ``directory`` if there is one, else ``None``."""
    from pyarrow import fs as pafs

    fs, p = _fs_path(directory, filesystem)
    target = _file_path(fs, p)
    if fs.get_file_info(target).type != pafs.FileType.File:
        return None
    return read_schema_file(target, filesystem=fs)


def empty_export(directory: str | os.PathLike, *, filesystem: Any = None) -> TFRecordSchema | None:
    """The schema file of ``directory`` when it records an export of no rows, else ``None``.

    An empty DataFrame exports as its schema file alone (``num_rows`` 0), which readers take
    for zero rows; a schema file that records rows while its data files are gone is not that,
    and readers let the missing files' error through. Unreadable paths give ``None`` too (the
    caller's listing error says why)."""
    from pyarrow import fs as pafs

    try:
        fs, p = _fs_path(directory, filesystem)
        if fs.get_file_info(p).type != pafs.FileType.Directory:
            return None
        found = find_schema_file(p, filesystem=fs)
    except (OSError, ValueError):
        return None
    return found if found is not None and found.num_rows == 0 else None
