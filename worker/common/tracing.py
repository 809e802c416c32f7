"""OpenTelemetry traces of every Ferry process, configured by the standard `OTEL_*` variables.

One job is one trace: the API's request span, its enqueue, the worker's queue wait, attempt and
phases, the webhook relay's hand-off and each delivery attempt. Processes pass the context on as a
W3C `traceparent` string (in the job record, in a webhook message), so this module is all they
share of OpenTelemetry.

Tracing is on only where `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is
set (and neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`): `tracing_from_env`
then returns a `Tracing`, else None, and callers skip every span with one `is None` test; no SDK
is set up. Spans leave through the SDK's batch processor and the OTLP/HTTP exporter: a collector
that is down costs a full queue of dropped spans, never a job's time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import _KNOWN_SAMPLERS, Sampler
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["QUEUE_SYSTEM", "Link", "Span", "SpanKind", "Status", "StatusCode", "Tracing", "TracingConfigError",
           "context_of", "current_ids", "ns", "span_context_of", "traceparent_of", "tracing_from_env"]

log = logging.getLogger("ferry.tracing")

# messaging.system of the job queue's spans: it is a Redis stream (the attribute is open to values beyond its list)
QUEUE_SYSTEM = "redis"
_PROPAGATOR = TraceContextTextMapPropagator()
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
_SHUTDOWN_WAIT_S = 3.0  # longest a process's exit waits for its last spans (the collector may be down)


class TracingConfigError(ValueError):
    """An `OTEL_*` variable Ferry cannot trace with; the message names it."""


class Tracing:
    """The process's tracer provider, its tracer, and the span processor (the batch processor in
    front of the OTLP/HTTP exporter) that every span ends in."""

    def __init__(self, provider: TracerProvider, processor: SpanProcessor) -> None:
        self.provider = provider
        self.processor = processor
        self.tracer: Tracer = provider.get_tracer("ferry")
        provider.add_span_processor(processor)

    def finished_child(self, parent: Span, name: str, start_ns: int, end_ns: int,
                       attributes: Mapping[str, Any] | None = None) -> None:
        """A child of the recording span `parent` that is over already (a phase whose times are known):
        handed to the processor as a finished span, without a live span's sampler call, attribute
        bounds and locks. Sampled with its parent, as every child of a parent-based sampler is."""
        context = parent.get_span_context()
        if not context.trace_flags.sampled:
            return
        own = SpanContext(context.trace_id, self.provider.id_generator.generate_span_id(), False, context.trace_flags,
                          context.trace_state)
        self.processor.on_end(ReadableSpan(name, own, context, parent.resource, attributes,
                                           instrumentation_scope=parent.instrumentation_scope,
                                           start_time=start_ns, end_time=max(start_ns, end_ns)))

    def shutdown(self) -> None:
        """Send what is queued, waiting at most a few seconds (a collector that is down holds no exit)."""
        closing = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        closing.start()
        closing.join(_SHUTDOWN_WAIT_S)


def tracing_from_env(service_name: str, environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """The process's tracing as `OTEL_*` configures it, None when off. `service_name` is the
    default of `OTEL_SERVICE_NAME`. Raises TracingConfigError on a variable it cannot use."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter == "none":
        return None
    endpoint_var = next((name for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
                         if environ.get(name, "").strip()), None)
    if endpoint_var is None:
        return None
    sampler = _check(environ, endpoint_var, exporter)
    # Imported only when on: the exporter pulls in protobuf and requests.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = environ[endpoint_var].strip()
    if endpoint_var == "OTEL_EXPORTER_OTLP_ENDPOINT":  # the base URL of every signal (the spec's rule)
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource, sampler=sampler)
    # Headers, timeout, compression, certificates and the batch processor's limits: the SDK reads OTEL_*.
    tracing = Tracing(provider, BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    # With the collector down the queue fills and every span is dropped: the SDK builds a "Queue full"
    # record per span (10-15 us, on the thread ending the span: the API's event loop) only to filter
    # it out as a duplicate. The exporter's own warnings still say the collector is unreachable.
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
    log.info("tracing to %s", endpoint)
    return tracing


def _check(environ: Mapping[str, str], endpoint_var: str, exporter: str) -> Sampler:
    """The sampler the variables ask for, after checking those the SDK would only warn about (and
    then trace differently than asked)."""
    if exporter != "otlp":
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: Ferry exports traces with 'otlp' only "
                                 "(or 'none')")
    url = urlsplit(environ[endpoint_var].strip())
    if url.scheme not in ("http", "https") or not url.hostname:
        raise TracingConfigError(f"{endpoint_var}={environ[endpoint_var]!r} is not an http(s):// URL")
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(name, "").strip()
        if protocol and protocol != "http/protobuf":
            raise TracingConfigError(f"{name}={protocol!r}: Ferry exports OTLP over HTTP ('http/protobuf') only")
    sampler = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler not in _KNOWN_SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={sampler!r} is not one of {sorted(_KNOWN_SAMPLERS)}")
    if sampler not in _RATIO_SAMPLERS:
        return _KNOWN_SAMPLERS[sampler]
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a ratio between 0 and 1")
    return _KNOWN_SAMPLERS[sampler](ratio)


def ns(unix_s: float) -> int:
    """Unix seconds (what job records and `time.time()` hold) as a span's nanoseconds."""
    return int(unix_s * 1e9)


def context_of(traceparent: str | None) -> Context | None:
    """The context a W3C `traceparent` carries, to start child spans in; None without a valid one."""
    if not traceparent:
        return None
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def span_context_of(traceparent: str | None) -> SpanContext | None:
    """The span a `traceparent` names (to link to), None without a valid one."""
    context = context_of(traceparent)
    return None if context is None else trace.get_current_span(context).get_span_context()


def traceparent_of(span: Span) -> str | None:
    """`span`'s W3C `traceparent`, how its children in other processes find it; None for an invalid span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(trace)s"


class TraceIdsInText(logging.Filter):
    """For a text log (`TEXT_LOG_FORMAT`): a line logged inside a span ends with its
    ` trace_id=... span_id=...`, any other with nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = current_ids()
        record.trace = "" if ids is None else f" trace_id={ids[0]} span_id={ids[1]}"
        return True


def log_as_text(level: int | str) -> None:
    """`logging.basicConfig` for a process logging text, its lines inside spans ending with their ids."""
    logging.basicConfig(level=level, format=TEXT_LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIdsInText())


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the span current in this thread or task, None outside one."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")
