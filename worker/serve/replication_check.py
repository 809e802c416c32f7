"""Whether the worker's terminal writes reached the replicas, checked off the publisher's thread.

With FERRY_REDIS_MIN_REPLICAS=n the worker asks, after each batch that ended jobs, whether each
shard that got a terminal write has n replicas holding it (`wait_replicated`: a marker written
after those writes, then WAIT on the same connection; the replication stream is ordered, so a
replica with the marker has the writes before it). Too few is logged, never retried: the result
is on the primary, and the terminal write and the ACK of the queue entry are one script, so a
primary lost before replicating it leaves the job pending on the promoted replica, where the
reaper hands it to a worker again (it resumes; nothing is lost).

A WAIT blocks its connection up to its timeout; on the publisher's thread, a shard without its
replica (after a failover, until the old node returns) would hold every job's tokens back that
long after each batch. Here it holds back only the next check.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis

from ferry.worker.common.connect import UNAVAILABLE, wait_replicated
from ferry.worker.protocol import Keys

log = logging.getLogger("ferry.worker.publisher")


class ReplicationCheck:
    """A daemon thread counting the replicas of the shards `submit`ted job ids ended in."""

    def __init__(self, client, keys: Keys, replicas: int, timeout_ms: int) -> None:
        self.client = client
        self.keys = keys
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._inbox: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="replication-check", daemon=True)
        self._thread.start()

    def submit(self, job_ids: list[str]) -> None:
        """Check the shards of jobs whose terminal writes were just made (never blocks)."""
        if job_ids:
            self._inbox.put(job_ids)

    def _run(self) -> None:
        while True:
            job_ids = self._inbox.get()
            while True:  # everything queued meanwhile: one check per shard covers it all
                try:
                    job_ids = job_ids + self._inbox.get_nowait()
                except queue.Empty:
                    break
            for job_id in {self.keys.shard_of(j): j for j in job_ids}.values():
                self._check(job_id)

    def _check(self, job_id: str) -> None:
        try:
            acks = wait_replicated(self.client, self.keys.ack(job_id), self.replicas, self.timeout_ms)
        except (redis.RedisError, *UNAVAILABLE) as exc:  # MOVED (a failover since the write), or the node is away
            log.warning("terminal write: no replica count", extra={"job_id": job_id, "error": str(exc)})
            return
        if acks < self.replicas:
            log.warning("terminal write not replicated in time",
                        extra={"job_id": job_id, "replicas": acks, "required": self.replicas})
