"""The webhook process's part of a job's trace: the relay's hand-off, then each delivery attempt.

The relay hands an event to Celery inside a PRODUCER span, child of the job's trace (its record's
`traceparent`), and puts that span's `traceparent` in the `WebhookMessage`; every delivery attempt
of the message, retries included, is a CLIENT span under it (`POST`, with the answer's
`http.response.status_code`, OpenTelemetry's HTTP semantic conventions) and sends its own
`traceparent` to the receiver. All of it only where tracing is on (`worker.common.tracing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from ferry.worker.common.tracing import SpanKind, Status, StatusCode, Tracing, context_of, traceparent_of

MESSAGING_SYSTEM = "celery"


@contextmanager
def handoff_span(tracing: Tracing | None, job_traceparent: str | None, job_id: str, event: str,
                 queue: str) -> Iterator[str]:
    """A PRODUCER span around handing `event` of `job_id` to Celery; yields the message's
    `traceparent` ("" with tracing off)."""
    if tracing is None:
        yield ""
        return
    attributes = {"messaging.system": MESSAGING_SYSTEM, "messaging.operation.type": "send",
                  "messaging.destination.name": queue, "ferry.job.id": job_id, "ferry.webhook.event": event}
    with tracing.tracer.start_as_current_span(f"send {queue}", context=context_of(job_traceparent),
                                              kind=SpanKind.PRODUCER, attributes=attributes) as span:
        yield traceparent_of(span) or ""


@contextmanager
def delivery_span(tracing: Tracing | None, message_traceparent: str, url: str, job_id: str, event: str,
                  attempt: int) -> Iterator[tuple[object | None, str | None]]:
    """A CLIENT span around one delivery attempt; yields (the span, its `traceparent` for the
    request's header), (None, None) with tracing off. `set_answer` records the outcome on it."""
    if tracing is None:
        yield None, None
        return
    parts = urlsplit(url)
    attributes = {"http.request.method": "POST", "url.full": url, "server.address": parts.hostname or "",
                  "http.request.resend_count": attempt - 1, "ferry.job.id": job_id, "ferry.webhook.event": event,
                  "ferry.webhook.attempt": attempt}
    if parts.port:
        attributes["server.port"] = parts.port
    with tracing.tracer.start_as_current_span("POST", context=context_of(message_traceparent),
                                              kind=SpanKind.CLIENT, attributes=attributes) as span:
        yield span, traceparent_of(span)


def set_answer(span, status_code: int | None, outcome: str, detail: str) -> None:
    """The attempt's answer on its span: the status code, and an error unless it was delivered."""
    if span is None:
        return
    span.set_attribute("ferry.webhook.outcome", outcome)
    if status_code is not None:
        span.set_attribute("http.response.status_code", status_code)
    if outcome != "delivered":
        span.set_attribute("error.type", str(status_code) if status_code is not None else "no_answer")
        span.set_status(Status(StatusCode.ERROR, detail))
