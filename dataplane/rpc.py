"""Flight plumbing shared by the driver and the nodes: bearer-token auth and JSON actions.

Every Flight call carries ``authorization: Bearer <cluster secret>``; servers refuse calls without
it. Control messages are JSON documents in Flight actions; nothing is pickled on the network.
Clients are created where they are used (inside a Spark task, inside a node) and never shared
across ``fork()``: gRPC does not survive it.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
from typing import Any

import pyarrow.flight as flight

__all__ = [
    "AuthMiddlewareFactory",
    "connect",
    "call_options",
    "do_json_action",
    "json_result",
    "bind_port",
    "PortRangeError",
]

logger = logging.getLogger(__name__)


class PortRangeError(OSError):
    """No free port in the configured range (raised on the node; the driver reports it)."""


class _Pass(flight.ServerMiddleware):
    pass


class AuthMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Refuses every call whose bearer token is not the cluster secret."""

    def __init__(self, secret: str) -> None:
        super().__init__()
        self._expected = f"Bearer {secret}".encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[Any]]) -> _Pass:
        values = headers.get("authorization") or headers.get("Authorization") or []
        for v in values:
            got = v.encode() if isinstance(v, str) else bytes(v)
            if hmac.compare_digest(got, self._expected):
                return _Pass()
        raise flight.FlightUnauthenticatedError(
            "dataplane: missing or wrong cluster secret (send 'authorization: Bearer <secret>')"
        )


def call_options(secret: str, timeout: float | None = None) -> flight.FlightCallOptions:
    """Call options carrying the bearer token (and an optional per-call deadline in seconds)."""
    return flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {secret}".encode())], timeout=timeout
    )


def connect(location: str, *, tls_root_certs: bytes | None = None) -> flight.FlightClient:
    """A new Flight client. Create one per process (or per task); never share across fork."""
    kw: dict[str, Any] = {}
    if tls_root_certs is not None:
        kw["tls_root_certs"] = tls_root_certs
    return flight.FlightClient(location, **kw)


def do_json_action(
    client: flight.FlightClient,
    secret: str,
    name: str,
    body: dict[str, Any] | None = None,
    *,
    timeout: float | None = 30.0,
) -> dict[str, Any]:
    """Run one JSON action and return its JSON reply (``{}`` when the server sends none)."""
    action = flight.Action(name, json.dumps(body or {}).encode())
    results = list(client.do_action(action, options=call_options(secret, timeout)))
    if not results:
        return {}
    return json.loads(results[0].body.to_pybytes())


def json_result(obj: dict[str, Any]) -> list[flight.Result]:
    """Server side: wrap a JSON reply for ``do_action``."""
    return [flight.Result(json.dumps(obj).encode())]


def bind_port(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    """Bind a TCP socket on ``host`` to port 0 or the first free port in ``port_range``.

    The caller keeps the socket open to hold the port and closes it just before the real server
    binds it.

    Raises:
        PortRangeError: every port in the range is taken.
    """
    if port_range is None:
        candidates = [0]
    else:
        lo, hi = port_range
        candidates = list(range(lo, hi + 1))
    for port in candidates:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((host, port))
            return s
        except OSError:
            s.close()
    lo, hi = port_range  # type: ignore[misc]
    raise PortRangeError(
        f"no free port in port_range {lo}-{hi} on {host} ({len(candidates)} tried): every port "
        f"is in use. Each node needs 2-3 ports (Flight, TF, TensorBoard on the chief); widen "
        f"port_range or stop what holds those ports."
    )
