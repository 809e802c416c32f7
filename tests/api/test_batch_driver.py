"""The batch driver in-process, on real Redis: what happens when a batch's input file is gone."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis.asyncio as aredis

from ferry.api.auth import KeyRing
from ferry.api.batch_driver import BatchDriver
from ferry.api.services import ApiMetrics, Services
from ferry.api.settings import ApiSettings
from ferry.worker.common.objectstore import FileStore
from ferry.worker.protocol import Keys
from tests.api.conftest import REDIS_URL, delete_prefix, new_prefix

pytestmark = pytest.mark.redis


def test_a_batch_whose_input_file_was_deleted_fails_instead_of_retrying_forever(tmp_path):
    prefix = new_prefix()

    async def run() -> dict:
        client = aredis.Redis.from_url(REDIS_URL, decode_responses=True)
        keys = Keys(prefix)
        svc = Services(settings=ApiSettings(), redis=client, keys=keys, hub=None, keyring=KeyRing.parse(None, None),
                       metrics=ApiMetrics(lambda: 0), configured_models=frozenset({"m"}))
        driver = BatchDriver(svc, FileStore(tmp_path))
        batch_id = f"batch_{uuid.uuid4().hex}"
        await client.hset(keys.batch(batch_id), mapping={
            "id": batch_id, "tenant": "t", "status": "validating", "endpoint": "/v1/completions",
            "input_file_id": f"file-{uuid.uuid4().hex}", "completion_window": "24h", "created_at": time.time(),
            "expires_at": time.time() + 100, "metadata": "null"})
        await client.sadd(keys.active_batches, batch_id)
        await driver.tick()
        raw = await client.hgetall(keys.batch(batch_id))
        active = await client.smembers(keys.active_batches)
        await client.aclose()
        return raw | {"active": active}

    try:
        raw = asyncio.run(run())
    finally:
        delete_prefix(prefix)
    assert raw["status"] == "failed" and raw["failed_at"] and not raw["active"]
    assert [e["code"] for e in json.loads(raw["errors"])] == ["file_not_found"]
