"""Hive-style partition directories: columns whose values live in paths, not in the files.

``df.write.partitionBy("day").parquet(root)`` writes ``root/day=0/part-....parquet`` and leaves
``day`` out of the files; readers (Spark, pyarrow) give it back as a column. :func:`hive_columns`
finds such keys below a data set's root, with one value per file, and :func:`add_constant_columns`
puts them into the batches read from that file.

Types are inferred as Spark infers them, narrowed to what TensorFlow holds: ``int64`` when every
value is an integer, ``float64`` when every value is a number, otherwise ``string`` (dates stay
strings such as ``"2024-01-31"``). ``__HIVE_DEFAULT_PARTITION__`` (Spark's directory for a null
key) is a null. Values are unescaped as Spark escapes them (``%2F`` is ``/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence
from urllib.parse import unquote

import pyarrow as pa

from formats.errors import SchemaError

__all__ = ["HIVE_NULL", "HiveColumns", "hive_columns", "add_constant_columns"]

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


@dataclass(frozen=True)
class HiveColumns:
    """The partition columns of a data set.

    Attributes:
        fields: one Arrow field per key, in directory order (outermost first).
        values: per file path, ``{key: pa.Scalar}`` (a null scalar for Spark's null directory).
    """

    fields: tuple[pa.Field, ...] = ()
    values: Mapping[str, Mapping[str, pa.Scalar]] | None = None

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def __bool__(self) -> bool:
        return bool(self.fields)

    def in_files(self, names: Sequence[str]) -> list[str]:
        """The ``names`` that are read from the files: all but the partition keys."""
        keys = set(self.names)
        return [n for n in names if n not in keys]


def _keys(path: str, prefix: str) -> list[tuple[str, str]]:
    rel = path[len(prefix):] if path.startswith(prefix) else ""
    out = []
    for part in rel.split("/")[:-1]:
        key, eq, value = part.partition("=")
        if eq and key:
            out.append((unquote(key), unquote(value)))
    return out


def _infer(values: Sequence[str | None]) -> pa.DataType:
    present = [v for v in values if v is not None]
    for typ, parse in ((pa.int64(), int), (pa.float64(), float)):
        try:
            for v in present:
                parse(v)
        except ValueError:
            continue
        if present:
            return typ
    return pa.string()


def hive_columns(files: Sequence[str], root: str, file_columns: Sequence[str], display=str) -> HiveColumns:
    """The ``key=value`` directories between ``root`` and each of ``files``, as columns.

    Keys that are also a column inside the files are left to the files. A single file (no
    directories below ``root``) has none.

    Raises:
        SchemaError: files sit under different keys (``a=1/b=2/x`` next to ``a=1/y``); names both.
    """
    prefix = root.rstrip("/") + "/"
    per_file = {f: _keys(f, prefix) for f in files}
    if not files:
        return HiveColumns()
    first = files[0]
    order = [k for k, _ in per_file[first]]
    for f in files[1:]:
        keys = [k for k, _ in per_file[f]]
        if keys != order:
            raise SchemaError(
                f"{display(f)} sits under the partition keys {keys} but {display(first)} under "
                f"{order}; every file of a partitioned data set must sit under the same "
                f"key=value directories. Move the odd file out, or read one partition directory."
            )
    keys = [k for k in order if k not in set(file_columns)]
    if not keys:
        return HiveColumns()
    raw = {f: {k: (None if v == HIVE_NULL else v) for k, v in per_file[f]} for f in files}
    types = {k: _infer([raw[f][k] for f in files]) for k in keys}
    values = {}
    for f in files:
        row = {}
        for k in keys:
            v = raw[f][k]
            if v is not None and types[k] == pa.int64():
                v = int(v)
            elif v is not None and types[k] == pa.float64():
                v = float(v)
            row[k] = pa.scalar(v, type=types[k])
        values[f] = row
    fields = tuple(pa.field(k, types[k], nullable=any(raw[f][k] is None for f in files)) for k in keys)
    return HiveColumns(fields, values)


def add_constant_columns(
    data: pa.RecordBatch | pa.Table, consts: Mapping[str, pa.Scalar], names: Sequence[str]
) -> pa.RecordBatch | pa.Table:
    """``data`` with ``names`` in that order, those in ``consts`` made of their one value."""
    n = data.num_rows
    arrays = [
        pa.repeat(consts[name], n) if name in consts else data.column(name) for name in names
    ]
    if isinstance(data, pa.Table):
        return pa.Table.from_arrays(arrays, names=list(names))
    return pa.RecordBatch.from_arrays(arrays, names=list(names))
