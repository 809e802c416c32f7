"""Model-source fixtures: a real S3 API server (moto, shared with the snapshot tests) and a local
server speaking the Hugging Face Hub's HTTP API (bench/hub_server.py)."""

from __future__ import annotations

import pytest

from bench.hub_server import HubServer
from tests.snapshots.conftest import s3_bucket, s3_env, s3_server  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def hub_server():
    with HubServer() as server:
        yield server


@pytest.fixture
def hub(hub_server, monkeypatch):
    """The Hub server, with HF_ENDPOINT pointing at it and no token."""
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub_server
