"""The intake thread: takes jobs from the queue while the engine has room, and holds their leases.

Each round it renews the leases of the jobs it holds (`QueueReader.renew`: a job another worker
took over, or whose entry Redis lost, stops here; a cancel flag cancels it), reclaims the entries
of dead workers now and then (`reap`), and reads new entries (`read`), never more than the engine
has room for: the rest wait in Redis, visible to other workers and the autoscaler. A live job may
take the place of a background one (the engine preempts the batch's request for it), so a worker
full of background jobs still reads the live lanes. What it takes, `JobStarter` decides and
starts (and renders the prompts); the engine loop admits the jobs that start.

A job's lease (its pending queue entry) is held from its start until its last write reached
Redis (`on_written`), then its slot frees. On a drain the intake stops reading and gives back
what blocked reads still delivered.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import redis

from ferry.worker.common.connect import UNAVAILABLE
from ferry.worker.protocol import Keys, Priority
from ferry.worker.serve.engine_loop import EngineLoop
from ferry.worker.serve.job_starts import JobStarter
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.publisher import Publisher
from ferry.worker.serve.queue_reader import QueueReader
from ferry.worker.serve.retry import RetryAbandoned, call_with_backoff
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.writes import Delivery, Discard, Finish, HandBack, JobWrite, Lost, ends_job

log = logging.getLogger("ferry.worker.intake")

_FIRST_CHUNK = 8  # jobs of a burst decided and started first, so the engine can start stepping early
_LIVE_ONLY_BLOCK_MS = 50  # blocking read for live jobs while every slot holds a background one


class Intake:
    def __init__(self, client: redis.Redis, keys: Keys, settings: WorkerSettings, worker_id: str,
                 starter: JobStarter, loop: EngineLoop, publisher: Publisher, metrics: WorkerMetrics,
                 draining: threading.Event) -> None:
        self.settings = settings
        self.reader = QueueReader(client, keys, settings.served_model_name, worker_id, settings.lease_s,
                                  handoffs=settings.lora_handoffs)
        self.starter = starter
        self.loop = loop
        self.publisher = publisher
        self.metrics = metrics
        self.draining = draining  # set: stop reading (the worker drains)
        self.leases: dict[str, Delivery] = {}  # job id -> its queue entry, from start until its last write
        self._leases_lock = threading.Lock()
        self._room = threading.Event()  # a slot freed (or a drain began): read again now
        self._renew_now = threading.Event()  # renew before the interval runs out (Redis restarted)
        self._background_streams = {keys.queue(settings.served_model_name, Priority.low, n)
                                    for n in range(keys.shards)}
        self.ok_at = 0.0  # monotonic time the loop last went round (it is stuck retrying while Redis is away)
        self.thread = threading.Thread(target=self._run, name="intake", daemon=True)

    def wake(self, renew: bool = False) -> None:
        """Look at the queue now (a drain began, or Redis restarted: `renew` the leases first)."""
        if renew:
            self._renew_now.set()
        self._room.set()

    def _backoff(self, what: str, fn, *args):
        """fn(*args), retried while Redis is unreachable (raises RetryAbandoned once a drain began)."""
        return call_with_backoff(functools.partial(fn, *args), what=what, stop=self.draining,
                                 max_delay_s=self.settings.redis_backoff_max_s)

    # --- the loop ------------------------------------------------------------------------------

    def _room_now(self) -> tuple[int, int]:
        """(room for jobs of any lane, room for live jobs alone). Live jobs may take the place of
        background ones the worker holds, up to max_num_seqs live jobs in all."""
        held = list(self.leases.values())
        held_background = sum(d.stream in self._background_streams for d in held)
        max_num_seqs = self.settings.engine.max_num_seqs
        live_room = min(max_num_seqs - (len(held) - held_background), held_background)
        stats = self.loop.stats
        if stats is not None and stats.num_waiting > 0:
            return 0, live_room  # the engine is short of KV: let the queue hold the work
        room = max_num_seqs - len(held)
        return room, max(room, live_room)

    def _run(self) -> None:
        s = self.settings
        next_renew = next_reap = 0.0
        try:
            while not self.draining.is_set():
                now = time.monotonic()
                self.ok_at = now
                if now >= next_renew or self._renew_now.is_set():
                    self._renew_now.clear()
                    self._backoff("renew leases", self._renew)
                    next_renew = now + s.lease_renew_interval_s
                self._room.clear()
                room, live_room = self._room_now()
                if live_room <= 0:
                    self._room.wait(min(0.1, max(0.0, next_renew - now)))
                    continue
                deliveries: list[Delivery] = []
                reap_room = room - self.reader.in_flight  # blocked reads may still claim that many
                if reap_room > 0 and now >= next_reap:
                    held = {d.entry_id for d in list(self.leases.values())}
                    deliveries = self._backoff("reap", self.reader.reap, reap_room, held)
                    next_reap = now + s.reaper_interval_s
                if not deliveries:
                    block_ms = int(min(s.read_block_ms, 1000 * max(0.001, min(next_renew, next_reap) - now)))
                    # Full of background jobs: read live ones only, which take the batch's places,
                    # in short blocks, so a slot a batch job frees is soon filled again.
                    live_only = room <= 0
                    if live_only:
                        block_ms = min(block_ms, _LIVE_ONLY_BLOCK_MS)
                    deliveries = self._backoff("read queue", self.reader.read, live_room if live_only else room,
                                               block_ms, live_only)
                if deliveries:
                    self._take_safely(deliveries)
        except RetryAbandoned:
            pass
        finally:
            self._hand_back_unread()

    def _hand_back_unread(self) -> None:
        """Entries the shard reads still in flight claimed after the intake stopped, and jobs peers
        moved here that were not read yet: back to the queue now, not after a lease (another worker
        takes them at once)."""
        try:
            claimed = self.reader.settle(self.settings.read_block_ms / 1000) + self.reader.handoffs()
            back = [HandBack(d.fields["job_id"], d) for d in claimed if d.fields.get("job_id")]
            if back:
                log.info("handing back jobs read during the drain", extra={"jobs": [w.job_id for w in back]})
                self.publisher.write(back)
        except UNAVAILABLE as exc:  # they stay pending under our name: the reaper offers them after the lease
            log.warning("could not hand back the jobs read during the drain: %s", exc)

    def _take_safely(self, deliveries: list[Delivery]) -> None:
        """Start `deliveries` in two chunks: the engine may begin a step with the first while the
        rest are prepared (it waits for them only while its next step is not full). The rest go
        together: each chunk costs two round trips and a hand-over to the engine thread."""
        pending = len(deliveries)
        self.loop.announce(pending)
        try:
            for chunk in (deliveries[:_FIRST_CHUNK], deliveries[_FIRST_CHUNK:]):
                if chunk:
                    self._backoff("start jobs", self._take, chunk)
                    pending -= len(chunk)
        except RetryAbandoned:
            raise
        except Exception:
            # A bug or an entry we cannot handle: keep serving. The entries stay pending under our
            # name, so the reaper offers them again after the lease (counting attempts up to the DLQ).
            log.exception("could not take jobs", extra={"entries": [d.entry_id for d in deliveries]})
            self.draining.wait(1.0)
        finally:
            if pending:
                self.loop.settle(pending)

    def _take(self, deliveries: list[Delivery]) -> None:
        """Decide and start `deliveries`; ends by telling the engine they all arrived (started or settled)."""
        if self.draining.is_set():
            # Read after the drain began: give them straight back (another worker takes them now).
            self.publisher.write([HandBack(d.fields["job_id"], d) for d in deliveries if d.fields.get("job_id")])
            self.loop.start([], arrived=len(deliveries))
            return
        fresh, duplicates = [], []
        for d in deliveries:
            (duplicates if d.fields.get("job_id") in self.leases else fresh).append(d)
        starts, writes = self.starter.prepare(fresh)
        writes += [Discard(d) for d in duplicates]  # a second entry for a job running here
        if writes:
            self.on_written(writes, self.publisher.write(writes))
        for job in starts:
            with self._leases_lock:
                self.leases[job.job_id] = job.delivery
            if job.delivery.reclaimed:
                self.metrics.reclaimed.inc()
            if job.delivery.handed:
                self.metrics.lora_handoffs.labels("received").inc()
            if job.attempts == 1:
                self.metrics.queue_time.observe(job.started_at - job.request.created_at)
            log.info("job reclaimed" if job.delivery.reclaimed else "job handed over" if job.delivery.handed
                     else "job picked",
                     extra={"job_id": job.job_id, "attempt": job.attempts, "priority": job.request.priority.value,
                            "resume_tokens": len(job.streamed.token_ids)})
        self.loop.start(starts, arrived=len(deliveries))

    def _renew(self) -> None:
        renewal = self.reader.renew(list(self.leases.items()))
        for job_id in renewal.taken:
            log.warning("job lost to another worker", extra={"job_id": job_id})
        for job_id in renewal.gone:
            log.warning("job stopped: Redis no longer has its queue entry (a restart or an eviction)",
                        extra={"job_id": job_id})
        for job_id in renewal.taken | renewal.gone:
            self._release(job_id)
            self.loop.abort(job_id, lost=True)
        for job_id in renewal.cancelled - renewal.taken - renewal.gone:
            self.loop.abort(job_id)

    def _release(self, job_id: str) -> None:
        with self._leases_lock:
            self.leases.pop(job_id, None)
        self._room.set()

    def on_written(self, writes: list[JobWrite], lost: dict[str, Lost]) -> None:
        """Called once writes reached Redis: ended and handed-back jobs free their slot."""
        for w in writes:
            if not ends_job(w) or w.job_id in lost:
                continue
            if isinstance(w, Finish):
                self.metrics.jobs.labels(w.state).inc()
                code = w.result.get("error_code")
                log.info("job finished", extra={"job_id": w.job_id, "state": w.state, "code": code})
            else:
                self.metrics.handed_back.inc()
                log.info("job handed back", extra={"job_id": w.job_id})
            self._release(w.job_id)
        for job_id, reason in lost.items():
            with self._leases_lock:
                first_report = job_id in self.leases
            if not first_report:  # writes already in flight when the first one found the job lost
                continue
            log.warning("job lost", extra={"job_id": job_id, "reason": reason.value})
            if reason is Lost.RECORD_GONE:
                self.metrics.records_lost.inc()
            self._release(job_id)
            self.loop.abort(job_id, lost=True)
