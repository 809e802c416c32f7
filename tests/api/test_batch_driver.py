"""The batch driver in-process, on real Redis and a real file store: a batch whose input file is
gone, a batch the driver raises on, a validation that takes several ticks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis.asyncio as aredis

from ferry.api.auth import KeyRing
from ferry.api.batch_driver import BatchDriver
from ferry.api.files import FileRecord, object_name, save_record
from ferry.api.services import ApiMetrics, Services
from ferry.api.settings import ApiSettings
from ferry.worker.common.objectstore import FileStore
from ferry.worker.protocol import Keys
from tests.api.conftest import REDIS_URL, delete_prefix, new_prefix

pytestmark = pytest.mark.redis

FIRST, LAST = f"batch_{'0' * 32}", f"batch_{'f' * 32}"  # tick order: FIRST is advanced before LAST


class Driven:
    """A driver on a key prefix of its own, and what a test writes and reads around it."""

    def __init__(self, client: aredis.Redis, prefix: str, store: FileStore) -> None:
        self.redis, self.keys, self.store = client, Keys(prefix), store
        self.svc = Services(settings=ApiSettings(), redis=client, keys=self.keys, hub=None,
                            keyring=KeyRing.parse(None, None), metrics=ApiMetrics(lambda: 0),
                            configured_models=frozenset({"m"}))
        self.driver = BatchDriver(self.svc, store)

    async def upload(self, lines: list[dict]) -> str:
        file_id = f"file-{uuid.uuid4().hex}"
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        record = FileRecord(id=file_id, tenant="t", bytes=len(data), created_at=int(time.time()), filename="in.jsonl",
                            purpose="batch", object_name=object_name("t", file_id))
        self.store.write_bytes(record.object_name, data)
        await save_record(self.redis, self.keys, record)
        return file_id

    async def batch(self, batch_id: str, input_file_id: str, status: str = "validating", **fields) -> None:
        await self.redis.hset(self.keys.batch(batch_id), mapping={
            "id": batch_id, "tenant": "t", "status": status, "endpoint": "/v1/completions",
            "input_file_id": input_file_id, "completion_window": "24h", "created_at": time.time(),
            "expires_at": time.time() + 100, "metadata": "null", "total": 0, "completed": 0, "failed": 0, **fields})
        await self.redis.sadd(self.keys.active_batches, batch_id)

    async def status(self, batch_id: str) -> dict:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        return raw | {"active": await self.redis.sismember(self.keys.active_batches, batch_id)}


def drive(tmp_path, scenario) -> None:
    prefix = new_prefix()

    async def run() -> None:
        client = aredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            await scenario(Driven(client, prefix, FileStore(tmp_path)))
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        delete_prefix(prefix)


def completion(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hi", "max_tokens": 2}}


def test_a_batch_whose_input_file_was_deleted_fails_instead_of_retrying_forever(tmp_path):
    async def scenario(d: Driven) -> None:
        await d.batch(FIRST, f"file-{uuid.uuid4().hex}")
        await d.driver.tick()
        raw = await d.status(FIRST)
        assert raw["status"] == "failed" and raw["failed_at"] and not raw["active"]
        assert [e["code"] for e in json.loads(raw["errors"])] == ["file_not_found"]

    drive(tmp_path, scenario)


def test_a_batch_the_driver_raises_on_is_retried_then_failed_alone_while_the_next_one_advances(tmp_path):
    async def scenario(d: Driven) -> None:
        file_id = await d.upload([completion("a"), completion("b")])
        # A record no driver can read (its window is not a number): every tick raises on it.
        await d.batch(FIRST, file_id, status="in_progress", expires_at="soon", total=2, last_line=2, cursor=0)
        await d.batch(LAST, file_id)
        errors = d.svc.metrics.registry.get_sample_value
        await d.driver.tick()
        first, last = await d.status(FIRST), await d.status(LAST)
        assert first["status"] == "in_progress" and first["active"] and first["driver_errors"] == "1"
        assert last["status"] == "in_progress" and last["total"] == "2"  # validated in the same tick
        assert errors("ferry_api_batch_driver_errors_total", {"scope": "batch"}) == 1
        for _ in range(4):
            await d.driver.tick()
        first, last = await d.status(FIRST), await d.status(LAST)
        assert first["status"] == "failed" and not first["active"]
        assert [e["code"] for e in json.loads(first["errors"])] == ["internal_error"]
        assert errors("ferry_api_batch_driver_errors_total", {"scope": "batch"}) == 5
        assert last["cursor"] == "2" and len(await d.redis.hgetall(d.keys.batch_inflight(LAST))) == 2
        await d.driver.tick()  # a failed batch is no longer driven, nor counted again
        assert errors("ferry_api_batch_driver_errors_total", {"scope": "batch"}) == 5

    drive(tmp_path, scenario)


def test_a_long_validation_advances_a_step_per_tick_and_holds_no_other_batch(tmp_path):
    async def scenario(d: Driven) -> None:
        big = await d.upload([completion(f"l{i}") for i in range(6000)])
        small = await d.upload([completion("x")])
        await d.batch(FIRST, big)
        await d.batch(LAST, small)
        await d.driver.tick()
        assert (await d.status(FIRST))["status"] == "validating"
        assert (await d.status(LAST))["status"] == "in_progress"
        ticks = 1
        while (await d.status(FIRST))["status"] == "validating":
            await d.driver.tick()
            ticks += 1
            assert ticks < 20
        first = await d.status(FIRST)
        assert first["status"] == "in_progress" and first["total"] == "6000" and first["last_line"] == "6000"

    drive(tmp_path, scenario)
