"""Fixtures for the pull readers: a real S3 server (SeaweedFS) for the whole session."""

from __future__ import annotations

import pytest

from tests.s3server import S3Server, acquire_shared, release_shared


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    """A SeaweedFS S3 endpoint on a free loopback port (or DATAPLANE_TEST_S3_ENDPOINT's)."""
    yield acquire_shared(tmp_path_factory.mktemp("seaweedfs"))
    release_shared()


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> S3Server:
    """Point the standard AWS variables at the test server for one test."""
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server
