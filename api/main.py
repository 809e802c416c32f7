"""The HTTP API process: `create_app()` and `ferry api [--host H] [--port P]`.

The API is thin: it validates, enqueues on Redis and streams events back; it holds no job state
of its own, so any number of replicas can run behind a load balancer.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from contextlib import asynccontextmanager

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from ferry.api.auth import KeyRing
from ferry.api.batch_driver import BatchDriver
from ferry.api.errors import BodyLimitMiddleware, install_error_handlers
from ferry.api.offloop import BodyChecks
from ferry.api.ratelimit import RateLimitHeaders
from ferry.api.routes import (
    admin,
    batches,
    files,
    health,
    jobs,
    loras,
    messages,
    openai,
    responses,
    tokenize,
    usage,
)
from ferry.api.services import ApiMetrics, Services
from ferry.api.settings import ApiSettings
from ferry.api.streaming import PubSubHub
from ferry.api.tracing import end_request_span, in_span, start_request_span
from ferry.worker.common.connect import ReplicationWaiter, connect_async
from ferry.worker.common.objectstore import open_store
from ferry.worker.common.tracing import Tracing, log_as_text, tracing_from_env
from ferry.worker.protocol import Keys

log = logging.getLogger("ferry.api")


class RequestMetricsMiddleware:
    """Pure ASGI (streams pass through untouched): counts answers by route template and status and,
    with tracing on, spans each request from its head to its body's end (`api.tracing`)."""

    def __init__(self, app, tracing: Tracing | None = None):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        span = None if self.tracing is None else start_request_span(self.tracing, scope)
        try:
            with in_span(span):
                await self.app(scope, receive, send_and_note)
        finally:
            if span is not None:
                end_request_span(span, scope, status)
            services = getattr(scope["app"].state, "services", None)
            route = scope.get("route")
            if services is not None:
                path = route.path if route is not None else "unmatched"
                services.metrics.requests.labels(scope["method"], path, str(status)).inc()


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or ApiSettings()
    keyring = KeyRing.parse(settings.api_keys, settings.api_keys_file)
    configured = frozenset(m.strip() for m in (settings.models or "").split(",") if m.strip())
    tracing = tracing_from_env("ferry-api")  # None unless OTEL_* names an endpoint; a bad variable fails here

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # A blocking pool: under a burst, requests queue for a connection instead of failing.
        # Socket timeouts: with Redis paused or gone, a request fails (503 + Retry-After) within
        # about a second instead of hanging for the whole outage.
        client = connect_async(
            settings.redis_url, cluster=settings.redis_cluster, decode_responses=True,
            max_connections=settings.redis_max_connections, pool_timeout_s=settings.redis_pool_timeout_s,
            socket_connect_timeout=settings.redis_socket_timeout_s, socket_timeout=settings.redis_socket_timeout_s,
        )
        hub = PubSubHub(client)
        hub.start()
        app.state.services = Services(
            settings=settings,
            redis=client,
            keys=Keys(settings.key_prefix, settings.queue_shards),
            hub=hub,
            keyring=keyring,
            metrics=ApiMetrics(lambda: hub.num_followers, keyring.tenant_names(), settings.usage_metrics_tenants),
            configured_models=configured,
            replication=ReplicationWaiter(client, settings.redis_min_replicas, settings.redis_replica_timeout_ms)
            if settings.redis_min_replicas else None,
            tracing=tracing,
        )
        app.state.services.heartbeats.start()
        app.state.body_checks = BodyChecks(settings.body_check_processes)
        app.state.files_store = open_store(settings.files_url, settings.s3_endpoint_url)
        driver = BatchDriver(app.state.services, app.state.files_store)
        driver.start()
        keyring.announce()
        # What start-up made (FastAPI, pydantic's models, the clients) lives as long as the process:
        # out of the cyclic collector, a full collection (25-50 ms of the event loop, every
        # request waiting) scans only what requests make.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await driver.close()
            app.state.body_checks.close()
            await app.state.services.heartbeats.close()
            await hub.close()
            if app.state.services.replication is not None:
                await app.state.services.replication.aclose()
            await client.aclose()
            if tracing is not None:
                tracing.shutdown()

    app = FastAPI(
        title="Ferry",
        version="1",
        summary="Async LLM inference jobs, resumable SSE, and an OpenAI-compatible API",
        lifespan=lifespan,
    )
    app.state.keyring = keyring
    install_error_handlers(app)
    uploads = frozenset({("POST", "/v1/files")})  # limited by max_file_bytes as they stream in
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       timeout_s=settings.http_body_timeout_s, streamed=uploads)
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(RequestMetricsMiddleware, tracing=tracing)  # outermost: its span covers every other layer
    app.include_router(jobs.router)
    app.include_router(openai.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(usage.router)
    app.include_router(admin.router)
    app.include_router(loras.router)
    app.include_router(health.router)
    return app


_SWITCH_INTERVAL_S = 0.001  # Python's default is 5 ms


def stream_deadline_s(grace_s: float) -> float:
    """How long after SIGTERM open streams and waits go on before they are ended (`PubSubHub.stop`):
    up to 2 s before the grace period is over, so that their last writes go out before uvicorn
    cancels whatever is left."""
    return max(grace_s - 2.0, grace_s / 2)


class _Server(uvicorn.Server):
    """uvicorn, whose graceful shutdown also ends the app's open streams and waits in time
    (uvicorn's own waits for them to end, then cuts what is left mid-body)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        super().__init__(config)
        self._app, self._grace_s = app, grace_s

    async def shutdown(self, sockets=None) -> None:
        hub = self._app.state.services.hub
        timer = asyncio.get_running_loop().call_later(stream_deadline_s(self._grace_s), hub.stop)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline on every request head: a connection whose request
    line and headers are not all in `head_timeout_s` after it opened, or after its previous response,
    is closed. uvicorn's keep-alive timer stops at the first byte, so a client sending its headers
    a byte at a time (slowloris) would hold its connection for ever. Bodies are not limited so."""

    head_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no whole request head yet
            self.transport.close()


def main(argv: list[str] | None = None) -> int:
    """`ferry api`: serve the API with uvicorn."""
    settings = ApiSettings()
    parser = argparse.ArgumentParser(prog="ferry api", description=main.__doc__)
    parser.add_argument("--host", default=settings.host, help=f"bind address (FERRY_HOST, default {settings.host})")
    parser.add_argument("--port", type=int, default=settings.port, help=f"port (FERRY_PORT, default {settings.port})")
    args = parser.parse_args(argv)
    log_as_text(settings.log_level)
    # Large bodies are parsed and checked on threads beside the event loop; a thread holds the GIL
    # for up to the switch interval at a time, so the loop (every other request) waits at most that long.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    app = create_app(settings)
    http = type("HeadTimeoutH11", (_HeadTimeoutH11,), {"head_timeout_s": settings.http_head_timeout_s})
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=settings.log_level.lower(),
                            access_log=False, http=http, timeout_keep_alive=settings.http_keep_alive_s,
                            timeout_graceful_shutdown=settings.shutdown_grace_s)
    _Server(config, app, settings.shutdown_grace_s).run()
    return 0
