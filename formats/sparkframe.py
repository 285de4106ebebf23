"""A Spark DataFrame made fit for the ``mapInArrow`` jobs here (push, inference, predict, export).

**Spark ML vectors.** A ``VectorUDT`` column (what ``VectorAssembler``, ``StandardScaler`` and
most Spark ML stages write) reaches Arrow as a struct of (type, size, indices, values), which no
tensor can hold. Every job that reads a DataFrame's rows first turns such a column into
``array<double>`` with Spark's own ``vector_to_array``: sparse vectors become dense, values stay
exact (float64). To push half the bytes, convert the column yourself first:
``df.withColumn("features", vector_to_array("features", "float32"))``.

**Column names.** ``DataFrame.mapInArrow`` resolves every column by name, and a name with a dot
(``sepal.length``; the ``parent.child`` columns of a flattened export) resolves as a struct
field, so the job fails before it starts (pyspark 3.5 and 4). :func:`map_in_arrow` runs such a
job on positional stand-in names and gives the function its batches under the real ones.

**Arrow batch bytes on Spark 3.5.** Spark 4 cuts the Arrow batches a ``mapInArrow`` task gets
at ``spark.sql.execution.arrow.maxBytesPerBatch``; Spark 3.5 only at ``maxRecordsPerBatch`` rows
(10,000 by default), so 10,000 image rows of 100 KB are a 1 GB batch: the executor runs out of
direct memory in the thread that writes to Python ("stdout writer"), and the task then waits
for ever. A job that knows its rows' size (:func:`row_bytes`, :func:`value_bytes`) runs with
:func:`records_per_batch` rows a batch there (:func:`with_conf`), about
:data:`ARROW_BATCH_BYTES`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import pyarrow as pa

logger = logging.getLogger(__name__)

__all__ = ["vector_columns", "vector_as_array", "dense_vectors", "map_in_arrow", "not_a_spark_frame",
           "ARROW_BATCH_BYTES", "RECORDS_PER_BATCH", "arrow_batches_by_rows", "row_bytes", "value_bytes", "value_width",
           "sampled_row_bytes",
           "records_per_batch", "with_conf", "bound_session_batches"]

#: bytes an Arrow batch of a job over a DataFrame aims at on Spark 3.5 (see the module docstring)
ARROW_BATCH_BYTES = 64 << 20
RECORDS_PER_BATCH = "spark.sql.execution.arrow.maxRecordsPerBatch"
#: rows :func:`value_bytes` looks at
VALUE_SAMPLE_ROWS = 256


def not_a_spark_frame(obj: Any) -> str:
    """What ``obj`` is, for an error saying a Spark DataFrame was expected, and how to get one
    from it (pandas and pandas-on-Spark frames are both called ``DataFrame``)."""
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.startswith("pyspark.pandas"):
        return f"{name} (pandas-on-Spark); pass its .to_spark()"
    if cls.__module__.startswith("pandas"):
        return f"{name}; make it a Spark DataFrame with spark.createDataFrame(pdf)"
    if cls.__module__.startswith("pyarrow"):
        return f"{name}; make it a Spark DataFrame with spark.createDataFrame(table.to_pandas())"
    if cls.__module__.startswith("pyspark") and "RDD" in cls.__name__:
        return f"{name}; pass rdd.toDF() (dataplane.compat.TFCluster takes RDDs as TFoS did)"
    return name


def vector_columns(spark_schema: Any) -> list[str]:
    """Top-level columns of ``spark_schema`` (a ``StructType``) that hold Spark ML vectors
    (``pyspark.ml.linalg.VectorUDT`` or the older ``pyspark.mllib.linalg.VectorUDT``)."""
    return [f.name for f in spark_schema.fields if type(f.dataType).__name__ == "VectorUDT"]


def vector_as_array(name: str) -> Any:
    """The Spark column expression for vector column ``name`` as ``array<double>``; a null
    vector stays null (``vector_to_array`` alone fails the task on one)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    col = F.col(f"`{name}`")
    return F.when(col.isNull(), F.lit(None)).otherwise(vector_to_array(col))


def dense_vectors(df: Any) -> Any:
    """``df`` with every vector column replaced, in place, by ``array<double>``; ``df``
    itself when it has none (no new DataFrame, no Spark call)."""
    names = vector_columns(df.schema)
    if not names:
        return df
    return df.withColumns({n: vector_as_array(n) for n in names})


@dataclass
class _RealNames:
    """The ``mapInArrow`` function ``fn``, handed its batches under ``names`` (by position)."""

    fn: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
    names: list[str]

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return self.fn(pa.RecordBatch.from_arrays(b.columns, names=self.names) for b in batches)


