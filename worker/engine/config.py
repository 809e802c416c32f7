"""Engine configuration: one validated dataclass (only the process edge reads the environment)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ferry.worker.models.quantization import check_quantization_name
from ferry.worker.models.sources import DEFAULT_CACHE_DIR

SPEC_METHODS = ("ngram", "draft")
MODEL_IMPLS = ("auto", "ferry", "transformers")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses k tokens per request, the target verifies them in one pass."""

    method: str  # "ngram" (prompt lookup in the request's own tokens) | "draft" (a small model, same tokenizer)
    num_speculative_tokens: int = 4  # k: tokens proposed per request per step
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram looked up in the request's tokens
    prompt_lookup_min: int = 1  # ngram: shortest n-gram tried before giving up
    draft_model: str | None = None  # draft: checkpoint directory, .gguf file (or cached hub id)
    disable_by_batch_size: int | None = None  # no proposals while this many requests run (compute-bound steps)
    min_acceptance_rate: float = 0.2  # a request whose recent acceptance falls below this pauses proposing
    pause_steps: int = 16  # steps a request goes without proposals after poor acceptance
    measure_speedup: bool = True  # propose only while measured decode steps run faster with them (spec/governor.py)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a checkpoint directory)")
        if self.method == "ngram" and self.draft_model:
            raise ValueError("draft_model is only used by method 'draft'")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 or None, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}")
        if self.pause_steps < 0:
            raise ValueError(f"pause_steps must be >= 0, got {self.pause_steps}")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """From the `speculative=` argument: a dict of these fields (`ngram_max` names prompt_lookup_max)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict like {{'method': 'ngram'}}, got {type(value).__name__}")
        value = dict(value)
        if "ngram_max" in value:
            if "prompt_lookup_max" in value:
                raise ValueError("give ngram_max or prompt_lookup_max, not both")
            value["prompt_lookup_max"] = value.pop("ngram_max")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative settings {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative needs a method: 'ngram' or 'draft'")
        return cls(**value)


@dataclass(slots=True)
class EngineConfig:
    model: str  # HF checkpoint directory, .gguf file (or a directory holding one), or a hub id in the local cache
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's)
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # KV pool budget; default sized from the device and limits
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int | None = None  # token budget per step (default 512 on CPU, 4096 on GPU)
    max_model_len: int | None = None  # prompt + output tokens per request (default: the model's)
    enable_prefix_caching: bool = True
    device: str | None = None  # "cpu", "cuda", "cuda:1"; default cuda when available
    seed: int = 0  # global RNG seed for unseeded sampling
    model_salt: str | None = None  # prefix-cache namespace of this model (default: from its config)
    # Speculative decoding (see SpeculativeConfig; a dict of its fields is accepted too); None = off.
    speculative: SpeculativeConfig | None = None
    # Weights kept quantized in memory (CPU only): None = the format's default (a quantized GGUF
    # stays quantized), "none", "gguf" (a GGUF's Q8_0/Q4_0/Q4_1 blocks), "int8" (quantized at
    # load); see worker/models/quantization.py
    quantization: str | None = None
    # Where GGUF models are converted to HF checkpoints, once per file (<dir>/<sha256 prefix>/);
    # a relative path is relative to the current directory
    model_cache_dir: str = DEFAULT_CACHE_DIR
    structured_outputs_cache_size: int = 64  # compiled grammars kept (LRU), keyed by spec and tokenizer
    # Ranks the model is split over (Megatron-style, docs/tensor-parallel.md): 1 runs in this process;
    # N > 1 spawns N - 1 rank processes (rank r on cuda:r, or CPU processes); kv_cache_bytes is per rank
    tensor_parallel_size: int = 1
    # A collective between the ranks that waits longer than this fails the step: a hung rank
    tensor_parallel_timeout_s: float = 120.0
    # Which code runs the model (vLLM's --model-impl): "auto" = Ferry's native decoder where it
    # implements the architecture, else the transformers fallback (worker/models/fallback.py);
    # "ferry" = native or refuse; "transformers" = the fallback even for a native architecture
    model_impl: str = "auto"
    # LoRA adapters (docs/lora.md): requests name an adapter (LoRARequest) and rows of different
    # adapters and of none share a step. max_loras adapters sit in device slots at once (LRU),
    # max_cpu_loras (default max(4 * max_loras, 16)) stay loaded in host memory; ranks up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a local directory, a .gguf file or a cached hub id")
        if not self.model_cache_dir:
            raise ValueError("model_cache_dir must name a directory (relative to the current one, or absolute)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > 128:
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.structured_outputs_cache_size < 1:
            raise ValueError(f"structured_outputs_cache_size must be >= 1, got {self.structured_outputs_cache_size}")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}")
        check_quantization_name(self.quantization)
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        self.speculative = SpeculativeConfig.of(self.speculative)
        if not 1 <= self.max_loras <= 256:
            raise ValueError(f"max_loras must be in [1, 256], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def host_lora_capacity(self) -> int:
        """Adapters kept loaded in host memory (max_cpu_loras, or its default)."""
        return self.max_cpu_loras or max(4 * self.max_loras, 16)

    def step_token_budget(self, device_type: str) -> int:
        """Tokens per step: max_num_batched_tokens, or its default on this kind of device."""
        return self.max_num_batched_tokens or (4096 if device_type == "cuda" else 512)
