"""Open streams must not slow the rest of the API: against a private redis-server, an idle
follower's ticks cost no Redis call, and the model list never waits for a pooled connection."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from fastapi.testclient import TestClient

from ferry.api.main import create_app
from ferry.api.settings import ApiSettings
from ferry.api.streaming import PubSubHub, follow_events
from ferry.worker.common.connect import connect_async
from ferry.worker.protocol import Keys, StartedEvent, event_to_fields, new_job_id
from tests.api.conftest import new_prefix

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def _reads(server) -> int:
    """XRANGE and XREVRANGE calls the server has answered (a private server: only this test's)."""
    stats = redis.Redis(port=server.port).info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("xrange", "xrevrange"))


def test_an_idle_followers_ticks_cost_no_redis_call(private):
    """The OpenAI routes tick every 0.5 s (disconnect checks, keep-alive timing), and each tick
    re-read the job's stream: 500 idle streams kept the Redis pool busy and /v1/models waited
    behind them for seconds. The stream is now re-read only after a quiet `resync_s`."""
    keys, job_id = Keys(new_prefix()), new_job_id()
    redis.Redis(port=private.port).xadd(keys.events(job_id), event_to_fields(
        StartedEvent(seq=0, worker_id="w", attempt=1)), id="0-1")

    async def run() -> int:
        client = connect_async(private.url, cluster=False, decode_responses=True, max_connections=4, pool_timeout_s=1)
        hub = PubSubHub(client)
        hub.start()
        events = follow_events(client, hub, keys, job_id, idle_s=0.01, resync_s=3600)
        try:
            assert [e.seq for e in await anext(events)] == [0]
            before = _reads(private)
            for _ in range(20):
                assert await anext(events) is None
            return _reads(private) - before
        finally:
            await events.aclose()
            await hub.close()
            await client.aclose()

    assert asyncio.run(run()) == 0


def test_the_model_list_answers_while_every_pooled_connection_is_taken(private, monkeypatch):
    """/v1/models answers from the heartbeats a background task reads (`ModelHeartbeats`), never
    waiting its turn for one of the connections open streams keep busy."""
    prefix = new_prefix()
    settings = ApiSettings(redis_url=private.url, key_prefix=prefix, redis_max_connections=2,
                           redis_pool_timeout_s=0.5)
    redis.Redis(port=private.port).zadd(Keys(prefix).models, {"tiny": time.time()})
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        assert [m["id"] for m in api.get("/v1/models").json()["data"]] == ["tiny"]
        pool = api.app.state.services.redis.connection_pool
        taken = [api.portal.call(pool.get_connection) for _ in range(2)]
        try:
            for _ in range(3):
                r = api.get("/v1/models")
                assert r.status_code == 200, r.text
                assert [m["id"] for m in r.json()["data"]] == ["tiny"]
        finally:
            for connection in taken:
                api.portal.call(pool.release, connection)
