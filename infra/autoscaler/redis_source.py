"""Read what the autoscaler decides on from Redis: per-model lag, pending and live workers.

Key names come from `worker/protocol/keys.py`: the model's streams, every shard's
`{prefix}:q:{s<n>}:{model}:{priority}`, read by the consumer group `workers`, and the
heartbeats — `{prefix}:workers` (worker id -> time of its last heartbeat) and
`{prefix}:worker:{id}` (a hash with the served `model`, with a TTL).
"""

from __future__ import annotations

from collections import Counter

import redis

from ferry.autoscaler.policy import Observation
from ferry.worker.protocol import GROUP, Keys

LAG_SCAN_CAP = 10_000  # most entries counted one by one when Redis cannot report the lag
HEARTBEAT_HORIZON_S = 600  # workers not seen for this long are not even looked up


class RedisBacklog:
    """Observations for each model from one Redis connection (`decode_responses=True`)."""

    def __init__(self, client: redis.Redis, prefix: str, shards: int = 1) -> None:
        self.client = client
        self.keys = Keys(prefix, shards)

    def observe(self, models: list[str], t: float) -> dict[str, Observation]:
        live = self.live_workers()
        out = {}
        for model in models:
            lag = pending = 0
            for key in self.keys.queues(model):
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
        """Live workers per served model: recent ids in `{prefix}:workers` whose heartbeat hash
        has not expired (the hash's TTL, not the sorted set, says whether a worker is alive)."""
        now, _ = self.client.time()
        ids = self.client.zrangebyscore(self.keys.workers, now - HEARTBEAT_HORIZON_S, "+inf")
        pipe = self.client.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hget(self.keys.worker(worker_id), "model")
        return Counter(m for m in pipe.execute() if m is not None)
