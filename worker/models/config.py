"""The architecture facts Ferry needs, read from a Hugging Face `config.json`.

One `ModelArch` covers Llama 2/3.x, Mistral, Qwen2, Qwen3, Phi-3/Phi-4 and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE, and with Gemma's own options (`GemmaConfig`) Gemma 2 and Gemma 3
(text): they differ only in the flags below (q/k/v bias, q/k RMSNorm,
rope scaling, tied embeddings, `moe`; Phi-3's checkpoints store q/k/v and gate/up already fused,
which is how Ferry holds them). RoPE variants come from
transformers' own rope init functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is outside what Ferry implements."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    kind: str  # "default", or the transformers rope type whose init function gave `inv_freq`
    # [head_dim / 2] inverse frequencies from transformers' own ROPE_INIT_FUNCTIONS (linear, llama3,
    # yarn, ...), so each variant's math is theirs; None: theta's plain ones
    inv_freq: tuple[float, ...] | None = None
    attention_scaling: float = 1.0  # cos and sin are multiplied by it (YaRN's mscale)
    # LongRoPE (Phi-3.5, Phi-3-128k): the long factors' frequencies, used for a token whose sequence
    # is longer than `original_max_positions` (see rope_table_rows); inv_freq holds the short ones.
    long_inv_freq: tuple[float, ...] | None = None
    original_max_positions: int = 0
    # Partial rotary (partial_rotary_factor < 1, Phi-4-mini): how many leading dims of each head
    # transformers rotates (0: all). Ferry's kernels rotate whole heads, so the loader reorders each
    # q/k head (partial_rotary_order) and the table rotates the other dims by exactly nothing.
    rotary_dim: int = 0


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): each token's router picks `top_k`
    of `num_experts` gated MLPs and sums their outputs, weighted by the router's softmax."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the chosen experts' weights renormalised to sum to 1 (Mixtral always)
    shared_intermediate_size: int  # Qwen2-MoE's always-on shared expert (gated by a sigmoid); 0: none
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts; the others are dense

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}"
            )


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Gemma 2 / Gemma 3 (text): GeGLU MLPs, (1 + w) RMSNorms (Ferry stores 1 + w), embeddings
    times sqrt(hidden_size), sandwich norms around attention and MLP, attention scaled by
    query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps attention logits, both may cap final logits;
    Gemma 3's sliding layers rotate with a rope of their own (`local_rope`, the others `arch.rope`)."""

    query_pre_attn_scalar: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' rope; None: one rope for all
    local_rope_layers: tuple[int, ...] = ()  # the layers that rotate with local_rope


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool  # Qwen2 always; Llama/Mistral/Qwen3 when attention_bias
    o_bias: bool  # Llama's attention_bias also covers o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    # [num_layers]: each layer's attention window (None: full attention). transformers' layer_types
    # where the config has them (Qwen2/3: sliding from max_window_layers on), else every layer
    layer_windows: tuple[int | None, ...] = ()
    # "ferry": Ferry's own decoder (worker/models/llama.py); "transformers": the model's transformers
    # code with Ferry's paged attention (worker/models/fallback.py), for any other decoder
    implementation: str = "ferry"
    gemma: GemmaConfig | None = None  # Gemma 2/3's decoder (see GemmaConfig); None: Llama's

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArch:
        archs = list(getattr(cfg, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or getattr(cfg, 'model_type', '?')}; "
                f"Ferry serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = _gemma_config(cfg) if arch in _GEMMA else None
        act = getattr(cfg, "hidden_act", "silu")
        if gemma is None and act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; Ferry implements silu")
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and getattr(cfg, "qkv_bias", True))
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        sliding = getattr(cfg, "sliding_window", None)  # each layer's: layer_windows
        if arch.startswith("Qwen") and not getattr(cfg, "use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
            rope=_rope_config(cfg) if arch != "Gemma3ForCausalLM" else _layer_rope(cfg, "full_attention"),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM", *_GEMMA),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            moe=_moe_config(cfg, arch),
            layer_windows=_layer_windows(cfg, int(sliding) if sliding else None),
            gemma=gemma,
        )


