"""One delivery attempt of a webhook, and where a delivery may go.

Timeouts, connection errors, 429 and 5xx are retried (by the Celery task) with exponential
backoff and jitter up to the attempt limit; 410 stops at once; any other answer is final;
redirects are never followed. A URL whose host resolves to a private, loopback, link-local or
otherwise non-public address is refused unless FERRY_WEBHOOK_ALLOW_PRIVATE is set, and the
connection goes to the address that was checked (no second DNS lookup to rebind).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from ferry.worker.common.addresses import RefusedUrl, check_addresses, resolve
from ferry.worker.webhooks.signing import sign


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the URL with its host replaced by the checked address
    host_header: str  # the original host[:port] for the Host header
    sni_hostname: str | None  # TLS server name (certificates are checked against the real name)


def resolve_target(url: str, allow_private: bool) -> Target:
    """Resolve the URL's host once, refuse non-public addresses (`worker.common.addresses`),
    pin the connection to one of the checked addresses."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise RefusedUrl(f"invalid URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise RefusedUrl("webhook URL must be http(s)://host/...")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    addresses = resolve(parsed.host, port)
    check_addresses(parsed.host, addresses, allow_private)
    host_header = parsed.host if parsed.port is None else f"{parsed.host}:{parsed.port}"
    return Target(
        url=str(parsed.copy_with(host=str(addresses[0]))),
        host_header=host_header,
        sni_hostname=parsed.host if parsed.scheme == "https" else None,
    )


@dataclass(frozen=True, slots=True)
class WebhookMessage:
    """One event for one receiver: everything a task needs. The body is fixed when the relay hands
    it over, so every retry sends the same bytes under the same id."""

    webhook_id: str  # stable across retries; receivers de-duplicate on it
    job_id: str
    event: str  # one of EVENTS
    url: str
    body: str  # JSON text, signed as bytes (utf-8)
    tenant: str = ""  # whose job or batch: its own webhook secrets sign, if its key configuration has any


@dataclass(frozen=True, slots=True)
class Attempt:
    outcome: str  # "delivered" | "retry" | "gone" | "rejected" | "refused"
    status_code: int | None
    detail: str


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before attempt `attempt + 1`: base * 2^(attempt-1), capped, with ±50% jitter."""
    delay = min(cap_s, base_s * 2 ** (attempt - 1))
    return delay * random.uniform(0.5, 1.5)


def attempt_delivery(delivery: WebhookMessage, secrets: Sequence[str], *, allow_private: bool,
                     timeout_s: float) -> Attempt:
    """POST the message once, signed with every secret in `secrets` (space-separated signatures:
    during a rotation a receiver holding either secret verifies it)."""
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
        "webhook-signature": " ".join(sign(secret, delivery.webhook_id, timestamp, body) for secret in secrets),
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
    return Attempt(
        "rejected", code, f"receiver answered {code}" + (" (redirects are not followed)" if 300 <= code < 400 else "")
    )
