"""URL resolution, S3 configuration from the AWS variables, HDFS preconditions, file listing."""

from __future__ import annotations

import os

import pytest
from pyarrow import fs

from formats.errors import StorageError
from formats.fs import hdfs_filesystem, hdfs_problems, list_files, resolve, s3_filesystem, write_text_atomic


def _s3_kwargs(s3) -> dict:
    return s3.__reduce__()[1][0]


def test_plain_and_file_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given, want in [
        (str(tmp_path / "a"), str(tmp_path / "a")),
        (f"file://{tmp_path}/a", str(tmp_path / "a")),
        # Hadoop's form, as Spark writes spark.sql.warehouse.dir and a table's Location
        (f"file:{tmp_path}/a", str(tmp_path / "a")),
        (f"FILE:{tmp_path}/my%20set", str(tmp_path / "my set")),
        ("rel/dir", str(tmp_path / "rel" / "dir")),
        (tmp_path / "p", str(tmp_path / "p")),
        # percent-encoded, as Spark's df.inputFiles() writes a path with a space; plain paths
        # keep a literal %
        (f"file://{tmp_path}/my%20set/x.parquet", str(tmp_path / "my set" / "x.parquet")),
        (str(tmp_path / "100%20"), str(tmp_path / "100%20")),
    ]:
        loc = resolve(given)
        assert isinstance(loc.filesystem, fs.LocalFileSystem)
        assert (loc.path, loc.scheme) == (want, "file")


def test_s3_url_and_endpoint_from_aws_variables():
    env = {
        "AWS_ACCESS_KEY_ID": "AK",
        "AWS_SECRET_ACCESS_KEY": "SK",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_REGION": "eu-west-3",
    }
    kw = _s3_kwargs(s3_filesystem(env=env))
    assert (kw["endpoint_override"], kw["scheme"], kw["region"]) == ("127.0.0.1:9000", "http", "eu-west-3")
    assert (kw["access_key"], kw["secret_key"]) == ("AK", "SK")
    # The S3-specific variable wins over the generic one.
    kw = _s3_kwargs(s3_filesystem(env={**env, "AWS_ENDPOINT_URL_S3": "https://s3.example:8443"}))
    assert (kw["endpoint_override"], kw["scheme"]) == ("s3.example:8443", "https")
    # A custom endpoint without a region gets a fixed one instead of asking AWS.
    kw = _s3_kwargs(s3_filesystem(env={"AWS_ENDPOINT_URL": "http://127.0.0.1:1"}))
    assert kw["region"] == "us-east-1"