def _gemma_config(cfg) -> GemmaConfig:
    """Gemma 2/3's options, refusing (by name) those Ferry's decoder does not implement."""
    act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"unsupported hidden_activation {act!r}; Ferry implements gelu_pytorch_tanh")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention=True is not supported; Ferry's attention is causal")
    final = getattr(cfg, "final_logit_softcapping", None)
    if cfg.model_type == "gemma2":
        soft = getattr(cfg, "attn_logit_softcapping", None)
        return GemmaConfig(float(cfg.query_pre_attn_scalar), float(soft) if soft else None,
                           float(final) if final else None)
    if cfg.model_type != "gemma3_text":
        raise UnsupportedModelError(f"unsupported Gemma config model_type {cfg.model_type!r}")
    # Gemma 3's attention takes no soft-cap (transformers ignores attn_logit_softcapping there).
    types = list(getattr(cfg, "layer_types", None) or ())
    if len(types) != cfg.num_hidden_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"unsupported layer_types {types}")
    local = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return GemmaConfig(float(cfg.query_pre_attn_scalar), None, float(final) if final else None,
                       local_rope=_layer_rope(cfg, "sliding_attention"), local_rope_layers=local)


def _layer_rope(cfg, layer_type: str) -> RopeConfig:
    """Gemma 3: the rope of one kind of layer, from rope_parameters[layer_type]."""
    params = dict((getattr(cfg, "rope_parameters", None) or {}).get(layer_type) or {})
    if float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor in rope_parameters[{layer_type!r}] is not supported")
    rope = _rope_frequencies(cfg, layer_type)
    if rope.kind == "longrope":
        raise UnsupportedModelError(f"rope type {rope.kind!r} in rope_parameters[{layer_type!r}] is not supported")
    return rope


def _layer_windows(cfg, window: int | None) -> tuple[int | None, ...]:
    types = getattr(cfg, "layer_types", None)
    if window is None or not types:
        return (window,) * cfg.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _moe_config(cfg, arch: str) -> MoeConfig | None:
    """Mixtral: every layer sparse, experts as wide as `intermediate_size`, weights renormalised.
    Qwen2/3-MoE: `moe_intermediate_size` experts in every `decoder_sparse_step`-th layer except
    `mlp_only_layers` (dense, `intermediate_size`), renormalised when `norm_topk_prob`; Qwen2-MoE
    adds a shared expert."""
    if arch == "MixtralForCausalLM":
        experts, inter, norm, shared = cfg.num_local_experts, cfg.intermediate_size, True, 0
        sparse = tuple(range(cfg.num_hidden_layers))
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        experts, inter = cfg.num_experts, cfg.moe_intermediate_size
        norm = bool(getattr(cfg, "norm_topk_prob", False))
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    else:
        return None
    if not experts:  # transformers runs every layer dense then
        return None
    return MoeConfig(num_experts=int(experts), top_k=int(cfg.num_experts_per_tok), intermediate_size=int(inter),
                     norm_topk_prob=norm, shared_intermediate_size=shared, sparse_layers=sparse)


# Variants whose frequencies depend on the length of the sequence being run in ways a paged cache
# cannot follow: dynamic NTK rescales every key's rotation as the sequence grows. (LongRoPE switches
# once, from its short to its long factors: the scheduler recomputes the sequence there, see
# rope_table_rows.)
_LENGTH_DEPENDENT_ROPE = ("dynamic",)


def _rope_config(cfg) -> RopeConfig:
    rope = _rope_frequencies(cfg)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial is None or float(partial) == 1.0:
        return rope
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotary_dim = int(head_dim * float(partial))
    if not 0 < rotary_dim < head_dim or rotary_dim % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor {partial} rotates {rotary_dim} of {head_dim} dims per head; Ferry needs an "
            "even number between 0 and the head size"
        )
    return replace(rope, rotary_dim=rotary_dim)


