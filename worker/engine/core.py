"""The engine core: the requests the engine holds, and the step that computes them.

A step is `schedule` (start the requests whose grammar has compiled, let the speculative
decoder propose, then the `Scheduler`) and `execute` (the `Executor`: the model and the sampler,
or the verification of proposals; then each request rolled back over the proposals its
verification rejected). The core appends no token: what a step sampled comes out as a
`CoreOutput`, and the output processor appends the tokens one by one, checks the stop
conditions and calls `finish` for the requests they end.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

from ferry.worker.engine.config import EngineConfig
from ferry.worker.engine.errors import InvalidStructuredOutputError, RequestFailedError
from ferry.worker.engine.hybrid_kv import HybridKVCacheManager
from ferry.worker.engine.kv_cache import KVCacheManager, KVUsage
from ferry.worker.engine.loading import LoadedModel
from ferry.worker.engine.lora.manager import LoraManager
from ferry.worker.engine.model_runner import StepOutput
from ferry.worker.engine.outputs import FinishReason, PositionLogprobs
from ferry.worker.engine.request import Request
from ferry.worker.engine.scheduler import Scheduler, SchedulerOutput
from ferry.worker.engine.spec.decode import SpecDecoder, SpecDecodeStats
from ferry.worker.engine.spec.proposers import DraftProposer, NgramProposer
from ferry.worker.models.kv_split import kv_split, may_release_behind_windows

_COMPILE_WAIT_S = 0.05  # a step with nothing to run waits this long at most for a grammar to compile


@dataclass(slots=True)
class SampledTokens:
    """One request's new tokens from one step, not yet appended to it."""

    request: Request
    token_ids: list[int]  # in order: its accepted proposals, then the target's own token (one without proposals)
    logprobs: list[PositionLogprobs] | None  # one entry per token, where asked for (the tokens' text not decoded)


@dataclass(slots=True)
class CoreOutput:
    """What one step of the core did."""

    # Finished by the core since the last step, with no tokens to add: aborted, failed (its
    # `error` set: a sampling row or a grammar compile failed) or resumed already at their end.
    ended: list[Request] = field(default_factory=list)
    sampled: list[SampledTokens] = field(default_factory=list)  # requests that got tokens this step, in batch order


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv: KVUsage
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from it
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None  # proposed / accepted counters; None when speculation is off


