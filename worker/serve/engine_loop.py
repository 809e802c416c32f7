"""The engine thread: admits started jobs, steps the engine, turns its outputs into writes.

Only this thread touches the engine. Other threads talk to it through `start`, `settle`, `abort`
and `hand_back_all`, which only queue a command (`Start`, `Abort`, `HandBackAll`); the thread
takes commands between steps and hands each step's writes (`worker.serve.writes`) to the
publisher without waiting for Redis.

Arrivals: the intake `announce`s jobs it has read and is still preparing, then `start`s them in
chunks. While announced jobs are on their way and the requests already here would not fill a
step, the thread waits for them (briefly) rather than step half-empty; once a step is full it
goes at once, and the rest are admitted during that step (a burst's first jobs do not wait for
the whole burst to be prepared).

A re-delivered job is admitted with the tokens and text the client already has as the engine
request's `Resume`: the engine continues exactly where the first attempt stopped and releases
only new text.

Background jobs (the engine's `background_priority` lane: the Batch API's lines) give way to the
others on this side of the engine too, as the scheduler does inside it: jobs of theirs that
arrive with foreground ones are admitted after the next step (their prompts could not join a
step that prefills a foreground one, and tokenizing them would hold it back); their tokens are
handed over every `_BACKGROUND_FLUSH_TOKENS` tokens instead of every step, joined into one token
event (nobody is waiting on each; their stream still gets every token, in order, and a resumed
job loses at most that many tokens of work); and the publisher writes them after the foreground
jobs' writes. While live traffic is present, background work is also paced (`BackgroundPacing`):
a step of background work alone is followed by a pause, so the batch does not hold the cores,
the GIL and the engine all the time, and a live job's whole path (the API, Redis, the intake,
this thread, the publisher) finds them free when it arrives. A live arrival ends the pause.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ferry.worker.engine import (
    Engine,
    EngineStats,
    InvalidSamplingParams,
    InvalidStructuredOutputError,
    RankFailedError,
    RequestOutput,
    Resume,
    SamplingParams,
)
from ferry.worker.protocol import (
    ENGINE_PRIORITY,
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
from ferry.worker.serve.chat import chat_messages, output_parser, template_knows_tools
from ferry.worker.serve.intake import JobStart
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.tool_parsers import DEFAULT_PARSER, PARSERS, NamedCall, ToolCallParser
from ferry.worker.serve.writes import Finish, HandBack, JobWrite, Progress, finish

log = logging.getLogger("ferry.worker.engine")

_STATS_INTERVAL_S = 0.25  # how often the engine's stats are copied out for /metrics and the heartbeat
_ARRIVAL_WAIT_S = 0.02  # longest wait for announced jobs before stepping without them
_BACKGROUND_FLUSH_TOKENS = 8  # a background job's tokens are handed over in groups of this many, as one event
_IDLE_POLL_S = 0.05  # with nothing to run: how often the loop looks at its timers


@dataclass(frozen=True, slots=True)
class BackgroundPacing:
    """How background work gives way to live traffic beyond the scheduler's rules.

    While live traffic is present (a foreground job ran or was admitted within `window_s`), each
    step that ran background work alone is followed by a pause of `ratio` times that step's
    length (at most `max_pause_s`: one slow step, a long batch prefill, never holds the batch
    back for long): the batch lane then runs at most 1 / (1 + ratio) of the time. A foreground
    arrival ends the pause at once. And at most `admit_per_step` background jobs are admitted
    between two steps (the rest wait a step): admitting one renders its chat template and
    tokenizes it on this thread, and its prompt joins the next step's prefill, so a burst of 64
    batch lines would otherwise hold a live job back by both. With no live traffic the batch
    runs flat out; `ratio` 0 turns pacing off."""

    ratio: float = 3.0
    window_s: float = 2.0
    max_pause_s: float = 0.1
    admit_per_step: int = 8


# --- commands from other threads -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    jobs: list[JobStart]  # admitted together: they share their first step
    arrived: int  # announced jobs now accounted for (started here or settled otherwise)


@dataclass(frozen=True, slots=True)
class Abort:
    job_id: str
    lost: bool  # another worker has the job: stop and write nothing; else it was cancelled


@dataclass(frozen=True, slots=True)
class HandBackAll:
    """Stop every job now and hand it back to the queue (a drain ran out of time)."""


Command = Start | Abort | HandBackAll


@dataclass(slots=True)
class _Run:
    """One job in the engine."""

    start: JobStart
    prompt_len: int  # the job's own prompt (not counting resumed tokens)
    next_seq: int
    token_ids: list[int]  # every generated token, earlier attempts included
    text: list[str]  # every released text piece, earlier attempts included
    first_token_at: float | None
    cached_tokens: int = 0
    pending: list = field(default_factory=list)  # events not handed over yet (a background job's: a few steps' tokens)
    tools: ToolCallParser | None = None  # a chat that may call tools: reads the calls out of its text
    background: bool = False  # in the engine's background lane (a batch's line): see the module docstring

    def seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


class EngineLoop:
    def __init__(self, engine: Engine, worker_id: str, metrics: WorkerMetrics, submit: Callable[[list[JobWrite]], None],
                 idle_task: Callable[[], None] | None = None, tool_call_parser: str = DEFAULT_PARSER,
                 pacing: BackgroundPacing = BackgroundPacing()) -> None:
        self.engine = engine
        self.pacing = pacing
        self.tool_call_parser = tool_call_parser  # worker.serve.tool_parsers.PARSERS: this model's call format
        self.worker_id = worker_id
        self.metrics = metrics
        self.submit = submit
        self.idle_task = (
            idle_task  # run between jobs only (a periodic snapshot): a running job's step never waits on it
        )
        self.runs: dict[str, _Run] = {}
        self.stats: EngineStats | None = None  # latest, replaced whole (read by other threads)
        self.stop = threading.Event()
        self.fatal: RankFailedError | None = None  # set once the engine can no longer step (the worker exits)
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._arriving = 0  # jobs announced by the intake and not yet started or settled
        self._deferred: list[JobStart] = []  # background jobs admitted after a step (see _take_commands)
        self._arriving_lock = threading.Lock()
        self._stats_at = 0.0
        self._foreground_at = float("-inf")  # monotonic time a foreground job last ran or was admitted
        self._last_step_s = 0.0  # how long the last engine step took (the pause is sized by it)
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- commands (any thread) -----------------------------------------------------------------

    def announce(self, count: int) -> None:
        """`count` jobs were read and are being prepared: each later `start(..., arrived=)` or
        `settle` accounts for some of them."""
        with self._arriving_lock:
            self._arriving += count

    @property
    def arriving(self) -> int:
        """Jobs announced and not yet started or settled (the worker is not idle while any are)."""
        return self._arriving

    def start(self, jobs: list[JobStart], arrived: int = 0) -> None:
        """Admit `jobs` together; `arrived` announced jobs are now accounted for."""
        self._inbox.put(Start(jobs, arrived))

    def settle(self, arrived: int) -> None:
        """`arrived` announced jobs will not come (the intake gave up on them)."""
        self._inbox.put(Start([], arrived))

    def abort(self, job_id: str, lost: bool = False) -> None:
        """Stop a job: cancelled (write the cancelled event), or `lost` to another worker (write nothing)."""
        self._inbox.put(Abort(job_id, lost))

    def hand_back_all(self) -> None:
        self._inbox.put(HandBackAll())

    # --- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stop.is_set():
            writes: list[JobWrite] = self._admit_deferred()
            if not self.engine.has_unfinished_requests() and not self._deferred:
                self._take_commands(writes, _IDLE_POLL_S)
            elif (pause_s := self._background_pause_s()) > 0:
                self._pause_background(writes, pause_s)
            else:
                self._take_commands(writes, None)
            self._await_arrivals(writes)
            self._expire(writes)
            if self.engine.has_unfinished_requests():
                started = time.monotonic()
                writes += self._step()
                self._last_step_s = time.monotonic() - started
            elif self.idle_task is not None and self.fatal is None:
                self.idle_task()
            now = time.monotonic()
            # A job's end refreshes them before its terminal write goes out: whoever sees the job
            # finished and then scrapes /metrics sees its tokens counted.
            if now - self._stats_at > _STATS_INTERVAL_S or any(isinstance(w, Finish) for w in writes):
                self._stats_at = now
                self.stats = self.engine.stats()
                self.metrics.set_engine_stats(self.stats)
            if writes:
                self.submit(writes)

    def _await_arrivals(self, writes: list[JobWrite]) -> None:
        """Announced jobs would join the next step: take them first, unless the step is full anyway."""
        deadline = time.monotonic() + _ARRIVAL_WAIT_S
        while self._arriving > 0 and not self.engine.next_step_is_full():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._take_commands(writes, remaining)

    def _pacing(self) -> bool:
        """Whether background work is paced now: on, and live traffic present."""
        return self.pacing.ratio > 0 and time.monotonic() - self._foreground_at <= self.pacing.window_s

    def _background_pause_s(self) -> float:
        """How long to hold background work back before the next step (`BackgroundPacing`): 0
        unless live traffic is present and every job here is a background one."""
        if any(not run.background for run in self.runs.values()):
            self._foreground_at = time.monotonic()  # live work steps now (and the batch's decodes ride along)
            return 0.0
        if not self._pacing():
            return 0.0
        return min(self.pacing.ratio * self._last_step_s, self.pacing.max_pause_s)

    def _pause_background(self, writes: list[JobWrite], pause_s: float) -> None:
        """Take commands for `pause_s` instead of stepping; a foreground job, a hand back or a
        command with something to write (a cancel) ends the pause."""
        started = time.monotonic()
        deadline = started + pause_s
        written = len(writes)
        while (remaining := deadline - time.monotonic()) > 0 and not self.stop.is_set():
            if self._take_commands(writes, remaining) or len(writes) > written:
                break
        self.metrics.background_paused.inc(time.monotonic() - started)

    def _take_commands(self, writes: list[JobWrite], wait_s: float | None) -> bool:
        """Run every queued command; wait up to `wait_s` for the first (None: do not wait).
        True when one needs the next step at once: a foreground job was admitted, or every job
        was handed back."""
        try:
            command = self._inbox.get(timeout=wait_s) if wait_s is not None else self._inbox.get_nowait()
        except queue.Empty:
            return False
        foreground = False  # a foreground job was admitted in this round: background ones wait a step
        handed_back = False
        # Background jobs admitted in this round while they are paced (BackgroundPacing.admit_per_step)
        room = self.pacing.admit_per_step if self._pacing() else None
        while True:
            if isinstance(command, Start):
                for job in command.jobs:
                    background = self._background(job)
                    if background and (foreground or self._deferred or room == 0):
                        self._deferred.append(job)
                        continue
                    if background and room is not None:
                        room -= 1
                    foreground |= not background
                    writes += self._admit(job)
                if command.arrived:
                    with self._arriving_lock:
                        self._arriving -= command.arrived
            elif isinstance(command, Abort):
                writes += self._admit_deferred(everyone=True)  # the job to stop may be among them
                writes += self._abort(command)
            else:
                writes += self._hand_back()
                handed_back = True
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return foreground or handed_back

    def _step(self) -> list[JobWrite]:
        try:
            outputs = self.engine.step()
        except RankFailedError as exc:  # a tensor-parallel rank is gone: no step can run; the jobs go back
            log.critical("tensor-parallel rank failed: handing every job back", extra={"error": str(exc)})
            self.fatal = exc
            return self._hand_back()
        except Exception as exc:  # the engine failed on this batch: fail its jobs, keep serving others
            log.exception("engine step failed")
            return [self._fail(job_id, ErrorCode.ENGINE_ERROR, f"engine error: {exc}") for job_id in list(self.runs)]
        writes = []
        for out in outputs:
            run = self.runs.get(out.request_id)
            if run is not None:  # None: an abort we already settled
                write = self._on_output(run, out)
                if write is not None:
                    writes.append(write)
        return writes

    # --- admitting ---------------------------------------------------------------------------------

    def _background(self, job: JobStart) -> bool:
        lane = self.engine.config.background_priority
        return lane is not None and ENGINE_PRIORITY[job.request.priority] >= lane

    def _admit_deferred(self, everyone: bool = False) -> list[JobWrite]:
        """Admit the deferred background jobs: all of them, or while paced `admit_per_step`
        (the rest after the next step)."""
        count = len(self._deferred) if everyone or not self._pacing() else self.pacing.admit_per_step
        writes: list[JobWrite] = []
        admitted, self._deferred = self._deferred[:count], self._deferred[count:]
        for job in admitted:
            writes += self._admit(job)
        return writes

    def _admit(self, job: JobStart) -> list[JobWrite]:
        req = job.request
        resumed = job.streamed.token_ids
        run = _Run(job, 0, job.streamed.next_seq, list(resumed), [job.streamed.text] if job.streamed.text else [],
                   job.first_token_at, background=self._background(job))
        self.runs[job.job_id] = run
        if not run.background:
            self._foreground_at = time.monotonic()
        try:
            prompt_ids = self._prompt_ids(req)
        except Exception as exc:  # tokenizer or chat-template errors (jinja raises its own types): bad input
            return [self._fail(job.job_id, ErrorCode.INVALID_PROMPT, f"{type(exc).__name__}: {exc}")]
        run.prompt_len = len(prompt_ids)
        run.tools = output_parser(req, job.job_id, self.tool_call_parser)
        if run.tools is not None and job.streamed.text:
            run.tools.feed(job.streamed.text)  # what the client has: the parser goes on from there
        if len(prompt_ids) >= self.engine.max_model_len:
            return [self._fail(job.job_id, ErrorCode.PROMPT_TOO_LONG,
                               f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.engine.max_model_len}")]
        reached = req.max_tokens is not None and len(resumed) >= req.max_tokens
        if resumed and (reached or len(prompt_ids) + len(resumed) >= self.engine.max_model_len):
            return [self._complete(run, "length", None, [])]  # the earlier attempt had reached its end
        try:
            params = SamplingParams(**req.sampling_kwargs())
        except InvalidStructuredOutputError as exc:
            return [self._fail(job.job_id, ErrorCode.INVALID_STRUCTURED_OUTPUT, str(exc))]
        except (ValueError, TypeError) as exc:
            return [self._fail(job.job_id, ErrorCode.INVALID_SAMPLING_PARAMS, str(exc))]
        resume = Resume(resumed, len(job.streamed.text)) if resumed else None
        try:
            self.engine.add_request(
                job.job_id, prompt_ids, params, priority=ENGINE_PRIORITY[req.priority], resume=resume
            )
        except InvalidSamplingParams as exc:
            return [self._fail(job.job_id, ErrorCode.INVALID_SAMPLING_PARAMS, str(exc))]
        except InvalidStructuredOutputError as exc:
            return [self._fail(job.job_id, ErrorCode.INVALID_STRUCTURED_OUTPUT, str(exc))]
        except ValueError as exc:
            return [self._fail(job.job_id, ErrorCode.INVALID_PROMPT, str(exc))]
        except Exception as exc:
            log.exception("engine refused a request", extra={"job_id": job.job_id})
            return [self._fail(job.job_id, ErrorCode.ENGINE_ERROR, f"{type(exc).__name__}: {exc}")]
        log.info("job admitted", extra={"job_id": job.job_id, "attempt": job.attempts, "prompt_tokens": len(prompt_ids),
                                        "resumed_tokens": len(resumed)})
        return []

    def _prompt_ids(self, req: JobRequest) -> list[int]:
        if req.messages is not None:
            native = template_knows_tools(self.engine.tokenizer)
            messages, tools = chat_messages(req, PARSERS[self.tool_call_parser], native)
            return self.engine.apply_chat_template(messages, tools=tools)
        if isinstance(req.prompt, str):
            return self.engine.encode(req.prompt)
        return list(req.prompt)

    # --- outputs -------------------------------------------------------------------------------------

    def _on_output(self, run: _Run, out: RequestOutput) -> JobWrite | None:
        job = run.start
        first_token_at = None
        if out.new_token_ids:
            if run.first_token_at is None:
                run.first_token_at = first_token_at = time.time()
                self.metrics.ttft.observe(first_token_at - job.request.created_at)
            run.token_ids += out.new_token_ids
            run.text.append(out.new_text)
            run.cached_tokens = min(out.num_cached_tokens, run.prompt_len)
            self._pend_token(run, TokenEvent(seq=run.seq(), text=out.new_text, token_ids=out.new_token_ids,
                                             logprobs=_logprobs(out, job.request.top_logprobs),
                                             chat=run.tools.feed(out.new_text) if run.tools else None))
        elif out.new_text:  # held-back text released at the end
            run.text.append(out.new_text)
            run.pending.append(TokenEvent(seq=run.seq(), text=out.new_text, token_ids=[],
                                          chat=run.tools.feed(out.new_text) if run.tools else None))
        if out.finished and run.tools is not None:
            rest = run.tools.finish()
            if rest:
                run.pending.append(TokenEvent(seq=run.seq(), text="", token_ids=[], chat=rest))
        if out.finished:
            if out.finish_reason in ("stop", "length"):
                return self._complete(run, out.finish_reason, out.stop_reason, out.metrics.inter_token_latencies)
            if isinstance(out.error, InvalidStructuredOutputError):  # its grammar did not compile
                return self._fail(job.job_id, ErrorCode.INVALID_STRUCTURED_OUTPUT, str(out.error))
            detail = f": {out.stop_reason}" if out.finish_reason == "error" else ""
            message = f"engine ended the request ({out.finish_reason}{detail})"
            return self._fail(job.job_id, ErrorCode.ENGINE_ERROR, message)
        if run.background and first_token_at is None and _pending_tokens(run) < _BACKGROUND_FLUSH_TOKENS:
            return None  # handed over with the next few, or with the job's end
        events, run.pending = run.pending, []
        if not events and first_token_at is None:
            return None
        return Progress(job.job_id, events, first_token_at, background=run.background)

    @staticmethod
    def _pend_token(run: _Run, event: TokenEvent) -> None:
        """Queue a step's token event; a background job's joins the one before it (one event per
        group: a stream entry, a message and a JSON encoding instead of one per token), and gives
        its seq back, so seqs stay gapless. Chat-with-tools deltas are not joined (each step's is
        parsed on its own)."""
        last = run.pending[-1] if run.pending else None
        joinable = (run.background and isinstance(last, TokenEvent) and last.chat is None and event.chat is None
                    and (last.logprobs is None) == (event.logprobs is None))
        if not joinable:
            run.pending.append(event)
            return
        last.text += event.text
        last.token_ids = last.token_ids + event.token_ids
        if event.logprobs is not None:
            last.logprobs = last.logprobs + event.logprobs
        run.next_seq -= 1  # the seq `event` took: nobody has seen it

    # --- endings --------------------------------------------------------------------------------------

    def _complete(self, run: _Run, finish_reason: str, stop_reason, itls: list[float]) -> Finish:
        for itl in itls:
            self.metrics.itl.observe(itl)
        calls = run.tools.calls if run.tools is not None else []
        # OpenAI's: "tool_calls" when the model chose to call (auto, required); a named function's call
        # was not the model's choice and ends with "stop".
        if calls and finish_reason == "stop" and not isinstance(run.tools, NamedCall):
            finish_reason = "tool_calls"
        event = CompletedEvent(
            seq=run.seq(),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            tool_calls=calls or None,
            usage=self._usage(run),
            timings=self._timings(run),
        )
        return self._end(run, event)

    def _fail(self, job_id: str, code: str, message: str) -> Finish:
        run = self.runs[job_id]
        log.warning("job failed", extra={"job_id": job_id, "code": code, "error": message})
        return self._end(run, FailedEvent(seq=run.seq(), code=code, message=message))

    def _end(self, run: _Run, event) -> Finish:
        job = run.start
        self.runs.pop(job.job_id, None)
        self.engine.abort(job.job_id)  # no-op (False) when the engine already finished it
        self.metrics.e2e.observe(event.ts - job.request.created_at)
        result = {
            "text": "".join(run.text),
            "token_ids": json.dumps(run.token_ids),
            "usage": self._usage(run).model_dump_json(),
            "timings": self._timings(run, event.ts).model_dump_json(),
        }
        if isinstance(event, CompletedEvent):
            result |= {"finish_reason": event.finish_reason, "stop_reason": json.dumps(event.stop_reason)}
            if run.tools is not None:
                result |= {"content": run.tools.content,
                           "tool_calls": json.dumps([c.model_dump() for c in run.tools.calls])}
        events, run.pending = run.pending, []
        write = finish(job.job_id, job.delivery, event, self.worker_id, result, events_before=events)
        write.background = run.background
        return write

    def _abort(self, command: Abort) -> list[JobWrite]:
        run = self.runs.get(command.job_id)
        if run is None:
            return []
        if command.lost:
            self.runs.pop(command.job_id)
            self.engine.abort(command.job_id)
            log.warning("job lost to another worker", extra={"job_id": command.job_id})
            return []
        return [self._end(run, CancelledEvent(seq=run.seq()))]

    def _expire(self, writes: list[JobWrite]) -> None:
        now = time.time()
        for job_id, run in list(self.runs.items()):
            if now > run.start.deadline:
                timeout = run.start.deadline - run.start.started_at
                writes.append(self._end(run, TimedOutEvent(seq=run.seq(), code=ErrorCode.EXECUTION_TIMEOUT,
                                                           message=f"ran longer than timeout_s={timeout:g}")))
                log.warning("job timed out", extra={"job_id": job_id})

    def _hand_back(self) -> list[JobWrite]:
        """Every job back to the queue: those running and the deferred ones (never admitted).
        These deliveries do not count against max_attempts: the worker left, the jobs did not fail."""
        writes: list[JobWrite] = []
        for job_id, run in list(self.runs.items()):
            self.runs.pop(job_id)
            self.engine.abort(job_id)
            events, run.pending = run.pending, []
            writes.append(HandBack(job_id, run.start.delivery, events, attempts=run.start.attempts - 1))
        deferred, self._deferred = self._deferred, []
        writes += [HandBack(job.job_id, job.delivery, [], attempts=job.attempts - 1) for job in deferred]
        return writes

    # --- result fields -------------------------------------------------------------------------------

    def _usage(self, run: _Run) -> Usage:
        n = len(run.token_ids)
        return Usage(prompt_tokens=run.prompt_len, completion_tokens=n, total_tokens=run.prompt_len + n,
                     cached_tokens=run.cached_tokens)

    def _timings(self, run: _Run, finished_at: float | None = None) -> Timings:
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


def _pending_tokens(run: _Run) -> int:
    return sum(len(e.token_ids) for e in run.pending if isinstance(e, TokenEvent))


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
