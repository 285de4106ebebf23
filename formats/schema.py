"""The one Arrow <-> TensorFlow type mapping that every data path uses.

The mapping is decided from the Arrow schema alone (plus optional declared shapes), column by
column, into a :class:`ColumnSpec`. Push (``feeders.source``), the pull readers and the TFRecord
coders all go through :func:`column_specs`, so one table gives the same tensors whichever way it
reaches TensorFlow.

=============================  ==============================================================
Arrow type                     TensorFlow
=============================  ==============================================================
bool, int*, uint*, float*      scalar of the same dtype, shape ``[batch]``
fixed_size_list<T>[n]          dense ``[batch, n]`` (nested fixed lists add dimensions)
list<T> / large_list<T>        ragged ``[batch, None]``; dense ``[batch, *shape]`` when a shape
                               is declared for the column (``shapes={"img": (28, 28)}``)
string / binary (and large_)   ``tf.string``
dictionary<T>                  decoded to T
timestamp[unit]                int64 microseconds since the UTC epoch, whatever the unit
date32                         int32 days since the epoch
struct<a: T, ...>              only with ``flatten_structs=True``: one column per leaf field,
                               named ``"parent.child"``; otherwise a SchemaError
map, decimal, anything else    SchemaError naming the column and the fix (cast / split)
=============================  ==============================================================

Nested lists become ragged tensors with one ragged dimension per variable-length list level
(``list<list<float>>`` -> ``ragged_rank`` 2, shape ``(None, None)``). Timestamps of every unit
become microseconds, Spark's unit (nanoseconds floored; :func:`timestamps_as_micros`); the time
zone is dropped (values are counts since the UTC epoch). ``ColumnSpec.arrow_type`` remembers the
original Arrow type so that readers (``formats.read_tfrecords``) can restore it, e.g. to keep
``string`` and ``binary`` apart.

Nothing here imports TensorFlow at module import time; :func:`tf_spec` imports it when called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from formats.errors import SchemaError

__all__ = [
    "same_columns",
    "schema_text",
    "ColumnSpec",
    "RaggedColumn",
    "column_specs",
    "untensorable_columns",
    "check_unique_names",
    "column_array",
    "list_offsets",
    "declare_shapes",
    "list_lengths",
    "uniform_shape",
    "list_depth",
    "is_list_type",
    "list_levels",
    "leaf_values",
    "check_fill_value",
    "mapping_arg",
    "names_arg",
    "fill_example",
    "flatten_struct_fields",
    "tf_spec",
    "to_numpy",
    "timestamps_as_micros",
]

# How Spark writes a pyspark.ml.linalg vector (VectorUDT) into Parquet / Arrow.
_SPARK_VECTOR_FIELDS = ("type", "size", "indices", "values")

_SCALAR_DTYPES = {
    pa.bool_(): "bool",
    pa.int8(): "int8",
    pa.int16(): "int16",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.uint8(): "uint8",
    pa.uint16(): "uint16",
    pa.uint32(): "uint32",
    pa.uint64(): "uint64",
    pa.float16(): "float16",
    pa.float32(): "float32",
    pa.float64(): "float64",
}


@dataclass(frozen=True)
class ColumnSpec:
    """How one Arrow column becomes one TF tensor.

    Attributes:
        name: column name.
        dtype: numpy/TF dtype name of the elements (``"string"`` for text and bytes).
        shape: per-row shape; ``()`` for scalars, ``None`` entries for ragged dimensions.
        ragged_rank: number of ragged dimensions (0 for dense).
        fill: value that replaces nulls; ``None`` means a null is an error.
        arrow_type: the column's original Arrow type when known (not part of equality); lets
            readers restore it, for example ``binary`` vs ``string`` or a timestamp's unit.
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...] = ()
    ragged_rank: int = 0
    fill: Any = None
    arrow_type: pa.DataType | None = field(default=None, compare=False, repr=False)

    @property
    def is_ragged(self) -> bool:
        return self.ragged_rank > 0


class RaggedColumn(NamedTuple):
    """A ragged column as flat values plus one ``row_splits`` array per ragged dimension."""

    values: np.ndarray
    row_splits: tuple[np.ndarray, ...]


