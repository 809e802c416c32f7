"""Liveness, readiness and Prometheus metrics (no API key needed)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from redis.exceptions import RedisError

from ferry.api.errors import ApiError
from ferry.api.schemas import error_responses
from ferry.api.services import Services, live_models, services

router = APIRouter(tags=["health"])
Svc = Annotated[Services, Depends(services)]


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    models: list[str]  # models with a live worker


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses=error_responses(503), summary="Redis reachable, a worker alive")
async def readyz(svc: Svc) -> Ready:
    try:
        await svc.redis.ping()
        models = await live_models(svc)
    except (RedisError, OSError) as exc:
        raise ApiError(503, "redis_unavailable", f"Redis is not reachable: {exc}") from exc
    if not models:
        raise ApiError(503, "no_workers", "no worker has sent a heartbeat recently")
    return Ready(status="ready", models=models)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
)
async def metrics(svc: Svc) -> PlainTextResponse:
    try:
        await svc.metrics.tenant_usage.refresh(svc.redis, svc.keys)
    except RedisError:  # Redis away: the tenant counters stay as last read
        pass
    return PlainTextResponse(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)
