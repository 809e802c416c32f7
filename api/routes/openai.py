"""OpenAI-compatible completions, chat completions and models, through the same job queue.

A request becomes a job like any other (`api.openai_jobs`; so it is queued, prioritised, retried
and visible at `/v1/jobs/{id}`); the handler follows the job's events and answers in OpenAI's
shapes (`api.openai_responses`), as one JSON body or as `stream: true` SSE chunks ending in
`data: [DONE]`. A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ferry.api.auth import tenant
from ferry.api.errors import ApiError, error_body, unsupported
from ferry.api.job_wait import cancel_quietly
from ferry.api.offloop import OffLoopBodyRoute
from ferry.api.openai_jobs import chat_jobs, completion_jobs
from ferry.api.openai_responses import Shape, job_error, usage_json
from ferry.api.openai_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    sse_200,
)
from ferry.api.ratelimit import admit_jobs
from ferry.api.schemas import error_responses
from ferry.api.services import (
    Services,
    check_against_model,
    live,
    refund,
    resolve_model,
    services,
    submit,
)
from ferry.api.streaming import (
    DEADLINE_MARGIN_S,
    KEEPALIVE,
    SSE_HEADERS,
    follow_events,
    prime,
    resume_comment,
    sse,
    sse_json,
)
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, Event, JobRequest, Usage
from ferry.worker.protocol.tools import ChatDelta

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OffLoopBodyRoute)

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]
# As on /v1/jobs: the same key with the same body answers from the same jobs, another body is a 409.
# At most 252 characters: with a choice's "#15" (`choice_key`) it stays within /v1/jobs' 255.
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=252)]

_TICK_S = 0.5  # idle ticks: disconnect checks and keep-alive timing
_ENDED = object()  # what anext() gives for a follow that has ended


# --- running a job for one HTTP request ----------------------------------------------------------



def choice_key(idempotency_key: str | None, index: int) -> str | None:
    """The idempotency key of a request's `index`-th job (one per choice): the request's own key
    for the first, the key with the index for the others."""
    if idempotency_key is None or index == 0:
        return idempotency_key
    return f"{idempotency_key}#{index}"


async def _answer(svc: Services, http: Request, jobs: list[JobRequest], shape_for: Callable[[str, int], Shape],
                  stream: bool, include_usage: bool, idempotency_key: str | None = None):
    """Run the jobs (one per prompt; only a single job streams) and answer with one body whose
    choices are theirs, in order. Any job's failure or a timeout cancels them all; so does the
    client going away, unless the request has an Idempotency-Key: then its jobs go on, and the
    client's retry with the same key answers from them (from their first event) instead of
    starting new ones."""
    for job in jobs:
        await check_against_model(svc, job)
    reservations = await admit_jobs(svc, http.state, jobs[0].tenant, jobs)
    job_ids: list[str] = []
    try:
        for index, (job, reservation) in enumerate(zip(jobs, reservations, strict=True)):
            key = choice_key(idempotency_key, index)
            job_ids.append((await submit(svc, job, key, source="openai", reservation=reservation)).job_id)
    except BaseException:
        # A job that did not get in (a full queue: 429 queue_full) gave its tokens back in submit;
        # the ones queued before it are cancelled (which gives theirs back; with an Idempotency-Key
        # they go on, for the retry to take up), those after it never ran, and the request is
        # refunded when none of its jobs was queued.
        if idempotency_key is None:
            await _cancel_all(svc, job_ids)
        if reservations[0] is not None:  # one admission: every job's reservation names its budget
            unsent = sum(tokens for _, tokens in reservations[len(job_ids) + 1:])
            await refund(svc, jobs[0].tenant, (reservations[0][0], unsent), requests=int(not job_ids))
        raise
    shapes = [shape_for(job_id, i) for i, job_id in enumerate(job_ids)]
    # Past its queueing and running limits a job can only have been lost (no worker took it): the
    # answer, streamed or not, ends then.
    deadline_s = (jobs[0].ttl_s or 0) + (jobs[0].timeout_s or 0) + DEADLINE_MARGIN_S
    if stream:
        events = follow_events(svc.redis, svc.hub, svc.keys, job_ids[0], idle_s=_TICK_S,
                               resync_s=svc.settings.sse_keepalive_s)
        return await _stream(svc, http, job_ids[0], events, shapes[0], include_usage, deadline_s,
                             keep_on_disconnect=idempotency_key is not None)
    try:
        async with asyncio.timeout(deadline_s):
            ends = await asyncio.gather(*(_collect(svc, http, shape, job_id) for shape, job_id in zip(shapes, job_ids,
                                                                                                    strict=True)))
    except TimeoutError:
        await _cancel_all(svc, job_ids)
        raise ApiError(504, "timeout", "no result in time; the job was cancelled") from None
    except BaseException:
        await _cancel_all(svc, job_ids)
        raise
    if any(end is None for end in ends):  # the client went away, or the process is shutting down
        if idempotency_key is None:
            await _cancel_all(svc, job_ids)
        if svc.hub.stopping:
            raise ApiError(503, "shutting_down", "this server is shutting down; retry",
                           headers={"Retry-After": "1"})
        return JSONResponse({}, status_code=499)
    bodies = [shape.body(end.finish_reason, end.usage) for shape, end in zip(shapes, ends, strict=True)]
    body = bodies[0] | {"choices": [b["choices"][0] for b in bodies]}
    body["usage"] = usage_json(Usage(**{name: sum(getattr(end.usage, name) for end in ends)
                                        for name in Usage.model_fields}))
    return JSONResponse(body)


async def _cancel_all(svc: Services, job_ids: list[str]) -> None:
    for job_id in job_ids:
        await cancel_quietly(svc, job_id)


async def _collect(svc: Services, http: Request, shape: Shape, job_id: str) -> Event | None:
    """Follow one job into `shape` until its `completed` event (returned); None when the client
    went away; raises the job's error when it ended otherwise."""
    events = follow_events(svc.redis, svc.hub, svc.keys, job_id, idle_s=_TICK_S,
                           resync_s=svc.settings.sse_keepalive_s)
    try:
        async for batch in events:
            if batch is None:
                if await http.is_disconnected():
                    return None
                continue
            for event in batch:
                if event.type == "token":
                    shape.add(event)
                elif event.type == "completed":
                    shape.tool_calls = list(event.tool_calls or [])
                    return event
                elif event.type in TERMINAL_EVENT_TYPES:
                    raise job_error(event)
        return None
    finally:
        await events.aclose()