def map_in_arrow(df: Any, fn: Any, schema: Any, **kwargs: Any) -> Any:
    """``df.mapInArrow(fn, schema, **kwargs)``, also when a column name holds a dot or a
    backtick (see the module docstring); ``fn`` sees the real names either way."""
    names = list(df.columns)
    if not any("." in n or "`" in n for n in names):
        return df.mapInArrow(fn, schema, **kwargs)
    stand_in = df.toDF(*[f"_dataplane_col{i}" for i in range(len(names))])
    return stand_in.mapInArrow(_RealNames(fn, names), schema, **kwargs)


def read_parquet(spark: Any, path: str) -> Any:
    """``spark.read.parquet`` over the files our readers take (:func:`formats.fs.parquet_files`):
    where a non-Parquet file (a README) sits beside ``*.parquet`` files, Spark would fail on it,
    so the Parquet files are named one by one. ``basePath`` is set where needed (those named
    files, a glob) so that ``key=value`` directories give the partition columns ours give.

    Only for paths Spark's own filesystems open (local, ``file://``, ``hdfs://``, ``s3a://``).
    """
    from formats.fs import list_files, listing_root, parquet_files, resolve

    loc = resolve(path)
    listed = list_files(loc)
    files = parquet_files(loc, listed)
    if loc.scheme == "file":
        prefix = "file://"
    else:
        scheme, rest = loc.url.split("://", 1)
        netloc = rest.split("/", 1)[0]
        prefix = f"{scheme}://" if loc.scheme == "s3" else f"{scheme}://{netloc}"
    root = listing_root(loc)
    named = len(files) != len(listed)
    reader = spark.read
    if named or root != loc.path:
        reader = reader.option("basePath", prefix + root)
    if named:
        return reader.parquet(*[prefix + f for f in files])
    return reader.parquet(prefix + loc.path)


def arrow_batches_by_rows(spark: Any) -> bool:
    """Whether ``spark`` cuts a ``mapInArrow`` task's Arrow batches by rows alone
    (``maxRecordsPerBatch``: Spark before 4.0, which adds ``maxBytesPerBatch``; for a Spark
    Connect session, the server's version)."""
    try:
        return int(str(spark.version).split(".")[0]) < 4
    except Exception:  # noqa: BLE001 - nothing to go by: leave Spark's setting
        return False


def row_bytes(schema: pa.Schema, shapes: Mapping[str, tuple[int, ...]],
              values: Mapping[str, float] | None = None) -> int:
    """Bytes a row takes in Arrow, as far as the schema, ``shapes`` (arrays of one shape) and
    ``values`` (the average bytes of other columns: :func:`value_bytes`, or a scan's) tell:
    fixed-width columns, arrays of one shape, the columns in ``values``; the rest count
    nothing."""
    import math

    from formats.schema import is_list_type

    total = int(sum((values or {}).values()))
    for f in schema:
        if f.name in (values or {}):
            continue
        if f.name in shapes:
            total += math.prod(shapes[f.name]) * (value_width(f.type) or 0)
        elif not is_list_type(f.type):  # a ragged array counts nothing here
            total += value_width(f.type) or 0
    return total


