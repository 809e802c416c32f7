"""The API's part of a job's trace: a server span per HTTP request, a producer span per enqueue.

The outermost middleware (`api.main.RequestMetricsMiddleware`) opens a request's span, continuing
the caller's W3C `traceparent` (or starting a trace), and holds it current while the app answers,
so whatever the request enqueues is its child. `enqueue_span` wraps one enqueue; its `traceparent`
goes into the job record, where the worker goes on from it. Attribute names follow OpenTelemetry's
HTTP and messaging semantic conventions. Only where tracing is on (`worker.common.tracing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ferry.worker.common.tracing import QUEUE_SYSTEM, Tracing, context_of, traceparent_of

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = (b"traceparent", b"tracestate")


def start_request_span(tracing: Tracing, scope) -> Span:
    """An HTTP request's SERVER span, child of the caller's `traceparent` when it sent one."""
    carrier = {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in _TRACE_HEADERS}
    attributes = {"http.request.method": scope["method"], "url.path": scope["path"], "url.scheme": scope["scheme"],
                  "network.protocol.version": scope.get("http_version", "1.1")}
    if scope.get("client"):
        attributes["client.address"] = scope["client"][0]
    return tracing.tracer.start_span(scope["method"], context=_PROPAGATOR.extract(carrier), kind=SpanKind.SERVER,
                                     attributes=attributes)


def in_span(span: Span | None) -> AbstractContextManager:
    """`span` current while the app answers (what it enqueues is its child); nothing without one."""
    return nullcontext() if span is None else trace.use_span(span, record_exception=True,
                                                             set_status_on_exception=True)


def end_request_span(span: Span, scope, status: int) -> None:
    """The answer on the request's span (named by its route template once routed), and its end."""
    route = scope.get("route")
    if route is not None:
        span.set_attribute("http.route", route.path)
        span.update_name(f"{scope['method']} {route.path}")
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


@contextmanager
def enqueue_span(tracing: Tracing | None, queue: str, job_id: str, parent: str | None = None) -> Iterator[str | None]:
    """A PRODUCER span around enqueueing `job_id` on `queue`, child of the span `parent` names (a
    batch's: its lines are enqueued later, by the driver) or else of the current one; yields its
    `traceparent` for the job record (None with tracing off)."""
    if tracing is None:
        yield None
        return
    attributes = {"messaging.system": QUEUE_SYSTEM, "messaging.operation.type": "send",
                  "messaging.operation.name": "enqueue", "messaging.destination.name": queue,
                  "messaging.message.id": job_id}
    with tracing.tracer.start_as_current_span(f"send {queue}", context=context_of(parent), kind=SpanKind.PRODUCER,
                                              attributes=attributes) as span:
        yield traceparent_of(span)


def current_traceparent(tracing: Tracing | None) -> str | None:
    """The current span's `traceparent` (a batch keeps its request's, for its lines), None with tracing off."""
    return None if tracing is None else traceparent_of(trace.get_current_span())
