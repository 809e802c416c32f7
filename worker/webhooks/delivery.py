"""Signed webhook delivery: a Celery app on the job Redis, one task per (job, event).

Standard Webhooks (https://www.standardwebhooks.com): every attempt carries `webhook-id`
(stable across retries, so receivers de-duplicate), `webhook-timestamp` (seconds, per attempt)
and `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">` keyed by the secret
`whsec_<base64>`. Timeouts, connection errors, 429 and 5xx are retried with exponential backoff
and jitter up to the attempt limit; 410 stops at once; any other answer is final; redirects
are never followed. A URL whose host resolves to a private, loopback, link-local or otherwise
non-public address is refused unless FERRY_WEBHOOK_ALLOW_PRIVATE is set, and the connection
goes to the address that was checked (no second DNS lookup to rebind).

`ferry webhooks` runs the Celery worker plus the relay (worker/webhooks/relay.py) that turns
job events into delivery tasks.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import httpx
from celery import Celery
from prometheus_client import CollectorRegistry, Counter, start_http_server
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.protocol.keys import Keys

log = logging.getLogger("ferry.webhooks")

EVENTS = ("job.started", "job.completed", "job.failed", "job.cancelled")
TASK_NAME = "ferry.webhooks.deliver"
SIGNATURE_TOLERANCE_S = 300


class WebhookSettings(BaseSettings):
    """The webhook process's view of FERRY_* (same names as ApiSettings' webhook fields)."""

    model_config = SettingsConfigDict(env_prefix="FERRY_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ferry"
    webhook_secret: str | None = None  # "whsec_<base64>"; required to deliver
    webhook_retry_base_s: float = 2.0  # first retry after ~base, then doubling (with jitter)
    webhook_retry_max_s: float = 3600.0  # cap on one backoff
    webhook_max_attempts: int = 8
    webhook_timeout_s: float = 10.0
    webhook_allow_private: bool = False
    webhook_concurrency: int = 16  # delivery threads in the Celery worker
    webhook_metrics_port: int = 9301  # 0 disables the Prometheus endpoint
    result_ttl_s: int = 86400  # how long delivery outcomes are kept (as long as the job)


# ---------------------------------------------------------------------------------------------
# Standard Webhooks signatures


class InvalidSignature(Exception):
    pass


def secret_key(secret: str) -> bytes:
    """The HMAC key inside a `whsec_<base64>` secret."""
    if not secret.startswith("whsec_"):
        raise ValueError("webhook secret must look like 'whsec_<base64>'")
    return base64.b64decode(secret.removeprefix("whsec_"))


def new_secret() -> str:
    return "whsec_" + base64.b64encode(random.SystemRandom().randbytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256(key, "id.timestamp.body")>`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, now: float | None = None) -> None:
    """Check a delivery as a receiver would; raises InvalidSignature. `headers` keys lower-case."""
    try:
        msg_id, timestamp = headers["webhook-id"], int(headers["webhook-timestamp"])
        signatures = headers["webhook-signature"].split()
    except (KeyError, ValueError) as exc:
        raise InvalidSignature(f"missing or malformed webhook headers: {exc}") from exc
    if abs((time.time() if now is None else now) - timestamp) > SIGNATURE_TOLERANCE_S:
        raise InvalidSignature("timestamp outside the tolerance")
    expected = sign(secret, msg_id, timestamp, body)
    # The header may carry several space-separated signatures (secret rotation).
    if not any(hmac.compare_digest(expected, s) for s in signatures if s.startswith("v1,")):
        raise InvalidSignature("no signature matches")


# ---------------------------------------------------------------------------------------------
# Where a delivery may go


class RefusedUrl(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the URL with its host replaced by the checked address
    host_header: str  # the original host[:port] for the Host header
    sni_hostname: str | None  # TLS server name (certificates are checked against the real name)


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve_target(url: str, allow_private: bool) -> Target:
    """Resolve the URL's host once, refuse non-public addresses, pin the connection to one."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise RefusedUrl(f"invalid URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise RefusedUrl("webhook URL must be http(s)://host/...")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parsed.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RefusedUrl(f"cannot resolve {parsed.host!r}: {exc}") from exc
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not allow_private:
        private = [str(a) for a in addresses if not _public(a)]
        if private:
            raise RefusedUrl(f"{parsed.host!r} resolves to non-public address {private[0]} (FERRY_WEBHOOK_ALLOW_PRIVATE is off)")
    host_header = parsed.host if parsed.port is None else f"{parsed.host}:{parsed.port}"
    return Target(
        url=str(parsed.copy_with(host=str(addresses[0]))),
        host_header=host_header,
        sni_hostname=parsed.host if parsed.scheme == "https" else None,
    )


# ---------------------------------------------------------------------------------------------
# One attempt


@dataclass(frozen=True, slots=True)
class Delivery:
    """Everything a task needs; the body is fixed at enqueue time so every retry is identical."""

    webhook_id: str  # stable across retries; receivers de-duplicate on it
    job_id: str
    event: str  # one of EVENTS
    url: str
    body: str  # JSON text, signed as bytes (utf-8)