def _element_type(name: str, t: pa.DataType, where: str) -> tuple[str, tuple[int | None, ...], int]:
    """Return (dtype, per-row shape, ragged_rank) for an Arrow type, or raise SchemaError."""
    if pa.types.is_dictionary(t):
        return _element_type(name, t.value_type, where)
    if t in _SCALAR_DTYPES:
        return _SCALAR_DTYPES[t], (), 0
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    ):
        return "string", (), 0
    if pa.types.is_timestamp(t):
        return "int64", (), 0
    if pa.types.is_date32(t):
        return "int32", (), 0
    if pa.types.is_fixed_size_list(t):
        dtype, inner, rr = _element_type(name, t.value_type, where)
        return dtype, (t.list_size, *inner), rr
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        dtype, inner, rr = _element_type(name, t.value_type, where)
        return dtype, (None, *inner), rr + 1
    if pa.types.is_decimal(t):
        raise SchemaError(
            f"column {name!r}{where} has type {t}: TensorFlow has no decimal type. "
            f"Cast it first: in Spark df.withColumn({name!r}, col({name!r}).cast('double')); "
            f"in pandas df[{name!r}] = df[{name!r}].astype('float64') before writing the file. "
            f"A float keeps about 15 significant digits; to keep every digit, store a scaled "
            f"integer instead (cents: cast(col * 100 as bigint))."
        )
    if pa.types.is_struct(t) and [f.name for f in t] == list(_SPARK_VECTOR_FIELDS):
        raise SchemaError(
            f"column {name!r}{where} is a Spark ML vector as Spark stores it (a struct of "
            f"{', '.join(_SPARK_VECTOR_FIELDS)}), which TensorFlow cannot read. Write it as an "
            f"array instead: from pyspark.ml.functions import vector_to_array; "
            f"df.withColumn({name!r}, vector_to_array({name!r}, 'float32')) before writing the "
            f"files (push it with cluster.train and it is converted for you)."
        )
    if pa.types.is_struct(t):
        raise SchemaError(
            f"column {name!r}{where} is a struct ({t}): TensorFlow tensors cannot hold structs. "
            f"Select its fields as separate columns, e.g. df.select('{name}.*'); when exporting "
            f"(formats.write_tfrecords / parquet_to_tfrecords, dataplane export "
            f"--flatten-structs), flatten_structs=True writes one '{name}.<field>' column per "
            f"field instead."
        )
    if pa.types.is_map(t):
        raise SchemaError(
            f"column {name!r}{where} is a map ({t}): TensorFlow tensors cannot hold maps. "
            f"Turn it into two list columns with map_keys()/map_values()."
        )
    raise SchemaError(
        f"column {name!r}{where} has Arrow type {t}, which has no TensorFlow equivalent. "
        f"Cast it to a numeric, string or list type before feeding it."
    )


def flatten_struct_fields(schema: pa.Schema) -> pa.Schema:
    """The schema with every struct column replaced by its leaf fields, named ``"a.b"``."""
    out: list[pa.Field] = []

    def add(prefix: str, f: pa.Field) -> None:
        if pa.types.is_struct(f.type):
            for i in range(f.type.num_fields):
                add(f"{prefix}{f.name}.", f.type.field(i))
        else:
            out.append(pa.field(f"{prefix}{f.name}", f.type, nullable=f.nullable))

    for f in schema:
        add("", f)
    return pa.schema(out)


def column_array(data: pa.RecordBatch | pa.Table, name: str) -> pa.Array | pa.ChunkedArray:
    """Column ``name`` of ``data``; a dotted name (``"a.b"``) reaches into struct column ``a``.

    A null struct makes its fields null (the parent's validity is applied to the child).
    """
    idx = data.schema.get_field_index(name)
    if idx >= 0:
        return data.column(idx)
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:cut])
        if data.schema.get_field_index(head) < 0:
            continue
        col = data.column(data.schema.get_field_index(head))
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        rest = parts[cut:]
        out = []
        for chunk in chunks:
            cur = chunk
            i = 0
            while i < len(rest):
                if not pa.types.is_struct(cur.type):
                    break
                # match the longest dotted child name first ("a.b" may itself be a field name)
                for j in range(len(rest), i, -1):
                    child = ".".join(rest[i:j])
                    if cur.type.get_field_index(child) >= 0:
                        cur = cur.flatten()[cur.type.get_field_index(child)]
                        i = j
                        break
                else:
                    break
            if i != len(rest):
                break
            out.append(cur)
        else:
            return out[0] if not isinstance(col, pa.ChunkedArray) else pa.chunked_array(out)
    raise SchemaError(f"column {name!r} is not in the data; the columns are {data.schema.names}.")


