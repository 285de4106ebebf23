"""feeders.flight: the per-process Flight client cache used by pushing tasks."""

from __future__ import annotations

import multiprocessing
import os

import pyarrow.flight as flight
import pytest

import feeders.flight as clients


class _Echo(flight.FlightServerBase):
    def do_action(self, context, action):  # type: ignore[no-untyped-def]
        yield flight.Result(str(os.getpid()).encode())


@pytest.fixture()
def server():
    srv = _Echo("grpc://127.0.0.1:0")
    yield f"grpc://127.0.0.1:{srv.port}"
    srv.shutdown()


@pytest.fixture(autouse=True)
def empty_cache():
    clients._TASK_CLIENTS.clear()
    yield
    clients._TASK_CLIENTS.clear()


def _ping(client: flight.FlightClient) -> bytes:
    return b"".join(r.body.to_pybytes() for r in client.do_action(flight.Action("ping", b"")))


def test_one_client_per_location_and_it_works(server):
    a = clients.task_client(server)
    assert clients.task_client(server) is a
    assert _ping(a) == str(os.getpid()).encode()
    other = "grpc://127.0.0.1:1"
    assert clients.task_client(other) is not a
    assert len(clients._TASK_CLIENTS) == 2


def test_tls_roots_are_part_of_the_key(server):
    plain = clients.task_client(server)
    assert clients.task_client(server, tls_root_certs=b"pem") is not plain


def test_the_cache_is_bounded_oldest_out(server, monkeypatch):
    monkeypatch.setattr(clients, "_TASK_CLIENTS_MAX", 3)
    first = clients.task_client("grpc://127.0.0.1:1")
    for port in (2, 3, 4):
        clients.task_client(f"grpc://127.0.0.1:{port}")
    assert len(clients._TASK_CLIENTS) == 3
    assert clients.task_client("grpc://127.0.0.1:1") is not first


def test_entries_of_another_process_are_dropped_not_reused(server):
    # What a forked child sees: entries keyed by its parent's pid. It must open its own.
    inherited = clients.connect(server)
    clients._TASK_CLIENTS[(os.getpid() + 1, server, None)] = inherited
    mine = clients.task_client(server)
    assert mine is not inherited
    assert list(clients._TASK_CLIENTS) == [(os.getpid(), server, None)]


def _child(location: str, conn) -> None:  # type: ignore[no-untyped-def]
    import feeders.flight as child_clients

    conn.send(_ping(child_clients.task_client(location)))


def test_a_spawned_process_gets_a_working_client(server):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    clients.task_client(server)
    proc = ctx.Process(target=_child, args=(server, child))
    proc.start()
    assert parent.poll(60)
    assert parent.recv() == str(os.getpid()).encode()  # the server's pid: this process
    proc.join(30)
    assert proc.exitcode == 0
