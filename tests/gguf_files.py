"""GGUF files written from the tiny HF checkpoints of tiny_models.py, the way llama.cpp's converter
writes them: `{arch}.*` hyper-parameters, the byte-level BPE tokenizer with its chat template in
the metadata, llama q/k rows permuted for llama.cpp's rotary kernel, Gemma's norms stored as w + 1
(Gemma2Model / Gemma3Model), 1-D tensors (norms, biases) kept F32, every matrix in the chosen type.

`gguf` can quantize to F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1. It cannot quantize to the
K-quants; for those the blocks are random bytes with small scales, so the weights are the file's
own rather than the HF model's, which is all a loader test needs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file
from transformers import AutoConfig, PreTrainedTokenizerFast

# HF name -> GGUF name; layer tensors are `model.layers.{i}.<key>` -> `blk.{i}.<value>`.
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused tensors
    "mlp.gate_up_proj": "ffn_up",
    # mixture of experts: the router, Qwen2-MoE's shared expert (its experts: EXPERT_PIECES)
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Gemma 2/3's sandwich norms (llama.cpp's ffn_norm is Gemma's pre-feed-forward norm).
GEMMA_LAYER_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
# One expert's matrix in a checkpoint -> the GGUF tensor that stacks it with the layer's other experts.
EXPERT_PIECES = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
                 "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# Byte offsets of the float16 scale fields in one block of each K-quant (gguf/quants.py layouts).
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# The scale each field gets: values come out roughly within +-0.3, like the tiny models' weights.
K_SCALE = {"Q2_K": 4e-3, "Q3_K": 1e-3, "Q4_K": 1.1e-3, "Q5_K": 5.5e-4, "Q6_K": 1.8e-4}


def gguf_name(hf_name: str, gemma: bool = False) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**LAYER_NAMES, **GEMMA_LAYER_NAMES} if gemma else LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the rows of the two rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: str = "F32",
    *,
    arch: str | None = None,
    overrides: dict[str, np.ndarray] | None = None,
    types: dict[str, str] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    tokenizer_model: str = "gpt2",
    seed: int = 0,
) -> Path:
    """Write the checkpoint in `hf_dir` as a GGUF at `out` with its matrices in `qtype`.

    `arch` replaces the config's model type in the file (e.g. "falcon"); `overrides` gives raw
    arrays for some HF names, stored in their numpy dtype (an F64 norm, say); `types` other types
    for some GGUF names (a mix as llama.cpp's Q4_K_M writes: {"blk.0.attn_v.weight": "Q8_0"}); `extra`
    F32 tensors under GGUF names beyond the model's (a vision tower's `v.*`, say)."""
    config = AutoConfig.from_pretrained(hf_dir)
    gemma = config.model_type in GEMMA_ARCH
    arch = arch or {"mistral": "llama", **MOE_ARCH, **GEMMA_ARCH}.get(config.model_type, config.model_type)
    weights = stack_experts(load_file(str(hf_dir / "model.safetensors")))
    writer = GGUFWriter(out, arch)
    writer.add_name(f"tiny {config.model_type}")
    if gemma:
        _write_gemma_hyperparameters(writer, config)
    else:
        _write_hyperparameters(writer, config)
    # The tokenizer as saved: AutoTokenizer would pick the architecture's class, and Qwen2's adds a token.
    _write_tokenizer(writer, PreTrainedTokenizerFast.from_pretrained(hf_dir), tokenizer_model)
    rng = np.random.default_rng(seed)
    for hf_name, tensor in weights.items():
        name = hf_name if hf_name.startswith("blk.") else gguf_name(hf_name, gemma)
        if overrides and hf_name in overrides:
            writer.add_tensor(name, overrides[hf_name])
            continue
        data = tensor.astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            data = data + np.float32(1)  # the converter's `data_torch + 1`: llama.cpp multiplies by the weight
        tensor_type = (types or {}).get(name, qtype)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # llama.cpp keeps the shared expert's gate 1-D
        if data.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(name, data)
        elif tensor_type == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif tensor_type in K_SCALE_OFFSETS:
            kind = GGMLQuantizationType[tensor_type]
            writer.add_tensor(name, random_k_blocks(data.shape, tensor_type, rng), raw_dtype=kind)
        else:
            kind = GGMLQuantizationType[tensor_type]
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's per-expert matrices stacked as llama.cpp stores them ([E, rows, cols] under
    `blk.{i}.ffn_{gate,up,down}_exps.weight`), everything else as it is."""
    out, stacks = {}, {}
    for name, tensor in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        layer, expert, piece = match.groups()
        stacks.setdefault(f"blk.{layer}.{EXPERT_PIECES[piece]}.weight", {})[int(expert)] = tensor
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def random_k_blocks(shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """[..., rows, bytes per row] uint8 (stacked experts: [E, rows, bytes]): random K-quant blocks
    whose float16 scales are all K_SCALE[qtype]."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    *lead, cols = shape
    rows = int(np.prod(lead))
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    scale = np.full((rows, cols // block_size), K_SCALE[qtype], dtype=np.float16).view(np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        blocks[:, :, offset : offset + 2] = scale.reshape(rows, -1, 2)
    return blocks.reshape(*lead, -1)


def _write_shape(writer: GGUFWriter, config) -> None:
    """The keys every family's converter writes: lengths, layers, heads, norm epsilon."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _write_hyperparameters(writer: GGUFWriter, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    _write_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter writes it: factors as tensors
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _write_gemma_hyperparameters(writer: GGUFWriter, config) -> None:
    """What llama.cpp's Gemma2Model / Gemma3Model write. The file cannot say query_pre_attn_scalar,
    the layer pattern or Gemma 3's local rope: the checkpoint must have llama.cpp's fixed ones."""
    pattern = 2 if config.model_type == "gemma2" else 6
    assert config.query_pre_attn_scalar == config.head_dim
    assert config.layer_types == [
        "full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(config.num_hidden_layers)
    ]
    _write_shape(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":  # no rope keys: llama.cpp's default base 10000
        assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        return
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    rope = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(rope["rope_theta"])  # the global layers'
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _write_tokenizer(writer: GGUFWriter, tokenizer, model: str) -> None:
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.eos_token_id)  # as llama.cpp's converters often write it
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