def test_s3_configuration_errors(monkeypatch):
    with pytest.raises(StorageError, match="only one of AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
        s3_filesystem(env={"AWS_ACCESS_KEY_ID": "AK"})
    with pytest.raises(StorageError, match=r"S3 endpoint 'ftp://x' .* is not an http\(s\) URL"):
        s3_filesystem(env={"AWS_ENDPOINT_URL": "ftp://x"})
    with pytest.raises(StorageError, match=r"names no bucket; write it as s3://bucket/prefix"):
        resolve("s3:///key")
    with pytest.raises(StorageError, match=r"unsupported URL scheme 'gs'.*filesystem="):
        resolve("gs://bucket/key")


def test_s3_location_path(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    loc = resolve("s3://bucket/some/prefix/")
    assert (loc.scheme, loc.path) == ("s3", "bucket/some/prefix")
    assert loc.display("bucket/some/prefix/f.parquet") == "s3://bucket/some/prefix/f.parquet"


def test_explicit_filesystem_strips_the_scheme(tmp_path):
    local = fs.LocalFileSystem()
    loc = resolve(f"s3://{tmp_path}/x", filesystem=local)
    assert (loc.filesystem, loc.path, loc.scheme) == (local, f"{tmp_path}/x", "custom")


def test_a_path_given_with_a_filesystem_is_that_filesystems_path(tmp_path, monkeypatch):
    # "bucket/key" with filesystem=S3FileSystem(...) (pyarrow's own convention) was made into
    # a local absolute path: "Path cannot start with a separator ('/home/me/bucket/key')"
    s3 = fs.S3FileSystem(endpoint_override="127.0.0.1:1", scheme="http", access_key="a", secret_key="b")
    loc = resolve("bucket/some/key/", filesystem=s3)
    assert (loc.filesystem, loc.path, loc.url) == (s3, "bucket/some/key", "bucket/some/key/")
    monkeypatch.chdir(tmp_path)
    local = fs.LocalFileSystem()
    assert resolve("rel/x", filesystem=local).path == f"{tmp_path}/rel/x"  # local: as today
    assert resolve(f"file://{tmp_path}/y", filesystem=local).path == f"{tmp_path}/y"


def test_an_s3_url_with_an_empty_path_component_is_named(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    with pytest.raises(StorageError, match=r"^'s3://b//k' has an empty path component \('//'\); .* "
                                           r"Remove the extra '/'\.$"):
        resolve("s3://b//k")


def test_hdfs_problems_name_each_missing_piece(tmp_path):
    problems = hdfs_problems(env={})
    assert len(problems) == 3
    assert "ARROW_LIBHDFS_DIR nor HADOOP_HOME" in problems[0]
    assert "JAVA_HOME is not set" in problems[1]
    assert "hadoop classpath --glob" in problems[2]
    # Variables set but pointing at nothing: each says where it looked.
    problems = hdfs_problems(env={"HADOOP_HOME": str(tmp_path), "JAVA_HOME": str(tmp_path),
                                  "CLASSPATH": "/opt/hadoop/share/hadoop/common/x.jar"})
    assert len(problems) == 2
    assert f"no libhdfs.so in {tmp_path}/lib/native" in problems[0]
    assert f"no libjvm.so under JAVA_HOME={tmp_path}" in problems[1]
    # A complete-looking setup has no problems.
    (tmp_path / "lib" / "native").mkdir(parents=True)
    (tmp_path / "lib" / "native" / "libhdfs.so").write_bytes(b"")
    (tmp_path / "lib" / "server").mkdir(parents=True)
    (tmp_path / "lib" / "server" / "libjvm.so").write_bytes(b"")
    env = {"HADOOP_HOME": str(tmp_path), "JAVA_HOME": str(tmp_path), "CLASSPATH": "/h/hadoop-common.jar"}
    assert hdfs_problems(env=env) == []


def test_hdfs_url_without_libhdfs_says_how_to_fix(monkeypatch):
    for var in ("ARROW_LIBHDFS_DIR", "HADOOP_HOME", "JAVA_HOME", "CLASSPATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(StorageError, match=r"cannot open hdfs://nn:9000/data: pyarrow's HDFS client "
                                           r"is not usable on this machine"):
        resolve("hdfs://nn:9000/data")


def test_hdfs_url_host_and_port_reach_the_client(tmp_path, monkeypatch):
    """With every piece 'present' (empty stand-ins) the client is tried with the URL's host:port."""
    (tmp_path / "lib" / "native").mkdir(parents=True)
    (tmp_path / "lib" / "native" / "libhdfs.so").write_bytes(b"")
    (tmp_path / "lib" / "server").mkdir(parents=True)
    (tmp_path / "lib" / "server" / "libjvm.so").write_bytes(b"")
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    monkeypatch.setenv("HADOOP_HOME", str(tmp_path))
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    monkeypatch.setenv("CLASSPATH", "/h/hadoop-common.jar")
    with pytest.raises(StorageError, match=r"cannot connect to HDFS at nn:9000 for hdfs://nn:9000/d"):
        hdfs_filesystem("hdfs://nn:9000/d")


def test_list_files_skips_markers_and_hidden(tmp_path):
    for name in ("part-1.parquet", "part-0.parquet", "_SUCCESS", ".part-0.parquet.crc",
                 "_tf_schema.json", "sub/part-2.parquet", "_temporary/0/part-9.parquet"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    files = list_files(resolve(tmp_path))
    assert files == [os.path.join(tmp_path, n) for n in ("part-0.parquet", "part-1.parquet",
                                                         "sub/part-2.parquet")]
    single = tmp_path / "part-0.parquet"
    assert list_files(resolve(single)) == [str(single)]
    # a marker named on its own is not read as data (inspect talked of schema inference)
    for marker in ("_SUCCESS", ".part-0.parquet.crc"):
        with pytest.raises(StorageError, match=rf"^{tmp_path}/{marker} is a marker file a writer leaves "
                                               rf"beside the data, not data; point at its directory \({tmp_path}\)\.$"):
            list_files(resolve(tmp_path / marker))


def test_a_device_or_pipe_is_named_as_neither_file_nor_directory(tmp_path):
    # /dev/null was reported as "cannot list /dev/null: ... Not a directory"
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path in ("/dev/null", str(pipe)):
        with pytest.raises(StorageError, match=rf"^{path} is neither a file nor a directory \(a device, "
                                               r"pipe or socket\); point at a data file"):
            list_files(resolve(path))


def test_an_ssl_failure_with_a_schemeless_endpoint_says_https_was_used(monkeypatch):
    from formats.fs import storage_error

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:8333")
    exc = OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 35, SSL connect error")
    msg = str(storage_error(exc, "read", "s3://b/k"))
    assert msg.endswith("AWS_ENDPOINT_URL has no scheme, so https is used; for a plain-HTTP server "
                        "write http://HOST:PORT."), msg
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://127.0.0.1:8333")
    assert "has no scheme" not in str(storage_error(exc, "read", "s3://b/k"))


def test_write_text_atomic_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "memo"
    target.write_text("old")
    write_text_atomic(target, "new ünïcode")
    assert target.read_text(encoding="utf-8") == "new ünïcode"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memo"]
    # a rename that fails (the target is a non-empty directory) leaves no temporary file
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "x").write_text("x")
    with pytest.raises(OSError):
        write_text_atomic(blocked, "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "memo"]
