"""The test S3 server starts even when a port chosen for it is taken before it binds it."""

from __future__ import annotations

import socket

import pytest

from tests import s3server


def test_server_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = s3server._server_ports([f"p{i}" for i in range(9)])
    assert len(set(ports.values())) == 9 and all(p < low for p in ports.values())


@pytest.mark.s3
def test_a_port_taken_before_the_server_binds_it_is_chosen_again(tmp_path, monkeypatch):
    # bench all --quick's pull-s3 failed once with "failed to listen on grpc port 38647: bind:
    # address already in use": the port was free when chosen, taken when SeaweedFS bound it
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    real, calls = s3server._server_ports, []

    def first_one_taken(names):  # type: ignore[no-untyped-def]
        ports = real(names)
        if not calls:
            ports["filer_grpc"] = holder.getsockname()[1]
        calls.append(ports)
        return ports

    monkeypatch.setattr(s3server, "_server_ports", first_one_taken)
    monkeypatch.delenv("DATAPLANE_TEST_S3_ENDPOINT", raising=False)
    try:
        server = s3server.start_s3_server(tmp_path / "weed", timeout=60)
        try:
            assert len(calls) == 2
            assert server.endpoint == f"http://127.0.0.1:{calls[1]['s3']}"
            bucket = server.make_bucket()
            fs = server.filesystem()
            with fs.open_output_stream(f"{bucket}/x") as out:
                out.write(b"hello")
            with fs.open_input_stream(f"{bucket}/x") as inp:
                assert inp.read() == b"hello"
        finally:
            server.stop()
    finally:
        holder.close()
