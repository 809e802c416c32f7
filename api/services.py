"""What every route uses: the process's shared clients, and the one way a job gets in.

`submit` is shared by the jobs API and the OpenAI-compatible API: model routing (404 for a
model nobody serves), idempotency (same key + same body -> the same job, other body -> 409),
the queue limit (429 + Retry-After), the atomic enqueue, and registering webhook jobs with the
relay.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aredis
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import ValidationError

from ferry.api.auth import KeyRing
from ferry.api.errors import UNSUPPORTED_PARAMETER, ApiError, not_found
from ferry.api.joblist import index_job
from ferry.api.served import MODEL_CACHE_S, ModelHeartbeats
from ferry.api.settings import ApiSettings
from ferry.api.streaming import PubSubHub
from ferry.api.tracing import enqueue_span
from ferry.api.usage import TenantUsageMetrics
from ferry.worker.common.addresses import RefusedUrl, check_addresses, check_url_shape, literal_address
from ferry.worker.common.connect import ReplicationWaiter
from ferry.worker.common.tracing import Tracing
from ferry.worker.protocol import (
    EnqueueResult,
    JobRecord,
    JobRequest,
    JobState,
    Keys,
    UnreadableRecord,
    cancel_job_async,
    enqueue_job_async,
    job_id_created_at,
    new_job_id_for,
)
from ferry.worker.protocol.keys import watch_value
from ferry.worker.protocol.loras import read_lora_async
from ferry.worker.protocol.usage import account_job_async, refund_reservation_async

log = logging.getLogger("ferry.api")

_RESOLVE_TIMEOUT_S = 2.0  # a webhook host that does not resolve within this is refused


class ApiMetrics:
    """The API's Prometheus metrics, in their own registry (one per app)."""

    def __init__(self, open_streams, tenants: list[str] = (), labelled_tenants: int = 0):
        self.registry = CollectorRegistry()
        self.tenant_usage = TenantUsageMetrics(list(tenants), labelled_tenants)
        self.registry.register(self.tenant_usage)
        self.requests = Counter(
            "ferry_api_requests", "HTTP requests answered", ["method", "route", "status"], registry=self.registry
        )
        self.jobs = Counter("ferry_api_jobs_submitted", "Jobs enqueued", ["model", "source"], registry=self.registry)
        self.open_streams = Gauge("ferry_api_open_streams", "Event streams being followed", registry=self.registry)
        self.open_streams.set_function(open_streams)
        self.batch_driver_errors = Counter(
            "ferry_api_batch_driver_errors", "Unexpected exceptions of the batch driver: on a batch (retried, then "
            "it fails) or on one line (that line is answered internal_error)", ["scope"], registry=self.registry
        )


@dataclass(slots=True)
class Services:
    settings: ApiSettings
    redis: aredis.Redis  # decode_responses=True
    keys: Keys
    hub: PubSubHub
    keyring: KeyRing
    metrics: ApiMetrics
    configured_models: frozenset[str]  # FERRY_MODELS: accepted even with no live worker
    models_remembered: frozenset[str] = frozenset()  # seen live (or with limits) by this process: routable
    limits_seen: dict[str, tuple[float, ModelLimits | None]] = field(default_factory=dict)
    redis_started: tuple[float, float] = (float("-inf"), 0.0)  # (monotonic read time, unix start time)
    replication: ReplicationWaiter | None = None  # FERRY_REDIS_MIN_REPLICAS > 0: a 202 waits for the replicas
    tracing: Tracing | None = None  # OTEL_* names an endpoint: requests and enqueues are spans (api.tracing)
    heartbeats: ModelHeartbeats = field(init=False)

    def __post_init__(self) -> None:
        self.heartbeats = ModelHeartbeats(self.redis, self.keys)


async def services(request: Request) -> Services:
    """FastAPI dependency (async: a sync dependency costs a threadpool hop)."""
    return request.app.state.services


def live(beats: dict[str, float], liveness_s: float) -> list[str]:
    """The models of `beats` with a heartbeat within `liveness_s`."""
    since = time.time() - liveness_s
    return [name for name, at in beats.items() if at >= since]


async def live_models(svc: Services) -> list[str]:
    """Models with a worker heartbeat within `model_liveness_s`."""
    return live(await svc.heartbeats.beats(), svc.settings.model_liveness_s)


