"""Turn a path or URL into a ``pyarrow.fs`` filesystem plus a path on it, and list data files.

Supported: plain paths and ``file://``; ``s3://bucket/key`` (credentials, endpoint and region
from the standard AWS variables, or pass ``filesystem=``); ``hdfs://host:port/path`` through
pyarrow's ``HadoopFileSystem`` (needs libhdfs, Java and the Hadoop jars; a missing piece is a
:class:`~formats.errors.StorageError` that says which and how to fix it).

The environment is read when a URL is resolved, never at import time.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

from formats.errors import StorageError

__all__ = [
    "Location",
    "resolve",
    "list_files",
    "parquet_files",
    "PARQUET_SUFFIXES",
    "s3_filesystem",
    "hdfs_filesystem",
    "hdfs_problems",
    "storage_error",
    "listing_root",
    "write_text_atomic",
    "through_pyarrow",
    "upload",
    "download",
    "local_copy",
]

logger = logging.getLogger(__name__)

_GLOB_CHARS = ("*", "?", "[")


def _glob_root(path: str) -> str | None:
    """The directory above the first component of ``path`` holding a glob character, if any."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in _GLOB_CHARS):
            return "/".join(parts[:i]) or "/"
    return None


def listing_root(loc: "Location") -> str:
    """The directory a location's files are listed under: its path, or for a glob pattern
    (``data/day=*/part-*.parquet``) the directory above the first wildcard. Hive-style
    ``key=value`` directories count from here."""
    return _glob_root(loc.path) or loc.path


def _matches(path: str, pattern: list[str]) -> bool:
    """``path`` is matched by the glob ``pattern`` (split on ``/``) or lies below a match."""
    import fnmatch

    parts = path.split("/")
    return len(parts) >= len(pattern) and all(
        fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern)
    )

_HIDDEN_PREFIXES = ("_", ".")


@dataclass(frozen=True)
class Location:
    """A resolved path or URL.

    Attributes:
        filesystem: the ``pyarrow.fs.FileSystem`` to read with (picklable).
        path: the path on that filesystem (``bucket/key`` for S3, absolute for local/HDFS).
        url: the URL as the user gave it, for messages.
        scheme: ``file``, ``s3`` or ``hdfs`` (``custom`` when a filesystem was passed in).
    """

    filesystem: Any
    path: str
    url: str
    scheme: str

    def display(self, path: str) -> str:
        """A path on this filesystem written back as a URL, for messages and listings."""
        if self.scheme == "s3":
            return f"s3://{path}"
        if self.scheme == "hdfs":
            parts = urlsplit(self.url)
            return f"hdfs://{parts.netloc}{path}"
        return path


