"""OpenAI's Responses API on the job queue: `POST /v1/responses` answers in the request, streams, or
(`background: true`) queues the response and returns at once; `GET /v1/responses/{id}` reads it (or
streams it, resumed with `starting_after`), `POST .../cancel` cancels a background one, `DELETE`
removes it.

A response is a job (`api.responses_jobs`), so it is queued, prioritised, rate-limited, retried on
a worker's death and visible at `/v1/jobs/{id}`; a background response survives the client and the
API process, and its stream is rebuilt from the job's durable events (`api.responses_render`).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ferry.api.auth import tenant
from ferry.api.errors import ApiError, unsupported
from ferry.api.job_wait import cancel_quietly, wait_for_end
from ferry.api.offloop import OffLoopBodyRoute
from ferry.api.openai_responses import job_error
from ferry.api.ratelimit import admit_jobs
from ferry.api.responses_jobs import ResponseMeta, job_id_of, response_id, response_job
from ferry.api.responses_render import ResponseEvents, input_items, response_object
from ferry.api.responses_schemas import RESPONSE_ID_PATTERN, ResponseCreate
from ferry.api.routes.jobs import wait_until_terminal
from ferry.api.schemas import IdempotencyKey, error_responses
from ferry.api.services import Services, cancel_job, check_against_model, get_job, resolve_model, services, submit
from ferry.api.streaming import DEADLINE_MARGIN_S, KEEPALIVE, SSE_EVENT_SCHEMA, SSE_HEADERS, follow_events, sse_json
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, JobRecord, JobRequest

router = APIRouter(prefix="/v1/responses", tags=["responses"], route_class=OffLoopBodyRoute)

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]
ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN)]

_TICK_S = 0.5  # idle ticks: disconnect checks and keep-alive timing
_STOP_WAIT_S = 10.0  # how long cancel and delete wait for a running response to stop
_SSE_200 = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                  "description": "the Response object, or with `stream: true` its typed SSE events"}}


async def _stored(svc: Services, ident: str, tenant_name: str) -> tuple[JobRecord, ResponseMeta]:
    """The stored response `ident` of `tenant_name` (404 for any other job, or one with store: false)."""
    try:
        record = await get_job(svc, job_id_of(ident), tenant_name)
    except ApiError as exc:
        if exc.status != 404:
            raise
        record = None
    meta = ResponseMeta.of(record) if record is not None else None
    if record is None or meta is None or not meta.store:
        raise ApiError(404, "response_not_found", f"response {ident!r} not found")
    return record, meta


def _stream(svc: Services, job_id: str, request: JobRequest, meta: ResponseMeta, starting_after: int,
            cancel_on_disconnect: bool) -> StreamingResponse:
    """The response's typed events after `starting_after`, as SSE, rebuilt from the job's events."""
    deadline = time.monotonic() + (request.ttl_s or 0) + (request.timeout_s or 0) + DEADLINE_MARGIN_S

    def sent(events: list[dict]) -> str:
        return "".join(sse_json(e, event=e["type"]) for e in events if e["sequence_number"] > starting_after)

    async def body():
        render = ResponseEvents(job_id, request, meta)
        follow = follow_events(svc.redis, svc.hub, svc.keys, job_id, idle_s=_TICK_S,
                               resync_s=svc.settings.sse_keepalive_s)
        finished, last_write = False, time.monotonic()
        try:
            if first := sent(render.begin()):
                yield first
            async for batch in follow:
                if batch is None:
                    if time.monotonic() > deadline and cancel_on_disconnect:
                        yield sse_json({"type": "error", "sequence_number": render.seq, "code": "timeout",
                                        "message": "no result in time; the response was cancelled", "param": None},
                                       event="error")
                        break
                    if time.monotonic() - last_write >= svc.settings.sse_keepalive_s:
                        last_write = time.monotonic()
                        yield KEEPALIVE
                    continue
                finished = batch[-1].type in TERMINAL_EVENT_TYPES
                if chunk := "".join(sent(render.on_event(event)) for event in batch):
                    last_write = time.monotonic()
                    yield chunk
            if not finished and svc.hub.stopping:
                yield (f": shutting down; resume at /v1/responses/{response_id(job_id)}?stream=true"
                       f"&starting_after={render.seq - 1}\n\n")
        finally:
            with anyio.CancelScope(shield=True):
                await follow.aclose()
            if not finished and cancel_on_disconnect and not svc.hub.stopping:
                await cancel_quietly(svc, job_id)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("", responses=_SSE_200 | error_responses(401, 404, 409, 413, 422, 429, 503, 504),
             summary="Create a response (OpenAI Responses API; background: true queues it)")
async def create_response(body: ResponseCreate, http: Request, svc: Svc, tenant_name: Tenant,
                          idempotency_key: IdempotencyKey = None):
    route = await resolve_model(svc, body.model, tenant_name)
    request = await response_job(svc, tenant_name, route, body)
    await check_against_model(svc, request)

    async def admission() -> tuple[str, int] | None:
        [reservation] = await admit_jobs(svc, http.state, tenant_name, [request])
        return reservation

    result = await submit(svc, request, idempotency_key, source="responses", admission=admission)
    job_id, meta = result.job_id, ResponseMeta.of(JobRecord.new(result.job_id, request))
    # Without an Idempotency-Key, a live response's client going away cancels it; a background one goes on.
    keep = body.background or idempotency_key is not None
    if body.stream:
        return _stream(svc, job_id, request, meta, -1, cancel_on_disconnect=not keep)
    if body.background:
        record = JobRecord.new(job_id, request) if result.created else await get_job(svc, job_id, tenant_name)
        return JSONResponse(response_object(record, meta))
    deadline_s = (request.ttl_s or 0) + (request.timeout_s or 0) + DEADLINE_MARGIN_S
    end = await wait_for_end(svc, http, job_id, deadline_s)
    if end is None:
        if not keep:
            await cancel_quietly(svc, job_id)
        return JSONResponse({}, status_code=499)
    if end.type in ("failed", "timed_out"):
        raise job_error(end)
    record = await get_job(svc, job_id, tenant_name)
    return JSONResponse(response_object(record, meta))


@router.get("/{ident}", responses=_SSE_200 | error_responses(401, 404, 422), summary="Get a response")
async def read_response(
    ident: ResponseId, svc: Svc, tenant_name: Tenant,
    stream: Annotated[bool, Query(description="stream its events (from the start, or after starting_after)")] = False,
    starting_after: Annotated[int | None, Query(ge=-1, description="a sequence_number: the events after it")] = None,
    include: Annotated[list[str] | None, Query(description="not supported")] = None,
    include_obfuscation: Annotated[bool | None, Query(description="accepted; Ferry never obfuscates")] = None,
):
    if include:
        raise unsupported("include", "not supported (no extra output data is available)")
    if starting_after is not None and not stream:
        raise ApiError(422, "invalid_request", "starting_after: only with stream=true", field="starting_after")
    record, meta = await _stored(svc, ident, tenant_name)
    if stream:
        after = -1 if starting_after is None else starting_after
        return _stream(svc, record.id, record.request, meta, after, cancel_on_disconnect=False)
    return JSONResponse(response_object(record, meta))


@router.get("/{ident}/input_items", responses=error_responses(401, 404, 422),
            summary="The items a response's model read (a page of them)")
async def list_input_items(
    ident: ResponseId, svc: Svc, tenant_name: Tenant,
    after: Annotated[str | None, Query(max_length=300, description="an item id: the items after it")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query(description="desc (newest first, the default) or asc")] = "desc",
    include: Annotated[list[str] | None, Query(description="not supported")] = None,
):
    if include:
        raise unsupported("include", "not supported (no extra item data is available)")
    record, meta = await _stored(svc, ident, tenant_name)
    items = input_items(record, meta)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(422, "invalid_request", f"after: {after!r} is not an item of this response", field="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


@router.post("/{ident}/cancel", responses=error_responses(401, 404, 409, 422),
             summary="Cancel a background response")
async def cancel_response(ident: ResponseId, svc: Svc, tenant_name: Tenant):
    record, meta = await _stored(svc, ident, tenant_name)
    if not meta.background:
        raise ApiError(409, "response_not_cancellable", "only a response created with background: true can be "
                       "cancelled (a live one is cancelled by closing its connection)")
    if not record.terminal:
        await cancel_job(svc, record.id)
        await wait_until_terminal(svc, record.id, _STOP_WAIT_S)
        record, meta = await _stored(svc, ident, tenant_name)
    return JSONResponse(response_object(record, meta))


@router.delete("/{ident}", responses=error_responses(401, 404, 409, 422), summary="Delete a response")
async def delete_response(ident: ResponseId, svc: Svc, tenant_name: Tenant):
    record, _ = await _stored(svc, ident, tenant_name)
    if not record.terminal:
        await cancel_job(svc, record.id)
        await wait_until_terminal(svc, record.id, _STOP_WAIT_S)
        record, _ = await _stored(svc, ident, tenant_name)
        if not record.terminal:
            raise ApiError(409, "response_running", "the response is still stopping; delete it again shortly",
                           headers={"Retry-After": "1"})
    await svc.redis.delete(svc.keys.job(record.id), svc.keys.events(record.id))
    return JSONResponse({"id": ident, "object": "response", "deleted": True})

