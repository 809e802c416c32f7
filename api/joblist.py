"""The per-tenant job index behind `GET /v1/jobs`: written before each enqueue, read newest first.

The index (`Keys.tenant_jobs`) is a sorted set whose scores are all 0, so it is ordered by
member: job ids begin with their creation time in hex (`new_job_id`), hence lexical order is
creation order and an id is its own cursor, valid even after that job is gone.

The entry is written as a command of its own, before the job's enqueue script (the index is in
the tenant's hash slot, the job in its own): a crash in between leaves an id with no job hash,
which listing skips, never an accepted job missing from the list. Entries older than the longest
a job hash lives are trimmed on each write, so the index stays bounded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ferry.api.settings import ApiSettings
from ferry.worker.protocol import JobRecord, JobState, Keys, UnreadableRecord, job_id_created_at

_SCAN_CHUNK = 100  # ids read per round trip while filling a page
_ORPHAN_GRACE_S = 60.0  # an id with no hash this old is dropped (younger: its enqueue may be under way)


def index_lifetime_s(s: ApiSettings) -> float:
    """How long an index entry may name a live job hash: queued, then running, then kept as a result."""
    return s.job_ttl_s + s.job_timeout_s + s.result_ttl_s


def _id_floor(unix_s: float) -> str:
    # The smallest id created at `unix_s` or later (the 12 hex digits of milliseconds).
    return f"{int(unix_s * 1000) & 0xFFFF_FFFF_FFFF:012x}"


async def index_job(redis, keys: Keys, settings: ApiSettings, tenant: str, job_id: str) -> None:
    """Add `job_id` to the tenant's index and trim entries past their lifetime (one key, one round trip)."""
    key, lifetime_s = keys.tenant_jobs(tenant), index_lifetime_s(settings)
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(key, {job_id: 0})
    pipe.zremrangebylex(key, "-", "(" + _id_floor(time.time() - lifetime_s))
    pipe.expire(key, int(lifetime_s) + 60)
    await pipe.execute()


@dataclass(frozen=True, slots=True)
class JobPage:
    records: list[JobRecord]  # newest first
    has_more: bool


async def list_jobs(redis, keys: Keys, tenant: str, *, after: str | None, limit: int,
                    status: JobState | None, batch_id: str | None) -> JobPage:
    """The tenant's jobs older than `after` (all when None), newest first, at most `limit`, filtered."""
    key = keys.tenant_jobs(tenant)
    upper = "(" + after if after is not None else "+"
    found: list[JobRecord] = []
    while len(found) <= limit:
        ids = await redis.zrevrangebylex(key, upper, "-", start=0, num=_SCAN_CHUNK)
        if not ids:
            break
        pipe = redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        orphans = []
        for job_id, raw in zip(ids, await pipe.execute(), strict=True):
            try:
                record = JobRecord.from_redis(raw)
            except UnreadableRecord:
                continue
            if record is None:
                created = job_id_created_at(job_id)
                if created is not None and time.time() - created > _ORPHAN_GRACE_S:
                    orphans.append(job_id)
                continue
            if record.tenant != tenant:
                continue
            if (status is None or record.state == status) and (batch_id is None or record.batch_id == batch_id):
                found.append(record)
        if orphans:
            await redis.zrem(key, *orphans)
        upper = "(" + ids[-1]
        if len(ids) < _SCAN_CHUNK:
            break
    return JobPage(found[:limit], len(found) > limit)
