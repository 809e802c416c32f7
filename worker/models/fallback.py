"""The transformers fallback: any other decoder-only `AutoModelForCausalLM`, run by its own
modeling code, with Ferry's paged KV cache and batched attention plugged in through
transformers' attention interface (vLLM's "transformers backend" idea).

transformers' attention modules project q/k/v, rotate them and then call the function registered
under `config._attn_implementation` with [batch, heads, tokens, head_dim] tensors. Ferry registers
`ferry_paged`: it writes the step's k/v into the layer's slice of the KV pool and runs
`kernels.ops.paged_attention` over the pool, so every sequence of the flat batch (one "batch
row" of all scheduled tokens, each with its own position) attends to its own paged context.
No causal mask is built (`ferry_paged` has no mask function): the paged metadata is the mask.
Continuous batching, chunked prefill, the prefix cache, snapshots and speculative decoding work
unchanged, because they only see the KV pool and the step's metadata.

On the CPU the model's `nn.Linear` layers (the LM head included) are swapped for Ferry's packed
products (`PackedLinear`, as the native decoder's), which torch's own float32 matmul trails by up
to 2x on some CPUs; the model's logits are checked against its unpacked forward, and a model whose
code reads a Linear's weight itself keeps its layers as they were.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ferry.kernels import ops
from ferry.kernels.ops import AttentionMetadata
from ferry.worker.models.config import ModelArch, RopeConfig, UnsupportedModelError, rope_parameters
from ferry.worker.models.llama import swap_in_packed_linears

log = logging.getLogger(__name__)

ATTENTION_NAME = "ferry_paged"
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
# What transformers' causal-LM heads do to the logits after the projection (each checked at load
# against the model's own forward, see _check_logits): config field -> how.
_LOGIT_PROCESSING = {
    "final_logit_softcapping": lambda logits, cap: torch.tanh(logits / cap) * cap,  # Gemma 2/3
    "logit_scale": lambda logits, scale: logits * scale,  # Cohere
    "logits_scaling": lambda logits, scale: logits / scale,  # Granite
}


@dataclass(slots=True)
class _Step:
    """What the attention function needs beyond its arguments, for the forward pass under way."""

    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata


_current = threading.local()  # .step: the _Step of this thread's forward pass


def paged_attention_forward(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function contract: query [1, H, T, D], key/value [1, Hkv, T, D]
    (rotated) -> ([1, T, H, D], no weights). Writes k/v into layer `module.layer_idx` of the pool."""
    step: _Step = _current.step
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError("attention sinks (s_aux) are not supported by Ferry's paged attention")
    layer = step.kv_cache[module.layer_idx]  # [2, blocks, Hkv, block_size, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if k.shape[1:] != layer.shape[2:3] + layer.shape[4:]:
        raise UnsupportedModelError(
            f"layer {module.layer_idx} attends with {k.shape[1]} kv heads of {k.shape[2]} dims; the KV pool holds "
            f"{layer.shape[2]} of {layer.shape[4]} (a model whose layers differ in KV shape is not supported)"
        )
    ops.write_kv(k, v, layer[0], layer[1], step.slot_mapping)
    q = query[0].transpose(0, 1)  # [T, H, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    options = {}
    if sliding_window:
        options["window"] = int(sliding_window)
    if softcap:
        options["softcap"] = float(softcap)
    out = ops.paged_attention(q, layer[0], layer[1], step.meta, scale, **options)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def fallback_arch(cfg) -> ModelArch:
    """The facts the engine needs of a model the fallback runs (its KV shape, vocabulary, ids),
    or UnsupportedModelError naming why transformers' code cannot run it under Ferry."""
    archs = list(getattr(cfg, "architectures", None) or [type(cfg).__name__])
    if getattr(cfg, "is_encoder_decoder", False) or type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(f"architecture {archs}: not a decoder-only AutoModelForCausalLM")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    if not model_class.__name__.endswith("ForCausalLM"):  # BERT-style LM heads: bidirectional encoders
        raise UnsupportedModelError(f"architecture {archs}: {model_class.__name__} is not a causal decoder")
    if getattr(cfg, "architectures", None) and model_class.__name__ not in cfg.architectures:
        raise UnsupportedModelError(f"config.json names architectures {archs} but its model_type "
                                    f"{cfg.model_type!r} builds {model_class.__name__}")
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"architecture {archs}: its transformers code ({model_class.__name__}) takes no custom attention "
            "function, so neither Ferry's native decoder nor its transformers fallback can run it"
        )
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if layer_types - _ATTENTION_LAYERS:
        raise UnsupportedModelError(f"architecture {archs}: layers of kind {sorted(layer_types - _ATTENTION_LAYERS)} "
                                    "hold state other than a KV cache")
    rope = _fallback_rope(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    eos = getattr(cfg, "eos_token_id", None)
    return ModelArch(
        architecture=model_class.__name__,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6) or 1e-6),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
        rope=rope,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),)),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        implementation="transformers",  # (layer_windows empty: transformers passes each layer's window)
    )