def mapping_arg(name: str, value: Any) -> dict[str, Any]:
    """``value`` as a dict of column name -> value, or a ValueError naming the argument.

    For ``shapes=`` / ``fill_values=``-style arguments (``None`` is an empty dict).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            f"{name} must be a dict of column name -> value, got {type(value).__name__} "
            f"{value!r}; e.g. {name}={{'x': 0}}."
        )
    return dict(value)


def fill_example(t: pa.DataType) -> str:
    """A fill value to show in an error's fix, of the column's (leaf) type: ``0``, ``''``,
    ``b''`` or ``False``."""
    while is_list_type(t):
        t = t.value_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "''"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "b''"
    if pa.types.is_boolean(t):
        return "False"
    return "0"


def names_arg(name: str, value: Any) -> list[str]:
    """``value`` (one column name, or a sequence of distinct names) as a list of names.

    For ``features=`` / ``columns=``-style arguments: a wrong type is a TypeError, a name given
    twice a ValueError, each naming the argument. A str is one name, never its characters.
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Sequence) or not all(
        isinstance(c, str) for c in value
    ):
        raise TypeError(f"{name} must be a column name or a list of column names, got {value!r}.")
    names = list(value)
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise ValueError(f"{name} lists column(s) {twice} more than once; name each column once.")
    return names


def check_fill_value(name: str, dtype: str, value: Any) -> None:
    """Raise SchemaError when ``value`` cannot stand in for a null of column ``name`` (``dtype``).

    A number for numeric columns (a bool for bool ones), a str or bytes for string columns:
    checked when the reader is built, not when the first null is met mid-epoch.
    """
    if value is None:
        return
    if dtype == "string":
        ok = isinstance(value, (str, bytes))
        want = "a str or bytes"
    elif dtype == "bool":
        ok = isinstance(value, (bool, np.bool_))
        want = "True or False"
    else:
        ok = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
        if ok and dtype.startswith(("int", "uint")) and not float(value).is_integer():
            ok = False
        want = "an integer" if dtype.startswith(("int", "uint")) else "a number"
        if ok and dtype.startswith(("int", "uint")):
            info = np.iinfo(dtype)
            if not info.min <= int(value) <= info.max:
                raise SchemaError(
                    f"fill value {value!r} for column {name!r} is beyond its type {dtype} "
                    f"({info.min} to {info.max}); give a value in that range, e.g. "
                    f"fill_values={{{name!r}: {0 if dtype.startswith('uint') else -1}}}, or cast "
                    f"the column to a wider type."
                )
    if not ok:
        raise SchemaError(
            f"fill value {value!r} for column {name!r} does not fit its type {dtype}; give "
            f"{want}, e.g. fill_values={{{name!r}: {0 if want != 'a str or bytes' else repr('')}}}."
        )


