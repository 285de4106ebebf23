"""The driver's control server: reservation, heartbeats and node outcomes.

Nodes reach it over Flight actions (JSON bodies, bearer token):

``register``   a node has bound its ports; body: node id, host, ports, pid.
``wait_spec``  block (bounded) until every node registered; reply: the topology, or pending.
``heartbeat``  a node is alive; reply says whether the driver wants it to stop.
``done``       the node's ``main`` finished: ok, or the traceback text (with ``note``: why a
               pass main read ended without rows, when one did).
``exited``     sent by the node's reaper when the node ended without a word (killed by a
               signal, a native crash, ``os._exit``): its exit code and its log's last lines.

A heartbeat or ``done`` may carry ``log``: what the node wrote to its stdout and stderr since
its last message (``run(log_to_driver=True)``), printed here on the driver's stderr.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.flight as flight

from dataplane.errors import drop_tf_noise
from dataplane.rpc import AuthMiddlewareFactory, json_result
from dataplane.topology import Topology, assign_roles

__all__ = ["ControlServer", "NodeStatus"]

logger = logging.getLogger(__name__)


@dataclass
class NodeStatus:
    """What the driver knows about one node's life."""

    registration: dict[str, Any]
    last_seen: float
    done: bool = False
    ok: bool = True
    traceback: str = ""
    # the node's own word on main's failure: why a pass it read ended without rows
    note: str = ""
    exited: bool = False
    # from the node's reaper when it ended without a word: its exit code (negative: the
    # signal that killed it) and the last lines it wrote
    exit_code: int | None = None
    exit_log: str = ""


