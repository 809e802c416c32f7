"""The async jobs API: submit, look up, follow (SSE, resumable), cancel."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ferry.api.auth import tenant
from ferry.api.errors import ApiError
from ferry.api.joblist import list_jobs
from ferry.api.offloop import OffLoopBodyRoute
from ferry.api.ratelimit import admit_jobs
from ferry.api.schemas import (
    IdempotencyKey,
    JobCreate,
    JobErrorInfo,
    JobList,
    JobOutput,
    JobUrls,
    JobView,
    WebhookDelivery,
    error_responses,
)
from ferry.api.services import (
    ModelRoute,
    Services,
    cancel_job,
    check_against_model,
    get_job,
    new_job_request,
    resolve_model,
    services,
    submit,
)
from ferry.api.streaming import KEEPALIVE, SSE_EVENT_SCHEMA, SSE_HEADERS, follow_events, resume_comment, sse
from ferry.worker.protocol import (
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    JobRecord,
    JobRequest,
    JobState,
    encode_event,
)
from ferry.worker.protocol.jobs import JOB_ID_PATTERN

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=OffLoopBodyRoute)

JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN)]  # checked before any Redis call: an id never names another key
Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


def job_request(body: JobCreate, route: ModelRoute, tenant_name: str, svc: Services) -> JobRequest:
    """The wire request for a submitted job; sampling errors are 422s naming `input.<field>`."""
    fields = body.input.model_dump(exclude={"model", "max_completion_tokens"}, exclude_unset=True)
    if body.input.max_completion_tokens is not None:
        fields["max_tokens"] = body.input.max_completion_tokens
    return new_job_request(svc, tenant_name, route, fields, loc=("body", "input"), ttl_s=body.ttl_s,
                           timeout_s=body.timeout_s, priority=body.priority, metadata=body.metadata,
                           webhook=body.webhook)


def urls(job_id: str) -> JobUrls:
    base = f"/v1/jobs/{job_id}"
    return JobUrls(self=base, events=f"{base}/events", cancel=f"{base}/cancel")


def job_view(record: JobRecord, deliveries: dict[str, str] | None = None) -> JobView:
    output = None
    if record.state == JobState.succeeded:
        output = JobOutput(
            text=record.text or "",
            token_ids=record.token_ids or [],
            finish_reason=record.finish_reason,
            stop_reason=record.stop_reason,
            content=record.content,
            reasoning_content=record.reasoning_content,
            tool_calls=record.tool_calls,
            prompt_logprobs=record.prompt_logprobs,
        )
    error = JobErrorInfo(code=record.error_code, message=record.error_message or "") if record.error_code else None
    return JobView(
        id=record.id,
        status=record.state,
        model=record.model_asked,
        priority=record.priority,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        attempts=record.attempts,
        output=output,
        usage=record.usage,
        timings=record.timings,
        error=error,
        metadata=record.request.metadata if record.request else {},
        batch_id=record.batch_id,
        webhook_deliveries={k: WebhookDelivery(**json.loads(v)) for k, v in (deliveries or {}).items()},
        urls=urls(record.id),
    )


async def wait_until_terminal(svc: Services, job_id: str, timeout_s: float) -> None:
    """Return when the job's terminal event is out, or after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            async for batch in follow_events(svc.redis, svc.hub, svc.keys, job_id, idle_s=svc.settings.sse_keepalive_s):
                if batch is not None and batch[-1].type in TERMINAL_EVENT_TYPES:
                    return
    except TimeoutError:
        return


def _prefer_wait(prefer: str | None, cap_s: float) -> float:
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), cap_s) if match else 0.0