def _endpoint(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(host[:port], scheme) from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, if either is set."""
    raw = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not raw:
        return None, "https"
    if "://" not in raw:
        return raw.rstrip("/"), "https"
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise StorageError(
            f"the S3 endpoint {raw!r} (from AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL) is not an "
            f"http(s) URL; set it like http://127.0.0.1:8333 or https://s3.example.com."
        )
    return parts.netloc, parts.scheme


def s3_filesystem(*, env: Mapping[str, str] | None = None) -> Any:
    """A ``pyarrow.fs.S3FileSystem`` configured from the standard AWS variables.

    Reads ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``),
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (``http://host:port`` for a local server),
    and ``AWS_REGION`` / ``AWS_DEFAULT_REGION``. Unset keys fall back to the AWS SDK's own
    chain (config files, instance roles).

    Args:
        env: where to read the variables (default: ``os.environ``, read now).
    """
    from pyarrow import fs

    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    host, scheme = _endpoint(env)
    if host:
        kwargs["endpoint_override"] = host
        kwargs["scheme"] = scheme
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if bool(key) != bool(secret):
        raise StorageError(
            "only one of AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY is set; set both (or neither "
            "to use the AWS SDK's default credential chain)."
        )
    if key:
        kwargs["access_key"] = key
        kwargs["secret_key"] = secret
        if env.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = env["AWS_SESSION_TOKEN"]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    elif host:
        # A custom endpoint (MinIO, SeaweedFS...) rarely cares, but the SDK would otherwise try
        # to discover the bucket's region from AWS itself.
        kwargs["region"] = "us-east-1"
    return fs.S3FileSystem(**kwargs)


def hdfs_problems(*, env: Mapping[str, str] | None = None) -> list[str]:
    """What is missing for pyarrow's ``HadoopFileSystem`` to load, each with its fix.

    pyarrow needs (1) ``libhdfs.so``, found through ``ARROW_LIBHDFS_DIR`` or
    ``$HADOOP_HOME/lib/native``; (2) a JVM, through ``JAVA_HOME``; (3) the Hadoop jars on
    ``CLASSPATH`` (``hadoop classpath --glob``). An empty list means all three look present.
    """
    env = os.environ if env is None else env
    problems = []
    lib_dirs = []
    if env.get("ARROW_LIBHDFS_DIR"):
        lib_dirs.append(env["ARROW_LIBHDFS_DIR"])
    if env.get("HADOOP_HOME"):
        lib_dirs.append(os.path.join(env["HADOOP_HOME"], "lib", "native"))
    if not lib_dirs:
        problems.append(
            "libhdfs: neither ARROW_LIBHDFS_DIR nor HADOOP_HOME is set; set HADOOP_HOME to your "
            "Hadoop install (libhdfs.so is in $HADOOP_HOME/lib/native) or ARROW_LIBHDFS_DIR to "
            "the directory holding libhdfs.so"
        )
    elif not any(os.path.exists(os.path.join(d, "libhdfs.so")) for d in lib_dirs):
        problems.append(
            f"libhdfs: no libhdfs.so in {', '.join(lib_dirs)}; point ARROW_LIBHDFS_DIR at the "
            f"directory that holds it (usually $HADOOP_HOME/lib/native)"
        )
    if not env.get("JAVA_HOME"):
        problems.append(
            "Java: JAVA_HOME is not set; install a JDK and export JAVA_HOME (libhdfs starts a "
            "JVM from $JAVA_HOME/lib/server/libjvm.so)"
        )
    elif not glob.glob(os.path.join(env["JAVA_HOME"], "**", "libjvm.so"), recursive=True):
        problems.append(
            f"Java: no libjvm.so under JAVA_HOME={env['JAVA_HOME']}; point JAVA_HOME at a JDK"
        )
    if "hadoop" not in env.get("CLASSPATH", "").lower():
        problems.append(
            "CLASSPATH: the Hadoop jars are not on CLASSPATH; run "
            "export CLASSPATH=$(hadoop classpath --glob)"
        )
    return problems


def hdfs_filesystem(url: str, *, env: Mapping[str, str] | None = None) -> Any:
    """A ``pyarrow.fs.HadoopFileSystem`` for ``hdfs://host[:port]/...``.

    Raises:
        StorageError: libhdfs, Java or the Hadoop classpath is missing (each named with its fix),
            or the connection failed.
    """
    from pyarrow import fs

    parts = urlsplit(url)
    host = parts.hostname or "default"
    port = parts.port or (8020 if parts.hostname else 0)
    problems = hdfs_problems(env=env)
    if problems:
        raise StorageError(
            f"cannot open {url}: pyarrow's HDFS client is not usable on this machine:\n  - "
            + "\n  - ".join(problems)
        )
    try:
        return fs.HadoopFileSystem(host, port)
    except (OSError, RuntimeError) as exc:
        raise StorageError(
            f"cannot connect to HDFS at {host}:{port} for {url}: {exc}. Check that the NameNode "
            f"is reachable and that CLASSPATH holds the output of `hadoop classpath --glob`."
        ) from exc


def resolve(path_or_url: str | os.PathLike, *, filesystem: Any = None) -> Location:
    """Resolve a path or URL to a :class:`Location`.

    Args:
        path_or_url: a local path, ``file://`` (or Hadoop's ``file:/path``), ``s3://`` or ``hdfs://`` URL.
        filesystem: a ``pyarrow.fs.FileSystem`` (or fsspec filesystem) to use instead of the
            one the URL implies; the URL's scheme is then stripped (``s3://b/k`` -> ``b/k``).

    Raises:
        StorageError: an unsupported scheme, an unusable HDFS setup.
    """
    if isinstance(path_or_url, os.PathLike):
        path_or_url = os.fspath(path_or_url)
    if not isinstance(path_or_url, str) or not path_or_url:
        raise StorageError(
            f"expected a path or URL string (local path, file://, s3:// or hdfs://), got "
            f"{path_or_url!r}."
        )
    url = path_or_url
    if url[:5].lower() == "file:" and url[5:6] == "/" and url[5:7] != "//":
        url = "file://" + url[5:]  # Hadoop's file:/path, as Spark writes a table's location
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    # not urlsplit's path: '?' and '#' are glob or name characters here, not a query
    netloc, _, rest = url.split("://", 1)[1].partition("/") if scheme else ("", "", "")
    url_path = "/" + rest
    if scheme == "file":
        from urllib.parse import unquote

        url_path = unquote(url_path)  # file:///data/my%20set, as Spark's inputFiles() writes it
    if filesystem is not None:
        from pyarrow import fs

        if not isinstance(filesystem, fs.FileSystem):
            filesystem = fs.PyFileSystem(fs.FSSpecHandler(filesystem))
        path = url.split("://", 1)[1] if scheme else url
        if scheme == "file" or (scheme == "" and isinstance(filesystem, fs.LocalFileSystem)):
            path = os.path.abspath(url_path if scheme == "file" else path)
        # any other filesystem takes its own paths as given ("bucket/key" for S3FileSystem)
        return Location(filesystem, path.rstrip("/") or "/", url, "custom")
    if scheme in ("", "file"):
        from pyarrow import fs

        path = url_path if scheme == "file" else url
        return Location(fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path)), url, "file")
    if scheme in ("s3", "s3a"):
        if not netloc:
            raise StorageError(f"{url!r} names no bucket; write it as s3://bucket/prefix.")
        path = f"{netloc}{url_path}".rstrip("/")
        if "//" in path:
            raise StorageError(
                f"{url!r} has an empty path component ('//'); pyarrow's S3 client cannot address "
                f"such a key. Remove the extra '/'."
            )
        return Location(s3_filesystem(), path, url, "s3")
    if scheme in ("hdfs", "viewfs"):
        return Location(hdfs_filesystem(url), url_path.rstrip("/") or "/", url, "hdfs")
    raise StorageError(
        f"unsupported URL scheme {scheme!r} in {url!r}; use a local path, file://, s3:// or "
        f"hdfs://, or pass filesystem= (a pyarrow.fs or fsspec filesystem)."
    )


def storage_error(exc: BaseException, what: str, url: str) -> StorageError:
    """Wrap a filesystem ``OSError`` into a :class:`StorageError` with a hint for the usual causes."""
    text = str(exc)
    hint = ""
    if "ACCESS_DENIED" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        hint = (
            " The S3 server refused the credentials: check AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or the filesystem= you passed) and that the key may read "
            "this bucket."
        )
    elif "NETWORK_CONNECTION" in text or "Could not connect" in text:
        hint = (
            " The S3 endpoint could not be reached: check AWS_ENDPOINT_URL / "
            "AWS_ENDPOINT_URL_S3 and that the server is running."
        )
    elif "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text or (text.startswith("Bucket '") and "not found" in text):
        # pyarrow's own text for a missing bucket names an option of its S3FileSystem
        text = text.split(". To create buckets", 1)[0]
        hint = (" The bucket does not exist: check the bucket name in the URL (nothing here "
                "creates buckets; create it first).")
    raw = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if "SSL" in text and raw and "://" not in raw:
        hint += (" AWS_ENDPOINT_URL has no scheme, so https is used; for a plain-HTTP server "
                 "write http://HOST:PORT.")
    return StorageError(f"cannot {what} {url}: {text.rstrip('.')}.{hint}")


def list_files(
    loc: Location,
    *,
    suffixes: Sequence[str] | None = None,
    accept: Callable[[str], bool] | None = None,
) -> list[str]:
    """Data files under a location, sorted: the file itself, or every file below a directory,
    or every file a glob pattern matches (``*``, ``?``, ``[...]`` within one path component, as
    Spark and ``tf.io.gfile.glob`` read them; files below a matching directory count).

    Hidden and marker files (names starting with ``_`` or ``.``, such as ``_SUCCESS`` or
    ``.part.crc``) are skipped. ``suffixes`` keeps only names ending in one of them; ``accept``
    is an extra predicate on the path.

    Raises:
        StorageError: the path does not exist, cannot be listed (credentials, network), or holds
            no matching file.
    """
    from pyarrow import fs

    try:
        info = loc.filesystem.get_file_info(loc.path)
    except OSError as exc:
        raise storage_error(exc, "read", loc.url) from exc
    root = _glob_root(loc.path) if info.type == fs.FileType.NotFound else None
    if root is not None:
        try:
            info = loc.filesystem.get_file_info(root)
        except OSError as exc:
            raise storage_error(exc, "read", loc.url) from exc
    if info.type == fs.FileType.NotFound:
        raise StorageError(
            f"{loc.url} does not exist (looked for {root or loc.path!r} on "
            f"{loc.filesystem.type_name}); check the path, and for s3:// the bucket, key and "
            f"AWS_ENDPOINT_URL."
        )
    if info.type == fs.FileType.File:
        name = loc.path.rsplit("/", 1)[-1]
        if name == "_SUCCESS" or name.startswith(("_committed_", "_started_")) or name.endswith(".crc"):
            raise StorageError(
                f"{loc.url} is a marker file a writer leaves beside the data, not data; point at "
                f"its directory ({loc.url.rsplit('/', 1)[0]})."
            )
        return [loc.path]
    if info.type == fs.FileType.Unknown:  # a device, a pipe, a socket: nothing to list or seek
        raise StorageError(
            f"{loc.url} is neither a file nor a directory (a device, pipe or socket); point at "
            f"a data file or a directory of them."
        )
    base = root or loc.path
    try:
        infos = loc.filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    except OSError as exc:
        raise storage_error(exc, "list", loc.url) from exc
    prefix = base.rstrip("/") + "/"
    pattern = loc.path.split("/") if root is not None else None
    files = []
    for entry in infos:
        if entry.type != fs.FileType.File:
            continue
        if pattern is not None and not _matches(entry.path, pattern):
            continue
        rel = entry.path[len(prefix):] if entry.path.startswith(prefix) else entry.base_name
        if any(part.startswith(_HIDDEN_PREFIXES) for part in rel.split("/")):
            continue
        if suffixes and not entry.base_name.endswith(tuple(suffixes)):
            continue
        if accept is not None and not accept(entry.path):
            continue
        files.append(entry.path)
    if not files:
        wanted = f" ending in {', '.join(suffixes)}" if suffixes else ""
        what = "matches no data file" if pattern is not None else "is a directory with no data files"
        raise StorageError(
            f"{loc.url} {what}{wanted} (hidden and _-prefixed files are skipped); check the "
            f"path."
        )
    return sorted(files)


PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")


def parquet_files(loc: Location, files: list[str]) -> list[str]:
    """The Parquet data files among ``files`` (a :func:`list_files` listing of ``loc``).

    Where some are named ``*.parquet`` (``.parq``, ``.pq``), the others count only if they
    start with Parquet's magic bytes (``part-00000`` from a writer that adds no suffix); the
    rest (a README, a schema) are skipped with a warning naming them. Without any such name,
    every file is taken (and one that is not Parquet fails where it is read, named).
    """
    named = [f for f in files if f.endswith(PARQUET_SUFFIXES)]
    others = [f for f in files if not f.endswith(PARQUET_SUFFIXES)]
    if not named or not others:
        return files

    def is_parquet(path: str) -> bool:
        try:
            with loc.filesystem.open_input_stream(path, compression=None) as f:
                return f.read(4) == b"PAR1"
        except OSError as exc:
            raise storage_error(exc, "read", loc.display(path)) from exc

    kept = [f for f in others if is_parquet(f)]
    skipped = [f for f in others if f not in kept]
    if skipped:
        logger.warning(
            "%s: skipping %d file(s) that are not Parquet: %s", loc.url, len(skipped),
            ", ".join(p.rsplit("/", 1)[-1] for p in skipped[:5]) + (" ..." if len(skipped) > 5 else ""),
        )
    return sorted(named + kept)


def files_stamp(path_or_url: str | os.PathLike) -> tuple | None:
    """What changes when the file at ``path_or_url`` (a local path or any URL :func:`resolve`
    takes), or any file of the directory there (a SavedModel, a Parquet data set), is written
    again: paths, sizes and modification times. None when nothing is there or it cannot be
    listed."""
    from pyarrow import fs as pafs

    try:
        loc = resolve(path_or_url)
        info = loc.filesystem.get_file_info(loc.path)
        if info.type == pafs.FileType.Directory:
            infos = loc.filesystem.get_file_info(pafs.FileSelector(loc.path, recursive=True))
        elif info.type == pafs.FileType.File:
            infos = [info]
        else:
            return None
    except (OSError, StorageError, ValueError):
        return None
    return tuple(sorted((i.path, i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to the local file ``path`` so that a reader sees the old contents or the
    new, never a part: written beside it (named with this process's id), then renamed over it."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# URL schemes whose files go through pyarrow.fs here. TensorFlow 2.18+ has no filesystem for
# them (its s3:// and hdfs:// moved to tensorflow-io, whose ops do not load there), so a model is
# saved to a local file first and copied, and read back the same way. Other schemes TensorFlow
# knows itself (gs://) stay TensorFlow's.
PYARROW_SCHEMES = ("s3", "s3a", "hdfs", "viewfs")


def through_pyarrow(path_or_url: str | os.PathLike) -> bool:
    """Whether ``path_or_url`` is a URL of a remote filesystem this module reaches through
    ``pyarrow.fs`` (``s3://``, ``hdfs://``) rather than a local path."""
    text = os.fspath(path_or_url)
    return isinstance(text, str) and "://" in text and urlsplit(text).scheme.lower() in PYARROW_SCHEMES


def upload(local: str | os.PathLike, url: str, *, overwrite: bool = True) -> None:
    """Copy the local file or directory ``local`` (a saved model) to ``url``, replacing what is
    there: a directory there is removed first, so no file of an earlier save stays beside the
    new ones. A file arrives whole (an S3 object appears when its upload completes); a
    directory's files arrive one by one.

    Raises:
        FileExistsError: something is at ``url`` and ``overwrite`` is False.
        StorageError: the filesystem refused (credentials, a missing bucket), naming the URL.
    """
    from pyarrow import fs as pafs

    loc = resolve(url)
    source = os.fspath(local)
    if (loc.scheme == "s3" and "/" not in loc.path) or loc.path == "/":
        # replacing what is there would empty the whole bucket or filesystem
        raise StorageError(f"cannot save to {url}: it names a bucket or a filesystem's root, "
                           f"not a place in it; add a path, e.g. {url.rstrip('/')}/models/model.keras")
    try:
        there = loc.filesystem.get_file_info(loc.path).type
        if there != pafs.FileType.NotFound and not overwrite:
            raise FileExistsError(f"{url} exists and the save was given overwrite=False")
        if there == pafs.FileType.Directory:
            loc.filesystem.delete_dir(loc.path)
        elif there == pafs.FileType.File and os.path.isdir(source):
            loc.filesystem.delete_file(loc.path)
        parent = loc.path.rsplit("/", 1)[0]
        if parent and parent != loc.path and loc.scheme != "s3":  # (S3 has no folders to make)
            loc.filesystem.create_dir(parent, recursive=True)
        pafs.copy_files(source, loc.path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=loc.filesystem)
    except (FileExistsError, StorageError):
        raise
    except OSError as exc:
        raise storage_error(exc, "write", url) from exc


def download(url: str, into: str | os.PathLike) -> str:
    """Copy the file or directory at ``url`` into the local directory ``into``, under its own
    name; returns the local path of the copy.

    Raises:
        StorageError: nothing is at ``url``, or the filesystem refused, naming the URL.
    """
    import posixpath

    from pyarrow import fs as pafs

    loc = resolve(url)
    target = os.path.join(os.fspath(into), posixpath.basename(loc.path.rstrip("/")) or "model")
    try:
        there = loc.filesystem.get_file_info(loc.path).type
        if there == pafs.FileType.NotFound:
            raise StorageError(f"nothing is at {url} (no file, no directory): check the path")
        if there == pafs.FileType.Directory:
            os.makedirs(target, exist_ok=True)
        pafs.copy_files(loc.path, target, source_filesystem=loc.filesystem,
                        destination_filesystem=pafs.LocalFileSystem())
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, "read", url) from exc
    return target


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local path holding what ``path`` holds, for the ``with`` block: an ``s3://`` or
    ``hdfs://`` file or folder is copied into a temporary directory (:func:`download`) and
    the copy removed afterwards; a local path, or ``file://``, is handed back as it is."""
    import tempfile

    if not isinstance(path, str) or not path:
        raise ValueError(f"local_copy needs a path or URL (str), got {path!r}")
    if not through_pyarrow(path):
        yield resolve(path).path if path.lower().startswith("file:") else path
        return
    with tempfile.TemporaryDirectory(prefix="dataplane-copy-") as scratch:
        yield download(path, scratch)
