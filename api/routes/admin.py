"""Admin routes (an API key with `admin=true`): the dead-letter queue, listed and re-queued.

A job lands in `{p}:dlq` when it was delivered too many times (a poison job) or its queue entry
was malformed; its record says `failed`. Re-queueing submits the stored request again as a new
job (same tenant, request, metadata and webhook; a new id and creation time): the failed job's
events and record stay as they were, so nobody following it sees its history change, and the
DLQ entries of the job are removed. Any other key gets 403 `admin_required`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse

from ferry.api.auth import admin
from ferry.api.errors import ApiError
from ferry.api.routes.jobs import job_view
from ferry.api.schemas import error_responses
from ferry.api.services import Services, services, submit
from ferry.worker.protocol import JobRecord, UnreadableRecord
from ferry.worker.protocol.jobs import JOB_ID_PATTERN

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(admin)])
Svc = Annotated[Services, Depends(services)]
_ENTRY_ID = r"^\d{1,20}-\d{1,20}$"
_SCAN = 500  # DLQ entries read per round trip while looking for a job's


def _entry_json(entry_id: str, fields: dict[str, str], tenant: str | None) -> dict[str, Any]:
    return {"id": entry_id, "object": "dlq_entry", "job_id": fields.get("job_id") or None, "tenant": tenant,
            "code": fields.get("code"), "message": fields.get("message"), "attempts": int(fields.get("attempts", 0)),
            "worker_id": fields.get("worker_id"), "stream": fields.get("stream"),
            "dead_lettered_at": float(fields["ts"]) if fields.get("ts") else None}


@router.get("/dlq", responses=error_responses(401, 403, 422), summary="Dead-lettered jobs, newest first")
async def list_dlq(svc: Svc, after: Annotated[str | None, Query(pattern=_ENTRY_ID, description="an entry id")] = None,
                   limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    upper = f"({after}" if after is not None else "+"
    entries = await svc.redis.xrevrange(svc.keys.dlq, upper, "-", count=limit + 1)
    pipe = svc.redis.pipeline(transaction=False)
    for _, fields in entries[:limit]:
        pipe.hget(svc.keys.job(fields.get("job_id") or "-"), "tenant")
    tenants = await pipe.execute() if entries else []
    data = [_entry_json(entry_id, fields, owner)
            for (entry_id, fields), owner in zip(entries[:limit], tenants, strict=True)]
    return {"object": "list", "data": data, "has_more": len(entries) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


async def _entries_of(svc: Services, job_id: str) -> list[str]:
    found, lower = [], "-"
    while True:
        entries = await svc.redis.xrange(svc.keys.dlq, lower, "+", count=_SCAN)
        found += [entry_id for entry_id, fields in entries if fields.get("job_id") == job_id]
        if len(entries) < _SCAN:
            return found
        lower = f"({entries[-1][0]}"


@router.post("/dlq/{job_id}/requeue", status_code=201, responses=error_responses(401, 403, 404, 409, 422),
             summary="Submit a dead-lettered job's request again, as a new job")
async def requeue(job_id: Annotated[str, Path(pattern=JOB_ID_PATTERN)], svc: Svc):
    entry_ids = await _entries_of(svc, job_id)
    if not entry_ids:
        raise ApiError(404, "dlq_entry_not_found", f"job {job_id!r} is not in the dead-letter queue")
    try:
        record = JobRecord.from_redis(await svc.redis.hgetall(svc.keys.job(job_id)))
    except UnreadableRecord:
        record = None
    if record is None or record.request is None:
        raise ApiError(409, "dlq_job_gone", f"job {job_id!r}'s record has expired or does not parse: "
                       "nothing to re-queue (drop the entry or let it age out)")
    request = record.request.model_copy(update={"created_at": time.time()})
    result = await submit(svc, request, None, source="admin")
    await svc.redis.xdel(svc.keys.dlq, *entry_ids)
    view = job_view(JobRecord.new(result.job_id, request)).model_dump(mode="json")
    return JSONResponse(view | {"requeued_from": job_id}, status_code=201)
