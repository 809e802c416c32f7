"""A running job's output: the engine's deltas for it become its events, and its end one `Finish`.

`JobRun` is one job in the engine: what its client already has (seqs, tokens, text, from earlier
attempts too), the events not yet handed over, and the parsers that read a chat's text: its
reasoning (with a reasoning parser), then tool calls out of the rest. `JobOutput` turns the
engine's `RequestOutput`s of a run into writes (`worker.serve.writes`): its tokens as `Progress`,
its end as one `Finish` carrying the result.

A background job's tokens are handed over in groups of `BACKGROUND_FLUSH_TOKENS`, joined into one
token event (nobody is waiting on each; its stream still gets every token, in order, and a resumed
job loses at most that many tokens of work).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ferry.worker.engine import FinishReason, RequestOutput
from ferry.worker.engine.outputs import RequestMetrics
from ferry.worker.protocol import (
    CancelledEvent,
    CompletedEvent,
    ErrorCode,
    FailedEvent,
    JobRequest,
    TimedOutEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ferry.worker.protocol.logprobs import PromptLogprobs, RankedLogprob
from ferry.worker.protocol.tools import ChatDelta, NamedToolChoice
from ferry.worker.serve.errors import error_code
from ferry.worker.serve.job_starts import JobStart
from ferry.worker.serve.job_trace import AttemptTrace
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.reasoning_parsers import Reasoning, ReasoningParser, chained
from ferry.worker.serve.tool_parsers import PARSERS, NamedCall, RequiredCalls, ToolCallParser
from ferry.worker.serve.writes import Finish, HandBack, Progress, finish

BACKGROUND_FLUSH_TOKENS = 8  # a background job's tokens are handed over in groups of this many, as one event

TerminalEvent = CompletedEvent | FailedEvent | CancelledEvent | TimedOutEvent


@dataclass(slots=True)
class JobRun:
    """One job in the engine."""

    start: JobStart
    next_seq: int
    token_ids: list[int]  # every generated token, earlier attempts included
    text: list[str]  # every released text piece, earlier attempts included
    first_token_at: float | None  # unix time of the first token (of any attempt)
    tools: ToolCallParser | None  # a chat that may call tools: reads the calls out of its text
    reasoning: ReasoningParser | None = None  # a chat on a worker with a reasoning parser: reads its thinking
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    pending: list = field(default_factory=list)  # events not handed over yet (a background job's: a few steps')
    admitted_at: float | None = None  # unix time it entered the engine (None: it did not)
    engine_metrics: RequestMetrics | None = None  # the engine's times of this attempt, once it ended
    prompt_logprobs: PromptLogprobs | None = None  # asked for: the prompt's, from the engine's first output

    @classmethod
    def begin(cls, job: JobStart, tool_call_parser: str, reasoning: Reasoning | None = None) -> JobRun:
        """A job as it enters the engine: it goes on from what earlier attempts streamed."""
        streamed = job.streamed
        thinks = reasoning is not None and job.request.messages is not None
        run = cls(job, streamed.next_seq, list(streamed.token_ids), [streamed.text] if streamed.text else [],
                  job.first_token_at, output_parser(job.request, job.job_id, tool_call_parser),
                  reasoning.new_parser() if thinks else None)
        if streamed.text:
            run.parse(streamed.text)  # what the client has: the parsers go on from there
        return run

    def parse(self, text: str) -> ChatDelta | None:
        """What the chat's parsers release after `text`; None for an output that is not parsed."""
        if self.reasoning is not None:
            return chained(self.reasoning.feed(text), self.tools)
        return self.tools.feed(text) if self.tools is not None else None

    def parse_end(self) -> ChatDelta | None:
        """What the parsers held back, released at the output's end."""
        if self.reasoning is None:
            return self.tools.finish() if self.tools is not None else None
        out = chained(self.reasoning.finish(), self.tools)
        if self.tools is not None:
            rest = self.tools.finish()
            out.content += rest.content
            out.tool_calls += rest.tool_calls
        return out

    @property
    def job_id(self) -> str:
        return self.start.job_id

    @property
    def prompt_len(self) -> int:
        return len(self.start.prompt_ids)

    def seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


def output_parser(request: JobRequest, job_id: str, parser_name: str) -> ToolCallParser | None:
    """What reads this job's output for tool calls; None when it may not call any."""
    choice = request.effective_tool_choice
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return NamedCall(job_id, choice.function.name)
    if choice == "required":
        return RequiredCalls(job_id, request.parallel_tool_calls)
    return PARSERS[parser_name](job_id, request.parallel_tool_calls)


