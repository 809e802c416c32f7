"""What every route uses: the process's shared clients, and the one way a job gets in.

`submit` is shared by the jobs API and the OpenAI-compatible API: model routing (404 for a
model nobody serves), idempotency (same key + same body -> the same job, other body -> 409),
the queue limit (429 + Retry-After), the atomic enqueue, and registering webhook jobs with the
relay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aredis
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge

from api.auth import KeyRing
from api.errors import ApiError, not_found
from api.settings import ApiSettings
from api.streaming import PubSubHub
from worker.protocol import EnqueueResult, JobRecord, JobRequest, Keys, enqueue_job_async
from worker.protocol.keys import watch_value

MODEL_CACHE_S = 1.0


class ApiMetrics:
    """The API's Prometheus metrics, in their own registry (one per app)."""

    def __init__(self, open_streams):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ferry_api_requests", "HTTP requests answered", ["method", "route", "status"], registry=self.registry
        )
        self.jobs = Counter("ferry_api_jobs_submitted", "Jobs enqueued", ["model", "source"], registry=self.registry)
        self.open_streams = Gauge("ferry_api_open_streams", "Event streams being followed", registry=self.registry)
        self.open_streams.set_function(open_streams)


@dataclass(slots=True)
class Services:
    settings: ApiSettings
    redis: aredis.Redis  # decode_responses=True
    keys: Keys
    hub: PubSubHub
    keyring: KeyRing
    metrics: ApiMetrics
    configured_models: frozenset[str]  # FERRY_MODELS: accepted even with no live worker
    # (monotonic time, names): live models as last read, reused for routing for MODEL_CACHE_S
    models_seen: tuple[float, frozenset[str]] = (float("-inf"), frozenset())


async def services(request: Request) -> Services:
    """FastAPI dependency (async: a sync dependency costs a threadpool hop)."""
    return request.app.state.services


async def live_models(svc: Services) -> list[str]:
    """Models with a worker heartbeat within `model_liveness_s`."""
    since = time.time() - svc.settings.model_liveness_s
    return list(await svc.redis.zrangebyscore(svc.keys.models, since, "+inf"))


async def _routable_models(svc: Services) -> frozenset[str]:
    # Routing reads the heartbeat set at most once per MODEL_CACHE_S: one round trip less per request.
    seen_at, names = svc.models_seen
    if time.monotonic() - seen_at > MODEL_CACHE_S:
        names = frozenset(await live_models(svc))
        svc.models_seen = (time.monotonic(), names)
    return names | svc.configured_models


async def resolve_model(svc: Services, name: str | None, field: str = "model") -> str:
    known = await _routable_models(svc)
    if name is None:
        if len(known) == 1:
            return next(iter(known))
        if not known:
            raise ApiError(404, "model_not_found", "no model is being served right now", field=field)
        raise ApiError(422, "invalid_request", f"{field}: required while {len(known)} models are served", field=field)
    if name not in known:
        raise ApiError(404, "model_not_found", f"model {name!r} is not served", field=field)
    return name


async def _check_queue(svc: Services, model: str) -> None:
    pipe = svc.redis.pipeline(transaction=False)
    for queue in svc.keys.queues(model):
        pipe.xlen(queue)
    waiting = sum(await pipe.execute())
    if waiting >= svc.settings.max_queue_len:
        raise ApiError(
            429,
            "queue_full",
            f"model {model!r} has {waiting} jobs queued (limit {svc.settings.max_queue_len}); retry later",
            headers={"Retry-After": str(svc.settings.retry_after_s)},
        )


async def get_job(svc: Services, job_id: str, tenant: str) -> JobRecord:
    """The job if it exists and belongs to `tenant`; otherwise 404 (never 403: ids do not leak)."""
    record = JobRecord.from_redis(await svc.redis.hgetall(svc.keys.job(job_id)))
    if record is None or record.tenant != tenant:
        raise not_found("job", job_id)
    return record


def _same_request(a: JobRequest, b: JobRequest) -> bool:
    return a.model_dump(exclude={"created_at"}) == b.model_dump(exclude={"created_at"})


async def _replay(svc: Services, request: JobRequest, job_id: str) -> EnqueueResult:
    existing = JobRecord.from_redis(await svc.redis.hgetall(svc.keys.job(job_id)))
    if existing is None or existing.request is None or not _same_request(existing.request, request):
        raise ApiError(
            409,
            "idempotency_conflict",
            "this Idempotency-Key was used with a different request" if existing else
            "this Idempotency-Key names a job that has expired",
            field="Idempotency-Key",
        )
    return EnqueueResult(job_id=job_id, created=False)


async def submit(svc: Services, request: JobRequest, idempotency_key: str | None, source: str) -> EnqueueResult:
    """Enqueue `request` (already routed to a model and stamped with its tenant)."""
    if idempotency_key is not None:
        known = await svc.redis.get(svc.keys.idempotency(request.tenant, idempotency_key))
        if known is not None:
            return await _replay(svc, request, known)
    await _check_queue(svc, request.model)
    result = await enqueue_job_async(
        svc.redis, svc.keys, request, idempotency_key=idempotency_key, idempotency_ttl_s=svc.settings.idempotency_ttl_s
    )
    if not result.created:  # lost a race with the same key
        return await _replay(svc, request, result.job_id)
    if request.webhook is not None:
        # After the enqueue: the relay drops watch entries whose job hash it cannot find.
        await svc.redis.hset(svc.keys.webhook_watch, result.job_id, watch_value("0-0", time.time()))
    svc.metrics.jobs.labels(request.model, source).inc()
    return result
