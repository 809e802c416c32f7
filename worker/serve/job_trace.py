"""A job's attempt on this worker as spans of the job's trace, made from timestamps it already has.

No thread a job waits on makes a span. The intake, once a job started, hands `started` its times
(an `AttemptStart`: the record's, the pick's, the hand-over's); the engine thread, at the job's
end, copies the times and counts it already has into an `AttemptTrace` that rides on the job's
`Finish`, and the publisher hands it over once written. `JobTracer`'s own thread turns both into
spans with explicit start and end times. Under the API's enqueue span (the job record's
`traceparent`; a job without one starts a trace of its own):

    queue wait        created_at -> started_at, from the job record (made at the first start: once
                      sent, within OTEL_BSP_SCHEDULE_DELAY, it survives a worker that dies with the job)
    process {model}   CONSUMER: queue entry read -> terminal write written; a resumed attempt
                      (attempt > 1, after a worker died or handed it back) links to the enqueue.
                      An attempt whose worker died is never sent (a span is sent when it ends), nor
                      one handed back by a drain (`forget`: its engine times went with the abort)
      intake          entry read -> started and prompt rendered (worker.serve.job_starts)
      admission       handed to the engine -> first scheduled
      prefill         first scheduled -> first token (prompt and cached tokens)
      decode          first token -> end (tokens, steps, preemptions, speculative proposals and acceptances)
      publish         the terminal write's round trip

Attribute names follow OpenTelemetry's messaging and GenAI semantic conventions; Ferry's own
are under `ferry.`.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from ferry.worker.common.tracing import (
    QUEUE_SYSTEM,
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

log = logging.getLogger("ferry.worker.tracing")

MAX_OPEN_ATTEMPTS = 100_000  # attempts whose end was never seen (lost to another worker) are dropped past this


@dataclass(slots=True)
class AttemptStart:
    """A job this worker started: what its first spans need (unix seconds)."""

    job_id: str
    traceparent: str | None  # the job record's: the API's enqueue span
    attempt: int  # deliveries that started running, this one included
    operation: str  # gen_ai.operation.name: "chat" or "text_completion"
    created_at: float  # the API accepted the job
    started_at: float  # it first started (on any worker): the end of its queue wait
    picked_at: float  # this worker read its queue entry
    ready_at: float  # started and rendered: handed to the engine
    resumed_tokens: int  # tokens earlier attempts streamed


@dataclass(slots=True)
class AttemptTrace:
    """One attempt's end: the times (unix seconds) and counts the engine thread had."""

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
    preemptions: int = 0  # times the engine freed its KV for another request's, this attempt
    draft_tokens: int = 0  # speculative proposals verified for it, this attempt (0: no speculation)
    accepted_tokens: int = 0  # of those, the ones accepted


@dataclass(slots=True)
class _Ended:
    job: AttemptTrace
    published_at: float  # its terminal write's round trip
    written_at: float


