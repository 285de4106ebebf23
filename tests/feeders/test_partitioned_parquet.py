"""A data set Spark wrote with ``df.write.partitionBy(...)`` read back by the pull readers,
whole or through glob patterns.

Spark leaves the partition columns out of the files and puts their values in ``key=value``
directory names (escaped: ``c/1`` is ``cat=c%2F1``; a null is ``__HIVE_DEFAULT_PARTITION__``).
Every reader must give them back as columns, each row with its own file's value. Patterns such
as ``data/day=[01]/*`` pick files as Spark and ``tf.io.gfile.glob`` do.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import feeders
from dataplane.errors import SchemaError, StackError, StorageError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning:petastorm")

ROWS = 600


def _cat(i: int) -> str | None:
    return None if i % 5 == 0 else f"c/{i % 2}"


@pytest.fixture(scope="module")
def parted(spark, tmp_path_factory) -> str:
    from pyspark.sql import functions as F

    df = spark.range(ROWS).select(
        "id",
        (F.col("id") % 3).alias("day"),
        F.when(F.col("id") % 5 == 0, None)
        .otherwise(F.concat(F.lit("c/"), (F.col("id") % 2).cast("string")))
        .alias("cat"),
        F.array(F.col("id").cast("float"), (F.col("id") * 0.5).cast("float")).alias("x"),
    )
    out = str(tmp_path_factory.mktemp("parted") / "data")
    df.repartition(2).write.partitionBy("day", "cat").parquet(out)
    return out


def _rows(ds) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    cols: dict[str, list] = {}
    for b in ds:
        if isinstance(b, tuple):
            b = dict(b[0], label=b[1])
        for k, v in b.items():
            cols.setdefault(k, []).append(v.numpy() if hasattr(v, "numpy") else v)
    out = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.argsort(out["id"])
    return {k: v[order] for k, v in out.items()}


def _check(got: dict[str, np.ndarray], ids: np.ndarray) -> None:
    np.testing.assert_array_equal(got["id"], ids)
    if "day" in got:
        assert got["day"].dtype == np.int64
        np.testing.assert_array_equal(got["day"], ids % 3)
    if "label" in got:
        np.testing.assert_array_equal(got["label"], ids % 3)
    if "cat" in got:
        want = [(_cat(int(i)) or "none").encode() for i in ids]
        assert got["cat"].tolist() == want
    if "x" in got:
        np.testing.assert_array_equal(got["x"], np.stack([ids, ids * 0.5], axis=1).astype(np.float32))


@pytest.mark.parametrize("shapes", [None, {"x": (2,)}], ids=["arrow-scan", "paged"])
def test_partition_columns_come_back_with_each_rows_value(parted, shapes):
    ds = feeders.parquet_dataset(parted, batch_size=64, shapes=shapes, fill_values={"cat": "none"})
    spec = ds.element_spec
    assert list(spec) == ["id", "x", "day", "cat"]  # the files' columns, then the keys in order
    assert spec["day"].dtype.name == "int64" and spec["cat"].dtype.name == "string"
    got = _rows(ds)
    if shapes is None:  # ragged rows of 2
        got["x"] = np.stack([np.asarray(r) for r in got["x"]]) if got["x"].dtype == object else got["x"]
    _check(got, np.arange(ROWS))


def test_partition_columns_in_shards_as_a_label_or_alone(parted):
    shards = [
        _rows(feeders.parquet_dataset(parted, batch_size=50, columns=["id", "x"], label="day",
                                      shapes={"x": (2,)}, shard=(i, 2)))
        for i in range(2)
    ]
    ids = np.concatenate([s["id"] for s in shards])
    assert len(ids) == ROWS and set(ids.tolist()) == set(range(ROWS))  # each row once
    for s in shards:
        _check(s, s["id"])
    only = list(feeders.parquet_dataset(parted, batch_size=1000, columns=["day"]))
    assert sum(int(b["day"].numpy().sum()) for b in only) == sum(i % 3 for i in range(ROWS))
    assert sum(int(b["day"].shape[0]) for b in only) == ROWS


def test_a_null_partition_needs_a_fill_value(parted):
    with pytest.raises(SchemaError) as err:
        feeders.parquet_dataset(parted, batch_size=64)
    text = str(err.value)
    assert "partition column 'cat' is null (__HIVE_DEFAULT_PARTITION__)" in text
    assert "cat=__HIVE_DEFAULT_PARTITION__" in text and "fill_values={'cat': ...}" in text


@pytest.mark.s3
def test_partitioned_data_on_s3(parted, s3_env):
    from pathlib import Path

    bucket = s3_env.make_bucket()
    s3_env.upload_dir(Path(parted), bucket, "parted")
    ds = feeders.parquet_dataset(f"s3://{bucket}/parted", batch_size=64, shapes={"x": (2,)},
                                 fill_values={"cat": "none"})
    _check(_rows(ds), np.arange(ROWS))


def test_adapters_on_partitioned_data(parted):
    """Petastorm reads partition columns itself; tensorflow-io's reader cannot, and says so."""
    if int(pa.__version__.split(".")[0]) >= 16:
        with pytest.raises(StackError, match="compat"):
            feeders.tfio_parquet_dataset(parted, batch_size=64, columns=["id", "day"])
        return
    with pytest.raises(SchemaError, match=r"column 'day': a partition column .*feeders\.parquet_dataset"):
        feeders.tfio_parquet_dataset(parted, batch_size=64, columns=["id", "day"])
    ds = feeders.petastorm_dataset("file://" + parted, batch_size=64, columns=["id", "day", "x"],
                                   shapes={"x": (2,)})
    _check(_rows(ds), np.arange(ROWS))


@pytest.mark.parametrize(
    ("pattern", "days"),
    [("day=*", {0, 1, 2}), ("day=[01]", {0, 1}), ("day=?/cat=c%2F1/part-*", {0, 1, 2}),
     ("day=2/*/*.parquet", {2})],
)
def test_glob_patterns_pick_files_and_keep_the_partition_columns(parted, pattern, days):
    got = _rows(feeders.parquet_dataset(f"{parted}/{pattern}", batch_size=64, shapes={"x": (2,)},
                                        fill_values={"cat": "none"}))
    want = np.array([i for i in range(ROWS) if i % 3 in days
                     and ("cat=c%2F1" not in pattern or _cat(i) == "c/1")])
    if "day=2/" in pattern:  # below the first wildcard only: day is not a column then
        assert "day" not in got and "cat" in got
    _check(got, want)


def test_a_pattern_that_matches_nothing_says_so(parted):
    with pytest.raises(StorageError, match=r"day=9\* matches no data file"):
        feeders.parquet_dataset(f"file://{parted}/day=9*", batch_size=64)
    with pytest.raises(StorageError, match=r"does not exist \(looked for '.*/nowhere'"):
        feeders.parquet_dataset(f"{parted}/../nowhere/*.parquet", batch_size=64)


@pytest.mark.s3
def test_glob_on_s3(parted, s3_env):
    from pathlib import Path

    bucket = s3_env.make_bucket()
    s3_env.upload_dir(Path(parted), bucket, "parted")
    ds = feeders.parquet_dataset(f"s3://{bucket}/parted/day=[12]/cat=c%2F?", batch_size=64,
                                 shapes={"x": (2,)})
    _check(_rows(ds), np.array([i for i in range(ROWS) if i % 3 in (1, 2) and _cat(i)]))
