"""Every pull reader yields the same tensors for the same table, locally and from S3.

One table (``tests.builders.conformance_table``: int64, int32, float32, float64, bool, string,
binary, fixed-length list, variable-length list) is written as Parquet and as TFRecord; each
reader's batches are collected, put in ``id`` order (Petastorm may reorder row groups) and
compared with tensors computed straight from the Arrow table: values, dtypes, shapes, ragged row
lengths, and exact batch sizes.

The adapters cannot carry every type, so they read the columns they can:

* Petastorm 0.13.1 drops ``fixed_size_list`` columns from its inferred schema (``vec``) and
  ``np.vstack``s list cells, so variable-length lists fail (``seq``).
* tensorflow-io's Parquet reader reads only flat primitive columns (no ``vec``, no ``seq``).

On the current stack the adapters must raise StackError naming the compat stack. From S3 only
the native readers run: Petastorm needs s3fs (not on the compat stack) and tensorflow-io's
Parquet reader aborts the process through its S3 plugin; both refuse up front, and that is
asserted too.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import feeders
from dataplane.errors import SchemaError, StackError, StorageError
from formats.schema import column_specs
from formats.schemafile import TFRecordSchema, write_schema_file
from tests.builders import conformance_table, write_parquet_files, write_tfrecord_files

# Petastorm calls pyarrow APIs that warn about their own deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning:petastorm")

ROWS = 300
BATCH = 64
ALL = ["id", "i32", "f32", "f64", "flag", "name", "blob", "vec", "seq"]
SCALARS = ["id", "i32", "f32", "f64", "flag", "name", "blob"]


def _on_compat() -> bool:
    return int(pa.__version__.split(".")[0]) < 16


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return conformance_table(ROWS)


@pytest.fixture(scope="module")
def local_data(tmp_path_factory, table):
    """Parquet (3 files, 40-row groups) and TFRecord (plain + schema file, and GZIP) copies."""
    root = tmp_path_factory.mktemp("conformance")
    write_parquet_files(table, root / "parquet", files=3, row_group_size=40)
    write_tfrecord_files(table, root / "tfrecord", files=2)
    write_schema_file(root / "tfrecord", TFRecordSchema(specs=column_specs(table.schema)))
    write_tfrecord_files(table, root / "tfrecord-gz", files=2, compression="GZIP")
    return root


@pytest.fixture(scope="module")
def s3_data(s3_server, local_data):
    bucket = s3_server.make_bucket()
    for name in ("parquet", "tfrecord", "tfrecord-gz"):
        s3_server.upload_dir(local_data / name, bucket, name)
    return f"s3://{bucket}"


def _read(kind: str, base: str, columns: list[str], table: pa.Table):
    if kind in ("parquet", "parquet-dense"):
        return feeders.parquet_dataset(f"{base}/parquet", columns=columns, batch_size=BATCH)
    if kind == "tfrecord":  # schema from the _tf_schema.json beside the data
        return feeders.tfrecord_dataset(f"{base}/tfrecord", columns=columns, batch_size=BATCH)
    if kind == "tfrecord-gzip":  # schema passed in; compression from the .gz suffix
        return feeders.tfrecord_dataset(
            f"{base}/tfrecord-gz", schema=table.schema, columns=columns, batch_size=BATCH
        )
    if kind == "petastorm":
        return feeders.petastorm_dataset(f"{base}/parquet", columns=columns, batch_size=BATCH)
    if kind == "tfio":
        return feeders.tfio_parquet_dataset(f"{base}/parquet", columns=columns, batch_size=BATCH)
    raise AssertionError(kind)


CARRIES = {
    "parquet": ALL,
    # without the ragged column the reader takes its dense path: ``vec`` decoded from its pages
    "parquet-dense": [c for c in ALL if c != "seq"],
    "tfrecord": ALL,
    "tfrecord-gzip": ALL,
    "petastorm": SCALARS,  # no vec (fixed_size_list dropped), no seq (ragged: vstack fails)
    "tfio": SCALARS,  # flat primitive columns only
}
ADAPTERS = {"petastorm", "tfio"}


def _collect(ds, columns):
    import tensorflow as tf

    batches = list(ds)
    sizes = [int(b["id"].shape[0]) for b in batches]
    assert sizes[:-1] == [BATCH] * (len(sizes) - 1), sizes
    assert 0 < sizes[-1] <= BATCH
    out = {c: tf.concat([b[c] for b in batches], axis=0) for c in columns}
    order = np.argsort(out["id"].numpy(), kind="stable")
    return {c: tf.gather(v, order) for c, v in out.items()}


def _check(got, table: pa.Table, columns):
    import tensorflow as tf

    assert sorted(got) == sorted(columns)
    assert got["id"].numpy().tolist() == list(range(ROWS))
    for name in columns:
        t, col = got[name], table.column(name)
        if name in ("id", "i32", "f32", "f64", "flag"):
            want = col.to_numpy()
            assert t.dtype == tf.as_dtype(want.dtype), name
            assert t.shape == (ROWS,), name
            np.testing.assert_array_equal(t.numpy(), want, err_msg=name)
        elif name == "name":
            assert t.dtype == tf.string
            assert [v.decode("utf-8") for v in t.numpy()] == col.to_pylist()
        elif name == "blob":
            assert t.dtype == tf.string
            assert t.numpy().tolist() == col.to_pylist()
        elif name == "vec":
            assert isinstance(t, tf.Tensor) and t.dtype == tf.float32 and t.shape == (ROWS, 3)
            np.testing.assert_array_equal(t.numpy(), np.array(col.to_pylist(), dtype=np.float32))
        elif name == "seq":
            assert isinstance(t, tf.RaggedTensor) and t.dtype == tf.int64
            assert t.ragged_rank == 1 and t.row_splits.dtype == tf.int64
            want = col.to_pylist()
            assert t.row_lengths().numpy().tolist() == [len(r) for r in want]
            assert t.to_list() == want
        else:
            raise AssertionError(name)


def _run(kind: str, base: str, table: pa.Table) -> None:
    columns = CARRIES[kind]
    if kind in ADAPTERS and not _on_compat():
        with pytest.raises(StackError, match=r"compat stack.*bash \.ci/setup compat"):
            _read(kind, base, columns, table)
        return
    _check(_collect(_read(kind, base, columns, table), columns), table, columns)


@pytest.mark.parametrize("kind", list(CARRIES))
def test_local(kind, local_data, table):
    _run(kind, str(local_data), table)


@pytest.mark.parametrize("kind", ["parquet", "parquet-dense", "tfrecord", "tfrecord-gzip"])
def test_local_file_url(kind, local_data, table):
    _run(kind, "file://" + str(local_data), table)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["parquet", "parquet-dense", "tfrecord", "tfrecord-gzip"])
def test_s3(kind, s3_env, s3_data, table):
    _run(kind, s3_data, table)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["parquet", "tfrecord"])
def test_s3_through_an_explicit_filesystem(kind, s3_server, s3_data, table, monkeypatch):
    # no AWS variables at all: only the filesystem handed in knows the endpoint and keys
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    read = feeders.parquet_dataset if kind == "parquet" else feeders.tfrecord_dataset
    ds = read(f"{s3_data}/{kind}", columns=ALL, batch_size=BATCH, filesystem=s3_server.filesystem())
    _check(_collect(ds, ALL), table, ALL)


@pytest.mark.s3
@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_adapters_on_s3_say_why_not(kind, s3_env, s3_data, table):
    """Neither adapter can read this S3 server on the compat stack; each says why, up front.

    Petastorm 0.13.1 opens s3:// only through s3fs (not on the stack; it cannot use
    pyarrow.fs). tensorflow-io's Parquet reader aborts the process through its S3 plugin.
    """
    if not _on_compat():
        with pytest.raises(StackError, match="compat stack"):
            _read(kind, s3_data, SCALARS, table)
        return
    expected = {"petastorm": (StackError, "s3fs"), "tfio": (StorageError, "only local files")}
    exc, pattern = expected[kind]
    with pytest.raises(exc, match=pattern):
        _read(kind, s3_data, SCALARS, table)


@pytest.mark.parametrize(
    ("kind", "column"), [("petastorm", "vec"), ("petastorm", "seq"), ("tfio", "vec"), ("tfio", "seq")]
)
def test_adapters_refuse_what_they_cannot_carry(kind, column, local_data, table):
    """On compat the adapter names the column and why; elsewhere it names the compat stack."""
    if not _on_compat():
        with pytest.raises(StackError, match="compat"):
            _read(kind, str(local_data), ["id", column], table)
        return
    with pytest.raises(SchemaError, match=rf"column '{column}'.*feeders\.parquet_dataset"):
        _read(kind, str(local_data), ["id", column], table)


@pytest.mark.parametrize("kind", ["petastorm", "tfio"])
def test_adapters_refuse_nulls_instead_of_shifting_or_inventing_values(kind, tmp_path):
    # tensorflow-io skipped each null and slid the column's later values up (rows no longer
    # matched their labels), or aborted the process on Spark's files; Petastorm handed nulls
    # over as NaN / None, which became INT64_MIN and the string 'None'
    import pyarrow.parquet as pq

    data = pa.table({"f": [1.0, None, 3.0, 4.0], "i": pa.array([1, 2, None, 4], pa.int64()),
                     "s": ["a", "b", None, "d"], "y": [0, 1, 0, 1]})
    (tmp_path / "parquet").mkdir()
    pq.write_table(data, tmp_path / "parquet" / "nulls.parquet")
    if not _on_compat():
        with pytest.raises(StackError, match="compat"):
            _read(kind, str(tmp_path), ["f", "y"], None)
        return
    name = {"petastorm": "petastorm_dataset", "tfio": "tfio_parquet_dataset"}[kind]
    for column in ("f", "i", "s"):
        with pytest.raises(SchemaError, match=rf"^{name}: column '{column}' has 1 null value\(s\) in row group 0 "
                                              rf"of {tmp_path}/parquet/nulls\.parquet; .*This reader cannot fill "
                                              rf"them: .*feeders\.parquet_dataset\(fill_values=\.\.\.\)\.$"):
            _read(kind, str(tmp_path), [column, "y"], None)
    got = [b["y"].numpy().tolist() for b in _read(kind, str(tmp_path), ["y"], None)]
    assert sum(got, []) == [0, 1, 0, 1]  # the columns without nulls still read
    if kind == "petastorm":  # a file without statistics: Petastorm's own batches are checked
        # (for numbers: its strings arrive with 'None' already written in, past telling)
        pq.write_table(data, tmp_path / "parquet" / "nulls.parquet", write_statistics=False)
        with pytest.raises(Exception, match=r"column 'i' has null value\(s\), which Petastorm hands over "
                                            r"as NaN or None"):
            list(_read(kind, str(tmp_path), ["i", "y"], None))
        # a keyword make_batch_reader does not take: at the call, not at the first batch
        with pytest.raises(TypeError, match=r"make_batch_reader takes no argument\(s\) \['nonsense'\]"):
            feeders.petastorm_dataset(f"{tmp_path}/parquet", columns=["y"], nonsense=1)


def test_label_splits_the_batch(local_data, table):
    for ds in (
        feeders.parquet_dataset(local_data / "parquet", batch_size=BATCH, label="f64"),
        feeders.tfrecord_dataset(local_data / "tfrecord", batch_size=BATCH, label="f64"),
    ):
        features, y = next(iter(ds))
        assert "f64" not in features and set(features) == set(ALL) - {"f64"}
        assert y.dtype.name == "float64" and y.shape[0] == BATCH