async def _routable_models(svc: Services, fresh: bool = False) -> frozenset[str]:
    beats = await (svc.heartbeats.refresh() if fresh else svc.heartbeats.beats())
    names = frozenset(live(beats, svc.settings.model_liveness_s))
    svc.models_remembered |= names
    return names | svc.configured_models | svc.models_remembered


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where a request's `model` goes: a served model's queue, with one of its LoRA adapters or none."""

    model: str  # the served (base) model: its queue, its limits
    lora: str | None = None  # the adapter applied (`JobRequest.lora`)

    @property
    def name(self) -> str:
        """What the client asked for: the answer's `model` echoes it."""
        return self.lora or self.model


async def resolve_model(svc: Services, name: str | None, tenant: str, field: str = "model") -> ModelRoute:
    """The model a request goes to: a served model (`served_model`), or a LoRA adapter registered for one
    (`worker.protocol.loras`) that `tenant` may use, routed to its base model's queue. An adapter the
    tenant may not use is the same 404 as a name nobody serves: names do not leak across tenants."""
    if name is not None and name not in await _routable_models(svc):
        entry = await read_lora_async(svc.redis, svc.keys, name)
        if entry is not None and entry.visible_to(tenant) and await is_routable(svc, entry.base_model):
            return ModelRoute(entry.base_model, entry.name)
    return ModelRoute(await served_model(svc, name, field))


async def is_routable(svc: Services, model: str) -> bool:
    """Whether `served_model` would route to `model`."""
    return (model in await _routable_models(svc) or model in await _routable_models(svc, fresh=True)
            or await model_limits(svc, model) is not None)


async def served_model(svc: Services, name: str | None, field: str = "model") -> str:
    """The served model `name` routes to (the only one, for None). A model is served while a worker of
    it sends heartbeats, and stays routable (its jobs queue until a worker scales up) when it is
    configured (FERRY_MODELS), was seen live by this process, or left its limits in Redis (workers
    write them for a week): a Redis restart or a pool scaled to zero is never a 404."""
    known = await _routable_models(svc)
    if name is not None and name not in known:
        known = await _routable_models(svc, fresh=True)  # a model that has just come up
    if name is None:
        if len(known) == 1:
            return next(iter(known))
        if not known:
            raise ApiError(404, "model_not_found", "no model is being served right now", field=field)
        raise ApiError(422, "invalid_request", f"{field}: required while {len(known)} models are served", field=field)
    if name not in known:
        if await model_limits(svc, name) is None:
            raise ApiError(404, "model_not_found", f"model {name!r} is not served", field=field)
        svc.models_remembered |= {name}
    return name


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    template_variables: frozenset[str] | None = None  # what its chat template reads (None: not reported)


def _limits(raw: dict) -> ModelLimits:
    """The model hash's fields (KeyError, ValueError: not a whole hash)."""
    variables = json.loads(raw.get("chat_template_variables") or "null")
    return ModelLimits(int(raw["vocab_size"]), int(raw["max_model_len"]),
                       frozenset(variables) if isinstance(variables, list) else None)


async def model_limits(svc: Services, model: str) -> ModelLimits | None:
    """What the model's workers reported of it (None: no worker of it has run yet)."""
    cached = svc.limits_seen.get(model)
    if cached is not None and time.monotonic() - cached[0] < MODEL_CACHE_S:
        return cached[1]
    raw = await svc.redis.hgetall(svc.keys.model_limits(model))
    try:
        limits = _limits(raw) if raw else None
    except (KeyError, ValueError, TypeError):
        limits = None
    svc.limits_seen[model] = (time.monotonic(), limits)
    return limits


async def check_against_model(svc: Services, request: JobRequest, prefix: str = "") -> None:
    """Token ids the model cannot have (a prompt's, stop_token_ids, logit_bias keys) are a 422 here, before the job
    is queued: in the engine such an id would fail the request."""
    limits = await model_limits(svc, request.model)
    if limits is None:
        return  # no worker has reported the model yet: the engine checks, and fails only that job
    checks = [("stop_token_ids", request.stop_token_ids or []), ("logit_bias", list(request.logit_bias or {}))]
    if isinstance(request.prompt, list):
        checks.append(("prompt", request.prompt))
    checks.append(("allowed_token_ids", request.allowed_token_ids or []))
    for name, ids in checks:
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            field = f"{prefix}{name}"
            message = f"{field}: token id {bad} is beyond the vocabulary of {request.model!r} ({limits.vocab_size} ids)"
            raise ApiError(422, "invalid_request", message, field=field)
    if request.messages is not None and limits.template_variables is not None:
        problem = request.template_problem(limits.template_variables)
        if problem is not None:
            field = f"{prefix}{problem[0]}"
            raise ApiError(422, UNSUPPORTED_PARAMETER, f"{field}: {problem[1]}", field=field)


