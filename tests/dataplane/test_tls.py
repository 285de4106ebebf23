"""A cluster whose Flight servers speak grpc+tls: the data plane works, and only a client that
trusts the cluster's certificate and carries its secret gets in."""

from __future__ import annotations

import datetime
import ipaddress
import json

import numpy as np
import pyarrow.flight as flight
import pytest

import dataplane
from tests.dataplane.clusterutil import wait_gone
from tests.dataplane.mains import feed_main
from tests.dataplane.test_push import check_epoch, epoch_results, make_df

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def self_signed_cert() -> tuple[bytes, bytes]:
    """A PEM certificate and key for 127.0.0.1 / localhost, valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dataplane-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture(scope="module")
def cert():
    return self_signed_cert()


@pytest.fixture(scope="module")
def feed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tls-feed")


@pytest.fixture(scope="module")
def cluster(spark, feed_dir, cert):
    c = dataplane.run(spark, feed_main, {"dir": str(feed_dir)}, num_nodes=2, tls=cert)
    yield c
    pids = [n.pid for n in c.nodes]
    c.shutdown()
    wait_gone(pids, 15)


def _metrics(client: flight.FlightClient, options=None):  # type: ignore[no-untyped-def]
    return list(client.do_action(flight.Action("metrics", b"{}"), options=options))


def test_nodes_and_driver_serve_grpc_tls(cluster, cert):
    assert [n.flight_location.split("://")[0] for n in cluster.nodes] == ["grpc+tls"] * 2
    # the driver's control server (registration, heartbeats) is TLS too: a plaintext client
    # cannot reach it, a trusting one gets as far as the secret check
    driver = cluster._control.location
    assert driver.startswith("grpc+tls://127.0.0.1:")
    port = driver.rsplit(":", 1)[1]
    with pytest.raises(flight.FlightUnavailableError):
        _metrics(flight.FlightClient(f"grpc://127.0.0.1:{port}"), flight.FlightCallOptions(timeout=10))
    with pytest.raises(flight.FlightUnauthenticatedError):
        _metrics(flight.FlightClient(driver, tls_root_certs=cert[0]))


def test_tls_must_be_pem_bytes(spark, cert):
    for bad in ("cert.pem", (cert[0].decode(), cert[1].decode()), (cert[1], cert[0]), (cert[0],)):
        with pytest.raises(TypeError, match=r"tls must be \(cert_pem, key_pem\)"):
            dataplane.run(spark, feed_main, {}, num_nodes=2, tls=bad)


def test_training_and_inference_over_tls(spark, cluster, feed_dir):
    rows = 2000
    report = cluster.train(make_df(spark, rows, 3), num_epochs=2)
    assert report.rows == 2 * rows and report.rows_per_node == {0: rows, 1: rows}
    for epoch in (0, 1):
        check_epoch(epoch_results(feed_dir, epoch, [0, 1]), rows)
    out = cluster.inference(make_df(spark, 500, 2), passthrough=("id",)).toPandas()
    out = out.sort_values("id").reset_index(drop=True)
    assert out["id"].tolist() == list(range(500))
    np.testing.assert_allclose(out["y"].to_numpy(), np.arange(500) * 0.5 * 2.0)


def test_only_trusting_clients_with_the_secret_get_in(cluster, cert):
    node = cluster.nodes[0]
    port = node.flight_port
    # plaintext gRPC to a TLS port: no connection
    plain = flight.FlightClient(f"grpc://127.0.0.1:{port}")
    with pytest.raises(flight.FlightUnavailableError):
        _metrics(plain, flight.FlightCallOptions(timeout=10))
    # TLS without trusting the cluster's certificate: the handshake fails
    untrusting = flight.FlightClient(f"grpc+tls://127.0.0.1:{port}")
    with pytest.raises(flight.FlightUnavailableError):
        _metrics(untrusting, flight.FlightCallOptions(timeout=10))
    # trusting the certificate but without the secret: refused by the bearer-token check
    trusting = flight.FlightClient(f"grpc+tls://127.0.0.1:{port}", tls_root_certs=cert[0])
    with pytest.raises(flight.FlightUnauthenticatedError):
        _metrics(trusting)
    wrong = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer not-the-secret")])
    with pytest.raises(flight.FlightUnauthenticatedError):
        _metrics(trusting, wrong)
    # the cluster's own metrics call (TLS + secret) works and counts what was pushed
    m = cluster.metrics()
    assert set(m) == {0, 1} and all(json.dumps(mm) for mm in m.values())
