"""Tiny Hugging Face checkpoints made on the spot: config + random init + save_pretrained.

Every test model goes through Ferry's real loading code (config.json, safetensors, tokenizer).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from ferry.worker.tools.demo_model import byte_level_bpe

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Ferry serves language models behind an async job API with streaming and webhooks.",
    "Grüße aus Zürich — naïve café, 東京, 🚀 emoji and other multi-byte characters.",
    "import os\nimport sys\n\nclass Engine:\n    def step(self):\n        return []\n",
]
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),  # q/k/v and gate/up stored fused
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    # no native decoder: served by the transformers fallback (worker/models/fallback.py)
    "olmo2": (Olmo2Config, Olmo2ForCausalLM),
    "granite": (GraniteConfig, GraniteForCausalLM),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM),
    "cohere": (CohereConfig, CohereForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# The mixture-of-experts families at a tiny shape (their defaults are 8 to 128 experts of 768+ features).
MOE_DEFAULTS = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 96, "norm_topk_prob": False},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True},
}


@functools.cache
def _tokenizer(vocab_size: int):
    return byte_level_bpe(CORPUS * 4, vocab_size)


def make_model(
    directory: Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shard_size: str | None = None,
    vocab_size: int = 384,
    **config_overrides,
) -> Path:
    """Write a random-weight checkpoint with a tokenizer to `directory` and return it."""
    tokenizer = _tokenizer(vocab_size)
    config_cls, model_cls = ARCHITECTURES[arch]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        # Wider weights than the default 0.02 give peaked logits, so greedy ties never hinge
        # on float rounding between two correct implementations.
        initializer_range=0.25,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    kwargs.update(MOE_DEFAULTS.get(arch, {}))
    kwargs.update(config_overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    directory.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    tokenizer.save_pretrained(directory)
    return directory