def rope_parameters(cfg, layer_type: str | None = None) -> tuple[str, dict]:
    """(rope type, its parameters) of a config. transformers 5 keeps everything in
    `rope_parameters`; older configs use rope_theta + rope_scaling. Gemma 3 keeps one dict per
    kind of layer there (`layer_type`)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    scaling = (getattr(cfg, "rope_scaling", None) or {}) if layer_type is None else {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    return params.get("rope_type", params.get("type", "default")) or "default", params


def _rope_frequencies(cfg, layer_type: str | None = None) -> RopeConfig:
    kind, params = rope_parameters(cfg, layer_type)
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta, kind="default")
    if kind in _LENGTH_DEPENDENT_ROPE or kind not in ROPE_INIT_FUNCTIONS:
        supported = ", ".join(k for k in ("default", *ROPE_INIT_FUNCTIONS) if k not in _LENGTH_DEPENDENT_ROPE)
        raise UnsupportedModelError(f"unsupported rope type {kind!r}; Ferry implements {supported}")
    by_layer = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), **by_layer)
    long_inv_freq, original_max = None, 0
    if kind == "longrope" and layer_type is None:
        original_max = int(params.get("original_max_position_embeddings")
                           or getattr(cfg, "original_max_position_embeddings", 0) or cfg.max_position_embeddings)
        long, _ = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), seq_len=original_max + 1)
        long_inv_freq = tuple(long.float().tolist())
    return RopeConfig(theta=theta, kind=kind, inv_freq=tuple(inv_freq.float().tolist()),
                      attention_scaling=float(attention_scaling), long_inv_freq=long_inv_freq,
                      original_max_positions=original_max)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[rotary dims / 2] float32 inverse frequencies: a variant's from transformers, else theta's
    (over the rotated dims only, as transformers computes them for partial rotary)."""
    if rope.inv_freq is not None:
        return torch.tensor(rope.inv_freq, dtype=torch.float32)
    dim = rope.rotary_dim or head_dim
    return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of position * inv_freq in the first half, sin in the second,
    both times the variant's attention scaling (as transformers scales them). LongRoPE: [2 *
    max_positions, head_dim], the short factors' rows, then the long factors'. Partial rotary: the
    pairs past the rotated ones get cos 1 and sin 0, unscaled, which leaves those dims as they are."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    tables = [torch.outer(positions, rope_inv_freq(rope, head_dim))]
    if rope.long_inv_freq is not None:
        tables.append(torch.outer(positions, torch.tensor(rope.long_inv_freq, dtype=torch.float32)))
    rows = []
    for freqs in tables:
        cos, sin = freqs.cos() * rope.attention_scaling, freqs.sin() * rope.attention_scaling
        still = head_dim // 2 - freqs.shape[1]  # pairs that do not rotate
        if still:
            cos = torch.cat([cos, torch.ones(max_positions, still)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_positions, still)], dim=1)
        rows.append(torch.cat((cos, sin), dim=-1))
    return torch.cat(rows)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] int64: the order Ferry holds a q/k head's dims in under partial rotary (new dim ->
    checkpoint dim). transformers rotates dims (i, i + rotary_dim / 2) for i < rotary_dim / 2 and
    passes the rest; the kernels rotate (j, j + head_dim / 2). So the rotated pairs go first in
    each half and the passed dims fill the rest, where the table's cos 1 / sin 0 keeps them. q
    and k reordered alike leave every q.k product, so attention, exactly as it was."""
    half, rot_half, still_half = head_dim // 2, rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(rot_half), *range(rotary_dim, rotary_dim + still_half)]
    second = [*range(rot_half, rotary_dim), *range(rotary_dim + still_half, head_dim)]
    assert len(first) == len(second) == half
    return torch.tensor(first + second)


def reorder_rotary_rows(rows: torch.Tensor, arch: ModelArch) -> None:
    """In place: the q and k heads' rows of a fused q/k/v tensor ([q + 2 kv rows, ...]: float
    weights, a bias, or a GGUF's raw blocks, whose blocks run along a row) in partial_rotary_order."""
    d = arch.head_dim
    order = partial_rotary_order(d, arch.rope.rotary_dim)
    for start, heads in ((0, arch.num_heads), (arch.num_heads * d, arch.num_kv_heads)):
        block = rows[start : start + heads * d]  # [heads * d, ...] of one projection
        block.copy_(block.reshape(heads, d, *block.shape[1:])[:, order].reshape(block.shape))


def rope_table_rows(rope: RopeConfig, start: int, end: int, long: bool, max_positions: int) -> range:
    """The rows of rope_cos_sin_cache that rotate positions start .. end-1 of a sequence: the
    positions themselves, or with LongRoPE, once the sequence is longer than original_max_positions
    (`long`), the long factors' rows. transformers decides per forward pass from the sequence's
    length and, when a sequence first grows past the switch, recomputes all its keys with the long
    factors; the scheduler does the same (Scheduler._recompute_with_long_rope)."""
    offset = max_positions if long and rope.long_inv_freq is not None else 0
    return range(start + offset, end + offset)