def _fallback_rope(cfg) -> RopeConfig:
    """transformers rotates q and k itself (each position from position_ids); Ferry refuses only
    the variants a paged cache cannot follow: dynamic NTK re-rotates every key as the sequence
    grows, and LongRoPE switches factors mid-sequence (served natively for Phi-3)."""
    kind, params = rope_parameters(cfg)
    if kind in ("dynamic", "longrope"):
        raise UnsupportedModelError(f"rope type {kind!r} is not supported under the transformers fallback")
    return RopeConfig(theta=float(params.get("rope_theta", 0.0) or 0.0), kind=kind)


class FallbackModel(nn.Module):
    """transformers' model for the checkpoint, stepped like Ferry's own decoder: `forward` over one
    flat batch returns the final hidden states, `compute_logits` the head's logits for some rows."""

    def __init__(self, hf_model: nn.Module, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.hf = hf_model
        self.decoder = hf_model.get_decoder()
        self.head = hf_model.get_output_embeddings()
        config = hf_model.config
        self.logit_processing = [(f, getattr(config, f)) for f in _LOGIT_PROCESSING if getattr(config, f, None)]
        self.cos_sin = None  # transformers rotates q and k itself
        self.native_stack = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        _current.step = _Step(kv_cache, slot_mapping, meta)
        try:
            with ops.pinned_backend(kv_cache):
                out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _current.step = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        logits = self.head(hidden)
        for field, value in self.logit_processing:
            logits = _LOGIT_PROCESSING[field](logits, value)
        return logits.float()


def load_fallback_model(model_dir: Path, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> FallbackModel:
    """transformers' model on `device` in `dtype` with `ferry_paged` attention, its logits checked
    against transformers' own forward (a head Ferry cannot reproduce is refused), its linear layers
    packed for the CPU product where that keeps the logits."""
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    hf_model = hf_model.to(device).eval()
    model = FallbackModel(hf_model, arch)
    expected = _check_logits(model)
    packed = _pack_linears(model, expected)
    if packed:
        log.info("transformers fallback: %d linear layers packed for the CPU product", packed)
    hf_model.set_attn_implementation(ATTENTION_NAME)
    return model


_CHECK_IDS = 4  # tokens the load-time logit checks run


@torch.inference_mode()
def _logits(model: FallbackModel) -> torch.Tensor:
    """Decoder + head + the known logit processing on a few tokens (eager attention)."""
    return model.compute_logits(model.decoder(input_ids=_check_ids(model), use_cache=False).last_hidden_state[0])


def _check_ids(model: FallbackModel) -> torch.Tensor:  # [1, _CHECK_IDS] int64
    return torch.arange(1, 1 + _CHECK_IDS, device=model.hf.device)[None] % model.arch.vocab_size


@torch.inference_mode()
def _check_logits(model: FallbackModel) -> torch.Tensor:
    """transformers' forward (eager attention) against decoder + head + the known logit processing on a few
    tokens: a model whose head does something else is refused rather than served wrong. Returns the logits."""
    expected = model.hf(input_ids=_check_ids(model), use_cache=False).logits[0].float()
    got = _logits(model)
    if not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
        raise UnsupportedModelError(
            f"{model.arch.architecture} changes its logits after the LM head in a way Ferry does not reproduce"
        )
    return got


def _pack_linears(model: FallbackModel, expected: torch.Tensor) -> int:
    """Swap every plain nn.Linear of the model for a PackedLinear where the CPU backend packs its
    weight; undone (returning 0) where the logits then differ from `expected` or the forward fails
    (modeling code that reads a Linear's weight tensor itself). Returns how many were swapped."""
    swapped = swap_in_packed_linears(model.hf)
    if not swapped:
        return 0
    model.head = model.hf.get_output_embeddings()
    try:
        if torch.allclose(_logits(model), expected, rtol=1e-3, atol=1e-3):
            return len(swapped)
        reason = "its logits moved"
    except Exception as exc:  # modeling code that reads a Linear's weight itself
        reason = f"{type(exc).__name__}: {exc}"
    for parent, name, original in swapped:
        setattr(parent, name, original)
    model.head = model.hf.get_output_embeddings()
    log.info("transformers fallback: %s keeps torch's linear layers (packed: %s)", model.arch.architecture, reason)
    return 0