def column_specs(
    schema: pa.Schema,
    *,
    columns: Sequence[str] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    fill_values: Mapping[str, Any] | None = None,
    flatten_structs: bool = False,
) -> list[ColumnSpec]:
    """Map an Arrow schema to per-column specs.

    Args:
        schema: the Arrow schema of the data.
        columns: keep only these columns, in this order (default: all, in schema order).
        shapes: declared per-row shapes for list columns; turns a ragged list into a dense
            tensor of that shape (rows whose length differs are an error at read time).
        fill_values: value to put in place of nulls per column (default: nulls are an error).
            In a list column it fills null elements, and a null list becomes an empty list
            (ragged levels) or, where the column is dense (a declared shape, or one length
            in every row), a list of that shape holding the value.
        flatten_structs: map each struct column to one column per leaf field, named
            ``"parent.child"`` (default False: a struct column is a SchemaError, because
            silently renaming columns would surprise a model expecting the original names).

    Raises:
        SchemaError: a column is missing, has a type TF cannot hold, or a declared shape does
            not fit the column.
    """
    shapes = mapping_arg("shapes", shapes)
    fill_values = mapping_arg("fill_values", fill_values)
    if flatten_structs:
        schema = flatten_struct_fields(schema)
    names = list(columns) if columns is not None else list(schema.names)
    for extra in list(shapes) + list(fill_values):
        if extra not in names and extra not in schema.names:
            raise SchemaError(
                f"shapes/fill_values name column {extra!r}, which the data does not have; its "
                f"columns are {list(schema.names)}."
            )
    # a column the data has but this read leaves out: nothing to do (one fill_values dict
    # serves reads of different columns=)
    shapes = {k: v for k, v in shapes.items() if k in names}
    fill_values = {k: v for k, v in fill_values.items() if k in names}
    specs = []
    for name in names:
        idx = schema.get_field_index(name)
        if idx < 0 and schema.names.count(name) > 1:
            made = "one made by flatten_structs from a struct's field" if flatten_structs else ""
            raise _duplicate_name(schema.names, name, "in the data", made)
        if idx < 0:
            raise SchemaError(
                f"column {name!r} is not in the data; the columns are {schema.names}."
            )
        arrow_type = schema.field(idx).type
        dtype, shape, rr = _element_type(name, arrow_type, "")
        if name in shapes:
            shape, rr = _declared_shape(name, shapes[name], shape), 0
        check_fill_value(name, dtype, fill_values.get(name))
        specs.append(ColumnSpec(name, dtype, shape, rr, fill_values.get(name), arrow_type))
    return specs


def check_unique_names(schema: pa.Schema, what: str) -> None:
    """Raise SchemaError if a column name appears more than once (a join's ``select(a.x, b.x)``):
    each column becomes the tensor of its name. ``what`` says what sends the columns."""
    names = list(schema.names)
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _duplicate_name(names, dup, f"in the DataFrame {what}")


def _duplicate_name(names: Sequence[str], dup: str, where: str, cause: str = "") -> SchemaError:
    """The one message for a column name held by several columns: where they are and the
    rename-by-position call that gives each its own name."""
    at = [i for i, n in enumerate(names) if n == dup]
    renamed = ", ".join(repr(f"{n}_{at.index(i) + 1}" if n == dup else n) for i, n in enumerate(names))
    return SchemaError(
        f"column name {dup!r} appears {len(at)} times {where} (at positions {at}; "
        f"{cause or 'a join keeps a column of each side'}), but each column becomes the tensor of its name. Give each its "
        f"own name first: in Spark df.toDF({renamed}) renames by position (withColumnRenamed "
        f"and drop would take both); in pyarrow table.rename_columns([{renamed}])."
    )


def untensorable_columns(schema: pa.Schema, names: Sequence[str] | None = None) -> list[tuple[str, SchemaError]]:
    """The columns of ``schema`` (``names``, default all, in that order) that no tensor can
    hold, each with the :class:`SchemaError` saying why and how to convert it."""
    bad: list[tuple[str, SchemaError]] = []
    for name in schema.names if names is None else names:
        try:
            column_specs(pa.schema([schema.field(name)]))
        except SchemaError as e:
            bad.append((name, e))
    return bad


def _declared_shape(name: str, raw: Any, shape: tuple[int | None, ...]) -> tuple[int, ...]:
    """``shapes[name]`` checked against the column's own per-row ``shape``."""
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in raw
    ):
        raise ValueError(
            f"shapes[{name!r}] must be a list of ints (the per-row shape), got {raw!r}; "
            f"e.g. shapes={{{name!r}: [28, 28]}}."
        )
    declared = tuple(int(d) for d in raw)
    if len(shape) == 0:
        raise SchemaError(
            f"column {name!r} is a scalar, but shape {declared} was declared for it; "
            f"shapes only apply to list columns."
        )
    if math.prod(declared) <= 0:
        raise SchemaError(f"declared shape {declared} for column {name!r} is empty.")
    return declared


