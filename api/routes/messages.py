"""Anthropic's Messages API, `POST /v1/messages`, through the same job queue as every route.

The body becomes one chat job (`api.anthropic_jobs`: queued, prioritised, retried, visible at
`/v1/jobs/{id}`, admitted against the tenant's live budget); the handler follows the job's events
and answers with one message or, with `stream: true`, Anthropic's named SSE events
(`api.anthropic_responses`). Errors on these routes are Anthropic's body (`api.errors`). A client
that goes away cancels its job: Anthropic's clients have no way to resume one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ferry.api.anthropic_jobs import message_job
from ferry.api.anthropic_responses import PING, MessageBuilder, stream_error
from ferry.api.anthropic_schemas import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
    anthropic_error_responses,
)
from ferry.api.auth import tenant
from ferry.api.errors import ApiError
from ferry.api.job_wait import cancel_quietly, run_without_generating
from ferry.api.offloop import OffLoopBodyRoute
from ferry.api.openai_responses import job_error
from ferry.api.ratelimit import admit_jobs
from ferry.api.schemas import IdempotencyKey
from ferry.api.services import Services, check_against_model, resolve_model, services, submit
from ferry.api.streaming import DEADLINE_MARGIN_S, SSE_EVENT_SCHEMA, SSE_HEADERS, follow_events, prime
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, Event

router = APIRouter(prefix="/v1", tags=["anthropic"], route_class=OffLoopBodyRoute)

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]

_TICK_S = 0.5  # idle ticks of a follow: disconnect checks and keep-alive timing
_ENDED = object()  # what anext() gives for a follow that has ended
_OK = {200: {"model": MessageResponse, "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
             "description": "the message, or with `stream: true` Anthropic's named SSE events"}}


@router.post(
    "/messages/count_tokens",
    response_model=TokenCount,
    responses=anthropic_error_responses(401, 404, 413, 422, 429, 503, 504),
    summary="Count a message's prompt tokens (Anthropic-compatible): the worker renders it as it would run it",
)
async def count_tokens(body: CountTokensRequest, http: Request, svc: Svc, tenant_name: Tenant) -> TokenCount:
    route = await resolve_model(svc, body.model, tenant_name)
    job = message_job(svc, tenant_name, route, body.as_message()).model_copy(update={"task": "tokenize"})
    record = await run_without_generating(svc, http, tenant_name, job)
    return TokenCount(input_tokens=len(record.token_ids or []))


@router.post(
    "/messages",
    response_model=MessageResponse,
    responses=_OK | anthropic_error_responses(401, 404, 409, 413, 422, 429, 503, 504),
    summary="Create a message (Anthropic-compatible)",
)
async def create_message(body: MessagesRequest, http: Request, svc: Svc, tenant_name: Tenant,
                         idempotency_key: IdempotencyKey = None):
    """Anthropic's `anthropic-version` header is accepted and not needed: there is one version. With an
    `Idempotency-Key` (as on /v1/jobs) a retry answers from the same job, from its first event, and a
    client that goes away leaves its job running for that retry."""
    route = await resolve_model(svc, body.model, tenant_name)
    job = message_job(svc, tenant_name, route, body)
    await check_against_model(svc, job)

    async def admission() -> tuple[str, int] | None:
        [reservation] = await admit_jobs(svc, http.state, tenant_name, [job])
        return reservation

    job_id = (await submit(svc, job, idempotency_key, source="anthropic", admission=admission)).job_id
    keep = idempotency_key is not None
    message = MessageBuilder(f"msg_{job_id}", route.name, tools=job.effective_tool_choice != "none")
    # Past its queueing and running limits a job can only have been lost (no worker took it).
    deadline_s = (job.ttl_s or 0) + (job.timeout_s or 0) + DEADLINE_MARGIN_S
    events = follow_events(svc.redis, svc.hub, svc.keys, job_id, idle_s=_TICK_S,
                           resync_s=svc.settings.sse_keepalive_s)
    if body.stream:
        return await _stream(svc, job_id, events, message, deadline_s, keep)
    return await _whole(svc, http, job_id, events, message, deadline_s, keep)



async def _whole(svc: Services, http: Request, job_id: str, events, message: MessageBuilder, deadline_s: float,
                 keep: bool):
    """The message once the job completes; its error if it ends otherwise. The job is cancelled when
    time runs out, or when the client goes away or the process shuts down first (unless `keep`: a
    retry with its Idempotency-Key answers from it)."""
    ended, timed_out = False, False
    try:
        async with asyncio.timeout(deadline_s):
            async for batch in events:
                if batch is None:
                    if await http.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                for event in batch:
                    ended = event.type in TERMINAL_EVENT_TYPES
                    if event.type == "token":
                        message.add(event)
                    elif event.type == "completed":
                        return JSONResponse(message.body(event))
                    elif ended:
                        raise job_error(event)
    except TimeoutError:
        timed_out = True
        raise ApiError(504, "timeout", "no result in time; the job was cancelled") from None
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
        if not ended and (timed_out or not keep):
            await cancel_quietly(svc, job_id)
    raise ApiError(503, "shutting_down", "this server is shutting down; retry", headers={"Retry-After": "1"})


async def _stream(svc: Services, job_id: str, events, message: MessageBuilder, deadline_s: float, keep: bool):
    try:
        buffered = await prime(events)  # a job that fails at once is still answered with an HTTP error
    except BaseException:
        await events.aclose()
        raise
    if buffered and buffered[-1].type in TERMINAL_EVENT_TYPES and buffered[-1].type != "completed":
        await events.aclose()
        raise job_error(buffered[-1])

    async def body():
        ended, timed_out = False, False
        last_write = time.monotonic()
        deadline = last_write + deadline_s
        try:
            out = [message.start()]
            batch: list[Event] | None = buffered
            while True:
                if batch is not None:
                    for event in batch:
                        out += message.render(event)
                    ended = bool(batch) and batch[-1].type in TERMINAL_EVENT_TYPES
                if out or time.monotonic() - last_write >= svc.settings.sse_keepalive_s:
                    last_write = time.monotonic()
                    yield "".join(out) or PING  # a burst of events goes out as one write
                    out = []
                if ended:
                    return
                batch = await anext(events, _ENDED)
                if batch is _ENDED:  # before the job's end: the process is shutting down
                    yield stream_error(503, "shutting_down", "this server is shutting down; retry")
                    return
                if batch is None and time.monotonic() > deadline:
                    timed_out = True
                    yield stream_error(504, "timeout", "no result in time; the job was cancelled")
                    return
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
            # The client went away, time ran out, or the process is shutting down.
            if not ended and (timed_out or not keep):
                await cancel_quietly(svc, job_id)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
