"""Counting a job that ended: the tenant's usage, and the correction of its rate-limit reservation.

Whoever writes a job's terminal state counts it right after, with one `lua.ACCOUNT` call on the
tenant's keys (one hash slot; the job hash is read first, in a command of its own): the worker's
publisher for every job a worker ends (succeeded, failed, timed out, cancelled while running,
dead-lettered), the API for a job cancelled while still queued. The call adds one request and
the job's prompt and completion tokens to the tenant's totals and to the day's, and gives the
tokens reserved at admission minus the tokens used back to the bucket they came from (negative
when the prompt was longer than estimated). A marker per job makes a second count a no-op.

The count comes after the terminal write, so a process that dies between the two leaves that one
job uncounted (its reservation is then simply spent): at most once, never twice.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from ferry.worker.protocol import lua
from ferry.worker.protocol.keys import Keys

USAGE_DAYS_KEPT = 90  # per-day usage hashes expire after this many days
ACCOUNT_FIELDS = ("tenant", "usage", "rate_budget", "reserved_tokens")  # what the job hash must say


def day_of(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d")


def account_call(keys: Keys, job_id: str, values: list, marker_ttl_s: int) -> tuple[list[str], list] | None:
    """The `lua.ACCOUNT` keys and args for a job whose hash says `values` (HMGET of ACCOUNT_FIELDS);
    None for a job whose hash is gone."""
    tenant, usage_json, budget, reserved = (v.decode() if isinstance(v, bytes) else v for v in values)
    if tenant is None:
        return None
    usage = json.loads(usage_json) if usage_json else {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    now = time.time()
    redis_keys = [keys.usage_counted(tenant, job_id), keys.usage(tenant), keys.usage_day(tenant, day_of(now))]
    give_back = 0
    if budget and reserved is not None:
        redis_keys.append(keys.rate_bucket(tenant, budget))
        give_back = int(reserved) - prompt - completion
    args = [int(marker_ttl_s), prompt, completion, USAGE_DAYS_KEPT * 86400, int(now * 1000), give_back]
    return redis_keys, args


def account_jobs(client, keys: Keys, job_ids: list[str], marker_ttl_s: int) -> None:
    """Count jobs that just ended (sync client, two pipelined round trips for all of them)."""
    if not job_ids:
        return
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hmget(keys.job(job_id), ACCOUNT_FIELDS)
    calls = [account_call(keys, job_id, values, marker_ttl_s)
             for job_id, values in zip(job_ids, pipe.execute(), strict=True)]
    script = client.register_script(lua.ACCOUNT)

    def build():
        pipe = client.pipeline(transaction=False)
        for call in calls:
            if call is not None:
                lua.add(pipe, script, *call)
        return pipe

    lua.raise_errors(lua.execute(build, [script]))


async def account_job_async(client, keys: Keys, job_id: str, marker_ttl_s: int) -> None:
    """Count one job that just ended (`redis.asyncio` client)."""
    call = account_call(keys, job_id, await client.hmget(keys.job(job_id), ACCOUNT_FIELDS), marker_ttl_s)
    if call is not None:
        await client.register_script(lua.ACCOUNT)(keys=call[0], args=call[1])


async def refund_reservation_async(client, keys: Keys, tenant: str, budget: str, tokens: int, requests: int) -> None:
    """Give back an admission's requests and tokens for work that never reached the queue
    (`lua.RATE_REFUND`; `redis.asyncio` client)."""
    if tokens <= 0 and requests <= 0:
        return
    await client.register_script(lua.RATE_REFUND)(
        keys=[keys.rate_bucket(tenant, budget)], args=[int(time.time() * 1000), requests, max(tokens, 0)])