def declare_shapes(specs: Sequence[ColumnSpec], shapes: Mapping[str, Sequence[int]] | None) -> list[ColumnSpec]:
    """``specs`` with the list columns named in ``shapes`` made dense with those per-row shapes.

    Raises:
        SchemaError: ``shapes`` names a column not in ``specs``, or a scalar column.
        ValueError: a shape is not a list of positive ints.
    """
    from dataclasses import replace

    shapes = mapping_arg("shapes", shapes)
    names = [s.name for s in specs]
    for extra in shapes:
        if extra not in names:
            raise SchemaError(
                f"shapes name column {extra!r}, which is not among the columns read: {names}."
            )
    out = []
    for s in specs:
        if s.name in shapes and shapes[s.name] is None:  # ragged: as read unless files say dense
            if not s.is_ragged:
                raise SchemaError(
                    f"shapes[{s.name!r}] is None (ragged), but the data declares column "
                    f"{s.name!r} dense with shape {s.shape}; leave it out of shapes."
                )
            out.append(s)
        elif s.name in shapes:
            out.append(replace(s, shape=_declared_shape(s.name, shapes[s.name], s.shape), ragged_rank=0))
        else:
            out.append(s)
    return out


def tf_spec(
    arrow_schema: pa.Schema,
    *,
    columns: Sequence[str] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    flatten_structs: bool = False,
) -> dict[str, Any]:
    """``{column: tf.TensorSpec | tf.RaggedTensorSpec}`` with a leading unknown batch dimension.

    Raises:
        SchemaError: as :func:`column_specs`, naming the column TF cannot hold.
    """
    import tensorflow as tf  # noqa: PLC0415 - only callers that build tensors pay for TF

    out: dict[str, Any] = {}
    specs = column_specs(
        arrow_schema, columns=columns, shapes=shapes, flatten_structs=flatten_structs
    )
    for spec in specs:
        dtype = tf.string if spec.dtype == "string" else tf.as_dtype(spec.dtype)
        shape = (None, *spec.shape)
        if spec.is_ragged:
            out[spec.name] = tf.RaggedTensorSpec(shape, dtype, ragged_rank=spec.ragged_rank)
        else:
            out[spec.name] = tf.TensorSpec(shape, dtype, name=spec.name)
    return out


_MICROS_PER = {"s": 1_000_000, "ms": 1_000, "us": 1}


INT96_UNIT = "us"
"""The unit every Parquet reader here gives Spark's legacy INT96 timestamps (pyarrow's
``coerce_int96_timestamp_unit``): microseconds, as Spark reads them. pyarrow's default,
nanoseconds, wraps around outside 1677-2262 without a word (9999-12-31, a common "no end"
date, read as 1816)."""


def parquet_arrow_schema(metadata: Any) -> pa.Schema:
    """The Arrow schema of a Parquet footer (``pyarrow.parquet.FileMetaData``) as the readers
    here read the file: INT96 timestamps in :data:`INT96_UNIT`, at any depth."""
    schema = metadata.schema.to_arrow_schema()
    pschema = metadata.schema
    int96 = {i for i in range(len(pschema)) if pschema.column(i).physical_type == "INT96"}
    if not int96:
        return schema
    leaves = iter(range(len(pschema)))  # Arrow's leaves in Parquet's column order

    def fix(t: pa.DataType) -> pa.DataType:
        if pa.types.is_struct(t):
            return pa.struct([t.field(i).with_type(fix(t.field(i).type)) for i in range(t.num_fields)])
        if pa.types.is_map(t):
            return pa.map_(t.key_field.with_type(fix(t.key_type)), t.item_field.with_type(fix(t.item_type)))
        if pa.types.is_fixed_size_list(t):
            return pa.list_(t.value_field.with_type(fix(t.value_type)), t.list_size)
        if pa.types.is_large_list(t):
            return pa.large_list(t.value_field.with_type(fix(t.value_type)))
        if pa.types.is_list(t):
            return pa.list_(t.value_field.with_type(fix(t.value_type)))
        leaf = next(leaves)
        if leaf in int96 and pa.types.is_timestamp(t):
            return pa.timestamp(INT96_UNIT, t.tz)
        return t

    fields = [f.with_type(fix(f.type)) for f in schema]
    return pa.schema(fields, metadata=schema.metadata)


