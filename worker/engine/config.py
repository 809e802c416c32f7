"""Engine configuration: one validated dataclass (only the process edge reads the environment)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str  # local directory, or a hub id already in the local cache
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
    snapshot_url: str | None = None  # prefix-cache snapshot store (file:///dir, s3://bucket/prefix): restored at start
    snapshot_max_bytes: int = 1 << 30  # KV bytes a snapshot keeps at most (the hottest whole chains)
    snapshot_keep: int = 3  # snapshots kept in the store; older ones are deleted after a save

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a local directory or a cached hub id")
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
        if self.snapshot_max_bytes <= 0 or self.snapshot_keep < 1:
            raise ValueError("snapshot_max_bytes must be > 0 and snapshot_keep >= 1")
