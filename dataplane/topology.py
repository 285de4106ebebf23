"""Who is who in a cluster: node descriptions, role assignment, the TF cluster spec.

These are small value objects passed around explicitly; nothing here reads the environment.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["NodeInfo", "Topology", "assign_roles"]

ROLES = ("chief", "worker", "ps", "evaluator")


@dataclass(frozen=True)
class NodeInfo:
    """One TF node as the driver sees it.

    Attributes:
        role: ``chief``, ``worker``, ``ps`` or ``evaluator``.
        index: index within the role (TF's ``task.index``).
        host: address the node's servers listen on.
        flight_port: port of the node's Arrow Flight server (data plane).
        tf_port: port reserved for the node's TF server (in the cluster spec).
        node_id: the launch task's partition id (0..num_nodes-1), stable for the cluster's life.
        pid: process id of the node process on its host.
        hostname: the executor machine's host name.
        worker_index: position among the nodes that receive training data (chief + workers),
            ``None`` for ps and evaluator.
        flight_scheme: ``grpc``, or ``grpc+tls`` when the cluster runs with ``tls=``.
    """

    role: str
    index: int
    host: str
    flight_port: int
    tf_port: int
    node_id: int = 0
    pid: int = 0
    hostname: str = ""
    worker_index: int | None = None
    flight_scheme: str = "grpc"

    @property
    def flight_location(self) -> str:
        return f"{self.flight_scheme}://{self.host}:{self.flight_port}"

    @property
    def tf_address(self) -> str:
        return f"{self.host}:{self.tf_port}"

    def describe(self) -> str:
        """Short human name used in error messages: ``node 1 (worker 0 on 10.0.0.5, pid 77)``."""
        return f"node {self.node_id} ({self.role} {self.index} on {self.host}, pid {self.pid})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "NodeInfo":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class Topology:
    """The whole cluster: every node with its role, and the TF cluster spec derived from it."""

    nodes: tuple[NodeInfo, ...]
    cluster_spec: dict[str, list[str]] = field(default_factory=dict)

    @property
    def workers(self) -> list[NodeInfo]:
        """Nodes that receive training data: the chief first, then workers by index."""
        return sorted(
            (n for n in self.nodes if n.worker_index is not None), key=lambda n: n.worker_index
        )

    def node(self, node_id: int) -> NodeInfo:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node with id {node_id}; nodes are {[n.node_id for n in self.nodes]}")

    def tf_config(self, node: NodeInfo) -> dict[str, Any]:
        """TF_CONFIG for one node. The evaluator is kept out of ``cluster`` (TF's rule)."""
        return {"cluster": self.cluster_spec, "task": {"type": node.role, "index": node.index}}

    def to_json(self) -> str:
        return json.dumps(
            {"nodes": [n.to_json() for n in self.nodes], "cluster_spec": self.cluster_spec}
        )

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        d = json.loads(text)
        return cls(tuple(NodeInfo.from_json(n) for n in d["nodes"]), d["cluster_spec"])


def assign_roles(
    registrations: dict[int, dict[str, Any]], *, num_ps: int, evaluator: bool
) -> Topology:
    """Give every registered node its role, deterministically by node id.

    Node ids ``0..num_ps-1`` become parameter servers, the next one the chief, the last one the
    evaluator (if requested), and the rest workers.

    Args:
        registrations: node id -> ``{"host", "flight_port", "flight_scheme", "tf_port", "pid",
            "hostname"}``.
        num_ps: number of parameter servers.
        evaluator: whether the last node is an evaluator.
    """
    ids = sorted(registrations)
    n = len(ids)
    if n < num_ps + 1 + int(evaluator):
        raise ValueError(
            f"{n} node(s) cannot hold {num_ps} ps + 1 chief"
            f"{' + 1 evaluator' if evaluator else ''}; raise num_nodes."
        )
    roles: list[tuple[str, int]] = [("ps", i) for i in range(num_ps)]
    roles.append(("chief", 0))
    n_workers = n - num_ps - 1 - int(evaluator)
    roles += [("worker", i) for i in range(n_workers)]
    if evaluator:
        roles.append(("evaluator", 0))
    nodes = []
    for node_id, (role, index) in zip(ids, roles):
        r = registrations[node_id]
        worker_index = 0 if role == "chief" else index + 1 if role == "worker" else None
        nodes.append(
            NodeInfo(
                role=role,
                index=index,
                host=r["host"],
                flight_port=int(r["flight_port"]),
                tf_port=int(r["tf_port"]),
                node_id=node_id,
                pid=int(r.get("pid", 0)),
                hostname=str(r.get("hostname", "")),
                worker_index=worker_index,
                flight_scheme=str(r.get("flight_scheme", "grpc")),
            )
        )
    spec: dict[str, list[str]] = {}
    for role in ("chief", "worker", "ps"):
        members = sorted((x for x in nodes if x.role == role), key=lambda x: x.index)
        if members:
            spec[role] = [x.tf_address for x in members]
    return Topology(tuple(nodes), spec)
