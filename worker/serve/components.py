"""The worker's side threads as small start/stop components (Celery's bootsteps are the model):
`Heartbeat` says the worker is alive and what it serves, `CancelListener` hears cancels at once.
The `Worker` starts each once it is ready and stops them, last started first, when it exits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis

from ferry.worker.common.connect import UNAVAILABLE, is_cluster
from ferry.worker.protocol import Keys
from ferry.worker.serve.engine_loop import EngineLoop
from ferry.worker.serve.intake import Intake
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.settings import WorkerSettings

log = logging.getLogger("ferry.worker")

MODEL_LIMITS_TTL_S = 7 * 86400  # a model scaled to zero keeps its limits known to the API this long


class Component:
    """A part of the worker with a thread of its own: `run` until `stopping` is set."""

    name = "component"

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        raise NotImplementedError


class Heartbeat(Component):
    """`{p}:worker:{id}` with a TTL (load, running, waiting, model, fingerprint, the LoRA adapters its
    engine holds as a JSON list), the model's limits for the API, the queue lag for /metrics; and a
    Redis that restarted (a new run id, maybe empty) gets the consumer groups back and the leases
    renewed at once."""

    name = "heartbeat"

    def __init__(self, client: redis.Redis, keys: Keys, settings: WorkerSettings, worker_id: str, fingerprint: str,
                 model_limits: dict[str, str], loop: EngineLoop, intake: Intake, metrics: WorkerMetrics,
                 draining: Callable[[], bool]) -> None:
        super().__init__()
        self.client, self.keys, self.settings, self.worker_id = client, keys, settings, worker_id
        self.fingerprint = fingerprint
        self.model_limits = model_limits  # what the API checks requests against (vocab size, context)
        self.loop, self.intake, self.metrics, self.draining = loop, intake, metrics, draining
        self._redis_run_id: str | None = None  # the Redis server's run id at the last beat

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._beat()
            except UNAVAILABLE:
                pass  # the intake logs the outage; the key's TTL tells the others
            self.stopping.wait(self.settings.heartbeat_interval_s)

    def _beat(self) -> None:
        s, model, stats, now = self.settings, self.settings.served_model_name, self.loop.stats, time.time()
        jobs = len(self.intake.leases)
        beat = {
            "model": model,
            "fingerprint": self.fingerprint,
            "load": f"{jobs / s.engine.max_num_seqs:.3f}",
            "jobs": str(jobs),
            "running": str(stats.num_running if stats else 0),
            "waiting": str(stats.num_waiting if stats else 0),
            "max_num_seqs": str(s.engine.max_num_seqs),
            "state": "draining" if self.draining() else "ready",
            "loras": json.dumps(self.loop.loras),  # LoRA adapters its engine holds (host memory or device)
            "ts": repr(now),
        }
        streams = self.intake.reader.streams
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.worker(self.worker_id), mapping=beat)
        pipe.expire(self.keys.worker(self.worker_id), max(1, int(s.heartbeat_ttl_s)))
        pipe.zadd(self.keys.workers, {self.worker_id: now})
        pipe.zadd(self.keys.models, {model: now})
        pipe.hset(self.keys.model_limits(model), mapping=self.model_limits)
        pipe.expire(self.keys.model_limits(model), MODEL_LIMITS_TTL_S)
        for stream in streams:
            pipe.xinfo_groups(stream)
        results = pipe.execute(raise_on_error=False)
        self.metrics.queue_lag.set(sum(_lag(groups) for groups in results[-len(streams):]))
        if not is_cluster(self.client):  # a cluster's failover promotes a replica that kept the data
            self._note_run_id(self.client.info("server"))

    def _note_run_id(self, info) -> None:
        """A Redis that restarted (a new run id) may have come back empty: recreate the consumer
        groups now and renew the leases at once, so jobs whose entries are gone stop here."""
        run_id = info.get("run_id") if isinstance(info, dict) else None
        if run_id is None:
            return
        if self._redis_run_id is not None and run_id != self._redis_run_id:
            log.warning("redis restarted: recreating consumer groups", extra={"run_id": run_id})
            try:
                self.intake.reader.ensure_groups()
            except UNAVAILABLE:
                return  # the next beat tries again
            self.intake.wake(renew=True)
        self._redis_run_id = run_id


def _lag(groups) -> int:
    if isinstance(groups, Exception):
        return 0
    return sum(g.get("lag") or 0 for g in groups if g.get("name") == "workers")


class CancelListener(Component):
    """`{p}:cancel`: a cancel reaches a running job at once (missed ones, while Redis is away, are
    caught by the lease renewal's flag check)."""

    name = "cancel"

    def __init__(self, client: redis.Redis, keys: Keys, intake: Intake, loop: EngineLoop, max_delay_s: float) -> None:
        super().__init__()
        self.client, self.keys, self.intake, self.loop, self.max_delay_s = client, keys, intake, loop, max_delay_s

    def run(self) -> None:
        delay = 0.05
        while not self.stopping.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.cancel)
                delay = 0.05
                while not self.stopping.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message and message["data"] in self.intake.leases:
                        log.info("cancel requested", extra={"job_id": message["data"]})
                        self.loop.abort(message["data"])
            except UNAVAILABLE:
                self.stopping.wait(delay)
                delay = min(self.max_delay_s, delay * 2)
            finally:
                pubsub.close()
