"""Read what the autoscaler decides on from Redis: per-model lag, pending and live workers.

Key names follow DESIGN.md's Redis layout (`{prefix}:q:{model}:{priority}` streams read by the
consumer group `workers`; `{prefix}:worker:{id}` heartbeat hashes with a `model` field and a
TTL). `worker/keys.py` owns those names for the worker and the API; the two helpers below
spell the same names so that the autoscaler image needs nothing from the worker package.
"""

from __future__ import annotations

import re
from collections import Counter

import redis

from infra.autoscaler.policy import Observation

PRIORITIES = ("high", "normal", "low")
GROUP = "workers"
LAG_SCAN_CAP = 10_000  # most entries counted one by one when Redis cannot report the lag


def queue_keys(prefix: str, model: str) -> list[str]:
    """The model's job streams, highest priority first."""
    return [f"{prefix}:q:{model}:{priority}" for priority in PRIORITIES]


def worker_key_pattern(prefix: str) -> str:
    """SCAN pattern matching every worker heartbeat hash under `prefix`."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":worker:*"


class RedisBacklog:
    """Observations for each model from one Redis connection (`decode_responses=True`)."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def observe(self, models: list[str], t: float) -> dict[str, Observation]:
        live = self.live_workers()
        out = {}
        for model in models:
            lag = pending = 0
            for key in queue_keys(self.prefix, model):
                q_lag, q_pending = self.queue_backlog(key)
                lag += q_lag
                pending += q_pending
            out[model] = Observation(t=t, lag=lag, pending=pending, live_workers=live[model])
        return out

    def queue_backlog(self, key: str) -> tuple[int, int]:
        """(lag, pending) of the `workers` group on one stream; (0, 0) if the stream is absent."""
        try:
            groups = self.client.xinfo_groups(key)
        except redis.ResponseError:  # no such key: nothing was ever queued
            return 0, 0
        group = next((g for g in groups if g["name"] == GROUP), None)
        if group is None:  # jobs queued before any worker created the group: all of them wait
            return int(self.client.xlen(key)), 0
        lag = group.get("lag")
        if lag is None:
            # Redis leaves lag unset when entries were deleted inside the undelivered range;
            # count what lies after the last delivered id instead (capped).
            lag = len(self.client.xrange(key, min="(" + group["last-delivered-id"], count=LAG_SCAN_CAP))
        return int(lag), int(group["pending"])

    def live_workers(self) -> Counter[str]:
        """Live heartbeats per served model (a hash expires when its worker stops renewing)."""
        keys = list(self.client.scan_iter(match=worker_key_pattern(self.prefix), count=500))
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "model")
        models = pipe.execute(raise_on_error=False)
        return Counter(m for m in models if isinstance(m, str))
