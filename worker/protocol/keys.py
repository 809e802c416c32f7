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
    def webhook_outbox(self) -> str:
        """Stream: finished webhook messages (`webhook_id`, `job_id`, `event`, `url`, `body`) the relay
        hands to Celery as they are; the Batch API's `batch.*` events come this way."""
        return f"{self.prefix}:webhooks:outbox"

    @property
    def celery_prefix(self) -> str:
        return f"{self.prefix}:celery:"

    @property
    def webhook_queue(self) -> str:
        return f"{self.prefix}:webhooks"

    # --- Batch API (files, batches) -----------------------------------------------------------------
    # Every key of one file or one batch carries the id as a hash tag (`{id}`): in Redis Cluster
    # they share a slot, so each script of the batch driver touches one slot and never a job key.

    def file(self, file_id: str) -> str:
        """Hash: one stored file's record (tenant, bytes, filename, purpose, created_at, object)."""
        return f"{self.prefix}:file:{{{file_id}}}"

    def tenant_files(self, tenant: str) -> str:
        """Sorted set: the tenant's file ids, scored by creation time (GET /v1/files)."""
        return f"{self.prefix}:files:{{{tenant_tag(tenant)}}}"

    def batch(self, batch_id: str) -> str:
        """Hash: one batch's state, request counts, cursor and committed output parts."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_lease(self, batch_id: str) -> str:
        """String, PX: the token of the API process driving the batch; every write checks it."""
        return f"{self.prefix}:batch:{{{batch_id}}}:lease"

    def batch_inflight(self, batch_id: str) -> str:
        """Hash: line number -> `job_id custom_id` of the batch's lines enqueued and not yet written out."""
        return f"{self.prefix}:batch:{{{batch_id}}}:inflight"

    def batch_parts(self, batch_id: str) -> str:
        """Hash: part number -> the object names of that part's output and error lines."""
        return f"{self.prefix}:batch:{{{batch_id}}}:parts"

    def tenant_batches(self, tenant: str) -> str:
        """Sorted set: the tenant's batch ids, scored by creation time (GET /v1/batches)."""
        return f"{self.prefix}:batches:{{{tenant_tag(tenant)}}}"

    @property
    def active_batches(self) -> str:
        """Set: ids of batches not yet in a final state; every API process's driver scans it."""
        return f"{self.prefix}:batches:active"


    # --- tenants: job index, rate limits, usage --------------------------------------------------
    # Every key of one tenant carries its tag (`{tag}`): one slot, so a script over a tenant's
    # buckets and counters touches one slot and never a job key.

    def tenant_jobs(self, tenant: str) -> str:
        """Sorted set, every score 0: the tenant's job ids, which sort by creation (`new_job_id`),
        so ZREVRANGEBYLEX lists newest first and an id is its own cursor (GET /v1/jobs). Written
        before the job's enqueue, in a command of its own; ids whose hash is gone are skipped."""
        return f"{self.prefix}:jobs:{{{tenant_tag(tenant)}}}"

    def rate_bucket(self, tenant: str, budget: str) -> str:
        """Hash: the tenant's token buckets of one budget (`live` or `batch`): requests and tokens,
        each its level, last refill (ms) and capacity per minute (`lua.RATE_LIMIT`)."""
        return f"{self.prefix}:ratelimit:{{{tenant_tag(tenant)}}}:{budget}"

    def usage(self, tenant: str) -> str:
        """Hash: the tenant's totals `requests`, `prompt_tokens`, `completion_tokens` (jobs that ended)."""
        return f"{self.prefix}:usage:{{{tenant_tag(tenant)}}}"

    def usage_day(self, tenant: str, day: str) -> str:
        """Hash: the same counters for one UTC day (`YYYY-MM-DD`), expiring after `USAGE_DAYS_KEPT`."""
        return f"{self.prefix}:usage:{{{tenant_tag(tenant)}}}:day:{day}"

    def usage_counted(self, tenant: str, job_id: str) -> str:
        """String, EX: set when a job's usage was counted, so counting twice (a retried write, the
        API and a worker both seeing the end) adds nothing."""
        return f"{self.prefix}:usage:{{{tenant_tag(tenant)}}}:counted:{job_id}"


def tenant_tag(name: str) -> str:
    """A hash tag for a free-form name (a tenant), without braces or colons in it."""
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def watch_value(last_id: str, registered_at: float) -> str:
    """A `webhook_watch` value: the last event stream id relayed, and when the job was registered."""
    return f"{last_id} {registered_at:.3f}"


def parse_watch_value(value: str) -> tuple[str, float]:
    last_id, _, registered = value.partition(" ")
    return last_id, float(registered or 0)
