"""What `kernels.decoder_stack` takes per decoder layer (plain data: no backend imported here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer's tensors (worker/models/llama.py's DecoderLayer). The four projections
    are weights as `kernels.pack_linear_weight` or `kernels.pack_quantized_weight` returned them
    (a layer may mix both)."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor | None  # [head_dim], Qwen3's per-head norms, else None
    k_norm: torch.Tensor | None
    qkv: object  # packed [hidden] -> [(heads + 2 kv heads) * head_dim]
    qkv_bias: torch.Tensor | None
    o: object
    o_bias: torch.Tensor | None
    gate_up: object  # [hidden] -> [2 * intermediate]: gate then up
    gate_up_bias: torch.Tensor | None
    down: object
    down_bias: torch.Tensor | None
    # Gemma 2/3 (GemmaDecoderLayer): the MLP's sandwich norms [hidden] (both or None; with them the
    # post-attention norm normalises the attention output alone), GeGLU, soft-capped attention
    # logits, and Gemma 3's sliding layers' own rotary table (`cos_sin_local`)
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    gelu: bool = False
    softcap: float | None = None
    local_rope: bool = False
    window: int | None = None  # sliding-window attention over this many positions; None: full
    # a sliding-window layer of a model whose KV may be split by kind (worker/models/kv_split.py):
    # with a windowed pool passed, the layer reads that pool at `pool_index`, else the main one there
    windowed: bool = False
    pool_index: int = 0