class JobOutput:
    """Builds the writes of runs on one worker (`worker_id`), observing the latency metrics."""

    def __init__(self, worker_id: str, metrics: WorkerMetrics) -> None:
        self.worker_id = worker_id
        self.metrics = metrics

    def on_output(self, run: JobRun, out: RequestOutput) -> Progress | Finish | None:
        """A step's delta for `run`: its events (None while a background job's group fills up), or
        its end."""
        request = run.start.request
        first_token_at = None
        if out.new_token_ids:
            if run.first_token_at is None:
                run.first_token_at = first_token_at = time.time()
                self.metrics.ttft.observe(first_token_at - request.created_at, self._exemplar(run))
            run.token_ids += out.new_token_ids
            run.text.append(out.new_text)
            run.cached_tokens = min(out.num_cached_tokens, run.prompt_len)
            prompt_logprobs = None
            if out.prompt_logprobs is not None:
                run.prompt_logprobs = _prompt_logprobs(out)
                # On the job's first token event only: a resumed attempt's client has them already.
                prompt_logprobs = run.prompt_logprobs if not run.start.streamed.token_ids else None
            _pend_token(run, TokenEvent(seq=run.seq(), text=out.new_text, token_ids=out.new_token_ids,
                                        logprobs=_logprobs(out, request.top_logprobs),
                                        chat=run.parse(out.new_text), prompt_logprobs=prompt_logprobs))
        elif out.new_text:  # held-back text released at the end
            run.text.append(out.new_text)
            run.pending.append(TokenEvent(seq=run.seq(), text=out.new_text, token_ids=[],
                                          chat=run.parse(out.new_text)))
        if out.finished:
            return self._finished(run, out)
        if run.start.background and first_token_at is None and _pending_tokens(run) < BACKGROUND_FLUSH_TOKENS:
            return None  # handed over with the next few, or with the job's end
        events, run.pending = run.pending, []
        if not events and first_token_at is None:
            return None
        return Progress(run.job_id, events, first_token_at, background=run.start.background)

    def _finished(self, run: JobRun, out: RequestOutput) -> Finish:
        run.engine_metrics = out.metrics
        rest = run.parse_end()
        if rest:
            run.pending.append(TokenEvent(seq=run.seq(), text="", token_ids=[], chat=rest))
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            return self.complete(run, out.finish_reason, out.stop_reason, out.metrics.inter_token_latencies)
        if out.error is not None:
            return self.fail(run, error_code(out.error), str(out.error))
        return self.fail(run, ErrorCode.ENGINE_ERROR, f"the engine ended the request ({out.finish_reason})")

    def complete(self, run: JobRun, finish_reason: str, stop_reason: str | int | None,
                 itls: list[float] = ()) -> Finish:
        for itl in itls:
            self.metrics.itl.observe(itl)
        calls = run.tools.calls if run.tools is not None else []
        # OpenAI's: "tool_calls" when the model chose to call (auto, required); a named function's call
        # was not the model's choice and ends with "stop".
        if calls and finish_reason == FinishReason.STOP and not isinstance(run.tools, NamedCall):
            finish_reason = "tool_calls"
        event = CompletedEvent(seq=run.seq(), finish_reason=str(finish_reason), stop_reason=stop_reason,
                               tool_calls=calls or None, usage=usage(run), timings=timings(run))
        return self.end(run, event)

    def fail(self, run: JobRun, code: str, message: str) -> Finish:
        return self.end(run, FailedEvent(seq=run.seq(), code=code, message=message))

    def end(self, run: JobRun, event: TerminalEvent) -> Finish:
        """The write that ends `run` with `event`, its pending events first and its result with it."""
        self.metrics.e2e.observe(event.ts - run.start.request.created_at, self._exemplar(run))
        output = {"text": "".join(run.text), "token_ids": run.token_ids, "usage": usage(run),
                  "timings": timings(run, event.ts)}
        if run.prompt_logprobs is not None:
            output["prompt_logprobs"] = run.prompt_logprobs
        if isinstance(event, CompletedEvent):
            output |= {"finish_reason": event.finish_reason, "stop_reason": event.stop_reason}
            if run.tools is not None:
                output |= {"content": run.tools.content, "tool_calls": run.tools.calls}
            if run.reasoning is not None:
                content = run.tools.content if run.tools is not None else run.reasoning.content
                output |= {"content": content, "reasoning_content": run.reasoning.reasoning}
        events, run.pending = run.pending, []
        write = finish(run.job_id, run.start.delivery, event, self.worker_id, output, events_before=events,
                       background=run.start.background)
        if run.start.traced:
            write.trace = attempt_trace(run, write.state, event.ts, output.get("finish_reason"))
        return write

    @staticmethod
    def _exemplar(run: JobRun) -> dict[str, str] | None:
        """A traced job's trace id, a latency's exemplar (OpenMetrics): a slow bucket links to its trace."""
        trace_id = run.start.trace_id
        return None if trace_id is None else {"trace_id": trace_id}

    @staticmethod
    def hand_back(run: JobRun) -> HandBack:
        """`run` back to the queue with what it streamed so far. These deliveries do not count
        against max_attempts: the worker left, the job did not fail."""
        events, run.pending = run.pending, []
        return HandBack(run.job_id, run.start.delivery, events, attempts=run.start.attempts - 1)


