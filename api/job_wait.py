"""Waiting on a job for a request that is answered whole (a Response, a tokenization): its terminal
event, unless the client goes away or time runs out first; the cancel every route does on its way
out, shielded so a cancelled request still cancels its job; and the whole round of a job that does
not generate (tokenize, detokenize, count tokens)."""

from __future__ import annotations

import asyncio

import anyio
from fastapi import Request

from ferry.api.errors import ApiError
from ferry.api.openai_responses import job_error
from ferry.api.ratelimit import admit_jobs
from ferry.api.services import Services, cancel_job, check_against_model, get_job, submit
from ferry.api.streaming import DEADLINE_MARGIN_S, follow_events
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, Event, JobRecord, JobRequest

_TICK_S = 0.5  # how often an idle wait checks that its client is still there


async def cancel_quietly(svc: Services, job_id: str) -> None:
    with anyio.CancelScope(shield=True):
        await cancel_job(svc, job_id)


async def wait_for_end(svc: Services, http: Request, job_id: str, deadline_s: float) -> Event | None:
    """The job's terminal event; None when the client went away first. Past `deadline_s` the job is
    cancelled and the answer is a 504."""
    follow = follow_events(svc.redis, svc.hub, svc.keys, job_id, idle_s=_TICK_S,
                           resync_s=svc.settings.sse_keepalive_s)
    try:
        async with asyncio.timeout(deadline_s):
            async for batch in follow:
                if batch is None:
                    if await http.is_disconnected():
                        return None
                elif batch[-1].type in TERMINAL_EVENT_TYPES:
                    return batch[-1]
        return None
    except TimeoutError:
        await cancel_quietly(svc, job_id)
        raise ApiError(504, "timeout", "no result in time; the job was cancelled") from None
    finally:
        with anyio.CancelScope(shield=True):
            await follow.aclose()


async def run_without_generating(svc: Services, http: Request, tenant_name: str, job: JobRequest) -> JobRecord:
    """Queue a tokenize or detokenize job and wait for the worker's answer (its record)."""
    await check_against_model(svc, job)

    async def admission() -> tuple[str, int] | None:
        [reservation] = await admit_jobs(svc, http.state, tenant_name, [job])
        return reservation

    job_id = (await submit(svc, job, None, source=job.task, admission=admission)).job_id
    end = await wait_for_end(svc, http, job_id, (job.ttl_s or 0) + (job.timeout_s or 0) + DEADLINE_MARGIN_S)
    if end is None:
        await cancel_quietly(svc, job_id)
        raise ApiError(499, "client_closed", "the client went away")
    if end.type != "completed":
        raise job_error(end)
    return await get_job(svc, job_id, tenant_name)