def value_width(t: pa.DataType) -> int | None:
    """Bytes one value of ``t`` takes (of its innermost values, for a list type); None when
    they vary (strings, binaries)."""
    from formats.schema import is_list_type

    while is_list_type(t):
        t = t.value_type
    try:
        return max(t.bit_width // 8, 1)
    except ValueError:
        return None


def value_bytes(df: Any, schema: pa.Schema, rows: int = VALUE_SAMPLE_ROWS, *,
                arrays: bool = False) -> dict[str, float]:
    """Average bytes of a value of each binary and string column of ``df`` (with ``arrays``,
    of each array column of fixed-width values too, nested ones flattened), over its first
    ``rows`` rows (nulls count 0): a ``limit`` query, which reads as few partitions as give
    that many rows (a shuffled frame computes its shuffle first). A column with no row
    sampled counts 0."""
    from pyspark.sql import functions as F

    from formats.schema import list_depth

    sizes = {}
    for f in schema:
        col = F.col(f"`{f.name}`")
        if _variable_width(f.type):
            sizes[f.name] = F.octet_length(col)
        elif arrays and list_depth(f.type) and value_width(f.type):  # strings inside: not counted
            for _ in range(list_depth(f.type) - 1):
                col = F.flatten(col)  # a row's values, all levels down
            sizes[f.name] = F.when(col.isNotNull(), F.size(col)) * value_width(f.type)
    if not sizes:
        return {}
    names = list(sizes)
    got = df.select(*[F.coalesce(e, F.lit(0)).alias(f"v{i}") for i, e in enumerate(sizes.values())]).limit(rows).collect()
    if not got:
        return {n: 0.0 for n in names}
    return {n: sum(r[f"v{i}"] for r in got) / len(got) for i, n in enumerate(names)}


def shuffles(df: Any) -> bool:
    """Whether a query of ``df``'s first rows computes a shuffle in full (an aggregate, a
    repartition, a sort, a join that is not a broadcast); True where the plan cannot be read
    (Spark Connect). A frame read from files, filtered and projected, does not; nor one whose
    shuffle lies below a ``df.cache()`` (its shuffle is computed once, and the push job reads
    the cache), nor a join that broadcasts its small side (computed in full, but small)."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return True
    try:
        return _shuffle_in(jdf.queryExecution().executedPlan())
    except Exception:  # noqa: BLE001 - cannot tell: assume the costly case
        return True


def _shuffle_in(plan: Any) -> bool:
    """Whether the physical ``plan`` (a py4j SparkPlan) has a shuffle exchange above any
    in-memory table scan (a cached frame's plan sits inside that scan's relation, which is no
    child of it)."""
    todo = [plan]
    while todo:
        node = todo.pop()
        name = node.getClass().getSimpleName()
        if name in ("ShuffleExchangeExec", "ShuffleQueryStageExec"):
            return True
        if name == "AdaptiveSparkPlanExec":  # adaptive execution holds its plan, as no child
            todo.append(node.executedPlan())
            continue
        if name == "BroadcastExchangeExec":
            continue  # the small side of a join: computed in full, shuffles included, but small
        if name == "ReusedExchangeExec":  # an exchange computed once for two places: no child
            todo.append(node.child())
            continue
        children = node.children()
        todo.extend(children.apply(i) for i in range(children.size()))
    return False


def sampled_row_bytes(df: Any, schema: pa.Schema) -> int:
    """:func:`row_bytes` of ``df`` with every binary, string and array column's size from
    :func:`value_bytes` (a sample of its first rows)."""
    return row_bytes(schema, {}, value_bytes(df, schema, arrays=True))


def _variable_width(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def records_per_batch(spark: Any, row_size: int) -> int | None:
    """The ``maxRecordsPerBatch`` that keeps a job's Arrow batches near
    :data:`ARROW_BATCH_BYTES` for rows of ``row_size`` bytes on a Spark that cuts batches by
    rows alone, if lower than the session's; else None (the session's setting stands)."""
    if row_size <= 0 or not arrow_batches_by_rows(spark):
        return None
    try:
        current = int(spark.conf.get(RECORDS_PER_BATCH))
    except Exception:  # noqa: BLE001 - nothing to go by: leave Spark's setting
        return None
    want = max(1, ARROW_BATCH_BYTES // row_size)
    return want if current <= 0 or want < current else None


def with_conf(spark: Any, key: str, value: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the session's SQL setting ``key`` at ``value`` (read when its query is
    planned, in this thread), then set back; ``fn()`` as it is when ``value`` is None."""
    if value is None:
        return fn()
    old = spark.conf.get(key)
    spark.conf.set(key, str(value))
    try:
        return fn()
    finally:
        spark.conf.set(key, old)


def bound_session_batches(spark: Any, row_size: int, what: str) -> int | None:
    """For a query the user plans and runs later (a lazy output DataFrame: ``cluster.inference``,
    ``dataplane.predict``), on a Spark that cuts Arrow batches by rows alone: if rows of
    ``row_size`` bytes make batches of over 4 x :data:`ARROW_BATCH_BYTES` at the session's
    ``maxRecordsPerBatch``, lower it for the session to about :data:`ARROW_BATCH_BYTES` a
    batch, with a warning (such batches run Spark 3.5's executor out of memory, and its task
    then waits for ever); the new setting, else None. It stays lowered: the query is planned
    after this returns, and only the session's setting reaches its plan."""
    rows = records_per_batch(spark, row_size)
    if rows is None:
        return None
    current = int(spark.conf.get(RECORDS_PER_BATCH))
    if 0 < current and current * row_size <= 4 * ARROW_BATCH_BYTES:
        return None
    spark.conf.set(RECORDS_PER_BATCH, str(rows))
    logger.warning(
        "%s: rows of about %s KiB make Arrow batches of %s MiB at %s=%s; Spark %s cuts batches "
        "by rows alone, and one that large runs an executor out of direct memory (its task "
        "then waits for ever). Set it to %s for this session (about %s MiB a batch).",
        what, f"{row_size / 1024:,.0f}", f"{current * row_size / 2**20:,.0f}" if current > 0 else "unbounded",
        RECORDS_PER_BATCH, current, spark.version, rows, ARROW_BATCH_BYTES >> 20)
    return rows
