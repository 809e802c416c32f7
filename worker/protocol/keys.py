"""Every Redis key and channel name Ferry uses, under one configurable prefix (default `ferry`).

| name                               | type             | written by      | use |
|------------------------------------|------------------|-----------------|-----|
| `{p}:q:{model}:{high,normal,low}`  | stream, group `workers` | api (XADD), worker (XACK+XDEL) | job envelopes `{job_id, attempt}` for one served model; XLEN = jobs waiting + in flight |
| `{p}:job:{id}`                     | hash             | api, worker     | the job record (`protocol.JobRecord`); EXPIRE after a terminal state |
| `{p}:job:{id}:events`              | stream           | worker (api for a queued cancel) | every event in order; entry id is `{seq}-1` |
| `{p}:job:{id}`                     | pub/sub channel  | worker          | the same events, live (JSON of `protocol.Event`) |
| `{p}:idem:{tenant}:{key}`          | string, NX EX    | api             | idempotency key -> job id |
| `{p}:cancel`                       | pub/sub channel  | api             | cancel wake-up: the message is the job id; the flag is `cancel` on the job hash |
| `{p}:dlq`                          | stream           | worker          | poison jobs: `{job_id, reason, code, message, attempts, worker_id}` |
| `{p}:worker:{id}`                  | hash, EX         | worker          | heartbeat: `model`, `load`, `running`, `waiting`, `fingerprint`, `ts` |
| `{p}:workers`                      | sorted set       | worker          | worker id -> unix time of its last heartbeat |
| `{p}:models`                       | sorted set       | worker          | served model name -> unix time of its last heartbeat (`/v1/models`) |
| `{p}:webhooks:watch`               | hash             | api, relay      | job id -> "<last event stream id> <registered unix ts>" for jobs with a webhook whose terminal event is not relayed yet |
| `{p}:webhooks:sent:{job}:{event}`  | string NX EX     | relay           | an event was handed to Celery once (relay restarts never enqueue it twice) |
| `{p}:webhooks:deliveries:{job}`    | hash, EX         | webhook worker  | event name -> JSON outcome (webhook id, outcome, status code, attempts) |
| `{p}:webhooks`                     | Celery queue     | relay, Celery   | webhook delivery tasks |
| `{p}:celery:*`                     | Celery's keys    | Celery          | broker keys (`global_keyprefix`) |

Redis pub/sub channels and keys live in separate namespaces, so a job's hash and its channel share
one name on purpose.
"""

from __future__ import annotations

PRIORITIES = ("high", "normal", "low")  # read order: a worker drains `high` before `normal` before `low`
GROUP = "workers"  # the consumer group every worker of a model joins on its queue streams


class Keys:
    """Key and channel names under `prefix` (no trailing colon)."""

    def __init__(self, prefix: str = "ferry") -> None:
        self.prefix = prefix.rstrip(":")
        self.group = GROUP

    def queue(self, model: str, priority: str) -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}: must be one of {PRIORITIES}")
        return f"{self.prefix}:q:{model}:{priority}"

    def queues(self, model: str) -> list[str]:
        """The model's queue streams in read order, high first."""
        return [self.queue(model, p) for p in PRIORITIES]

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:events"

    def channel(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def idempotency(self, tenant: str, key: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{key}"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}:dlq"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def models(self) -> str:
        return f"{self.prefix}:models"

    # --- webhook delivery ---------------------------------------------------------------------------

    @property
    def webhook_watch(self) -> str:
        return f"{self.prefix}:webhooks:watch"

    def webhook_sent(self, job_id: str, event: str) -> str:
        return f"{self.prefix}:webhooks:sent:{job_id}:{event}"

    def webhook_deliveries(self, job_id: str) -> str:
        return f"{self.prefix}:webhooks:deliveries:{job_id}"

    @property
    def celery_prefix(self) -> str:
        return f"{self.prefix}:celery:"

    @property
    def webhook_queue(self) -> str:
        return f"{self.prefix}:webhooks"


def watch_value(last_id: str, registered_at: float) -> str:
    """A `webhook_watch` value: the last event stream id relayed, and when the job was registered."""
    return f"{last_id} {registered_at:.3f}"


def parse_watch_value(value: str) -> tuple[str, float]:
    last_id, _, registered = value.partition(" ")
    return last_id, float(registered or 0)
