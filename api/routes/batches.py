"""OpenAI's Batch API: create a batch from an uploaded JSONL file, look it up, cancel it, list them.

The work itself is done by the batch driver (`api.batch_driver`) of whichever API process holds
the batch's lease; these routes only write and read the batch's record.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from ferry.api.auth import tenant
from ferry.api.batches import BATCH_ID_PATTERN, ENDPOINTS, WINDOW_S, batch_json, new_batch_id
from ferry.api.errors import ApiError, not_found
from ferry.api.files import get_record
from ferry.api.schemas import IdempotencyKey, error_responses
from ferry.api.services import Services, check_webhook_url, services
from ferry.api.tracing import current_traceparent
from ferry.worker.protocol import lua

router = APIRouter(prefix="/v1/batches", tags=["batches"])

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]
BatchId = Annotated[str, Path(pattern=BATCH_ID_PATTERN)]


class BatchWebhook(BaseModel):
    model_config = {"extra": "forbid"}

    url: str = Field(pattern=r"^https?://")


class BatchCreate(BaseModel):
    model_config = {"extra": "forbid"}

    input_file_id: str
    endpoint: Literal[ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal["24h"]
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    webhook: BatchWebhook | None = None  # Ferry's: where batch.completed/failed/expired/cancelled are sent


async def _batch(svc: Services, batch_id: str, tenant_name: str) -> dict:
    raw = await svc.redis.hgetall(svc.keys.batch(batch_id))
    if not raw or raw.get("tenant") != tenant_name:
        raise not_found("batch", batch_id)
    return raw


def _idempotent_batch_id(tenant_name: str, key: str) -> str:
    """The batch a create with this Idempotency-Key makes: the same id for every retry, one per tenant
    and key (both hashed with their lengths, so no two pairs share an id)."""
    digest = hashlib.sha256(f"{len(tenant_name)}:{tenant_name}{len(key)}:{key}".encode()).hexdigest()
    return f"batch_{digest[:32]}"


def _body_digest(body: BatchCreate) -> str:
    return hashlib.sha256(body.model_dump_json().encode()).hexdigest()


@router.post("", responses=error_responses(401, 404, 409, 422), summary="Create a batch from an uploaded file")
async def create(body: BatchCreate, svc: Svc, tenant_name: Tenant, idempotency_key: IdempotencyKey = None):
    """With an Idempotency-Key, a retry of the same body answers the batch the first one made
    (`Idempotent-Replayed: true`), and another body with that key is a 409, as on /v1/jobs."""
    batch_id = new_batch_id() if idempotency_key is None else _idempotent_batch_id(tenant_name, idempotency_key)
    if idempotency_key is not None:
        # The first create of this key takes the id; a retry finds it (its record may be unfinished
        # when the first create died midway: then this one writes it whole).
        first = await svc.redis.hsetnx(svc.keys.batch(batch_id), "idempotency_body", _body_digest(body))
        if first:  # until the record is whole: a create refused below leaves nothing behind for long
            await svc.redis.expire(svc.keys.batch(batch_id), svc.settings.idempotency_ttl_s)
        else:
            raw = await svc.redis.hgetall(svc.keys.batch(batch_id))
            if raw.get("idempotency_body") != _body_digest(body) or raw.get("tenant", tenant_name) != tenant_name:
                raise ApiError(409, "idempotency_conflict", "this Idempotency-Key was used with a different request",
                               field="Idempotency-Key")
            if "status" in raw:
                return JSONResponse(batch_json(raw), headers={"Idempotent-Replayed": "true"})
    try:
        input_file = await get_record(svc.redis, svc.keys, body.input_file_id, tenant_name)
    except ApiError as exc:
        exc.field = "input_file_id"
        raise
    if input_file.purpose != "batch":
        raise ApiError(422, "invalid_request", "input_file_id: the file's purpose is not 'batch'",
                       field="input_file_id")
    if body.webhook is not None:
        await check_webhook_url(svc, body.webhook.url)
    now = time.time()
    window = svc.settings.batch_window_s or WINDOW_S[body.completion_window]
    raw = {"id": batch_id, "tenant": tenant_name, "status": "validating", "endpoint": body.endpoint,
           "input_file_id": body.input_file_id, "completion_window": body.completion_window,
           "created_at": str(now), "expires_at": str(now + window), "metadata": json.dumps(body.metadata),
           "total": "0", "completed": "0", "failed": "0"}
    if idempotency_key is not None:
        raw["idempotency_body"] = _body_digest(body)
    if body.webhook is not None:
        raw["webhook_url"] = body.webhook.url
    if (traceparent := current_traceparent(svc.tracing)) is not None:
        raw["traceparent"] = traceparent  # the batch's trace: its lines' jobs join it (api.batch_jobs)
    await svc.redis.hset(svc.keys.batch(batch_id), mapping=raw)
    if idempotency_key is not None:
        await svc.redis.persist(svc.keys.batch(batch_id))
    await svc.redis.zadd(svc.keys.tenant_batches(tenant_name), {batch_id: now})
    await svc.redis.sadd(svc.keys.active_batches, batch_id)
    return JSONResponse(batch_json(raw))


@router.get("/{batch_id}", responses=error_responses(401, 404), summary="A batch")
async def retrieve(batch_id: BatchId, svc: Svc, tenant_name: Tenant) -> dict[str, Any]:
    return batch_json(await _batch(svc, batch_id, tenant_name))


@router.post("/{batch_id}/cancel", responses=error_responses(401, 404, 409), summary="Cancel a batch")
async def cancel(batch_id: BatchId, svc: Svc, tenant_name: Tenant) -> dict[str, Any]:
    """Lines already answered stay in the output; the batch ends `cancelled` once its running jobs stop."""
    await _batch(svc, batch_id, tenant_name)
    before = await svc.redis.register_script(lua.BATCH_CANCEL)(keys=[svc.keys.batch(batch_id)], args=[time.time()])
    if before not in ("validating", "in_progress", "cancelling"):
        raise ApiError(409, "batch_not_cancellable", f"batch {batch_id!r} is {before}: it can no longer be cancelled")
    return batch_json(await _batch(svc, batch_id, tenant_name))


@router.get("", responses=error_responses(401), summary="The caller's batches, newest first (cursor pagination)")
async def list_batches(svc: Svc, tenant_name: Tenant, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    index = svc.keys.tenant_batches(tenant_name)
    start = 0
    if after is not None:
        rank = await svc.redis.zrevrank(index, after)
        start = rank + 1 if rank is not None else 0
    ids = await svc.redis.zrevrange(index, start, start + limit)
    data = []
    for batch_id in ids[:limit]:
        raw = await svc.redis.hgetall(svc.keys.batch(batch_id))
        if raw:
            data.append(batch_json(raw))
    return {"object": "list", "data": data, "has_more": len(ids) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}