def timestamps_as_micros(name: str, arr: pa.Array) -> pa.Array:
    """A timestamp array in microseconds (``timestamp[us]``, same time zone), whatever its unit.

    Spark holds every timestamp in microseconds, so this is the one unit TensorFlow sees from
    every path: a Parquet file written by pandas (nanoseconds) or with milliseconds reads as the
    same numbers as its Spark export. Nanoseconds are floored to the microsecond, as Spark and
    numpy do; a seconds or milliseconds value beyond int64 microseconds raises SchemaError.
    """
    t = arr.type
    if t.unit == "us":
        return arr
    ints = arr.cast(pa.int64())
    mask = ints.is_null().to_numpy(zero_copy_only=False) if ints.null_count else None
    values = ints.fill_null(0).to_numpy(zero_copy_only=False) if ints.null_count else ints.to_numpy()
    if t.unit == "ns":
        micros = values // 1000
    else:
        factor = _MICROS_PER[t.unit]
        limit = np.iinfo(np.int64).max // factor
        over = np.abs(values) > limit
        if over.any():
            raise SchemaError(
                f"column {name!r} holds timestamp {int(values[np.argmax(over)])} ({t.unit} since "
                f"the epoch), beyond what int64 microseconds (the unit TensorFlow gets, as in "
                f"Spark) can hold; filter the row or cast the column before reading."
            )
        micros = values * factor
    return pa.array(micros, type=pa.timestamp("us", tz=t.tz), mask=mask)


def _flat_values(name: str, arr: pa.Array, spec: ColumnSpec, *, elements: bool = False) -> np.ndarray:
    """Leaf values of a (possibly nested list) array as a numpy array of spec.dtype
    (``elements``: ``arr`` holds the elements of a list column's rows)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_timestamp(arr.type):
        arr = timestamps_as_micros(name, arr)  # before the fill, which is then in microseconds
    if arr.null_count:
        if spec.fill is None:
            # (the rows converted at once: often several of the user's batches)
            where = (f"null element(s) inside its lists ({len(arr)} elements in the rows read "
                     f"together)" if elements else f"null value(s) among {len(arr)} rows read together")
            raise SchemaError(
                f"column {name!r} has {arr.null_count} {where}; "
                f"TensorFlow tensors cannot hold nulls. Give a fill value "
                f"(fill_values={{{name!r}: {fill_example(arr.type)}}}) or filter/impute the nulls "
                f"before feeding."
            )
        arr = arr.fill_null(pa.scalar(spec.fill, type=arr.type))
    t = arr.type
    if pa.types.is_timestamp(t) or pa.types.is_date32(t):
        arr = arr.cast(pa.int64() if pa.types.is_timestamp(t) else pa.int32())
    if spec.dtype == "string":
        # as bytes: TF strings are bytes, and text Spark holds need not be valid UTF-8
        # (CAST(X'FF61' AS STRING)), which decoding to Python str refused
        if pa.types.is_string(t):
            arr = arr.view(pa.binary())
        elif pa.types.is_large_string(t):
            arr = arr.view(pa.large_binary())
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=object)
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=spec.dtype)


def list_offsets(arr: pa.Array) -> np.ndarray:
    """A list array's offsets as int64 (``len(arr) + 1`` of them, not rebased).

    An empty list array from Spark 3.5's JVM has no offsets buffer at all, and pyarrow 14 then
    reads one value of garbage; its offsets are ``[0]``.
    """
    if len(arr) == 0:
        return np.zeros(1, dtype=np.int64)
    return np.asarray(arr.offsets.to_numpy(), dtype=np.int64)


def list_lengths(arr: pa.Array, spec: ColumnSpec) -> list[list[int]] | None:
    """``[shortest, longest]`` list per ragged level of ``spec`` over ``arr``'s non-null rows.

    None when the column has no ragged level or no non-null row. Levels of a known size
    (``fixed_size_list``) are walked through but not reported.
    """
    import pyarrow.compute as pc

    if not spec.is_ragged or arr.null_count == len(arr):
        return None
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    out = []
    for dim in spec.shape:
        if dim is None:
            lo, hi = pc.min_max(pc.list_value_length(arr)).values()
            if lo.as_py() is None:  # no list at this level: every one above it was empty
                return out + [[0, 0]] * (sum(d is None for d in spec.shape) - len(out))
            out.append([lo.as_py(), hi.as_py()])
        arr = arr.flatten()
    return out


def is_list_type(t: pa.DataType) -> bool:
    """Whether ``t`` is one of Arrow's list types (list, large_list, fixed_size_list)."""
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def first_null_row(arr: pa.Array) -> int | None:
    """The first row of ``arr`` that is null or whose array holds a null (one list level
    down), or None: the row to name in an error about nulls."""
    import pyarrow.compute as pc

    if arr.null_count:
        return int(pc.index(arr.is_null(), True).as_py())
    if is_list_type(arr.type):
        flat = arr.flatten()
        if flat.null_count:
            return int(pc.list_parent_indices(arr)[pc.index(flat.is_null(), True).as_py()].as_py())
    return None


