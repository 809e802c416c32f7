"""Engine: add_request / abort / step. A step is (propose ->) schedule -> execute -> update."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, fields, replace

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ferry.worker.engine.config import EngineConfig
from ferry.worker.engine.detokenizer import IncrementalDetokenizer
from ferry.worker.engine.executor import Executor, ParallelExecutor, check_tensor_parallel
from ferry.worker.engine.kv_budget import kv_budget_bytes
from ferry.worker.engine.kv_cache import KVCacheManager, KVUsage, cache_extra
from ferry.worker.engine.model_runner import ModelRunner, StepOutput
from ferry.worker.engine.outputs import Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from ferry.worker.engine.parallel.group import RankGroup
from ferry.worker.engine.parallel.wire import RankSpec
from ferry.worker.engine.prefix_io import KV_LAYOUT, KVLayout, PrefixBlocks
from ferry.worker.engine.request import Request
from ferry.worker.engine.resume import Resume
from ferry.worker.engine.sampler import advance_generator
from ferry.worker.engine.sampling_params import InvalidSamplingParams, SamplingParams
from ferry.worker.engine.scheduler import Scheduler, SchedulerOutput
from ferry.worker.engine.spec.decode import SpecDecoder, SpecDecodeStats
from ferry.worker.engine.spec.proposers import DraftProposer, NgramProposer, load_draft
from ferry.worker.engine.structured import GrammarState, InvalidStructuredOutputError, StructuredOutputManager
from ferry.worker.models.config import ModelArch
from ferry.worker.models.loader import gguf_file, load_model, parse_dtype, resolve_model_path
from ferry.worker.models.quantization import resolve_quantization
from ferry.worker.models.sharding import UNSHARDED, local_arch
from ferry.worker.protocol.sampling import MODEL_DEFAULTS

log = logging.getLogger(__name__)

_COMPILE_WAIT_S = 0.05  # a step with nothing to run waits this long at most for a grammar to compile


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv: KVUsage
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from it
    num_preemptions: int
    spec_decode: SpecDecodeStats | None = None  # proposed / accepted counters; None when speculation is off


class Engine:
    """A continuously batched, paged-KV engine for one model. Not thread-safe: call it from one thread."""

    def __init__(self, model: str, **kwargs) -> None:
        """`model`: an HF directory or a cached hub id; `kwargs`: the other `EngineConfig` fields."""
        self.config = EngineConfig(model=str(model), **kwargs)
        cfg = self.config
        self.model_dir = resolve_model_path(cfg.model, cfg.model_cache_dir)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.arch = ModelArch.from_hf_config(hf_config)
        self.dtype = parse_dtype(cfg.dtype, getattr(hf_config, "dtype", None))
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = self._eos_token_ids()
        self.sampling_defaults = self._sampling_defaults()
        torch.manual_seed(cfg.seed)

        self.tensor_parallel_size = tp = cfg.tensor_parallel_size
        check_tensor_parallel(self.arch, tp, self.device, cfg.quantization)  # before any weight is read
        if tp > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", 0)  # rank r runs on cuda:r
        # Quantized weights load on one rank only: the format's default at tensor_parallel_size > 1 is float.
        requested = cfg.quantization if tp == 1 or cfg.quantization is not None else "none"
        quantization = resolve_quantization(requested, gguf_file(cfg.model), self.device, self.dtype)
        self.quantization = quantization.method  # "none" | "gguf" | "int8": what the weights are held as
        self.block_size = cfg.block_size
        group = RankGroup(self._rank_spec()) if tp > 1 else None  # the ranks load their shards meanwhile
        try:
            self.executor, num_blocks, bytes_per_block, draft = self._start_model(group, quantization)
        except BaseException:
            if group is not None:
                group.close()
            raise
        self.runner = self.executor.runner  # rank 0's model runner
        self.kv = KVCacheManager(num_blocks, self.block_size, cfg.enable_prefix_caching)
        self.spec: SpecDecoder | None = None
        spec = cfg.speculative
        if spec is not None:
            proposer = (
                NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                if draft is None
                else DraftProposer(*draft, self.kv, num_blocks, self.dtype, self.device, self.arch.vocab_size)
            )
            self.spec = SpecDecoder(spec, proposer, self.max_model_len)
        self.model_salt = cfg.model_salt or self._default_model_salt()
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens or (4096 if self.device.type == "cuda" else 512),
            watermark_blocks=min(num_blocks // 100, 8),
            background_priority=cfg.background_priority,
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Structured outputs (None without a tokenizer: grammars are over the tokens' text).
        self.structured = (
            None
            if self.tokenizer is None
            else StructuredOutputManager(
                self.tokenizer, self.arch.vocab_size, self.eos_token_ids, cfg.structured_outputs_cache_size
            )
        )
        self._compiling: dict[str, Request] = {}  # requests whose grammar is compiling, by id
        self._pending: list[RequestOutput] = []  # aborts reported by the next step
        self._arrivals = itertools.count()
        log.info(
            "engine ready: %s (%s) on %s, %s, quantization %s, tensor parallel %d, KV pool %d blocks x %d tokens "
            "(%.1f MiB per rank), max_model_len %d",
            self.model_dir.name, self.arch.architecture, self.device, self.dtype, self.quantization, tp, num_blocks,
            self.block_size, num_blocks * bytes_per_block / 2**20, self.max_model_len,
        )
        # What snapshots save and restore: whole blocks, every kv head (from every rank).
        arch = self.arch
        layout = KVLayout(KV_LAYOUT, (arch.num_layers, 2, arch.num_kv_heads, self.block_size, arch.head_dim),
                          self.dtype, self.block_size)
        self.prefix_blocks = PrefixBlocks(self.kv, self.executor, layout)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        return cls(config.model, **{f.name: getattr(config, f.name) for f in fields(config) if f.name != "model"})

    # --- set-up helpers ----------------------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        if self.arch.sliding_window and self.arch.sliding_window < limit:
            # Ferry attends over the whole context; capping at the window keeps results exact.
            log.warning(
                "model uses a sliding window of %d tokens: max_model_len capped to it", self.arch.sliding_window
            )
            limit = self.arch.sliding_window
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds what the model supports ({limit})")
        return wanted

    def _load_tokenizer(self):
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
        if not any((self.model_dir / n).is_file() for n in names):
            log.warning("no tokenizer in %s: prompts must be token ids and outputs carry no text", self.model_dir)
            return None
        return AutoTokenizer.from_pretrained(self.model_dir)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.arch.eos_token_ids)
        if (self.model_dir / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _sampling_defaults(self) -> dict[str, float | int]:
        """The sampling values the model's generation_config.json sets (only those it names: the
        fields a client leaves unset take them, see `SamplingParams.resolved`)."""
        path = self.model_dir / "generation_config.json"
        if not path.is_file():
            return {}
        config = json.loads(path.read_text())
        found = {name: config[name] for name in MODEL_DEFAULTS if config.get(name) is not None}
        if found:
            log.info("sampling defaults from generation_config.json: %s", found)
        return found

    def _start_model(self, group: RankGroup | None, quantization) -> tuple[Executor, int, int, tuple | None]:
        """Load this rank's model (and a draft model), size the KV pool (the smallest of every
        rank's), build the executor. Returns it, the block count, bytes per block and the draft."""
        cfg = self.config
        shard = UNSHARDED if group is None else group.shard
        model = load_model(self.model_dir, self.arch, self.dtype, self.device, self.max_model_len, quantization, shard)
        spec = cfg.speculative
        draft = None
        if spec is not None and spec.method == "draft":  # whole, on rank 0
            draft = load_draft(
                spec.draft_model, self.arch, self.tokenizer, self.dtype, self.device, self.max_model_len,
                cfg.model_cache_dir,
            )
        local = local_arch(self.arch, shard)
        bytes_per_block = ModelRunner.bytes_per_block(local, self.block_size, self.dtype)
        if draft is not None:  # the draft's KV pool mirrors the target's blocks, from the same budget
            bytes_per_block += ModelRunner.bytes_per_block(draft[1], self.block_size, self.dtype)
        ranks_per_host = shard.size if self.device.type == "cpu" else 1
        num_blocks = kv_budget_bytes(cfg.kv_cache_bytes, self.device, self.max_model_len, self.block_size,
                                     cfg.max_num_seqs, bytes_per_block, ranks_per_host) // bytes_per_block
        if group is not None:
            num_blocks = group.agree_num_blocks(num_blocks)
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"a KV pool of {num_blocks} blocks x {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={self.max_model_len}; raise kv_cache_bytes (needs at least "
                f"{-(-self.max_model_len // self.block_size) * bytes_per_block} bytes) or lower max_model_len"
            )
        if group is None:
            executor = Executor(ModelRunner(model, local, num_blocks, self.block_size, self.dtype, self.device))
        else:
            executor = ParallelExecutor(group, self.arch, model, local, num_blocks, self.block_size, self.dtype,
                                        self.device)
        return executor, num_blocks, bytes_per_block, draft

    def _rank_spec(self) -> RankSpec:
        cfg = self.config
        return RankSpec(
            model_dir=str(self.model_dir), arch=self.arch, dtype=self.dtype, device_type=self.device.type,
            max_model_len=self.max_model_len, block_size=self.block_size, kv_cache_bytes=cfg.kv_cache_bytes,
            max_num_seqs=cfg.max_num_seqs, size=cfg.tensor_parallel_size, num_threads=torch.get_num_threads(),
            store_port=0, timeout_s=cfg.tensor_parallel_timeout_s,
        )

    def _default_model_salt(self) -> str:
        config_text = (self.model_dir / "config.json").read_text()
        # Quantized weights compute other KV; an unquantized engine keeps the salt it always had.
        held = "" if self.quantization == "none" else f"|{self.quantization}"
        return hashlib.sha256(f"{config_text}|{self.dtype}{held}".encode()).hexdigest()[:16]

    # --- public API ----------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer: give prompts as token-id lists")
        return self.tokenizer.encode(prompt)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a chat, rendered with the model's own chat template (given `tools`, the
        functions the model may call, in OpenAI's shape)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain prompt instead")
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: Resume | None = None,
    ) -> None:
        """Queue a request. `priority`: lower is served first and preempted last.

        `resume`: the request generated part of its output elsewhere (a job whose worker died);
        it continues as an uninterrupted run would have (see `worker.engine.resume`)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids)
        params = params.resolved(self.sampling_defaults, self.max_model_len - len(token_ids))
        self.check_params(params)
        resumed = list(resume.token_ids) if resume is not None else []
        self._validate_resume(token_ids, resumed, params)
        if params.structured_outputs is not None and self.structured is None:
            raise InvalidStructuredOutputError("structured_outputs need a model with a tokenizer")
        request = Request(
            request_id=str(request_id),
            prompt_token_ids=token_ids,
            params=params,
            priority=int(priority),
            arrival_seq=next(self._arrivals),
            metrics=RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time),
            prompt=text,
            eos_token_ids=self.eos_token_ids,
            cache_extra=cache_extra(self.model_salt, params.cache_salt),
        )
        if resumed:
            request.output_token_ids = resumed
            request.all_token_ids += resumed
            if request.generator is not None:
                advance_generator(request.generator, len(resumed), self.arch.vocab_size)
        self.scheduler.add(request)
        if params.structured_outputs is not None:  # waits in the scheduler until compiled (its matcher then
            # advances over the resumed tokens)
            request.grammar = GrammarState(self.structured.compile(params.structured_outputs))
            self._compiling[request.request_id] = request
        if self.tokenizer is None:
            return
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop_strings)
        self._detokenizers[request.request_id] = detok
        if resumed and detok.replay(resumed, params.min_tokens, resume.num_text_chars) is not None:
            self.abort(request.request_id)
            self._pending.pop()  # nothing was queued: the caller gets the error instead of an abort output
            raise ValueError("the resumed tokens already end the request with a stop string")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the token ids must be this model's."""
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = next((t for t in ids if t >= self.arch.vocab_size), None)
            if bad is not None:
                raise InvalidSamplingParams(
                    f"invalid {name}: token id {bad} is beyond the vocabulary ({self.arch.vocab_size} ids)"
                )

    def _validate_resume(self, prompt_ids: list[int], resumed: list[int], params: SamplingParams) -> None:
        if not resumed:
            return
        if not all(isinstance(t, int) and 0 <= t < self.arch.vocab_size for t in resumed):
            raise ValueError(f"resumed token ids must be integers in [0, {self.arch.vocab_size})")
        if len(resumed) >= params.max_tokens:
            raise ValueError(f"{len(resumed)} resumed tokens already reach max_tokens={params.max_tokens}")
        if len(prompt_ids) + len(resumed) >= self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + resumed ({len(resumed)}) tokens leave no room in "
                f"max_model_len={self.max_model_len}"
            )

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if not all(isinstance(t, int) and 0 <= t < self.arch.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.arch.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens leave room to generate"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed and the next step reports it as 'abort'."""
        request = self.scheduler.requests.get(str(request_id))
        if request is None:
            return False
        self.scheduler.finish(request, "abort")
        self._compiling.pop(request.request_id, None)
        self._pending.append(self._output(request, [], None))
        self._detokenizers.pop(request.request_id, None)
        return True

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do at tensor_parallel_size=1). The engine
        cannot step afterwards. Idempotent."""
        self.executor.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def next_step_is_full(self) -> bool:
        """True when requests added now could not join the next step (see `Scheduler.next_step_is_full`)."""
        return self.scheduler.next_step_is_full()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> KVUsage:
        return self.kv.usage(self.scheduler.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv=self.kv_usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode=self.spec.stats.snapshot() if self.spec is not None else None,
        )

    # --- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a delta for every request that produced tokens or ended."""
        outputs, self._pending = self._pending, []
        if self._compiling:
            outputs += self._start_grammars()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._compiling:  # nothing else to do: give the compiles the CPU rather than spin
                wait([r.grammar.compiled for r in self._compiling.values()], _COMPILE_WAIT_S, FIRST_COMPLETED)
            return outputs
        result = self.executor.execute(sched)
        if self.spec is not None:
            self.spec.observe(sched.requests, result.sampled)
        return outputs + self._update(sched, result)

    def _start_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar finished compiling its matcher (it can be scheduled
        from now on); fail those whose grammar did not compile."""
        outputs = []
        for request in [r for r in self._compiling.values() if r.grammar.compiled.done()]:
            del self._compiling[request.request_id]
            try:
                request.grammar.start(request.output_token_ids)
            except InvalidStructuredOutputError as exc:
                outputs.append(self._fail(request, str(exc), exc))
        return outputs

    def _update(self, sched: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens, strict=True):
            request.num_computed_tokens += num_new
            failure = result.failed.get(request.request_id)
            if failure is not None:
                outputs.append(self._fail(request, failure))
                continue
            tokens = result.sampled.get(request.request_id)
            if tokens is None:
                continue  # a prefill chunk that did not reach the prompt's end
            try:
                if request.spec.token_ids:
                    # Roll back over the rejected proposals: their KV is stale and will be overwritten.
                    request.num_computed_tokens -= len(request.spec.token_ids) - (len(tokens) - 1)
                    self.spec.record(request, len(tokens) - 1)
                if self.spec is not None:  # blocks of rejected positions, and of proposals never verified
                    self.kv.trim(request)
                outputs.append(self._append(request, tokens, result.logprobs.get(request.request_id), now))
            except Exception as exc:  # one request's tokens (its detokenizer, its stop strings) raised
                log.exception("request %s failed on its own output", request.request_id)
                outputs.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
        return outputs

    def _fail(self, request: Request, message: str, error: Exception | None = None) -> RequestOutput:
        """End one request whose own processing raised, with finish reason "error" and the message
        as its stop reason; the rest of the batch goes on."""
        if not request.is_finished:
            self.scheduler.finish(request, "error", message)
        self._detokenizers.pop(request.request_id, None)
        output = self._output(request, [], None)
        output.error = error
        return output

    def _append(self, request: Request, tokens: list[int], logprobs: list | None, now: float) -> RequestOutput:
        """Append a step's tokens one by one: a stop condition met inside an accepted run of
        proposals ends the request right there, as it would have without speculation."""
        emitted, emitted_logprobs = [], []
        reason, stop_reason = None, None
        detok = self._detokenizers.get(request.request_id)
        for i, token in enumerate(tokens):
            token_logprobs = self._decorate(logprobs[i]) if logprobs is not None else None
            request.append_output(token, token_logprobs)
            emitted.append(token)
            if token_logprobs is not None:
                emitted_logprobs.append(token_logprobs)
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.token_times.append(now)
            reason, stop_reason = self._token_stop(request, token)
            if request.grammar is not None:
                if not request.grammar.accept(token):
                    raise InvalidStructuredOutputError(f"token {token} does not match the grammar")
                if reason is None and request.grammar.finished:
                    reason = "stop"  # the grammar accepted its end (an EOS that ignore_eos let through)
            if detok is not None:
                stops_active = request.num_output_tokens >= request.params.min_tokens
                matched = detok.add_tokens([token], final=reason is not None, check_stop=stops_active)
                if matched is not None and reason is None:
                    reason, stop_reason = "stop", matched
            if reason is not None:
                break
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)
        output = self._output(request, emitted, emitted_logprobs or None)
        if reason is not None:
            self._detokenizers.pop(request.request_id, None)
        return output

    def _token_stop(self, request: Request, token: int) -> tuple[str | None, str | int | None]:
        p = request.params
        if request.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in request.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _decorate(self, logprobs: PositionLogprobs | None) -> PositionLogprobs | None:
        if logprobs is None or self.tokenizer is None:
            return logprobs
        return {tid: replace(lp, decoded_token=self.tokenizer.decode([tid])) for tid, lp in logprobs.items()}

    def _output(self, request: Request, new_tokens: list[int], new_logprobs: list | None) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        text = detok.take_delta(request.is_finished) if detok is not None else ""
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_text=text,
            new_logprobs=new_logprobs,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            metrics=request.metrics,
        )


__all__ = ["Engine", "EngineStats", "Logprob"]
