"""Deciding what each delivered queue entry becomes, and starting the jobs that run.

`prepare`, per delivered entry: read the job hash and its event stream in one round trip and
decide: skip (already terminal), fail (malformed envelope, unknown job, bad request, too many
deliveries -> `{p}:dlq`), cancel, time out (TTL passed before it ever started), or start. A start
is one atomic script (`running`, attempts + 1, `started` event on the first attempt) and carries
what was already generated, so the job resumes where the client left off. A started job's prompt
is rendered here too (chat template, tokenizer: `worker.serve.render`), off the engine thread;
a prompt the model cannot take fails the job (`invalid_prompt`). So is its LoRA adapter found
(`worker.serve.loras`): one this worker cannot serve fails the job (`lora_not_found`). A job whose
adapter this worker does not hold while a peer with room does goes to that peer instead of starting
(`worker.serve.lora_affinity`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis
from pydantic import ValidationError

from ferry.worker.engine import InvalidPromptError, LoRARequest
from ferry.worker.protocol import (
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    CancelledEvent,
    CompletedEvent,
    Envelope,
    ErrorCode,
    FailedEvent,
    JobRequest,
    JobState,
    Keys,
    StartedEvent,
    TimedOutEvent,
    Timings,
    TokenEvent,
    Usage,
    event_from_fields,
    event_json_tail,
    lua,
)
from ferry.worker.protocol.jobs import TERMINAL_STATES_ARG
from ferry.worker.serve.job_trace import AttemptStart, JobTracer
from ferry.worker.serve.lora_affinity import LoraAffinity
from ferry.worker.serve.loras import LoraResolver, LoraUnavailable
from ferry.worker.serve.render import PromptRenderer
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.writes import Delivery, Discard, Finish, JobWrite, finish

log = logging.getLogger("ferry.worker.intake")


@dataclass(slots=True)
class Streamed:
    """What the client already has of a re-delivered job (empty for a first delivery)."""

    token_ids: list[int]  # generated tokens already in the event stream
    text: str  # text already in the event stream
    next_seq: int  # seq of the next event


@dataclass(slots=True)
class JobStart:
    """A job this worker now runs: everything the engine thread needs."""

    job_id: str
    delivery: Delivery
    request: JobRequest
    prompt_ids: list[int]  # the prompt, rendered and tokenized (the engine thread admits token ids only)
    attempts: int  # deliveries that started running, this one included
    started_at: float  # unix time the job first started (on any worker)
    first_token_at: float | None  # unix time of its first token, if an earlier attempt had one
    deadline: float  # unix time its execution timeout runs out
    streamed: Streamed  # what earlier attempts already streamed
    traceparent: str | None = None  # the job record's W3C trace context (`worker.serve.job_trace`)
    picked_at: float = 0.0  # unix time this worker read its queue entry
    ready_at: float = 0.0  # unix time it was started and its prompt rendered: handed to the engine
    traced: bool = False  # tracing on: its end carries its times for spans (`worker.serve.job_trace`)
    lora: LoRARequest | None = None  # the adapter it runs with (`JobRequest.lora`, from the registry)

    @property
    def trace_id(self) -> str | None:
        """Its trace's id (tracing on), from the record's W3C `traceparent` ("00-<trace id>-<span id>-<flags>")."""
        return self.traceparent[3:35] if self.traced and self.traceparent else None

    @property
    def background(self) -> bool:
        """A background-lane job (a batch's line): it gives way to live jobs."""
        return self.request.priority.background


@dataclass(slots=True)
class _Candidate:
    delivery: Delivery
    job_id: str
    envelope_error: str | None  # why the envelope is malformed (its job id was still readable)


@dataclass(slots=True)
class _Decided:
    """A job to start: everything its `JobStart` holds but the prompt, rendered once it started."""

    candidate: _Candidate
    request: JobRequest
    attempts: int
    started_at: float
    first_token_at: float | None
    deadline: float
    streamed: Streamed
    traceparent: str | None
    picked_at: float


class JobStarter:
    def __init__(self, client: redis.Redis, keys: Keys, settings: WorkerSettings, worker_id: str,
                 renderer: PromptRenderer, tracer: JobTracer | None = None,
                 affinity: LoraAffinity | None = None) -> None:
        self.client = client
        self.affinity = affinity  # LoRA on: jobs go to a peer holding their adapter (None: every job starts here)
        self.loras = LoraResolver(client, keys, settings.served_model_name, settings.engine.enable_lora)
        self.tracer = tracer  # tracing on: a started job's queue wait and intake become spans
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.renderer = renderer
        self._start = lua.register(client, lua.START)

    def prepare(self, deliveries: list[Delivery]) -> tuple[list[JobStart], list[JobWrite]]:
        """Decide every delivery: jobs to start, and writes that settle the others (skip/fail/cancel/time out)."""
        writes: list[JobWrite] = []
        candidates: list[_Candidate] = []
        for d in deliveries:
            try:
                env = Envelope.from_fields(d.fields)
                candidates.append(_Candidate(d, env.job_id, None))
            except ValidationError as exc:
                reason = _validation_summary(exc)
                job_id = d.fields.get("job_id")
                log.warning("malformed envelope", extra={"entry_id": d.entry_id, "job_id": job_id, "error": reason})
                if isinstance(job_id, str) and job_id:
                    candidates.append(_Candidate(d, job_id, reason))
                else:
                    writes.append(self._dead_letter(None, d, ErrorCode.MALFORMED_ENVELOPE, reason, attempts=0))
        if not candidates:
            return [], writes
        pipe = self.client.pipeline(transaction=False)
        for c in candidates:
            pipe.hgetall(self.keys.job(c.job_id))
            pipe.xrange(self.keys.events(c.job_id))
        answers = pipe.execute()
        decided: list[_Decided] = []
        for i, c in enumerate(candidates):
            decision = self._decide(c, answers[2 * i], answers[2 * i + 1])
            (decided if isinstance(decision, _Decided) else writes).append(decision)
        if self.affinity is not None:
            decided = self._hand_off(decided)
        self.loras.prefetch({job.request.lora for job in decided if job.request.lora is not None})
        return self._start_all(decided, writes)

    def _decide(self, c: _Candidate, job: dict[str, str], entries: list) -> _Decided | JobWrite:
        d, job_id, now = c.delivery, c.job_id, time.time()
        if not job:
            return self._dead_letter(
                None,
                d,
                ErrorCode.JOB_NOT_FOUND,
                f"job {job_id} does not exist (expired or never written)",
                attempts=0,
                job_id=job_id,
            )
        events = [event_from_fields(fields) for _, fields in entries]
        if job.get("state") in TERMINAL_STATES or (events and events[-1].type in TERMINAL_EVENT_TYPES):
            return Discard(d)  # settled already (e.g. cancelled while queued)
        next_seq = events[-1].seq + 1 if events else 0
        attempts = int(job.get("attempts", "0"))
        if c.envelope_error is not None:
            return self._dead_letter(next_seq, d, ErrorCode.MALFORMED_ENVELOPE, c.envelope_error, attempts, job_id)
        try:
            request = JobRequest.model_validate_json(job.get("request", ""))
        except ValidationError as exc:
            return finish(
                job_id,
                d,
                FailedEvent(seq=next_seq, code=ErrorCode.INVALID_REQUEST, message=_validation_summary(exc)),
                self.worker_id,
            )
        if job.get("cancel") == "1":
            return finish(job_id, d, CancelledEvent(seq=next_seq), self.worker_id)
        if attempts >= self.settings.max_attempts:
            message = f"delivered {attempts + 1} times, more than max_attempts={self.settings.max_attempts}"
            return self._dead_letter(next_seq, d, ErrorCode.MAX_ATTEMPTS_EXCEEDED, message, attempts, job_id)
        started_at = float(job["started_at"]) if "started_at" in job else None
        ttl = request.ttl_s or self.settings.job_ttl_s
        if started_at is None and now > request.created_at + ttl:
            message = f"waited {now - request.created_at:.1f}s in the queue, more than ttl_s={ttl:g}"
            return finish(
                job_id, d, TimedOutEvent(seq=next_seq, code=ErrorCode.TTL_EXPIRED, message=message), self.worker_id
            )
        timeout = request.timeout_s or self.settings.job_timeout_s
        if started_at is not None and now > started_at + timeout:
            message = f"ran longer than timeout_s={timeout:g}"
            return finish(job_id, d, TimedOutEvent(seq=next_seq, code=ErrorCode.EXECUTION_TIMEOUT, message=message),
                             self.worker_id)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        streamed = Streamed(
            token_ids=[t for e in tokens for t in e.token_ids],
            text="".join(e.text for e in tokens),
            next_seq=max(next_seq, 1),  # the start writes `started` as seq 0 when the stream is empty
        )
        first_token_at = float(job["first_token_at"]) if "first_token_at" in job else None
        return _Decided(c, request, attempts + 1, started_at or now, first_token_at, (started_at or now) + timeout,
                        streamed, job.get("traceparent"), now)

    def _hand_off(self, decided: list[_Decided]) -> list[_Decided]:
        """`decided` less the jobs moved to a peer that holds their adapter (`LoraAffinity`)."""
        generating = [(job.candidate.delivery, job.candidate.job_id, job.request.lora)
                      for job in decided if job.request.task == "generate"]
        moves = self.affinity.choose(generating)
        if not moves:
            return decided
        moved = self.affinity.move([(job.candidate.delivery, job.candidate.job_id, moves[job.candidate.job_id])
                                    for job in decided if job.candidate.job_id in moves])
        return [job for job in decided if job.candidate.job_id not in moved]

    def _start_all(self, decided: list[_Decided], writes: list[JobWrite]) -> tuple[list[JobStart], list[JobWrite]]:
        """Start the decided jobs (one script each, one round trip), then render their prompts."""
        if not decided:
            return [], writes

        def build():
            pipe = self.client.pipeline(transaction=False)
            for job in decided:
                job_id = job.candidate.job_id
                started = event_json_tail(StartedEvent(seq=0, worker_id=self.worker_id, attempt=job.attempts))
                args = [TERMINAL_STATES_ARG, JobState.running.value, self.worker_id, repr(job.started_at),
                        self.keys.channel(job_id), started]
                lua.add(pipe, self._start, [self.keys.job(job_id), self.keys.events(job_id)], args)
            return pipe

        answers = lua.raise_errors(lua.execute(build, [self._start]))
        ok: list[JobStart] = []
        again: list[Delivery] = []
        for job, attempts in zip(decided, answers, strict=True):
            if not attempts:
                again.append(job.candidate.delivery)  # cancelled or settled between the read and the start
                continue
            job.attempts = int(attempts)
            start = self._render(job)
            (ok if isinstance(start, JobStart) else writes).append(start)
        if again:
            more_starts, more_writes = self.prepare(again)
            ok += more_starts
            writes += more_writes
        return ok, writes

    def _render(self, job: _Decided) -> JobStart | Finish:
        """The started job with its prompt as token ids and its adapter, or the write that fails it (an adapter
        this worker cannot serve, a prompt the model cannot take)."""
        c = job.candidate
        try:
            lora = None if job.request.lora is None else self.loras.request_for(job.request.lora)
        except LoraUnavailable as exc:
            log.warning("job failed", extra={"job_id": c.job_id, "code": ErrorCode.LORA_NOT_FOUND, "error": str(exc)})
            event = FailedEvent(seq=job.streamed.next_seq, code=ErrorCode.LORA_NOT_FOUND, message=str(exc))
            return finish(c.job_id, c.delivery, event, self.worker_id)
        try:
            prompt_ids = self.renderer.render(job.request)
            if job.request.task != "generate":
                return self._answer_without_engine(job, prompt_ids)
        except InvalidPromptError as exc:
            log.warning("job failed", extra={"job_id": c.job_id, "code": ErrorCode.INVALID_PROMPT, "error": str(exc)})
            event = FailedEvent(seq=job.streamed.next_seq, code=ErrorCode.INVALID_PROMPT, message=str(exc))
            return finish(c.job_id, c.delivery, event, self.worker_id)
        start = JobStart(c.job_id, c.delivery, job.request, prompt_ids, job.attempts, job.started_at,
                         job.first_token_at, job.deadline, job.streamed, job.traceparent, job.picked_at, time.time(),
                         lora=lora)
        if self.tracer is not None:
            start.traced = True
            operation = "chat" if job.request.messages is not None else "text_completion"
            self.tracer.started(AttemptStart(c.job_id, job.traceparent, job.attempts, operation,
                                             job.request.created_at, job.started_at, job.picked_at, start.ready_at,
                                             len(job.streamed.token_ids)))
        return start

    def _answer_without_engine(self, job: _Decided, prompt_ids: list[int]) -> Finish:
        """A tokenize or detokenize job, answered here: the prompt's token ids, or their text."""
        text = self.renderer.decode(prompt_ids) if job.request.task == "detokenize" else ""
        now = time.time()
        timings = Timings(queue_s=job.started_at - job.request.created_at, total_s=now - job.request.created_at)
        event = CompletedEvent(seq=job.streamed.next_seq, finish_reason="stop", usage=Usage(), timings=timings)
        output = {"text": text, "token_ids": prompt_ids, "finish_reason": "stop", "usage": Usage(), "timings": timings}
        return finish(job.candidate.job_id, job.candidate.delivery, event, self.worker_id, output)

    def _dead_letter(self, seq: int | None, d: Delivery, code: str, message: str, attempts: int,
                     job_id: str | None = None) -> Finish | Discard:
        """Fail the job (when it exists: `seq` is its next event) and park the entry in {p}:dlq."""
        entry = {
            "job_id": job_id or "",
            "code": code,
            "message": message,
            "attempts": str(attempts),
            "worker_id": self.worker_id,
            "stream": d.stream,
            "entry_id": d.entry_id,
            "envelope": json.dumps(d.fields),
            "ts": repr(time.time()),
        }
        log.warning("dead-lettered", extra={"job_id": job_id, "code": code, "entry_id": d.entry_id})
        if seq is None:
            return Discard(d, dead_letter=entry)
        write = finish(job_id, d, FailedEvent(seq=seq, code=code, message=message), self.worker_id)
        write.dead_letter = entry
        return write


def _validation_summary(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
