"""The engine thread: admits started jobs, steps the engine, turns its outputs into writes.

Only this thread touches the engine. Other threads queue commands (`start`, `settle`, `abort`,
`hand_back_all`); the thread takes them between steps and hands each step's writes to the
publisher without waiting for Redis. Jobs arrive rendered and tokenized (`worker.serve.render`,
in the intake): admitting one is `Engine.add_request` on token ids, and a request the engine
refuses fails its job with the code of its exception (`worker.serve.errors`). A re-delivered job
is admitted with what its client has as the request's `Resume`: the engine goes on from there.

Arrivals: the intake `announce`s jobs it is still preparing, then `start`s them in chunks. While
announced jobs are on their way and the requests here would not fill a step, the thread waits
for them (briefly) rather than step half-empty; once a step is full it goes at once.

Background jobs (the Batch API's lines) give way to live ones: the engine schedules them after
live prompts, their tokens go out in groups (`worker.serve.job_output`) after the live jobs'
writes, and while live traffic is present a step of background work alone is followed by a pause
(`worker.serve.pacing`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ferry.worker.engine import Engine, EngineStats, RankFailedError, Resume, SamplingParams
from ferry.worker.protocol import CancelledEvent, ErrorCode, TimedOutEvent
from ferry.worker.serve.errors import error_code
from ferry.worker.serve.inbox import Abort, Inbox, Start
from ferry.worker.serve.job_output import JobOutput, JobRun, TerminalEvent
from ferry.worker.serve.job_starts import JobStart
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.pacing import BackgroundPacing, Pacer
from ferry.worker.serve.reasoning_parsers import Reasoning
from ferry.worker.serve.tool_parsers import DEFAULT_PARSER
from ferry.worker.serve.writes import Finish, JobWrite

log = logging.getLogger("ferry.worker.engine")

_STATS_INTERVAL_S = 0.25  # how often the engine's stats are copied out for /metrics and the heartbeat
_ARRIVAL_WAIT_S = 0.02  # longest wait for announced jobs before stepping without them
_IDLE_POLL_S = 0.05  # with nothing to run: how often the loop looks at its timers


class EngineLoop(Inbox):
    def __init__(self, engine: Engine, worker_id: str, metrics: WorkerMetrics, submit: Callable[[list[JobWrite]], None],
                 idle_task: Callable[[], None] | None = None, tool_call_parser: str = DEFAULT_PARSER,
                 pacing: BackgroundPacing | None = None, reasoning: Reasoning | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.metrics = metrics
        self.submit = submit  # hands a step's writes to the publisher (never blocks)
        self.idle_task = idle_task  # between jobs only (a periodic snapshot): no running job's step waits on it
        self.tool_call_parser = tool_call_parser  # worker.serve.tool_parsers.PARSERS: this model's call format
        self.reasoning = reasoning  # this model's reasoning parser and think tags; None: chats are not split
        self.output = JobOutput(worker_id, metrics)
        self.pacer = Pacer(pacing or BackgroundPacing())
        self.runs: dict[str, JobRun] = {}
        self.stats: EngineStats | None = None  # latest, replaced whole (read by other threads)
        # LoRA adapters the engine holds, as of `stats` (the heartbeat's; the operator's, loaded before
        # the loop starts, from the first beat on: peers hand their jobs here at once)
        self.loras: list[str] = engine.loras_held()
        self.stop = threading.Event()
        self.fatal: RankFailedError | None = None  # set once the engine can no longer step (the worker exits)
        self._stats_at = 0.0
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stop.is_set():
            writes: list[JobWrite] = []
            if not self.engine.has_unfinished_requests():
                self._take_commands(writes, _IDLE_POLL_S)
            elif (pause_s := self.pacer.pause_s(any(not r.start.background for r in self.runs.values()))) > 0:
                self._pause_background(writes, pause_s)
            else:
                self._take_commands(writes, None)
            self._await_arrivals(writes)
            self._expire(writes)
            if self.engine.has_unfinished_requests():
                started = time.monotonic()
                writes += self._step()
                self.pacer.step_took(time.monotonic() - started)
            elif self.idle_task is not None and self.fatal is None:
                self.idle_task()
            now = time.monotonic()
            # A job's end refreshes them before its terminal write goes out: whoever sees the job
            # finished and then scrapes /metrics sees its tokens counted.
            if now - self._stats_at > _STATS_INTERVAL_S or any(isinstance(w, Finish) for w in writes):
                self._stats_at = now
                self.stats = self.engine.stats()
                self.loras = self.engine.loras_held()
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

    def _pause_background(self, writes: list[JobWrite], pause_s: float) -> None:
        """Take commands for `pause_s` instead of stepping; a live job, a hand back or a command
        with something to write (a cancel) ends the pause."""
        started = time.monotonic()
        deadline = started + pause_s
        written = len(writes)
        while (remaining := deadline - time.monotonic()) > 0 and not self.stop.is_set():
            if self._take_commands(writes, remaining) or len(writes) > written:
                break
        self.metrics.background_paused.inc(time.monotonic() - started)

    def _take_commands(self, writes: list[JobWrite], wait_s: float | None) -> bool:
        """Run every queued command; wait up to `wait_s` for the first (None: do not wait). True
        when one needs the next step at once: a live job was admitted, or every job was handed back."""
        try:
            command = self._inbox.get(timeout=wait_s) if wait_s is not None else self._inbox.get_nowait()
        except queue.Empty:
            return False
        urgent = False
        while True:
            if isinstance(command, Start):
                for job in command.jobs:
                    urgent |= not job.background
                    writes += self._admit(job)
                if command.arrived:
                    self._arrived(command.arrived)
            elif isinstance(command, Abort):
                writes += self._abort(command)
            else:
                writes += self._hand_back()
                urgent = True
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return urgent

    def _step(self) -> list[JobWrite]:
        try:
            outputs = self.engine.step()
        except RankFailedError as exc:  # a tensor-parallel rank is gone: no step can run; the jobs go back
            log.critical("tensor-parallel rank failed: handing every job back", extra={"error": str(exc)})
            self.fatal = exc
            return self._hand_back()
        except Exception as exc:  # the engine failed on this batch: fail its jobs, keep serving others
            log.exception("engine step failed")
            return [self._fail(run, ErrorCode.ENGINE_ERROR, f"engine error: {exc}") for run in list(self.runs.values())]
        writes = []
        for out in outputs:
            run = self.runs.get(out.request_id)
            if run is None:  # an abort we already settled
                continue
            write = self.output.on_output(run, out)
            if isinstance(write, Finish):
                self.runs.pop(run.job_id, None)
            if write is not None:
                writes.append(write)
        return writes

    # --- admitting and ending --------------------------------------------------------------------

    def _admit(self, job: JobStart) -> list[JobWrite]:
        run = JobRun.begin(job, self.tool_call_parser, self.reasoning)
        self.runs[job.job_id] = run
        if not job.background:
            self.pacer.live_seen()
        resumed = job.streamed.token_ids
        run.admitted_at = time.time()
        try:
            kwargs = job.request.sampling_kwargs()
            if run.reasoning is not None and "structured_outputs" in kwargs:  # the grammar is the answer's
                kwargs |= self.reasoning.grammar_kwargs()
            params = SamplingParams(**kwargs)
            self.engine.add_request(job.job_id, job.prompt_ids, params, priority=job.request.priority.rank,
                                    resume=Resume(resumed, len(job.streamed.text)) if resumed else None,
                                    background=job.background, lora_request=job.lora)
        except Exception as exc:  # the engine refused the request: its exception's type says why
            code = error_code(exc)
            if code != ErrorCode.ENGINE_ERROR:
                return [self._fail(run, code, str(exc))]
            log.exception("engine refused a request", extra={"job_id": job.job_id})
            return [self._fail(run, code, f"{type(exc).__name__}: {exc}")]
        traced = {"trace_id": job.trace_id} if job.trace_id is not None else {}
        log.info("job admitted", extra={"job_id": job.job_id, "attempt": job.attempts, **traced,
                                        "prompt_tokens": len(job.prompt_ids), "resumed_tokens": len(resumed)})
        return []

    def _fail(self, run: JobRun, code: str, message: str) -> Finish:
        log.warning("job failed", extra={"job_id": run.job_id, "code": code, "error": message})
        return self._end(run, self.output.fail, code, message)

    def _end(self, run: JobRun, ending: Callable[..., Finish], *args) -> Finish:
        """Take `run` out of the engine (a no-op when the engine already finished it) and write its end."""
        self.runs.pop(run.job_id, None)
        self.engine.abort(run.job_id)
        return ending(run, *args)

    def _abort(self, command: Abort) -> list[JobWrite]:
        run = self.runs.get(command.job_id)
        if run is None:
            return []
        if command.lost:
            self.runs.pop(command.job_id)
            self.engine.abort(command.job_id)
            return []
        return [self._end(run, self.output.end, CancelledEvent(seq=run.seq()))]

    def _expire(self, writes: list[JobWrite]) -> None:
        now = time.time()
        for job_id, run in list(self.runs.items()):
            if now > run.start.deadline:
                timeout = run.start.deadline - run.start.started_at
                event: TerminalEvent = TimedOutEvent(seq=run.seq(), code=ErrorCode.EXECUTION_TIMEOUT,
                                                     message=f"ran longer than timeout_s={timeout:g}")
                writes.append(self._end(run, self.output.end, event))
                log.warning("job timed out", extra={"job_id": job_id})

    def _hand_back(self) -> list[JobWrite]:
        """Every running job back to the queue."""
        writes: list[JobWrite] = []
        for job_id, run in list(self.runs.items()):
            self.runs.pop(job_id)
            self.engine.abort(job_id)
            writes.append(self.output.hand_back(run))
        return writes