def new_job_request(svc: Services, tenant: str, route: ModelRoute, fields: dict[str, Any], *,
                    loc: tuple[str, ...] = ("body",), ttl_s: float | None = None, timeout_s: float | None = None,
                    **job: Any) -> JobRequest:
    """The one place a request to either API becomes a `JobRequest` for `route`'s model and adapter:
    `fields` (prompt or messages, sampling) as the client sent them at `loc` in its body, and `job`
    (priority, metadata, webhook). Sets what neither client chooses: the tenant, its own prefix-cache
    namespace (tenants never share cache entries: no timing side channel) and the process's default
    limits. A validation error is a 422 naming the request's field."""
    try:
        return JobRequest(**fields, **job, model=route.model, lora=route.lora, tenant=tenant, cache_salt=tenant,
                          ttl_s=ttl_s or svc.settings.job_ttl_s, timeout_s=timeout_s or svc.settings.job_timeout_s)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": (*loc, *e["loc"])} for e in exc.errors()]) from exc


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
    """The job if it exists and belongs to `tenant`; otherwise 404 (never 403: ids do not leak).

    A job accepted before Redis last started, whose record is gone or incomplete, is a 404 with
    the code `job_state_lost` (Redis restarted without persistence): a definite answer, never a 500."""
    try:
        record = JobRecord.from_redis(await svc.redis.hgetall(svc.keys.job(job_id)))
    except UnreadableRecord:
        raise job_state_lost(job_id) from None
    if record is None:
        if await _lost_in_restart(svc, job_id):
            raise job_state_lost(job_id)
        raise not_found("job", job_id)
    if record.tenant != tenant:
        raise not_found("job", job_id)
    return record


def job_state_lost(job_id: str) -> ApiError:
    return ApiError(404, "job_state_lost", f"job {job_id!r} was accepted, but the job store lost its record "
                    "(Redis restarted without persistence): it will not finish; submit it again")


async def _lost_in_restart(svc: Services, job_id: str) -> bool:
    """Whether the id names a job accepted before Redis last started, recently enough that its
    record would still be there (the id carries its creation time: `new_job_id`)."""
    created = job_id_created_at(job_id)
    if svc.settings.redis_cluster:
        return False  # a cluster's failover promotes a replica holding the data; no one server's start says more
    if created is None or time.time() - created > svc.settings.result_ttl_s + svc.settings.job_ttl_s:
        return False
    # Redis reports its uptime in whole seconds: a job within a second of the start is not claimed lost.
    return created < await redis_started_at(svc) - 1.0


async def redis_started_at(svc: Services) -> float:
    """Unix time the Redis server started (from INFO; read at most once per MODEL_CACHE_S)."""
    read_at, started = svc.redis_started
    if time.monotonic() - read_at > MODEL_CACHE_S:
        info = await svc.redis.info("server")
        started = time.time() - float(info["uptime_in_seconds"])
        svc.redis_started = (time.monotonic(), started)
    return started


async def cancel_job(svc: Services, job_id: str) -> JobState | None:
    """Request a job's cancellation (`cancel_job_async`); a job it cancels while still queued ends
    here, so it is counted here too (`worker.protocol.usage`; counting twice adds nothing)."""
    state = await cancel_job_async(svc.redis, svc.keys, job_id, result_ttl_s=svc.settings.result_ttl_s)
    if state == JobState.cancelled:
        await account_job_async(svc.redis, svc.keys, job_id, svc.settings.result_ttl_s)
    return state


async def _check_replicated(svc: Services, job_id: str) -> None:
    """A 202 only for a job at least `redis_min_replicas` replicas hold: a failover of its primary
    cannot lose it. Fewer within the timeout is a 503 (the job may still run: retrying with the same
    Idempotency-Key answers the same job)."""
    waiter = svc.replication
    acks = await waiter.wait(svc.keys.ack(job_id))
    if acks < waiter.replicas:
        raise ApiError(503, "not_replicated", f"the job reached {acks} of the {waiter.replicas} replicas required "
                       f"within {waiter.timeout_ms} ms; retry (with an Idempotency-Key, retries name the same job)",
                       headers={"Retry-After": "1"})


