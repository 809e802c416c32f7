"""Snapshot fixtures: small engines over the session's tiny model, and a real S3 API server (moto)."""

from __future__ import annotations

import uuid

import pytest

from ferry.worker.engine import Engine
from ferry.worker.snapshots import SnapshotStats, restore_snapshot
from tests.snapshots.util import BLOCK_BYTES, BS, free_port


@pytest.fixture
def make_engine(llama_dir):
    def make(model_dir=None, num_blocks: int = 64, **kwargs) -> Engine:
        kwargs.setdefault("block_size", BS)
        kwargs.setdefault("max_model_len", 128)
        block_bytes = BLOCK_BYTES * kwargs["block_size"] // BS
        return Engine(model_dir or llama_dir, kv_cache_bytes=num_blocks * block_bytes, **kwargs)

    return make


@pytest.fixture
def restored_engine(make_engine):
    """A fresh engine with the snapshot at `url` restored as a worker does at start: (engine, stats)."""

    def make(url, **kwargs) -> tuple[Engine, SnapshotStats]:
        engine = make_engine(**kwargs)
        stats = SnapshotStats()
        restore_snapshot(engine, url, stats)
        return engine, stats

    return make


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on a free port, spoken to over HTTP. Yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(monkeypatch):
    """Credentials and region for boto3's standard chain (moto accepts any)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ferrytest")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ferrytest")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FERRY_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def s3_bucket(s3_server, s3_env):
    """A fresh bucket on the moto server; FERRY_S3_ENDPOINT_URL points at it. Yields the bucket name."""
    import boto3

    s3_env.setenv("FERRY_S3_ENDPOINT_URL", s3_server)
    bucket = f"ferrytest-{uuid.uuid4().hex}"
    client = boto3.client("s3", endpoint_url=s3_server)
    client.create_bucket(Bucket=bucket)
    yield bucket
    objects = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    if objects:
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in objects]})
    client.delete_bucket(Bucket=bucket)