@dataclass(frozen=True, slots=True)
class Attempt:
    outcome: str  # "delivered" | "retry" | "gone" | "rejected" | "refused"
    status_code: int | None
    detail: str


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before attempt `attempt + 1`: base * 2^(attempt-1), capped, with ±50% jitter."""
    delay = min(cap_s, base_s * 2 ** (attempt - 1))
    return delay * random.uniform(0.5, 1.5)


def attempt_delivery(delivery: Delivery, secret: str, *, allow_private: bool, timeout_s: float) -> Attempt:
    try:
        target = resolve_target(delivery.url, allow_private)
    except RefusedUrl as exc:
        return Attempt("refused", None, str(exc))
    body = delivery.body.encode()
    timestamp = int(time.time())
    headers = {
        "host": target.host_header,
        "content-type": "application/json",
        "user-agent": "ferry-webhooks",
        "webhook-id": delivery.webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, delivery.webhook_id, timestamp, body),
    }
    extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
            request = client.build_request("POST", target.url, headers=headers, content=body, extensions=extensions)
            response = client.send(request)
    except httpx.TransportError as exc:  # timeouts, refused connections, TLS failures
        return Attempt("retry", None, f"{type(exc).__name__}: {exc}")
    code = response.status_code
    if 200 <= code < 300:
        return Attempt("delivered", code, "ok")
    if code == 410:
        return Attempt("gone", code, "receiver answered 410 Gone: no more retries")
    if code == 429 or code >= 500:
        return Attempt("retry", code, f"receiver answered {code}")
    return Attempt("rejected", code, f"receiver answered {code}" + (" (redirects are not followed)" if 300 <= code < 400 else ""))


# ---------------------------------------------------------------------------------------------
# The Celery app


def make_celery(settings: WebhookSettings, on_final=None) -> Celery:
    """A Celery app on the job Redis; its keys live under `<prefix>:celery:`.

    `on_final(delivery, attempt, attempts)` is called once per delivery when it is settled
    (delivered, refused, rejected, gone, or out of attempts).
    """
    keys = Keys(settings.key_prefix)
    app = Celery("ferry", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        # A retry waits in the worker as an ETA task; Redis re-delivers an unacked task after the
        # visibility timeout, so it must outlast the longest backoff.
        broker_transport_options={
            "global_keyprefix": keys.celery_prefix,
            "visibility_timeout": max(3600, int(2 * settings.webhook_retry_max_s + settings.webhook_timeout_s)),
        },
        broker_connection_retry_on_startup=True,
        task_default_queue=keys.webhook_queue,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        task_serializer="json",
        accept_content=["json"],
    )

    @app.task(name=TASK_NAME, bind=True, max_retries=None)
    def deliver(task, delivery: dict) -> str:
        d = Delivery(**delivery)
        number = task.request.retries + 1
        if not settings.webhook_secret:
            raise RuntimeError("FERRY_WEBHOOK_SECRET is not set")
        attempt = attempt_delivery(
            d, settings.webhook_secret, allow_private=settings.webhook_allow_private, timeout_s=settings.webhook_timeout_s
        )
        log.info("webhook %s %s -> %s attempt %d: %s", d.event, d.job_id, d.url, number, attempt.detail)
        if attempt.outcome == "retry" and number < settings.webhook_max_attempts:
            raise task.retry(countdown=backoff_s(number, settings.webhook_retry_base_s, settings.webhook_retry_max_s))
        if on_final is not None:
            on_final(d, attempt, number)
        return attempt.outcome

    return app


def enqueue(app: Celery, delivery: Delivery) -> None:
    app.send_task(TASK_NAME, kwargs={"delivery": asdict(delivery)})


def main(argv: list[str] | None = None) -> int:
    """`ferry webhooks`: the Celery delivery worker plus the job-event relay, in one process."""
    from worker.webhooks.relay import Relay

    parser = argparse.ArgumentParser(prog="ferry webhooks", description=main.__doc__)
    parser.add_argument("--concurrency", type=int, default=None, help="delivery threads (FERRY_WEBHOOK_CONCURRENCY)")
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = WebhookSettings()
    if not settings.webhook_secret:
        log.error("FERRY_WEBHOOK_SECRET is not set (expected 'whsec_<base64>'): refusing to send unsigned webhooks")
        return 2
    secret_key(settings.webhook_secret)
    if settings.webhook_allow_private:
        log.warning("FERRY_WEBHOOK_ALLOW_PRIVATE is on: webhooks may reach private and loopback addresses")
    registry = CollectorRegistry()
    outcomes = Counter("ferry_webhook_deliveries", "Settled webhook deliveries", ["outcome"], registry=registry)
    if settings.webhook_metrics_port:
        start_http_server(settings.webhook_metrics_port, registry=registry)
    relay = Relay(settings)

    def on_final(delivery: Delivery, attempt: Attempt, attempts: int) -> None:
        outcomes.labels("failed" if attempt.outcome == "retry" else attempt.outcome).inc()
        relay.record(delivery, attempt, attempts)

    app = make_celery(settings, on_final)
    relay.app = app
    stop = threading.Event()
    threading.Thread(target=relay.run, args=(stop,), name="webhook-relay", daemon=True).start()
    concurrency = args.concurrency or settings.webhook_concurrency
    try:
        app.worker_main([
            "worker", "--pool=threads", f"--concurrency={concurrency}", f"--loglevel={args.loglevel}",
            "-Q", Keys(settings.key_prefix).webhook_queue, "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"ferry-webhooks-{os.getpid()}@{socket.gethostname()}",
        ])
    finally:
        stop.set()
    return 0