class EngineCore:
    """Scheduler, KV blocks, speculative decoding and the executor, behind add_request /
    schedule / execute / finish."""

    def __init__(self, config: EngineConfig, model: LoadedModel) -> None:
        self.executor = model.executor
        self.max_model_len = model.max_model_len
        self.kv = _kv_manager(config, model)
        self.spec: SpecDecoder | None = None
        spec = config.speculative
        if spec is not None:
            proposer = (
                NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                if model.draft is None
                else DraftProposer(*model.draft, self.kv, model.num_blocks, model.dtype, model.device,
                                   model.arch.vocab_size)
            )
            self.spec = SpecDecoder(spec, proposer, model.max_model_len)
        self.lora = None if not config.enable_lora else LoraManager(
            model.executor, model.arch, model.dtype, model.model_salt, config.max_loras, config.max_lora_rank,
            config.host_lora_capacity, config.model_cache_dir,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget(model.device.type),
            watermark_blocks=min(model.num_blocks // 100, 8),
            lora=self.lora,
        )
        self._compiling: dict[str, Request] = {}  # requests whose grammar is compiling, by id
        self._ended: list[Request] = []  # finished between steps, reported by the next one

    # --- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Hold a request (ValueError if its id is already here). One with nothing left to
        generate (a resume whose tokens reach max_tokens or the context's end) is finished at
        once with LENGTH, as the uninterrupted run was; the next step reports it."""
        self.scheduler.add(request)
        if request.length_reached(self.max_model_len):
            self.finish(request, FinishReason.LENGTH)
            self._ended.append(request)
        else:
            if request.grammar is not None:  # waits in the scheduler until compiled
                self._compiling[request.request_id] = request
            if request.lora is not None:  # waits until its adapter is in memory
                self.lora.prepare(request)

    def abort(self, request_id: str) -> bool:
        """Finish a request now (False if it is not here); the next step reports it as ABORT."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, FinishReason.ABORT)
        self._ended.append(request)
        return True

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None,
               error: Exception | None = None) -> None:
        """End a request and free its blocks (the caller reports it). Idempotent."""
        if request.is_finished:
            return
        self.scheduler.finish(request, reason, stop_reason)
        request.error = error
        self._compiling.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv=self.kv.usage(self.scheduler.running),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode=self.spec.stats.snapshot() if self.spec is not None else None,
        )

    # --- the step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Start the requests whose grammar compiled, let the speculative decoder propose, and
        schedule this step."""
        if self._compiling:
            self._start_grammars()
        if self.lora is not None:
            self._start_loras()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def execute(self, sched: SchedulerOutput) -> CoreOutput:
        """Run the scheduled step and roll each request back over its rejected proposals. The
        output also holds what ended since the last step."""
        out = CoreOutput(ended=self._ended)
        self._ended = []
        if sched.is_empty:
            if self._compiling:  # nothing else to do: give the compiles the CPU rather than spin
                wait([r.grammar.compiled for r in self._compiling.values()], _COMPILE_WAIT_S, FIRST_COMPLETED)
            elif self.lora is not None:  # likewise for adapters loading
                self.lora.wait(_COMPILE_WAIT_S)
            return out
        result = self.executor.execute(sched)
        if self.spec is not None:
            self.spec.observe(sched.requests, result.sampled)
        self._update(sched, result, out)
        return out

    def _start_grammars(self) -> None:
        """Give each request whose grammar finished compiling its matcher (it can be scheduled
        from now on); fail those whose grammar did not compile."""
        for request in [r for r in self._compiling.values() if r.grammar.compiled.done()]:
            del self._compiling[request.request_id]
            try:
                request.grammar.start(request.output_token_ids)
            except InvalidStructuredOutputError as exc:
                self.finish(request, FinishReason.ERROR, error=exc)
                self._ended.append(request)

    def _start_loras(self) -> None:
        """Take in the adapters that finished loading; fail the requests whose adapter did not."""
        for request, error in self.lora.poll(self.scheduler.waiting):
            self.finish(request, FinishReason.ERROR, error=error)
            self._ended.append(request)

    def _update(self, sched: SchedulerOutput, result: StepOutput, out: CoreOutput) -> None:
        """Count the computed tokens; a request whose sampling failed ends alone, with ERROR."""
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens, strict=True):
            request.num_computed_tokens += num_new
            scored = result.prompt_logprobs.get(request.request_id)
            if scored is not None:  # by position: a preempted request's recompute writes the same entries again
                first, entries = scored
                request.prompt_logprobs[first:first + len(entries)] = entries
            failure = result.failed.get(request.request_id)
            if failure is not None:
                self.finish(request, FinishReason.ERROR, error=RequestFailedError(failure))
                out.ended.append(request)
                continue
            tokens = result.sampled.get(request.request_id)
            if tokens is None:
                continue  # a prefill chunk that did not reach the prompt's end
            if request.spec.token_ids:
                # Roll back over the rejected proposals: their KV is stale and will be overwritten.
                request.num_computed_tokens -= len(request.spec.token_ids) - (len(tokens) - 1)
                self.spec.record(request, len(tokens) - 1)
            if self.spec is not None:  # blocks of rejected positions, and of proposals never verified
                self.kv.trim(request)
            out.sampled.append(SampledTokens(request, tokens, result.logprobs.get(request.request_id)))


def _kv_manager(config: EngineConfig, model: LoadedModel) -> KVCacheManager | HybridKVCacheManager:
    """The KV blocks' manager: one pool, or a hybrid model's two (`hybrid_kv`) where loading made them."""
    if model.num_window_blocks:
        window = kv_split(model.arch).window
        return HybridKVCacheManager(model.num_blocks, model.num_window_blocks, config.block_size,
                                    config.enable_prefix_caching, window)
    return KVCacheManager(model.num_blocks, config.block_size, config.enable_prefix_caching, window=_kv_window(model))


def _kv_window(model: LoadedModel) -> int | None:
    """How far back any layer reads KV, where every layer of the model has a sliding window (its
    widest): the KV manager releases blocks before it. None where some layer attends over the
    whole context, or something else reads old blocks (`may_release_behind_windows`)."""
    windows = model.arch.layer_windows
    if not windows or None in windows or not may_release_behind_windows(model.arch, model.draft is not None):
        return None
    return max(windows)