def null_row_note(batch: pa.RecordBatch, row: int, columns: Sequence[str]) -> str:
    """" The first row with a null there has a=1, b='x'.": the sentence a null error adds to
    name ``row`` by its values in ``columns`` (an id), for the user to find it."""
    values = ", ".join(f"{c}={batch.column(c)[row].as_py()!r}" for c in columns)
    return f" The first row with a null there has {values}."


def list_levels(arr: pa.Array) -> list[pa.Array]:
    """The values of each list level below ``arr``, top down: for ``list<list<float>>``, the
    inner lists, then the floats. Only the non-null rows of this slice contribute, so each
    level's ``null_count`` counts nulls inside the arrays, never a null row. Empty for a
    column that is not a list."""
    levels = []
    while is_list_type(arr.type):
        arr = arr.flatten()
        levels.append(arr)
    return levels


def leaf_values(arr: pa.Array) -> pa.Array:
    """The scalars at the bottom of a list column (``arr`` itself when it is not a list)."""
    levels = list_levels(arr)
    return levels[-1] if levels else arr


def list_depth(t: pa.DataType) -> int:
    """How many list levels (any of :func:`is_list_type`'s) ``t`` has (0 for a scalar type)."""
    depth = 0
    while is_list_type(t):
        t, depth = t.value_type, depth + 1
    return depth


def uniform_shape(lengths: Sequence[Sequence[int | None]] | None) -> tuple[int, ...] | None:
    """The one shape every row has, from ``[shortest, longest]`` per list level (as
    :func:`list_lengths` gives them); None when a level's lengths differ, are unknown, or are 0
    (an empty level cannot be told from a missing one, so such a column stays ragged)."""
    if not lengths:
        return None
    shape = []
    for lo, hi in lengths:
        if lo is None or lo != hi or lo <= 0:
            return None
        shape.append(int(lo))
    return tuple(shape)


