"""Engine: add_request / abort / step for one model, in three parts (vLLM v1's cut).

- the input processor (`input_processor.py`) checks what a caller gives and builds the `Request`;
- the core (`core.py`) holds the requests and runs each step: schedule, then execute;
- the output processor (`output_processor.py`) appends the step's tokens, checks the stop
  conditions and builds the `RequestOutput` deltas.

All three are built from one `LoadedModel` (`loading.py`: model, tokenizer, KV pool, executor).
"""

from __future__ import annotations

from dataclasses import fields

from ferry.worker.engine.config import EngineConfig
from ferry.worker.engine.core import EngineCore, EngineStats
from ferry.worker.engine.errors import LoraAdapterError
from ferry.worker.engine.input_processor import InputProcessor
from ferry.worker.engine.kv_cache import KVUsage
from ferry.worker.engine.loading import load
from ferry.worker.engine.lora import LoRARequest
from ferry.worker.engine.output_processor import OutputProcessor
from ferry.worker.engine.outputs import Logprob, RequestOutput
from ferry.worker.engine.prefix_io import PrefixBlocks
from ferry.worker.engine.resume import Resume
from ferry.worker.engine.sampling_params import SamplingParams


class Engine:
    """A continuously batched, paged-KV engine for one model. Not thread-safe: call it from one thread."""

    def __init__(self, model: str, **kwargs) -> None:
        """`model`: an HF directory or a cached hub id; `kwargs`: the other `EngineConfig` fields."""
        self.config = EngineConfig(model=str(model), **kwargs)
        loaded = load(self.config)
        self.inputs = InputProcessor(loaded, self.config.structured_outputs_cache_size, self.config.enable_lora)
        self.core = EngineCore(self.config, loaded)
        self.outputs = OutputProcessor(self.core, loaded.tokenizer, loaded.max_model_len)

        # What the worker, snapshots, benches and tests read: the model's facts ...
        self.model_dir = loaded.model_dir
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self.device = loaded.device
        self.max_model_len = loaded.max_model_len
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.sampling_defaults = loaded.sampling_defaults
        self.quantization = loaded.quantization
        self.model_salt = loaded.model_salt
        self.block_size = self.config.block_size
        self.tensor_parallel_size = self.config.tensor_parallel_size
        # ... and the parts that hold its state (each one object, shared with the part that owns it).
        self.executor, self.runner = loaded.executor, loaded.runner
        self.kv, self.scheduler, self.spec = self.core.kv, self.core.scheduler, self.core.spec
        self.structured = self.inputs.structured
        # What snapshots save and restore: whole blocks, every kv head (from every rank).
        self.prefix_blocks = PrefixBlocks(self.core.kv, loaded.executor, loaded.kv_layout)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        return cls(config.model, **{f.name: getattr(config, f.name) for f in fields(config) if f.name != "model"})

    # --- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: Resume | None = None,
        background: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. `priority`: lower is served first and preempted last. `background`:
        background work (a batch's line), which steps aside while foreground prompts prefill.

        `resume`: the request generated part of its output elsewhere (a job whose worker died);
        it continues as an uninterrupted run would have (see `worker.engine.resume`), and one
        whose earlier tokens already reach its end comes out of the next step finished, LENGTH.

        `lora_request`: the LoRA adapter it runs with (enable_lora=True); loaded in the background
        when the engine does not hold it yet (the request waits meanwhile). An adapter that fails to
        load ends the request alone, FinishReason.ERROR with a LoraAdapterError.

        Raises an `EngineInputError` (worker.engine.errors) for what it refuses: InvalidPromptError,
        PromptTooLongError, InvalidSamplingParams, InvalidStructuredOutputError, InvalidResumeError,
        LoraAdapterError (LoRA is off);
        a ValueError for a request id already here; TypeError for params that are no SamplingParams.
        Nothing of a refused request stays behind."""
        request, detokenizer = self.inputs.process(
            request_id, prompt, params, priority, arrival_time, resume, background, lora_request
        )
        self.core.add_request(request)
        self.outputs.add_request(request, detokenizer)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks are freed and the next step reports it, ABORT."""
        return self.core.abort(str(request_id))

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a delta for every request that produced tokens or ended."""
        scheduled = self.core.schedule()
        executed = self.core.execute(scheduled)
        return self.outputs.process(executed)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do at tensor_parallel_size=1) and the adapter
        loader. The engine cannot step afterwards. Idempotent."""
        if self.core.lora is not None:
            self.core.lora.close()
        self.executor.close()

    # --- LoRA adapters ---------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter into host memory now (vLLM's add_lora): LoraAdapterError names what is
        wrong with it (LoRA off, files missing or corrupt, rank over max_lora_rank, targets Ferry
        does not adapt, another base model's shapes)."""
        if self.core.lora is None:
            raise LoraAdapterError(f"LoRA adapter {lora_request.lora_name!r}: this engine runs without LoRA "
                                   "(enable_lora=False)")
        self.core.lora.load_now(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter from memory (a running request keeps its slot until it ends)."""
        return self.core.lora is not None and self.core.lora.remove(lora_name)

    def loras_held(self) -> list[str]:
        """The adapters this engine holds in host memory or in a device slot, by name."""
        return [] if self.core.lora is None else self.core.lora.held()

    # --- prompts ---------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids (InvalidPromptError for a model without a tokenizer)."""
        return self.inputs.encode(prompt)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a chat, rendered with the model's own chat template (given `tools`, the
        functions the model may call, in OpenAI's shape); InvalidPromptError without a template
        or for messages it refuses."""
        return self.inputs.apply_chat_template(messages, add_generation_prompt, tools)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the token ids must be this model's."""
        self.inputs.check_params(params)

    # --- state -----------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

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
        return self.core.stats()


__all__ = ["Engine", "EngineStats", "Logprob"]
