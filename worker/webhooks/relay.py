"""Turns job events into webhook delivery tasks; runs inside `ferry webhooks`.

The API registers every job that has a webhook in `{p}:webhooks:watch` (after enqueueing it).
The relay follows the event streams of all watched jobs with one XREAD per queue shard (one hash
slot each in a cluster), remembers the last
entry it handled per job in the watch hash (so a restart resumes where it stopped and a job
that ran while the relay was down is still reported), and hands `job.started` and the terminal
event to Celery once each (`{p}:webhooks:sent:…` NX guards against double hand-offs). A job
leaves the watch set after its terminal event, or when its hash has expired.

One bad entry stops no one else's webhooks: of an event the relay reads only its type and time
(an event of a newer worker, with a field this version does not know, is relayed all the same),
and an event or outbox message it cannot read at all is logged and passed over. A job whose
hand-off fails for itself (the broker refuses that one message: over SQS's size limit, say) is
held back, its events unmarked, and tried again after a backoff of its own while the others go
on. Only a failure of Redis or of the connection to the broker, which every message would meet,
makes the relay retry its whole step.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime

import redis
from kombu.exceptions import OperationalError

from ferry.worker.common.connect import connect
from ferry.worker.common.tracing import Tracing
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, WEBHOOK_EVENT_FOR, JobRecord, JobState, Keys, UnreadableRecord
from ferry.worker.protocol.codec import decoded
from ferry.worker.protocol.keys import parse_watch_value, watch_value
from ferry.worker.webhooks.delivery import Attempt, WebhookMessage
from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.tasks import enqueue
from ferry.worker.webhooks.tracing import handoff_span

log = logging.getLogger("ferry.webhooks.relay")

RELAY_BLOCK_S = 0.5  # longest blocking read of the watched jobs' event streams
_RETRY_MIN_S, _RETRY_MAX_S = 0.2, 30.0  # backoff after a failed step
FORGET_AFTER_S = 60.0  # a watched job whose hash is still missing this long after registration is gone
GC_INTERVAL_S = 30.0


def job_payload(event_name: str, record: JobRecord, ts: float) -> dict:
    """The webhook body: Standard Webhooks' `{type, timestamp, data}` with the job in `data`, as
    it was at the event (the hash may be further along by the time `job.started` is relayed)."""
    terminal = event_name != "job.started"
    data: dict = {
        "id": record.id,
        "status": record.state.value if terminal else JobState.running.value,
        "model": record.model,
        "metadata": record.request.metadata if record.request else {},
        "created_at": record.created_at,
        "started_at": record.started_at,
        "finished_at": record.finished_at if terminal else None,
    }
    if terminal:
        data["output"] = (
            {"text": record.text, "finish_reason": record.finish_reason, "stop_reason": record.stop_reason}
            if record.state == JobState.succeeded
            else None
        )
        data["usage"] = record.usage.model_dump() if record.usage else None
        data["timings"] = record.timings.model_dump() if record.timings else None
        data["error"] = {"code": record.error_code, "message": record.error_message} if record.error_code else None
    timestamp = datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")
    return {"type": event_name, "timestamp": timestamp, "data": data}


def _event_type_and_time(fields: dict) -> tuple[str, float]:
    """An event stream entry's type and the time in its event: all the relay needs, read without
    validating the rest of the event."""
    entry = decoded(fields)
    return entry["type"], float(json.loads(entry["data"])["ts"])


class Relay:
    """Follows watched jobs' event streams; `app` (the Celery app) is set before `run`."""

    def __init__(self, settings: WebhookSettings, app=None, client: redis.Redis | None = None,
                 tracing: Tracing | None = None):
        self.settings = settings
        self.app = app
        self.tracing = tracing  # tracing on: a hand-off is a span of its job's trace
        self.keys = Keys(settings.key_prefix, settings.queue_shards)
        self.redis = client or connect(settings.redis_url, cluster=settings.redis_cluster, decode_responses=True,
                                       socket_connect_timeout=2.0, socket_timeout=RELAY_BLOCK_S + 2.0)
        self._last_gc = 0.0
        self._held: dict[str, tuple[float, float]] = {}  # job whose hand-off failed -> (retry at, backoff) monotonic s
        self.handoff_failures = 0  # relay steps that failed (exported as ferry_webhook_handoff_failures_total)

    def run(self, stop: threading.Event) -> None:
        """Relay until `stop`. Any failure (Redis, or the Celery broker refusing a hand-off) is
        retried with backoff: nothing was marked sent, so the same events are read and handed
        off again."""
        log.info("relay following %s", self.keys.webhook_watch)
        delay = _RETRY_MIN_S
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as exc:  # kombu and redis raise their own types; the relay must outlive them all
                self.handoff_failures += 1
                log.warning("relay: %s: %s; retrying in %.1f s", type(exc).__name__, exc, delay)
                stop.wait(delay)
                delay = min(_RETRY_MAX_S, delay * 2)
                continue
            delay = _RETRY_MIN_S
            if not busy:
                stop.wait(0.2)

    def step(self, block_ms: int = int(RELAY_BLOCK_S * 1000)) -> bool:
        """Hand off the outbox, then read every watched job's new events; False when there was nothing to do."""
        sent_outbox = self._drain_outbox()
        watched = {job: parse_watch_value(v) for job, v in self.redis.hgetall(self.keys.webhook_watch).items()}
        if time.time() - self._last_gc > GC_INTERVAL_S:
            self._forget_expired(watched)
        now = time.monotonic()
        self._held = {job: held for job, held in self._held.items() if job in watched}
        ready = {job: mark for job, mark in watched.items() if self._held.get(job, (now, 0.0))[0] <= now}
        if not ready:
            return sent_outbox
        jobs_of = {self.keys.events(job): job for job in ready}
        answer, blocked = self._read(ready, block_ms)
        for stream, entries in answer:
            job_id = jobs_of[stream]
            self._handle_apart(job_id, entries, ready[job_id][1])
        return blocked or bool(answer)

    def _handle_apart(self, job_id: str, entries: list, registered_at: float) -> None:
        """`_handle`, with a failure of this job's own kept to it: logged and counted, its mark left
        where it was, and the job held back for a backoff of its own (doubling while it fails). A
        failure of Redis or of the connection to the broker is everyone's, and fails the step."""
        try:
            self._handle(job_id, entries, registered_at)
        except (redis.RedisError, OperationalError):
            raise
        except Exception as exc:  # the broker refused this message, or its data broke the hand-off
            self.handoff_failures += 1
            backoff = min(_RETRY_MAX_S, 2 * self._held.get(job_id, (0.0, _RETRY_MIN_S / 2))[1])
            self._held[job_id] = (time.monotonic() + backoff, backoff)
            log.warning("relay: job %s: %s: %s; its webhooks wait %.1f s, the others go on", job_id,
                        type(exc).__name__, exc, backoff)
        else:
            self._held.pop(job_id, None)

    def _read(self, watched: dict[str, tuple[str, float]], block_ms: int) -> tuple[list, bool]:
        """New events of the watched jobs: one XREAD per queue shard, since one XREAD names streams of
        one hash slot in a cluster; it blocks only when every watched job is in one shard (else the
        run loop's pause paces the reads). Returns (entries per stream, whether the read blocked)."""
        by_shard: dict[int, dict[str, str]] = {}
        for job, (last, _) in watched.items():
            by_shard.setdefault(self.keys.shard_of(job), {})[self.keys.events(job)] = last
        if len(by_shard) == 1:
            return self.redis.xread(next(iter(by_shard.values())), count=100, block=block_ms) or [], True
        pipe = self.redis.pipeline(transaction=False)
        for streams in by_shard.values():
            pipe.xread(streams, count=100)
        return [item for answer in pipe.execute() for item in (answer or [])], False

    def _handle(self, job_id: str, entries: list, registered_at: float) -> None:
        """Relay a batch of one job's events, then move its mark (or drop it after the last)."""
        for entry_id, fields in entries:
            try:
                kind, ts = _event_type_and_time(fields)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("relay: job %s: event %s is unreadable (%r); passed over", job_id, entry_id, exc)
                continue
            name = WEBHOOK_EVENT_FOR.get(kind)
            if name is not None:
                self._hand_off(job_id, name, ts)
            if kind in TERMINAL_EVENT_TYPES:
                self.redis.hdel(self.keys.webhook_watch, job_id)
                return
        self.redis.hset(self.keys.webhook_watch, job_id, watch_value(entries[-1][0], registered_at))

    def _hand_off(self, job_id: str, name: str, ts: float) -> None:
        """Hand one event to Celery, then mark it sent: a hand-off the broker refused raises and is
        tried again; a relay that dies between the two sends it twice under the same webhook id
        (receivers de-duplicate on it: Standard Webhooks is at least once)."""
        # The worker writes a terminal event and the result into the hash in one script: the
        # hash is complete by the time its terminal event can be read.
        try:
            record = JobRecord.from_redis(self.redis.hgetall(self.keys.job(job_id)))
        except UnreadableRecord:
            log.warning("relay: job %s has an unreadable record; no webhook", job_id)
            return
        webhook = record.request.webhook if record and record.request else None
        if webhook is None or name not in webhook.events:
            return
        sent = self.keys.webhook_sent(job_id, name)
        if self.redis.exists(sent):
            return
        body = json.dumps(job_payload(name, record, ts), separators=(",", ":"))
        # The id names the (job, event) pair, so it is the same on every retry and every relay.
        with handoff_span(self.tracing, record.traceparent, job_id, name, self.keys.webhook_queue) as traceparent:
            enqueue(self.app, WebhookMessage(f"msg_{job_id}_{name.removeprefix('job.')}", job_id, name, webhook.url,
                                             body, record.tenant, traceparent))
        self.redis.set(sent, "1", ex=self.settings.result_ttl_s)

    def _drain_outbox(self) -> bool:
        """Hand the outbox's ready-made messages to Celery, then drop them (at least once: a relay
        that dies in between sends one again under the same webhook id)."""
        entries = self.redis.xrange(self.keys.webhook_outbox, count=100)
        for entry_id, fields in entries:
            given = {name: fields[name] for name in WebhookMessage.__slots__ if name in fields}
            try:
                message = WebhookMessage(**given)
            except TypeError:  # a field missing
                log.warning("relay: outbox entry %s is not a whole webhook message (%s); dropped", entry_id,
                            sorted(fields))
            else:
                enqueue(self.app, message)
            self.redis.xdel(self.keys.webhook_outbox, entry_id)
        return bool(entries)

    def _forget_expired(self, watched: dict[str, tuple[str, float]]) -> None:
        self._last_gc = time.time()
        for job_id, (_, registered_at) in list(watched.items()):
            if time.time() - registered_at > FORGET_AFTER_S and not self.redis.exists(self.keys.job(job_id)):
                self.redis.hdel(self.keys.webhook_watch, job_id)
                del watched[job_id]

    def record(self, delivery: WebhookMessage, attempt: Attempt, attempts: int) -> None:
        """Store a settled delivery's outcome where GET /v1/jobs/{id} shows it."""
        outcome = {
            "webhook_id": delivery.webhook_id,
            "url": delivery.url,
            "outcome": "failed" if attempt.outcome == "retry" else attempt.outcome,
            "status_code": attempt.status_code,
            "attempts": attempts,
            "detail": attempt.detail,
            "at": time.time(),
        }
        key = self.keys.webhook_deliveries(delivery.job_id)
        pipe = self.redis.pipeline(transaction=False)  # one key: a cluster pipeline cannot be a transaction
        pipe.hset(key, delivery.event, json.dumps(outcome))
        pipe.expire(key, self.settings.result_ttl_s)
        pipe.execute()