def _same_request(a: JobRequest, b: JobRequest) -> bool:
    return a.model_dump(exclude={"created_at"}) == b.model_dump(exclude={"created_at"})


async def _replay(svc: Services, request: JobRequest, job_id: str) -> EnqueueResult:
    try:
        existing = JobRecord.from_redis(await svc.redis.hgetall(svc.keys.job(job_id)))
    except UnreadableRecord:
        existing = None
    if existing is None or existing.request is None or not _same_request(existing.request, request):
        raise ApiError(
            409,
            "idempotency_conflict",
            "this Idempotency-Key was used with a different request" if existing else
            "this Idempotency-Key names a job that has expired",
            field="Idempotency-Key",
        )
    return EnqueueResult(job_id=job_id, created=False)


async def check_webhook_url(svc: Services, url: str, field: str = "webhook.url") -> None:
    """Refuse, before anything is queued, a webhook URL the webhook worker would refuse to deliver
    to (the worker checks again at delivery: DNS may change in between)."""
    try:
        host, port = check_url_shape(url)
        literal = literal_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), _RESOLVE_TIMEOUT_S
            )
            addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        check_addresses(host, addresses, svc.settings.webhook_allow_private)
    except RefusedUrl as exc:
        raise ApiError(422, "webhook_refused", f"{field}: {exc}", field=field) from None
    except (OSError, TimeoutError, UnicodeError) as exc:
        raise ApiError(422, "webhook_refused", f"{field}: cannot resolve the host ({exc})", field=field) from None


async def submit(svc: Services, request: JobRequest, idempotency_key: str | None, source: str,
                 reservation: tuple[str, int] | None = None,
                 admission: Callable[[], Awaitable[tuple[str, int] | None]] | None = None) -> EnqueueResult:
    """Enqueue `request` (already routed to a model and stamped with its tenant). Its rate-limit
    reservation (api.ratelimit) is `reservation`, or what `admission` takes once the request is
    known to be new (an idempotent replay takes nothing) and the queue has room. A request that
    does not become a new job (a full queue, a failed enqueue, a replay) gives its reservation's
    tokens back, and the request too when `admission` took it here."""
    queued, took_request = False, False
    try:
        if idempotency_key is not None:
            known = await svc.redis.get(svc.keys.idempotency(request.tenant, idempotency_key))
            if known is not None:
                return await _replay(svc, request, known)
        if request.webhook is not None:
            await check_webhook_url(svc, request.webhook.url)
        await _check_queue(svc, request.model)
        if admission is not None:
            reservation = await admission()
            took_request = True
        job_id = new_job_id_for(svc.keys, request, idempotency_key)
        await index_job(svc.redis, svc.keys, svc.settings, request.tenant, job_id)  # before the enqueue: api.joblist
        with enqueue_span(svc.tracing, request.model, job_id) as traceparent:
            result = await enqueue_job_async(
                svc.redis, svc.keys, request, job_id=job_id, idempotency_key=idempotency_key,
                idempotency_ttl_s=svc.settings.idempotency_ttl_s, reservation=reservation, traceparent=traceparent,
            )
        queued = result.created
    finally:
        if not queued and reservation is not None:
            await refund(svc, request.tenant, reservation, requests=int(took_request))
    if not result.created:  # lost a race with the same key
        return await _replay(svc, request, result.job_id)
    if svc.replication is not None:
        await _check_replicated(svc, result.job_id)
    if request.webhook is not None:
        # After the enqueue: the relay drops watch entries whose job hash it cannot find.
        await svc.redis.hset(svc.keys.webhook_watch, result.job_id, watch_value("0-0", time.time()))
    svc.metrics.jobs.labels(request.model, source).inc()
    return result


async def refund(svc: Services, tenant: str, reservation: tuple[str, int], requests: int = 0) -> None:
    """Give a reservation's tokens (and `requests`) back to its budget. Shielded (it runs on the
    way out of a failed or cancelled submit); a Redis error is logged, never raised over the error
    that made the refund necessary."""
    budget, tokens = reservation
    try:
        with anyio.CancelScope(shield=True):
            await refund_reservation_async(svc.redis, svc.keys, tenant, budget, tokens, requests)
    except (aredis.RedisError, OSError) as exc:
        log.warning("could not give back %d tokens to %s's %s budget: %s", tokens, tenant, budget, exc)
