"""A job's attempt on this worker as spans of the job's trace, made from timestamps it already has.

The engine thread is the latency-critical one, so it makes no span. The intake opens an attempt's
span once the job started (its start and the intake's times are known then) and the job carries
it; at the job's end the engine thread copies the times and counts it already has into an
`AttemptTrace` (a few fields) that rides on the job's `Finish`; once the publisher has written it,
`JobTracer.ended` adds the phases and ends the attempt, on the publisher's thread. Every span gets
explicit start and end times. Under the API's enqueue span (the job record's `traceparent`; a job
without one starts a trace of its own):

    queue wait        created_at -> started_at, from the job record (sent at the first start:
                      it survives a worker that dies with the job)
    process {model}   CONSUMER: queue entry read -> terminal write written; a resumed attempt
                      (attempt > 1, after a worker died or handed it back) links to the enqueue.
                      An attempt whose worker died is never sent (a span is sent when it ends)
      intake          entry read -> started and prompt rendered (worker.serve.job_starts)
      admission       handed to the engine -> first scheduled
      prefill         first scheduled -> first token (prompt and cached tokens)
      decode          first token -> end (tokens, steps)
      publish         the terminal write's round trip

Attribute names follow OpenTelemetry's messaging and GenAI semantic conventions; Ferry's own
are under `ferry.`.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from ferry.worker.common.tracing import (
    Link,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracing,
    context_of,
    ns,
    span_context_of,
)

MESSAGING_SYSTEM = "redis"


@dataclass(slots=True)
class AttemptTrace:
    """One attempt's end: its open span and the times (unix seconds) and counts the engine thread had."""

    span: Span  # the attempt's, opened by `JobTracer.started`
    job_id: str
    ready_at: float  # started and rendered: handed to the engine
    admitted_at: float | None  # entered the engine (None: it never did)
    first_scheduled_at: float | None  # the engine first computed its tokens, this attempt
    first_token_at: float | None  # its first token of this attempt
    finished_at: float  # its terminal event
    state: str  # the terminal state
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served
    output_tokens: int  # tokens generated in all, earlier attempts included
    steps: int  # engine steps that gave it tokens, this attempt
    finish_reason: str | None = None


class JobTracer:
    """Makes the spans of attempts on one worker (serving `model` as `worker_id`)."""

    def __init__(self, tracing: Tracing, model: str, worker_id: str) -> None:
        self.tracer = tracing.tracer
        self.model = model
        self.worker_id = worker_id

    def started(self, job_id: str, traceparent: str | None, attempt: int, operation: str, created_at: float,
                started_at: float, picked_at: float, ready_at: float, resumed_tokens: int) -> Span:
        """A job this worker started: its queue wait (first attempt), its intake, and its attempt's
        span, open (`ended` ends it). `operation`: gen_ai.operation.name, "chat" or "text_completion"."""
        parent = context_of(traceparent)
        common = {"ferry.job.id": job_id, "messaging.destination.name": self.model}
        if attempt == 1:
            self._span("queue wait", parent, created_at, started_at, common)
        attributes = common | {
            "messaging.system": MESSAGING_SYSTEM, "messaging.operation.type": "process",
            "messaging.message.id": job_id, "ferry.job.attempt": attempt, "ferry.worker.id": self.worker_id,
            "gen_ai.operation.name": operation, "gen_ai.request.model": self.model,
        }
        links = []
        if attempt > 1:
            attributes |= {"ferry.job.resumed": True, "ferry.job.resumed_tokens": resumed_tokens}
            enqueued = span_context_of(traceparent)
            if enqueued is not None:
                links.append(Link(enqueued, {"ferry.link": "resumed after an earlier attempt"}))
        span = self.tracer.start_span(f"process {self.model}", context=parent, kind=SpanKind.CONSUMER,
                                      attributes=attributes, links=links, start_time=ns(picked_at))
        self._span("intake", trace.set_span_in_context(span), picked_at, ready_at, common)
        return span

    def ended(self, job: AttemptTrace, published_at: float, written_at: float) -> None:
        """The attempt's phases and its end; `published_at` -> `written_at`: its terminal write's round trip."""
        attempt, common = job.span, {"ferry.job.id": job.job_id}
        attempt.set_attributes({
            "ferry.job.state": job.state, "gen_ai.usage.input_tokens": job.prompt_tokens,
            "gen_ai.usage.output_tokens": job.output_tokens, "gen_ai.usage.cache_read.input_tokens": job.cached_tokens,
        })
        if job.finish_reason is not None:
            attempt.set_attribute("gen_ai.response.finish_reasons", [job.finish_reason])
        if job.state == "failed":
            attempt.set_status(Status(StatusCode.ERROR))
        inside = trace.set_span_in_context(attempt)
        if job.admitted_at is not None:
            self._span("admission", inside, job.ready_at, job.first_scheduled_at or job.finished_at, common)
        if job.first_scheduled_at is not None:
            self._span("prefill", inside, job.first_scheduled_at, job.first_token_at or job.finished_at, common | {
                "gen_ai.usage.input_tokens": job.prompt_tokens,
                "gen_ai.usage.cache_read.input_tokens": job.cached_tokens})
        if job.first_token_at is not None:
            self._span("decode", inside, job.first_token_at, job.finished_at, common | {
                "gen_ai.usage.output_tokens": job.output_tokens, "ferry.decode.steps": job.steps})
        self._span("publish", inside, published_at, written_at, common)
        attempt.end(end_time=ns(written_at))

    def _span(self, name: str, context, start: float, end: float, attributes: dict) -> None:
        span = self.tracer.start_span(name, context=context, attributes=attributes, start_time=ns(start))
        span.end(end_time=ns(max(start, end)))