class JobTracer:
    """Makes the spans of attempts on one worker (serving `model` as `worker_id`), on a thread of its own."""

    def __init__(self, tracing: Tracing, model: str, worker_id: str) -> None:
        self.tracing = tracing
        self.tracer = tracing.tracer
        self.model = model
        self.worker_id = worker_id
        self._inbox: queue.SimpleQueue[AttemptStart | _Ended | str | None] = queue.SimpleQueue()
        self._open: dict[str, Span] = {}  # job id -> its attempt's span, until the attempt ends here
        self.thread = threading.Thread(target=self._run, name="tracing", daemon=True)
        self.thread.start()

    def started(self, job: AttemptStart) -> None:
        """Its queue wait (first attempt), its intake and its attempt's span, open until `ended`."""
        self._inbox.put(job)

    def ended(self, job: AttemptTrace, published_at: float, written_at: float) -> None:
        """Its phases and its attempt's end."""
        self._inbox.put(_Ended(job, published_at, written_at))

    def forget(self, job_id: str) -> None:
        """The job left this worker without an end (handed back, or lost to another worker)."""
        self._inbox.put(job_id)

    def close(self, timeout_s: float = 2.0) -> None:
        """Make the spans handed over so far (the process is about to flush and exit)."""
        self._inbox.put(None)
        self.thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._inbox.get()) is not None:
            try:
                if isinstance(item, AttemptStart):
                    self._started(item)
                elif isinstance(item, _Ended):
                    self._ended(item)
                else:
                    self._open.pop(item, None)
            except Exception:  # the SDK, or a malformed context in a record: the job stands, its spans do not
                log.exception("job spans not made")

    def _started(self, job: AttemptStart) -> None:
        parent = context_of(job.traceparent)
        # The job's id is messaging.message.id (each attribute costs 2-3 us to make and as much to export).
        if job.attempt == 1:  # a span of the sampler's own (its parent is the API's enqueue, in another process)
            self.tracer.start_span("queue wait", context=parent, attributes={"messaging.message.id": job.job_id},
                                   start_time=ns(job.created_at)).end(end_time=ns(max(job.created_at, job.started_at)))
        attributes = {
            "messaging.system": QUEUE_SYSTEM, "messaging.operation.type": "process",
            "messaging.destination.name": self.model, "messaging.message.id": job.job_id,
            "ferry.job.attempt": job.attempt, "ferry.worker.id": self.worker_id,
            "gen_ai.operation.name": job.operation, "gen_ai.request.model": self.model,
        }
        links = []
        if job.attempt > 1:
            attributes |= {"ferry.job.resumed": True, "ferry.job.resumed_tokens": job.resumed_tokens}
            enqueued = span_context_of(job.traceparent)
            if enqueued is not None:
                links.append(Link(enqueued, {"ferry.link": "resumed after an earlier attempt"}))
        span = self.tracer.start_span(f"process {self.model}", context=parent, kind=SpanKind.CONSUMER,
                                      attributes=attributes, links=links, start_time=ns(job.picked_at))
        self._phase(span, "intake", job.picked_at, job.ready_at)
        if len(self._open) >= MAX_OPEN_ATTEMPTS:
            self._open.pop(next(iter(self._open)))
        self._open[job.job_id] = span

    def _ended(self, ended: _Ended) -> None:
        job = ended.job
        attempt = self._open.pop(job.job_id, None)
        if attempt is None:
            return
        attempt.set_attributes({
            "ferry.job.state": job.state, "gen_ai.usage.input_tokens": job.prompt_tokens,
            "gen_ai.usage.output_tokens": job.output_tokens, "gen_ai.usage.cache_read.input_tokens": job.cached_tokens,
        })
        if job.finish_reason is not None:
            attempt.set_attribute("gen_ai.response.finish_reasons", [job.finish_reason])
        if job.state == "failed":
            attempt.set_status(Status(StatusCode.ERROR))
        if job.admitted_at is not None:
            self._phase(attempt, "admission", job.ready_at, job.first_scheduled_at or job.finished_at)
        if job.first_scheduled_at is not None:
            self._phase(attempt, "prefill", job.first_scheduled_at, job.first_token_at or job.finished_at, {
                "gen_ai.usage.input_tokens": job.prompt_tokens,
                "gen_ai.usage.cache_read.input_tokens": job.cached_tokens})
        if job.first_token_at is not None:
            decode = {"gen_ai.usage.output_tokens": job.output_tokens, "ferry.decode.steps": job.steps,
                      "ferry.decode.preemptions": job.preemptions}
            if job.draft_tokens:
                decode |= {"ferry.spec.draft_tokens": job.draft_tokens,
                           "ferry.spec.accepted_tokens": job.accepted_tokens}
            self._phase(attempt, "decode", job.first_token_at, job.finished_at, decode)
        self._phase(attempt, "publish", ended.published_at, ended.written_at)
        attempt.end(end_time=ns(ended.written_at))

    def _phase(self, attempt: Span, name: str, start: float, end: float, attributes: dict | None = None) -> None:
        """A phase of `attempt`, over already (the job's id is on the attempt)."""
        self.tracing.finished_child(attempt, name, ns(start), ns(end), attributes)
