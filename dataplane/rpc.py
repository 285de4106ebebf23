"""Flight plumbing of the driver and the nodes: JSON actions, port binding, and the auth/client
helpers re-exported from :mod:`feeders.flight`.

Every Flight call carries ``authorization: Bearer <cluster secret>``; servers refuse calls without
it. Control messages are JSON documents in Flight actions; nothing is pickled on the network.
Clients, the bearer-token middleware and the per-process client cache of the push tasks
(:func:`task_client`) live in :mod:`feeders.flight`, the lowest package that uses them.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Mapping

import pyarrow.flight as flight

from feeders.flight import AuthMiddlewareFactory, call_options, connect, task_client

__all__ = [
    "AuthMiddlewareFactory",
    "connect",
    "task_client",
    "call_options",
    "do_json_action",
    "json_result",
    "bind_port",
    "PortRangeError",
]


class PortRangeError(OSError):
    """No free port in the configured range (raised on the node; the driver reports it)."""


def connect_driver(location: str, tls: Mapping[str, str] | None) -> flight.FlightClient:
    """A client of the driver's control server, from a node config's ``tls`` entry.

    ``tls`` is ``{"cert": PEM, "key": PEM}`` when the cluster runs with TLS (the certificate is
    every client's root), else ``None``.
    """
    return connect(location, tls_root_certs=tls["cert"].encode() if tls else None)


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
