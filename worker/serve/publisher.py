"""Everything the worker writes about jobs, in pipelined round trips.

After each engine step the engine thread hands over the step's writes (`worker.serve.writes`);
the publisher thread sends all pending writes in a single pipeline (two when they mix live jobs
with the background lane's: the live ones go first), one script call per job
(`worker.protocol.lua`): `EMIT` appends a job's events to `{p}:job:{s<n>}:{id}:events` (entry id
`{seq}-1`), publishes each on `{p}:job:{s<n>}:{id}` (SPUBLISH on a cluster), and, when the job
ends, writes the result into the job hash, sets the expiries and only then XACKs and XDELs the
queue entry; the jobs that ended are then counted against their tenants (`worker.protocol.usage`).
Scripts make each job's write atomic: either all of it lands or none, so a re-delivered job never
sees events without the state that goes with them.

Seq fencing: Redis refuses an event whose seq already exists. A worker that finds another
worker's event at its next seq has lost the job (it was reclaimed during a stall) and stops
writing it; the same seq with the same bytes is its own earlier write, retried after a lost reply.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import redis

from ferry.worker.common.connect import UNAVAILABLE
from ferry.worker.protocol import Envelope, JobState, Keys, Priority, event_to_fields, lua
from ferry.worker.protocol.jobs import TERMINAL_STATES_ARG
from ferry.worker.protocol.usage import account_jobs
from ferry.worker.serve.job_trace import JobTracer
from ferry.worker.serve.replication_check import ReplicationCheck
from ferry.worker.serve.retry import RetryAbandoned, call_with_backoff
from ferry.worker.serve.writes import Delivery, Discard, Finish, HandBack, JobWrite, Lost, Progress

log = logging.getLogger("ferry.worker.publisher")


class Publisher:
    """Writes batches of `JobWrite`s; thread-safe (holds no state besides the Redis client)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str, result_ttl_s: int,
                 min_replicas: int = 0, replica_timeout_ms: int = 1000) -> None:
        self.client = client
        self.min_replicas = min_replicas  # replicas terminal writes are checked against (WAIT), 0: not checked
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.result_ttl_s = int(result_ttl_s)
        self.replica_timeout_ms = replica_timeout_ms
        self._emit = lua.register(client, lua.EMIT)
        self._hand_back = client.register_script(lua.HAND_BACK)
        self._replication = ReplicationCheck(client, keys, min_replicas, replica_timeout_ms) if min_replicas else None

    def write(self, writes: list[JobWrite]) -> dict[str, Lost]:
        """One pipelined round trip for all `writes`; returns the jobs found no longer this worker's."""
        answers: list[str | None] = []  # job id whose emit result comes at this position, else None

        def build():
            answers.clear()
            pipe = self.client.pipeline(transaction=False)
            for w in writes:
                if isinstance(w, Finish | Discard) and w.dead_letter is not None:
                    pipe.xadd(self.keys.dlq, w.dead_letter)
                    answers.append(None)
                if isinstance(w, Progress | Finish) or (isinstance(w, HandBack) and w.events):
                    self._add_emit(pipe, w)
                    answers.append(w.job_id)
                if isinstance(w, HandBack):
                    self._add_hand_back(pipe, w)
                    answers.append(None)
                elif isinstance(w, Discard):
                    self._add_ack(pipe, w.delivery)
                    answers.extend([None, None])
            return pipe

        results = lua.execute(build, [self._emit, self._hand_back])
        lost: dict[str, Lost] = {}
        for job_id, result in zip(answers, results, strict=True):
            if isinstance(result, UNAVAILABLE) or (isinstance(result, Exception)
                                                   and not isinstance(result, redis.ResponseError)):
                raise result  # the whole batch is retried: every write of it is idempotent
            if isinstance(result, Exception):
                log.error("redis refused a write", extra={"job_id": job_id, "error": str(result)})
            elif job_id is not None and result in (0, -1):
                lost[job_id] = Lost.TAKEN if result == 0 else Lost.RECORD_GONE
        ended = [w.job_id for w in writes if isinstance(w, Finish) and w.job_id not in lost]
        if self._replication is not None:
            self._replication.submit(ended)
        try:
            account_jobs(self.client, self.keys, ended, self.result_ttl_s)
        except redis.RedisError as exc:  # the terminal writes stand; these jobs go uncounted
            log.warning("usage of %d ended job(s) not counted: %s", len(ended), exc)
        return lost

    def _add_emit(self, pipe, w: Progress | Finish | HandBack) -> None:
        keys = [self.keys.events(w.job_id), self.keys.job(w.job_id)]
        first_token_at = w.first_token_at if isinstance(w, Progress) else None
        args: list = ["" if first_token_at is None else repr(first_token_at), len(w.events)]
        for event in w.events:
            f = event_to_fields(event)
            args += [f["seq"], f["type"], f["data"]]
        if isinstance(w, Finish):
            keys.append(w.delivery.stream)
            args += [self.result_ttl_s, self.keys.group, w.delivery.entry_id]
            for name, value in w.result.items():
                args += [name, value]
        lua.add(pipe, self._emit, keys, args)

    def _add_hand_back(self, pipe, w: HandBack) -> None:
        d = w.delivery
        attempt = int(d.fields.get("attempt", "1") or 1) + 1
        started = w.attempts is not None
        target = self.keys.queue(self.model, Priority.high, self.keys.shard_of(w.job_id)) if started else d.stream
        keys = [d.stream, target, self.keys.job(w.job_id)]
        args = [TERMINAL_STATES_ARG, JobState.queued.value, self.keys.group, d.entry_id, self.worker_id,
                w.attempts if started else "", *Envelope(job_id=w.job_id, attempt=attempt).to_args()]
        lua.add(pipe, self._hand_back, keys, args)

    def _add_ack(self, pipe, d: Delivery) -> None:
        pipe.xack(d.stream, self.keys.group, d.entry_id)
        pipe.xdel(d.stream, d.entry_id)