async def _stream(svc: Services, http: Request, job_id: str, events, shape: Shape, include_usage: bool,
                  deadline_s: float, keep_on_disconnect: bool = False):
    try:
        buffered = await prime(events)
    except BaseException:
        await events.aclose()
        raise
    if buffered and buffered[-1].type in TERMINAL_EVENT_TYPES and buffered[-1].type != "completed":
        await events.aclose()
        raise job_error(buffered[-1])

    def chunk(payload: dict) -> str:
        if include_usage and "usage" not in payload:
            payload["usage"] = None
        return sse_json(payload)

    def render(event: Event) -> list[str]:
        """The SSE messages for one event; the last event's end with `[DONE]`."""
        if event.type == "token" and event.prompt_logprobs is not None:  # the first token's: the prompt's first
            return [chunk(shape.prompt_logprobs_chunk(event.prompt_logprobs))] + render(
                event.model_copy(update={"prompt_logprobs": None}))
        if event.type == "token" and (shape.tools or event.chat is not None):  # a parsed chat
            piece = shape.chat_delta_chunk(event.chat or ChatDelta(), event.logprobs)
            shape.add(event)
            return [chunk(piece)] if piece is not None else []
        if event.type == "token":
            out = (
                [chunk(shape.chunk(event.text, event.logprobs))]
                if event.text or (shape.logprobs and event.logprobs)
                else []
            )
            shape.text += event.text
            return out
        if event.type == "completed":
            out = [chunk(shape.chunk("", None, event.finish_reason))]
            return out + ([chunk(shape.usage_chunk(event.usage))] if include_usage else []) + [sse("[DONE]")]
        if event.type in TERMINAL_EVENT_TYPES:
            error = job_error(event)
            return [sse_json(error_body(error.status, error.code, error.message)), sse("[DONE]")]
        return []

    async def body():
        finished, last_seq, timed_out = False, -1, False
        last_write = time.monotonic()
        deadline = last_write + deadline_s
        try:
            first = shape.first_chunk()
            out = [chunk(first)] if first is not None else []
            batch: list[Event] | None = buffered
            while True:
                if batch is not None:
                    for event in batch:
                        out += render(event)
                    finished = bool(batch) and batch[-1].type in TERMINAL_EVENT_TYPES
                    last_seq = batch[-1].seq if batch else last_seq
                if out or (batch is None and time.monotonic() - last_write >= svc.settings.sse_keepalive_s):
                    last_write = time.monotonic()
                    yield "".join(out) or KEEPALIVE  # a burst of events goes out as one write
                    out = []
                if finished:
                    break
                batch = await anext(events, _ENDED)
                if batch is _ENDED:  # before the terminal event: the process is shutting down
                    yield resume_comment(job_id, last_seq)
                    break
                if batch is None and time.monotonic() > deadline:
                    timed_out = True
                    late = error_body(504, "timeout", "no result in time; the job was cancelled")
                    yield sse_json(late) + sse("[DONE]")
                    break
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
            # The client went away mid-stream (its job goes on only for a retry with its
            # Idempotency-Key), or the deadline passed.
            if not finished and not svc.hub.stopping and not (keep_on_disconnect and not timed_out):
                await cancel_quietly(svc, job_id)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses=sse_200(CompletionResponse) | error_responses(401, 404, 409, 413, 422, 429, 503, 504),
    summary="Create a completion (OpenAI-compatible)",
)
async def completions(body: CompletionRequest, http: Request, svc: Svc, tenant_name: Tenant,
                      idempotency_key: IdempotencyKey = None):
    route = await resolve_model(svc, body.model, tenant_name)
    jobs = completion_jobs(svc, tenant_name, route, body)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

    def shape(job_id: str, index: int) -> Shape:
        return Shape(f"cmpl-{job_id}", route.name, int(jobs[0].created_at), chat=False,
                     logprobs=body.logprobs is not None, index=index, echo=jobs[index].prompt if body.echo else "")

    return await _answer(svc, http, jobs, shape, body.stream, include_usage, idempotency_key)


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses=sse_200(ChatCompletionResponse) | error_responses(401, 404, 409, 413, 422, 429, 503, 504),
    summary="Create a chat completion (OpenAI-compatible)",
)
async def chat_completions(body: ChatCompletionRequest, http: Request, svc: Svc, tenant_name: Tenant,
                           idempotency_key: IdempotencyKey = None):
    route = await resolve_model(svc, body.model, tenant_name)
    jobs = chat_jobs(svc, tenant_name, route, body)
    if len(jobs) > 1 and body.stream:
        raise unsupported("stream", "n > 1 is answered whole; stream with n = 1")
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    tools = jobs[0].effective_tool_choice != "none"

    def shape(job_id: str, index: int) -> Shape:
        return Shape(f"chatcmpl-{job_id}", route.name, int(jobs[0].created_at), chat=True, logprobs=body.logprobs,
                     index=index, tools=tools)

    return await _answer(svc, http, jobs, shape, body.stream, include_usage, idempotency_key)


@router.get("/models", response_model=ModelList, responses=error_responses(401),
            summary="Models served: those with a live worker and every configured one (FERRY_MODELS), "
                    "and the LoRA adapters of those the caller may use")
async def models(svc: Svc, tenant_name: Tenant) -> ModelList:
    """A configured model is listed even while its pool is scaled to zero: its jobs queue and wake
    the pool. `created` is the model's last worker heartbeat (0: no worker of it seen yet). An
    adapter follows its base model, with `parent` (the base) and `root` (its path)."""
    seen = await svc.heartbeats.beats()
    names = set(live(seen, svc.settings.model_liveness_s)) | svc.configured_models
    adapters = [entry for _, entry in sorted((await svc.heartbeats.loras()).items())
                if entry.base_model in names and entry.visible_to(tenant_name)]
    return ModelList(data=[ModelCard(id=name, created=int(seen.get(name, 0))) for name in sorted(names)]
                     + [ModelCard.of_lora(entry) for entry in adapters])