@router.post(
    "",
    status_code=202,
    response_model=JobView,
    responses={200: {"model": JobView, "description": "finished within `Prefer: wait=N`"}}
    | error_responses(401, 404, 409, 413, 422, 429),
    summary="Submit a job",
)
async def create_job(
    body: JobCreate,
    http: Request,
    svc: Svc,
    tenant_name: Tenant,
    idempotency_key: IdempotencyKey = None,
    prefer: Annotated[str | None, Header(description="`wait=N`: block up to N seconds for the result")] = None,
):
    route = await resolve_model(svc, body.input.model, tenant_name, field="input.model")
    request = job_request(body, route, tenant_name, svc)
    await check_against_model(svc, request, prefix="input.")
    async def admission() -> tuple[str, int] | None:
        [reservation] = await admit_jobs(svc, http.state, tenant_name, [request])
        return reservation

    result = await submit(svc, request, idempotency_key, source="jobs", admission=admission)
    wait_s = _prefer_wait(prefer, svc.settings.max_wait_s)
    if wait_s > 0:
        await wait_until_terminal(svc, result.job_id, wait_s)
    # A job created just now is queued as written (saves a round trip); anything else is read back.
    fresh = result.created and wait_s == 0
    record = JobRecord.new(result.job_id, request) if fresh else await get_job(svc, result.job_id, tenant_name)
    headers = {"Location": urls(record.id).self}
    if wait_s > 0:
        headers["Preference-Applied"] = f"wait={wait_s:g}"
    if not result.created:
        headers["Idempotent-Replayed"] = "true"
    status = 200 if wait_s > 0 and record.terminal else 202
    return JSONResponse(job_view(record).model_dump(mode="json"), status_code=status, headers=headers)


@router.get("", response_model=JobList, responses=error_responses(401, 422),
            summary="The caller's jobs, newest first (cursor pagination)")
async def list_caller_jobs(
    svc: Svc,
    tenant_name: Tenant,
    after: Annotated[str | None, Query(pattern=JOB_ID_PATTERN, description="a job id: the jobs older than it")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
    batch_id: Annotated[str | None, Query(pattern=JOB_ID_PATTERN, description="only this batch's lines")] = None,
) -> JobList:
    page = await list_jobs(svc.redis, svc.keys, tenant_name, after=after, limit=limit, status=status, batch_id=batch_id)
    data = [job_view(record) for record in page.records]
    return JobList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                   has_more=page.has_more)


@router.get("/{job_id}", response_model=JobView, responses=error_responses(401, 404, 422), summary="Get a job")
async def read_job(job_id: JobId, svc: Svc, tenant_name: Tenant) -> JobView:
    record = await get_job(svc, job_id, tenant_name)
    return job_view(record, await svc.redis.hgetall(svc.keys.webhook_deliveries(job_id)))


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
            "description": "SSE: one event per job event, `id` = seq",
        }
    }
    | error_responses(401, 404, 422),
    summary="Follow a job's events (SSE; Last-Event-ID resumes)",
)
async def job_events(
    job_id: JobId,
    svc: Svc,
    tenant_name: Tenant,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", pattern=r"^\d{1,9}$")] = None,
):
    await get_job(svc, job_id, tenant_name)
    after = int(last_event_id) if last_event_id is not None else -1

    async def stream():
        last, ended = after, False
        async for batch in follow_events(svc.redis, svc.hub, svc.keys, job_id, after, svc.settings.sse_keepalive_s):
            if batch is None:
                yield KEEPALIVE
                continue
            yield "".join(sse(encode_event(e), event=e.type, id=e.seq) for e in batch)
            last, ended = batch[-1].seq, batch[-1].type in TERMINAL_EVENT_TYPES
        if not ended and svc.hub.stopping:
            yield resume_comment(job_id, last)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post(
    "/{job_id}/cancel",
    response_model=JobView,
    responses={202: {"model": JobView, "description": "cancellation requested; the worker stops within a step"}}
    | error_responses(401, 404, 409, 422),
    summary="Cancel a job",
)
async def cancel(job_id: JobId, svc: Svc, tenant_name: Tenant):
    record = await get_job(svc, job_id, tenant_name)
    if record.terminal and record.state != JobState.cancelled:
        raise ApiError(409, "job_finished", f"job {job_id!r} already {record.state.value}")
    state = await cancel_job(svc, job_id)
    if state is None:
        raise ApiError(404, "job_not_found", f"job {job_id!r} not found")
    if state in TERMINAL_STATES and state != JobState.cancelled:  # it finished in the meantime
        raise ApiError(409, "job_finished", f"job {job_id!r} already {state.value}")
    record = await get_job(svc, job_id, tenant_name)
    return JSONResponse(job_view(record).model_dump(mode="json"), status_code=200 if record.terminal else 202)