def attempt_trace(run: JobRun, state: str, finished_at: float, finish_reason: str | None) -> AttemptTrace:
    """`run`'s attempt for its spans (`worker.serve.job_trace`): the engine's monotonic times
    become unix times through the moment it entered the engine."""
    start, metrics = run.start, run.engine_metrics

    def unix(monotonic: float | None) -> float | None:
        if monotonic is None or metrics is None or run.admitted_at is None:
            return None
        return run.admitted_at + (monotonic - metrics.arrival_time)

    return AttemptTrace(
        job_id=run.job_id, ready_at=start.ready_at, admitted_at=run.admitted_at,
        first_scheduled_at=unix(metrics.first_scheduled_time) if metrics else None,
        first_token_at=unix(metrics.first_token_time) if metrics else None, finished_at=finished_at, state=state,
        prompt_tokens=run.prompt_len, cached_tokens=run.cached_tokens, output_tokens=len(run.token_ids),
        steps=len(metrics.token_times) if metrics else 0, finish_reason=finish_reason,
        preemptions=metrics.num_preemptions if metrics else 0, draft_tokens=metrics.num_draft_tokens if metrics else 0,
        accepted_tokens=metrics.num_accepted_tokens if metrics else 0)


def usage(run: JobRun) -> Usage:
    n = len(run.token_ids)
    return Usage(prompt_tokens=run.prompt_len, completion_tokens=n, total_tokens=run.prompt_len + n,
                 cached_tokens=run.cached_tokens)


def timings(run: JobRun, finished_at: float | None = None) -> Timings:
    created = run.start.request.created_at
    end = finished_at or time.time()
    first = run.first_token_at
    n = len(run.token_ids)
    return Timings(
        queue_s=run.start.started_at - created,
        ttft_s=None if first is None else first - created,
        tbt_s=(end - first) / (n - 1) if first is not None and n > 1 else None,
        total_s=end - created,
    )


def _pend_token(run: JobRun, event: TokenEvent) -> None:
    """Queue a step's token event; a background job's joins the one before it (one event per
    group: a stream entry, a message and a JSON encoding instead of one per token), and gives its
    seq back, so seqs stay gapless. Parsed chat deltas are not joined (each step's is parsed on
    its own)."""
    last = run.pending[-1] if run.pending else None
    joinable = (run.start.background and isinstance(last, TokenEvent) and last.chat is None and event.chat is None
                and (last.logprobs is None) == (event.logprobs is None))
    if not joinable:
        run.pending.append(event)
        return
    last.text += event.text
    last.token_ids = last.token_ids + event.token_ids
    if event.logprobs is not None:
        last.logprobs = last.logprobs + event.logprobs
    run.next_seq -= 1  # the seq `event` took: nobody has seen it


def _pending_tokens(run: JobRun) -> int:
    return sum(len(e.token_ids) for e in run.pending if isinstance(e, TokenEvent))


def _prompt_logprobs(out: RequestOutput) -> PromptLogprobs:
    def ranked(position) -> dict[int, RankedLogprob]:
        return {tid: RankedLogprob(logprob=lp.logprob, rank=lp.rank, token=lp.decoded_token)
                for tid, lp in position.items()}

    return [None if position is None else ranked(position) for position in out.prompt_logprobs]


def _logprobs(out: RequestOutput, top_n: int) -> list[TokenLogprob] | None:
    if out.new_logprobs is None:
        return None
    result = []
    for token, position in zip(out.new_token_ids, out.new_logprobs, strict=True):
        sampled = position[token]
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top_n]
        result.append(TokenLogprob(
            token_id=token, token=sampled.decoded_token, logprob=sampled.logprob,
            top=[TopLogprob(token_id=t, token=lp.decoded_token, logprob=lp.logprob) for t, lp in ranked],
        ))
    return result