class ControlServer(flight.FlightServerBase):
    """Runs in the driver process for the life of one cluster."""

    def __init__(
        self,
        host: str,
        secret: str,
        *,
        num_nodes: int,
        num_ps: int,
        evaluator: bool,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.scheme = "grpc+tls" if tls else "grpc"
        kw: dict[str, Any] = {}
        if tls:
            kw["tls_certificates"] = [flight.CertKeyPair(cert=tls[0], key=tls[1])]
        super().__init__(
            f"{self.scheme}://{host}:0", middleware={"auth": AuthMiddlewareFactory(secret)}, **kw
        )
        self.host = host
        self._num_nodes = num_nodes
        self._num_ps = num_ps
        self._evaluator = evaluator
        self._cond = threading.Condition()
        self.status: dict[int, NodeStatus] = {}
        self.topology: Topology | None = None
        self.stopping = False
        self.role_error: str | None = None
        self.launch_failures: dict[int, dict[str, str]] = {}
        # (key, n) -> (node id, value): the first node's value of its n-th ctx.agree(key, ...)
        self.agreed: dict[tuple[str, int], tuple[int, Any]] = {}

    @property
    def location(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    # -- driver-side API ---------------------------------------------------------------------
    def wait_registered(self, timeout: float) -> bool:
        """Block until every node registered (True) or ``timeout`` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.topology is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def registered_ids(self) -> list[int]:
        with self._cond:
            return sorted(self.status)

    def request_stop(self) -> None:
        """Tell every node (through its next heartbeat or wait) to stop."""
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def snapshot(self) -> dict[int, NodeStatus]:
        with self._cond:
            return {k: NodeStatus(**vars(v)) for k, v in self.status.items()}

    def wait_for(self, predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
        """Wait until ``predicate(status_dict)`` holds, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.status):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.25))
            return True

    # -- Flight handlers -----------------------------------------------------------------------
    def do_action(self, context: flight.ServerCallContext, action: flight.Action):  # type: ignore[override]
        import json

        body = json.loads(action.body.to_pybytes() or b"{}")
        handler = getattr(self, f"_on_{action.type}", None)
        if handler is None:
            raise flight.FlightServerError(f"dataplane control: unknown action {action.type!r}")
        return json_result(handler(body))

    def _on_register(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id = int(body["node_id"])
        with self._cond:
            if node_id in self.status:
                # A retried launch task of a node that already registered: refuse the duplicate.
                return {"accepted": False, "reason": f"node {node_id} is already registered"}
            self.status[node_id] = NodeStatus(registration=body, last_seen=time.monotonic())
            if len(self.status) == self._num_nodes:
                try:
                    self.topology = assign_roles(
                        {k: v.registration for k, v in self.status.items()},
                        num_ps=self._num_ps,
                        evaluator=self._evaluator,
                    )
                except ValueError as e:  # pragma: no cover - run() validates this up front
                    self.role_error = str(e)
            self._cond.notify_all()
        logger.debug("node %d registered from %s", node_id, body.get("host"))
        return {"accepted": True}

    def _on_launch(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id = int(body["node_id"])
        with self._cond:
            st = self.status.get(node_id)
            if st is None or st.exited:
                return {"registered": False}
            return {"registered": True, "registration": st.registration}

    def _on_launch_failed(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._cond:
            self.launch_failures[int(body["node_id"])] = {
                "error": str(body.get("error", "")),
                "log": str(body.get("log", "")),
            }
            self._cond.notify_all()
        return {}

    def _on_wait_spec(self, body: dict[str, Any]) -> dict[str, Any]:
        wait = min(float(body.get("wait", 5.0)), 10.0)
        deadline = time.monotonic() + wait
        with self._cond:
            self._touch(body)
            while self.topology is None and not self.stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ready": False, "stop": False}
                self._cond.wait(left)
            if self.stopping:
                return {"ready": False, "stop": True}
            return {"ready": True, "topology": self.topology.to_json()}  # type: ignore[union-attr]

    def _on_agree(self, body: dict[str, Any]) -> dict[str, Any]:
        """The value of the first node to ask: every node's n-th ``ctx.agree(key, value)`` gets it."""
        node_id = int(body["node_id"])
        with self._cond:
            self._touch(body)
            first = self.agreed.setdefault((str(body["key"]), int(body["n"])), (node_id, body["value"]))
        return {"node_id": first[0], "value": first[1]}

    def _on_heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._show_log(body)
        with self._cond:
            self._touch(body)
            return {"stop": self.stopping}

    def _show_log(self, body: dict[str, Any]) -> None:
        """Print a node's forwarded log lines, each prefixed with the node."""
        text = body.get("log")
        if not text:
            return
        node_id = int(body.get("node_id", -1))
        who = f"node {node_id}"
        with self._cond:
            if self.topology is not None and node_id in self.status:
                who += f" {self.topology.node(node_id).role}"
        lines = drop_tf_noise(str(text).rstrip("\n").split("\n"))
        if not lines:
            return
        out = "".join(f"[{who}] {line.rstrip(chr(13))}\n" for line in lines)
        try:
            sys.stderr.write(out)
            sys.stderr.flush()
        except (OSError, ValueError):  # the driver's stderr is closed: nothing to show it on
            pass

    def _on_done(self, body: dict[str, Any]) -> dict[str, Any]:
        self._show_log(body)
        node_id = int(body["node_id"])
        with self._cond:
            st = self.status.get(node_id)
            if st is not None:
                st.last_seen = time.monotonic()
                if body.get("exiting"):
                    st.exited = True
                else:
                    st.done = True
                    st.ok = bool(body.get("ok"))
                    st.traceback = str(body.get("traceback", ""))
                    st.note = str(body.get("note", ""))
            self._cond.notify_all()
        return {"stop": self.stopping}

    def _on_exited(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._cond:
            st = self.status.get(int(body["node_id"]))
            if st is not None:
                st.exit_code = int(body["code"])
                st.exit_log = str(body.get("log", ""))
            self._cond.notify_all()
        return {}

    def _touch(self, body: dict[str, Any]) -> None:
        st = self.status.get(int(body.get("node_id", -1)))
        if st is not None:
            st.last_seen = time.monotonic()
