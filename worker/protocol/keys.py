"""Every Redis key and channel name Ferry uses, under one configurable prefix (default `ferry`).

docs/architecture.md tables them with their types, writers and uses. In short: per model and
queue shard, one queue stream per priority (`{p}:q:{s<n>}:{model}:{priority}`); per job, a hash
(`{p}:job:{s<n>}:{id}`), an event stream (`{p}:job:{s<n>}:{id}:events`) and a pub/sub channel
(the hash's name: channels and keys are separate namespaces, so they share it on purpose);
idempotency keys; the cancel channel; per worker and shard a hand-off stream
(`{p}:q:{s<n>}:{model}:to:{worker}`, jobs moved to the worker that holds their LoRA adapter); the
dead-letter stream; worker heartbeats; the LoRA adapter registry; the webhook relay's bookkeeping;
Celery's broker keys under `{p}:celery:`.

Shards (Redis Cluster): `{s<n>}` is a hash tag, so a shard's queue streams and the keys of every
job in it share one hash slot, and each script of the queue (enqueue, start, emit, hand back,
cancel) touches one slot. A job id ends with `-s<n>` (`new_job_id`), so every key of a job
follows from its id alone; an id without that ending is in shard 0. An idempotency key's shard
comes from its (tenant, key) digest, and a job enqueued under it is put in that shard.

Spread: of N shards, shard n's tag is the first of `s<n>`, `s<n>.1`, `s<n>.2`, ... whose slot lies
in the n-th N-th of the slot space. A cluster created with its slots split evenly (what
`redis-cli --cluster create` and ElastiCache do) then holds N shards for N primaries one per
primary, where plain `{s0}`, `{s1}`, `{s2}` hash to slots 11097, 15224 and 2843 (two on one
primary of three). With one shard the tag is `{s0}`.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ferry.worker.common.settings import MAX_QUEUE_SHARDS
from ferry.worker.protocol.lanes import Priority

GROUP = "workers"  # the consumer group every worker of a model joins on its queue streams
HANDOFF_TTL_S = 86_400  # a hand-off stream outlives its worker's last hand-off by this long
_SHARD_SUFFIX = re.compile(r"-s(\d{1,4})$")  # how a job id names its shard (`new_job_id`)


class Keys:
    """Key and channel names under `prefix` (no trailing colon), with `shards` queue shards per model."""

    def __init__(self, prefix: str = "ferry", shards: int = 1) -> None:
        if not 1 <= shards <= MAX_QUEUE_SHARDS:
            raise ValueError(f"shards must be between 1 and {MAX_QUEUE_SHARDS}, got {shards}")
        self.prefix = prefix.rstrip(":")
        self.group = GROUP
        self.shards = shards
        self._tags = _shard_tags(shards)

    @staticmethod
    def shard_of(job_id: str) -> int:
        """The queue shard a job id names (`-s<n>` at its end; 0 for an id without it)."""
        match = _SHARD_SUFFIX.search(job_id)
        return int(match.group(1)) if match else 0

    def shard_tag(self, shard: int) -> str:
        """The hash tag of a shard's keys, braces included (`{s<n>}` or `{s<n>.<k>}`: the module's
        docstring says why). A shard beyond `shards` (a job id from a process configured with more)
        gets `{s<n>}`: its keys still share one slot."""
        return self._tags[shard] if shard < self.shards else f"{{s{shard}}}"

    def shard_slot(self, shard: int) -> int:
        """The hash slot of a shard's keys."""
        return key_slot(self.shard_tag(shard).encode())

    def queue(self, model: str, priority: Priority | str, shard: int = 0) -> str:
        """The queue stream of one lane of one shard (ValueError for a lane that does not exist)."""
        lane = Priority(priority)
        return f"{self.prefix}:q:{self.shard_tag(shard)}:{model}:{lane}"

    def shard_queues(self, model: str, shard: int) -> list[str]:
        """One shard's queue streams in read order, high first (one hash slot)."""
        return [self.queue(model, p, shard) for p in Priority]

    def queues(self, model: str) -> list[str]:
        """All the model's queue streams in read order: every shard's high, then normal, then low."""
        return [self.queue(model, p, n) for p in Priority for n in range(self.shards)]

    def handoff(self, model: str, shard: int, worker_id: str) -> str:
        """A worker's hand-off stream in one shard: entries of that shard's queue streams another
        worker moved to it (`worker.serve.lora_affinity`), read before the queue (the shard's slot)."""
        return f"{self.prefix}:q:{self.shard_tag(shard)}:{model}:to:{worker_id}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{self.shard_tag(self.shard_of(job_id))}:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.job(job_id)}:events"

    def channel(self, job_id: str) -> str:
        return self.job(job_id)

    def idempotency(self, tenant: str, key: str) -> str:
        """One name per (tenant, key) pair: both are hashed with their lengths, so no two pairs
        share a name whatever characters they hold (`acme` + `x:K` is not `acme:x` + `K`). It
        lives in shard `idempotency_shard(tenant, key)`, with the job it names."""
        tag = self.shard_tag(self.idempotency_shard(tenant, key))
        return f"{self.prefix}:idem:{tag}:{_idempotency_digest(tenant, key)}"

    def idempotency_shard(self, tenant: str, key: str) -> int:
        """The shard of a job enqueued under an idempotency key: the key's own shard."""
        return int(_idempotency_digest(tenant, key)[:8], 16) % self.shards

    def ack(self, job_id: str) -> str:
        """String, 60 s: the marker written on the job's shard before a WAIT (`worker.common.connect`)."""
        return f"{self.prefix}:ack:{self.shard_tag(self.shard_of(job_id))}"

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

    @property
    def loras(self) -> str:
        """Hash: LoRA adapter name -> its registry entry as JSON (`worker.protocol.loras`); no hash tag,
        like `models`: one key, read on its own."""
        return f"{self.prefix}:loras"

    def model_limits(self, model: str) -> str:
        """Hash: `vocab_size`, `max_model_len`, `chat_template_variables` (JSON) of a served model, written
        by its workers."""
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


@lru_cache(maxsize=8)
def _shard_tags(shards: int) -> tuple[str, ...]:
    tags = []
    for n in range(shards):
        low, high = n * REDIS_CLUSTER_HASH_SLOTS // shards, (n + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        k = 0
        while not low <= key_slot((tag := f"s{n}.{k}" if k else f"s{n}").encode()) < high:
            k += 1
        tags.append(f"{{{tag}}}")
    return tuple(tags)


def _idempotency_digest(tenant: str, key: str) -> str:
    digest = hashlib.sha256()
    for part in (tenant, key):
        raw = part.encode()
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.hexdigest()


def tenant_tag(name: str) -> str:
    """A hash tag for a free-form name (a tenant), without braces or colons in it."""
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def watch_value(last_id: str, registered_at: float) -> str:
    """A `webhook_watch` value: the last event stream id relayed, and when the job was registered."""
    return f"{last_id} {registered_at:.3f}"


def parse_watch_value(value: str) -> tuple[str, float]:
    last_id, _, registered = value.partition(" ")
    return last_id, float(registered or 0)