class PublisherThread:
    """Drains the engine's writes into Redis: everything queued goes out in one round trip."""

    def __init__(self, publisher: Publisher, on_written: Callable[[list[JobWrite], dict[str, Lost]], None],
                 stop: threading.Event, max_delay_s: float, tracer: JobTracer | None = None) -> None:
        self.publisher = publisher
        self.tracer = tracer  # tracing on: ended jobs' spans, made here once their end is written
        self.on_written = on_written
        self.stop = stop
        self.max_delay_s = max_delay_s
        self.inbox: queue.SimpleQueue[list[JobWrite]] = queue.SimpleQueue()
        self._unwritten = 0  # batches submitted and not yet written
        self._done = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def submit(self, writes: list[JobWrite]) -> None:
        """Queue writes (never blocks on Redis: the engine thread calls this after every step)."""
        with self._done:
            self._unwritten += 1
        self.inbox.put(writes)

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far is written; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._unwritten == 0, timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                batch = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            taken = 1
            while True:  # everything queued behind it rides along in the same round trip
                try:
                    batch = batch + self.inbox.get_nowait()
                except queue.Empty:
                    break
                taken += 1
            # Foreground jobs' writes go in a round trip of their own, ahead of the background
            # lane's (a batch's dozens of jobs): a live job's first token does not wait for them.
            # Every write of a background job stays in its part, in order (a job's seqs must not
            # be overtaken by its own later events).
            background_jobs = {w.job_id for w in batch if isinstance(w, Progress | Finish) and w.background}
            background = [w for w in batch if getattr(w, "job_id", None) in background_jobs]
            foreground = [w for w in batch if getattr(w, "job_id", None) not in background_jobs]
            lost: dict[str, Lost] = {}
            published_at = time.time()
            try:
                for part in (foreground, background):
                    if part:
                        lost |= call_with_backoff(lambda p=part: self.publisher.write(p), what="publish",
                                                  stop=self.stop, max_delay_s=self.max_delay_s)
            except RetryAbandoned:
                return
            self.on_written(batch, lost)
            if self.tracer is not None:
                self._trace(batch, lost, published_at, time.time())
            with self._done:
                self._unwritten -= taken
                self._done.notify_all()

    def _trace(self, batch: list[JobWrite], lost: dict[str, Lost], published_at: float, written_at: float) -> None:
        """Hand the tracer the attempts this round trip ended, and those that left without an end."""
        for w in batch:
            if isinstance(w, Finish) and w.trace is not None and w.job_id not in lost:
                self.tracer.ended(w.trace, published_at, written_at)
            elif isinstance(w, HandBack) or (isinstance(w, Finish) and w.job_id in lost):
                self.tracer.forget(w.job_id)
