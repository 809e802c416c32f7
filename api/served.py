"""What is served, as this API process last read it: each served model's last worker heartbeat
(`{p}:models`) and the LoRA adapter registry (`{p}:loras`, `worker.protocol.loras`). Routing,
/v1/models and /readyz go by it. A task reads both every MODEL_CACHE_S (`start`), in one round trip,
so no request waits for them: a read of its own would wait its turn for a pooled Redis connection
behind every open stream's reads.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aredis

from ferry.api.tasks import cancel_and_wait
from ferry.worker.protocol import Keys
from ferry.worker.protocol.loras import LoraEntry, decode_lora

log = logging.getLogger("ferry.api")

MODEL_CACHE_S = 1.0


class ModelHeartbeats:
    """The served models' heartbeats and the registered adapters, read together."""

    def __init__(self, redis: aredis.Redis, keys: Keys):
        self._redis, self._keys = redis, keys
        self._beats: dict[str, float] | None = None  # model -> unix time of its last heartbeat
        self._loras: dict[str, LoraEntry] = {}  # adapter name -> its registry entry
        self._read_at = float("-inf")  # monotonic
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever(), name="model-heartbeats")

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def beats(self) -> dict[str, float]:
        """The last read; read now only when there is none yet, or (no task started) none recent."""
        if self._beats is None or (self._task is None and time.monotonic() - self._read_at > MODEL_CACHE_S):
            await self.refresh()
        return self._beats

    async def loras(self) -> dict[str, LoraEntry]:
        """The registered adapters as of `beats`' read (an unreadable entry is left out)."""
        await self.beats()
        return self._loras

    async def refresh(self) -> dict[str, float]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrange(self._keys.models, 0, -1, withscores=True)
        pipe.hgetall(self._keys.loras)
        beats, loras = await pipe.execute()
        entries = {name: decode_lora(raw) for name, raw in loras.items()}
        self._beats, self._loras = dict(beats), {name: e for name, e in entries.items() if e is not None}
        self._read_at = time.monotonic()
        return self._beats

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except (aredis.RedisError, OSError) as exc:  # Redis away: the requests that need it answer 503
                log.debug("model heartbeats not read: %s", exc)
            await asyncio.sleep(MODEL_CACHE_S)
