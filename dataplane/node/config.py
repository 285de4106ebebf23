"""A node's configuration: what the driver tells every node it starts, as one typed value.

The driver builds one :class:`NodeConfig` per cluster (``dataplane.run``), the launch task
(:mod:`dataplane.node.launcher`, which re-exports it) fills in the fields only it knows with
:meth:`NodeConfig.for_node` and writes it to ``config.json`` in the node's work directory, and the
node process (:mod:`dataplane.node.process`) loads it from there. The defaults below are the only
ones: ``run()``'s keyword defaults refer to them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NodeConfig"]

_MiB = 1 << 20


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node process needs to start, join its cluster and run ``main``.

    Secrets (the cluster's ``secret``, the TLS private key) stay out of ``repr``.
    """

    cluster_id: str
    driver: str  # the driver's control server, e.g. "grpc://10.0.0.5:40123"
    secret: str = field(repr=False)  # bearer token of every call in the cluster
    buffer_bytes: int = 64 * _MiB  # the node's feed buffer; producers wait when it is full
    cache_bytes: int = 1024 * _MiB  # memory for train(cache=True); the rest spills to disk
    port_range: tuple[int, int] | None = None  # inclusive; None: any free port
    bind_host: str | None = None  # None until the launch task resolves it on its executor
    heartbeat_interval: float = 1.0  # seconds between heartbeats to the driver
    heartbeat_timeout: float = 15.0  # the node exits when the driver is unreachable this long
    reservation_timeout: float = 120.0  # seconds for every node to register
    stop_grace: float = 10.0  # seconds main gets to return after a stop before the node exits
    tensorboard: bool = False  # start TensorBoard on the chief
    log_to_driver: bool = True  # send the node's stdout/stderr to the driver with its heartbeats
    log_dir: str | None = None  # TensorBoard's log directory on the chief
    default_fs: str = "file:///"  # the Hadoop default file system, for ctx paths
    tls_cert: str | None = None  # PEM; every client's root. None: plaintext gRPC
    tls_key: str | None = field(default=None, repr=False)  # PEM private key of tls_cert
    node_id: int | None = None  # the launch task's partition; None in the driver's template

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("NodeConfig: tls_cert and tls_key go together (both PEM text, or both None)")

    @property
    def tls(self) -> dict[str, str] | None:
        """``{"cert", "key"}`` PEM text, as :func:`dataplane.rpc.connect_driver` takes it, or
        ``None`` for plaintext gRPC."""
        if self.tls_cert is None:
            return None
        return {"cert": self.tls_cert, "key": self.tls_key or ""}

    @property
    def scheme(self) -> str:
        """The Flight scheme of the node's server."""
        return "grpc+tls" if self.tls_cert else "grpc"

    def for_node(self, node_id: int, bind_host: str) -> NodeConfig:
        """This cluster's config for one node, as its launch task knows it."""
        return dataclasses.replace(self, node_id=node_id, bind_host=bind_host)

    # -- config.json ------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeConfig:
        data: dict[str, Any] = json.loads(text)
        if data.get("port_range") is not None:
            low, high = data["port_range"]
            data["port_range"] = (int(low), int(high))
        return cls(**data)

    def save(self, path: str) -> None:
        """Write to a new file only its owner can read (the config holds the cluster's secret)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> NodeConfig:
        with open(path) as f:
            return cls.from_json(f.read())