def _list_parts(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Child values and row splits (rebased to 0) of a list or fixed_size_list array."""
    if pa.types.is_fixed_size_list(arr.type):
        n = arr.type.list_size
        values = arr.flatten()
        return values, np.arange(len(arr) + 1, dtype=np.int64) * n
    offsets = list_offsets(arr)
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    return values, offsets - offsets[0]


def _fill_null_lists(arr: pa.Array, spec: ColumnSpec, level: int) -> pa.Array:
    """``arr`` (list level ``level`` of a column) with its null lists replaced: by a list of
    the declared shape holding ``spec.fill`` where the rest of the shape is known (dense), else
    by an empty list (ragged)."""
    import pyarrow.compute as pc

    rest = tuple(spec.shape[level:]) if spec.shape else ()
    depth = list_depth(arr.type)
    value: Any = []
    if rest and all(d is not None for d in rest):
        if depth == 1:  # the leaf lists: a flat run of values (shape (28, 28) from 784 floats)
            value = [spec.fill] * math.prod(rest)  # type: ignore[arg-type]
        elif depth == len(rest):
            value = spec.fill
            for d in reversed(rest):
                value = [value] * int(d)  # type: ignore[arg-type]
    return pc.if_else(arr.is_null(), pa.scalar(value, type=arr.type), arr)


def _column_to_numpy(name: str, arr: pa.Array, spec: ColumnSpec) -> np.ndarray | RaggedColumn:
    if isinstance(arr, pa.ChunkedArray):
        # one chunk: use it as it is (combine_chunks copies even then, e.g. list columns)
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    if not spec.shape:
        return _flat_values(name, arr, spec)
    # Nested list column: walk down, collecting row splits, checking list-level nulls.
    splits: list[np.ndarray] = []
    cur = arr
    while is_list_type(cur.type):
        if cur.null_count:
            if spec.fill is None:
                raise SchemaError(
                    f"column {name!r} has null lists ({cur.null_count} in the batch being "
                    f"converted, not counting later ones); TensorFlow cannot hold "
                    f"a null list. Give a fill value (fill_values={{{name!r}: {fill_example(cur.type)}}}: a null list "
                    f"becomes an empty one if the column is ragged, or, if it is dense, one of its "
                    f"shape holding the value) or "
                    f"replace nulls with empty lists (coalesce(col, array())) first."
                )
            cur = _fill_null_lists(cur, spec, len(splits))
        cur, s = _list_parts(cur)
        splits.append(s)
    values = _flat_values(name, cur, spec, elements=True)
    if spec.is_ragged:
        return RaggedColumn(values, tuple(splits))
    # Dense: every row must hold exactly prod(shape) leaf values.
    per_row = math.prod(spec.shape)  # type: ignore[arg-type]
    rows = len(arr)
    lengths = np.diff(splits[0])
    if len(splits) == 1 and not np.all(lengths == per_row):
        bad = int(np.argmax(lengths != per_row))
        raise SchemaError(
            f"column {name!r} is fed as dense shape {spec.shape} ({per_row} values a row), but "
            f"row {bad} of this batch has {int(lengths[bad])} values. Declare the column ragged "
            f"(shapes={{{name!r}: None}}; a pushed column is dense when every row of the first "
            f"DataFrame or micro-batch had one length) or fix the data."
        )
    if 1 < len(splits) <= len(spec.shape):
        _check_nested_lengths(name, spec, splits)
    if values.shape[0] != rows * per_row:
        raise SchemaError(
            f"column {name!r} is fed as dense shape {spec.shape} but a batch of {rows} rows holds "
            f"{values.shape[0]} values (expected {rows * per_row}). Fix the data or declare it ragged."
        )
    return values.reshape((rows, *spec.shape))  # type: ignore[arg-type]


def _check_nested_lengths(name: str, spec: ColumnSpec, splits: list[np.ndarray]) -> None:
    """Every list at every level has the length the declared shape gives it (the innermost
    level holds the rest of the shape's values). A total count alone let [[1, 2, 3], [4]]
    read as [[1, 2], [3, 4]] under shape (2, 2)."""
    depth = len(splits)
    for level, s in enumerate(splits):
        want = spec.shape[level] if level < depth - 1 else math.prod(spec.shape[level:])  # type: ignore[arg-type]
        lengths = np.diff(s)
        if np.all(lengths == want):
            continue
        index = int(np.argmax(lengths != want))
        row = index
        for up in range(level - 1, -1, -1):  # the row that list belongs to
            row = int(np.searchsorted(splits[up], row, side="right")) - 1
        raise SchemaError(
            f"column {name!r} is fed as dense shape {spec.shape}, but row {row} of this batch has "
            f"a list of {int(lengths[index])} {'values' if level == depth - 1 else 'lists'} at "
            f"nesting level {level + 1} (expected "
            f"{want}). Declare the column ragged (shapes={{{name!r}: None}}) or fix the data."
        )


def to_numpy(
    data: pa.RecordBatch | pa.Table, specs: Sequence[ColumnSpec]
) -> dict[str, np.ndarray | RaggedColumn]:
    """Convert the spec'd columns of a batch to numpy arrays (this is the one copy out of Arrow).

    Raises:
        SchemaError: a null without a fill value, or a list row that does not fit its shape.
    """
    out: dict[str, np.ndarray | RaggedColumn] = {}
    for spec in specs:
        col = column_array(data, spec.name)
        out[spec.name] = _column_to_numpy(spec.name, col, spec)
    return out


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    if (pa.types.is_list(a) and pa.types.is_list(b)) or (
        pa.types.is_large_list(a) and pa.types.is_large_list(b)
    ):
        return _same_type(a.value_type, b.value_type)
    if pa.types.is_fixed_size_list(a) and pa.types.is_fixed_size_list(b):
        return a.list_size == b.list_size and _same_type(a.value_type, b.value_type)
    return a.equals(b)


def same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    """Same column names and types, ignoring nullability, list child names and metadata
    (Spark's nullability flags differ between equivalent DataFrames)."""
    return a.names == b.names and all(_same_type(x.type, y.type) for x, y in zip(a, b))


def schema_text(schema: pa.Schema) -> str:
    """A schema on one line, for error messages: ``id: int64, vec: list<float>``."""
    return ", ".join(f"{f.name}: {f.type}" for f in schema)
