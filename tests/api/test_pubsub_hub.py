"""The API's shared pub/sub connection against the real Redis: followers that subscribe at once."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from ferry.api.streaming import PubSubHub
from ferry.worker.common.connect import connect, connect_async
from tests.api.conftest import REDIS_URL

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def test_followers_subscribing_at_once_to_a_fresh_hub_each_get_their_messages():
    async def run() -> dict[str, bool]:
        client = connect_async(REDIS_URL, cluster=False, decode_responses=True, max_connections=8, pool_timeout_s=1)
        publisher = connect(REDIS_URL, cluster=False, decode_responses=True)
        hub = PubSubHub(client)
        hub.start()
        got: dict[str, bool] = {}

        async def follow(channel: str) -> None:
            async with hub.subscribe(channel) as queue:
                await asyncio.sleep(0.3)
                publisher.publish(channel, "x")
                try:
                    got[channel] = await asyncio.wait_for(queue.get(), 3) == "x"
                except TimeoutError:
                    got[channel] = False

        prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
        await asyncio.gather(*(follow(f"{prefix}:{i}") for i in range(3)))
        await hub.close()
        await client.aclose()
        publisher.close()
        return got

    assert list(asyncio.run(run()).values()) == [True] * 3
