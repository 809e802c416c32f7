"""Every Redis key and channel name Ferry uses, under one configurable prefix (default `ferry`).

docs/architecture.md tables them with their types, writers and uses. In short: per model, one
queue stream per priority (`{p}:q:{model}:{priority}`); per job, a hash (`{p}:job:{id}`), an
event stream (`{p}:job:{id}:events`) and a pub/sub channel (`{p}:job:{id}`: channels and keys
are separate namespaces, so the hash and the channel share a name on purpose); idempotency keys;
the cancel channel; the dead-letter stream; worker heartbeats; the webhook relay's bookkeeping;
Celery's broker keys under `{p}:celery:`.
"""

from __future__ import annotations

import hashlib

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
        """One name per (tenant, key) pair: both are hashed with their lengths, so no two pairs
        share a name whatever characters they hold (`acme` + `x:K` is not `acme:x` + `K`)."""
        digest = hashlib.sha256()
        for part in (tenant, key):
            raw = part.encode()
            digest.update(len(raw).to_bytes(8, "little") + raw)
        return f"{self.prefix}:idem:{digest.hexdigest()}"

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

    def model_limits(self, model: str) -> str:
        """Hash: `vocab_size`, `max_model_len` of a served model, written by its workers."""
        return f"{self.prefix}:model:{model}"

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
