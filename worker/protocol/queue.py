"""The atomic writes a client of the queue makes: enqueue a job (one or many), request a cancel.

Each is one Lua script (`worker.protocol.lua`), so atomic and one round trip:
- `enqueue_job`: with an idempotency key, `GET {p}:idem:{s<n>}:{digest}`; if set, return that job
  id and write nothing, else `SET ... job_id EX idempotency_ttl_s`; then `HSET {p}:job:{s<n>}:{id}`
  the fields of `JobRecord.new(...)` and `XADD {p}:q:{s<n>}:{model}:{priority}` the `Envelope`.
  Every key is in the job's shard (one hash slot): the idempotency key's shard when there is one,
  else a shard drawn at random, so the shards of a model fill evenly. The XLEN of
  a queue stream is the number of jobs waiting or in flight (workers XACK and XDEL an entry once
  the job is terminal), which is what the API compares with its queue limit.
- `cancel_job`: set `cancel` on the hash; a job still queued is finished right there (state
  `cancelled`, a `cancelled` event at the next seq, published, expiry set); every call also
  publishes the job id on `{p}:cancel`, which makes the worker running the job abort it within
  one step.
"""

from __future__ import annotations

import random
import time

from pydantic import BaseModel

from ferry.worker.protocol import lua
from ferry.worker.protocol.codec import text
from ferry.worker.protocol.events import CancelledEvent, event_json_tail
from ferry.worker.protocol.jobs import TERMINAL_STATES_ARG, Envelope, JobRecord, JobRequest, JobState, new_job_id
from ferry.worker.protocol.keys import Keys


class EnqueueResult(BaseModel):
    job_id: str
    created: bool  # False: the idempotency key already named `job_id`, nothing was written


def new_job_id_for(keys: Keys, request: JobRequest, idempotency_key: str | None) -> str:
    """A fresh id for `request`, in the shard its enqueue must use: its idempotency key's shard (the
    script writes both in one slot), else any shard at random. For callers that need the id before
    the enqueue (the tenant's job index is written first: api.joblist)."""
    shard = (random.randrange(keys.shards) if idempotency_key is None
             else keys.idempotency_shard(request.tenant, idempotency_key))
    return new_job_id(request.created_at, shard)


def _enqueue_call(keys: Keys, request: JobRequest, job_id: str | None, idempotency_key: str | None,
                  idempotency_ttl_s: int, batch_line: tuple[str, str] | None = None,
                  reservation: tuple[str, int] | None = None,
                  traceparent: str | None = None) -> tuple[list[str], list[str]]:
    job_id = job_id or new_job_id_for(keys, request, idempotency_key)
    shard = keys.shard_of(job_id)
    record = JobRecord.new(job_id, request, *(batch_line or (None, None)), reservation=reservation,
                           traceparent=traceparent)
    redis_keys = [keys.job(job_id), keys.queue(request.model, request.priority.value, shard)]
    if idempotency_key is not None:
        if keys.idempotency_shard(request.tenant, idempotency_key) != shard:
            raise ValueError(f"job id {job_id!r} is in shard {shard}, its idempotency key is not: "
                             "let enqueue choose the id")
        redis_keys.append(keys.idempotency(request.tenant, idempotency_key))
    args = [job_id, str(int(idempotency_ttl_s)), *Envelope(job_id=job_id).to_args()]
    for field, value in record.to_redis().items():
        args += [field, value]
    return redis_keys, args


def _enqueue_result(answer) -> EnqueueResult:
    created, job_id = answer
    return EnqueueResult(job_id=text(job_id), created=bool(int(created)))


def enqueue_job(client, keys: Keys, request: JobRequest, *, job_id: str | None = None,
                idempotency_key: str | None = None, idempotency_ttl_s: int = 86400) -> EnqueueResult:
    """Write the job hash and its envelope atomically (sync `redis.Redis`)."""
    redis_keys, args = _enqueue_call(keys, request, job_id, idempotency_key, idempotency_ttl_s)
    return _enqueue_result(client.register_script(lua.ENQUEUE)(keys=redis_keys, args=args))


async def enqueue_job_async(client, keys: Keys, request: JobRequest, *, job_id: str | None = None,
                            idempotency_key: str | None = None, idempotency_ttl_s: int = 86400,
                            batch_line: tuple[str, str] | None = None,
                            reservation: tuple[str, int] | None = None,
                            traceparent: str | None = None) -> EnqueueResult:
    """`enqueue_job` for `redis.asyncio.Redis`; `batch_line` (batch id, custom_id) marks a Batch API line's job;
    `reservation` (budget, tokens) is what the tenant's rate limit reserved for it (`worker.protocol.usage`);
    `traceparent` is the W3C context the job's trace goes on from (`JobRecord.traceparent`)."""
    redis_keys, args = _enqueue_call(keys, request, job_id, idempotency_key, idempotency_ttl_s, batch_line,
                                     reservation, traceparent)
    return _enqueue_result(await client.register_script(lua.ENQUEUE)(keys=redis_keys, args=args))


def enqueue_jobs(client, keys: Keys, requests: list[JobRequest], *,
                 job_ids: list[str] | None = None) -> list[EnqueueResult]:
    """Many jobs in one round trip (sync client), each atomic on its own: a batch arrives at the
    workers together instead of trickling in over many round trips."""
    script = client.register_script(lua.ENQUEUE)
    calls = [_enqueue_call(keys, request, job_id, None, 0)
             for request, job_id in zip(requests, job_ids or [None] * len(requests), strict=True)]

    def build():
        pipe = client.pipeline(transaction=False)
        for redis_keys, args in calls:
            lua.add(pipe, script, redis_keys, args)
        return pipe

    return [_enqueue_result(answer) for answer in lua.raise_errors(lua.execute(build, [script]))]


def _cancel_call(keys: Keys, job_id: str, result_ttl_s: int) -> tuple[list[str], list[str]]:
    now = time.time()
    tail = event_json_tail(CancelledEvent(seq=0, ts=now))
    args = [TERMINAL_STATES_ARG, JobState.cancelled.value, str(int(result_ttl_s)), repr(now), keys.cancel,
            keys.channel(job_id), job_id, tail]
    return [keys.job(job_id), keys.events(job_id)], args


def cancel_job(client, keys: Keys, job_id: str, *, result_ttl_s: int = 86400) -> JobState | None:
    """Request cancellation (sync client). Returns the state after the call, None for an unknown job.

    A queued job is `cancelled` at once; a running one stays `running` until its worker aborts it
    within one step (watch the events); a terminal one is left as it is.
    """
    redis_keys, args = _cancel_call(keys, job_id, result_ttl_s)
    answer = lua.register(client, lua.CANCEL)(keys=redis_keys, args=args)
    return None if answer is None else JobState(text(answer))


async def cancel_job_async(client, keys: Keys, job_id: str, *, result_ttl_s: int = 86400) -> JobState | None:
    """`cancel_job` for `redis.asyncio.Redis`."""
    redis_keys, args = _cancel_call(keys, job_id, result_ttl_s)
    answer = await lua.register(client, lua.CANCEL)(keys=redis_keys, args=args)
    return None if answer is None else JobState(text(answer))
