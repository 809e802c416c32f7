"""The Gemma part of a GGUF (llama.cpp's `gemma2` and `gemma3`, text only), read as a transformers
Gemma2Config / Gemma3TextConfig checkpoint.

Three things differ from the other families:

- Norms. Gemma's RMSNorm scales by 1 + w; llama.cpp multiplies by the weight, so its converter
  (convert_hf_to_gguf.py, Gemma2Model / Gemma3Model) stores every `*norm.weight` as w + 1. The
  checkpoint gets w back: NORM_OFFSET is added to each of them (and Ferry's loader folds 1 + w
  again, `_fold_gemma_norms`).
- Layer names. llama.cpp's `ffn_norm` is Gemma's pre_feedforward_layernorm (not Llama's
  post_attention_layernorm), and the sandwich norms have names of their own (LAYER_NAMES).
- What the file does not say. llama.cpp's loader (src/llama-model.cpp, `LLM_ARCH_GEMMA2` /
  `LLM_ARCH_GEMMA3` in load_hparams) hardcodes the attention scale, the sliding-window pattern and
  Gemma 3's local rope; `gemma_config_kwargs` derives the same values as transformers fields.
"""

from __future__ import annotations

from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from ferry.worker.models.config import UnsupportedModelError

# architecture -> (config class, model class)
GEMMA_MODELS = {"gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}
# llama.cpp layer key -> HF module, where it differs from the Llama table (gguf.py `_LAYER_NAMES`)
LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
NORM_OFFSET = -1.0  # undoes the converter's `data_torch + 1` on every name ending in "norm.weight"
GEMMA_FAMILY = {"permuted_qk": False, "layer_names": LAYER_NAMES, "norm_offset": NORM_OFFSET}  # gguf.py's _Family

# llama.cpp: `hparams.set_swa_pattern(2)` for gemma2, `(6)` for gemma3: layer i slides unless
# i % n == n - 1 (Gemma 2: even layers slide; Gemma 3: every 6th layer is global).
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp reads the model size from the layer count; only the 27B shapes (Gemma 2: 46 layers,
# Gemma 3: 62) scale queries by (hidden / heads) ** -0.5 rather than head_dim ** -0.5
# (`f_attention_scale`, after gemma_pytorch's config.py: query_pre_attn_scalar).
_WIDE_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
# Gemma 2's `{arch}.key` -> (transformers field, llama.cpp's value when the file omits the key:
# `hparams.n_swa = 4096; // default value of gemma 2`, llama-hparams.h f_attn_logit_softcapping = 50,
# f_final_logit_softcapping = 30).
_GEMMA2_KEYS = {"attention.sliding_window": ("sliding_window", 4096),
                "attn_logit_softcapping": ("attn_logit_softcapping", 50.0),
                "final_logit_softcapping": ("final_logit_softcapping", 30.0)}
# llama.cpp gemma3: `rope_freq_base_train_swa = 10000.0f; rope_freq_scale_train_swa = 1.0f`: the
# sliding layers rotate with base 10000 and no scaling, whatever the file's rope.* keys say.
_GEMMA3_LOCAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# A multimodal Gemma 3's vision tower goes to a separate mmproj file (`general.architecture` clip);
# its tensors are `v.*` and `mm.*`.
_VISION_PREFIXES = ("v.", "mm.")


def query_pre_attn_scalar(arch: str, num_layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The number whose inverse square root scales queries, as llama.cpp picks it (by layer count:
    it has no key for it)."""
    return hidden // heads if num_layers == _WIDE_SCALE_LAYERS[arch] else head_dim


def layer_types(arch: str, num_layers: int, sliding: bool) -> list[str]:
    pattern = _SWA_PATTERN[arch]
    return ["sliding_attention" if sliding and i % pattern != pattern - 1 else "full_attention"
            for i in range(num_layers)]


def refuse_vision(path, arch: str, names: set[str]) -> None:
    """UnsupportedModelError for a vision projector file or a file holding a vision tower."""
    if arch == "clip":
        raise UnsupportedModelError(
            f"{path}: a vision projector (mmproj) GGUF, not a language model; Ferry serves text only: "
            "pass the model's own GGUF"
        )
    vision = sorted(n for n in names if n.startswith(_VISION_PREFIXES))
    if vision:
        raise UnsupportedModelError(
            f"{path}: a vision tower's tensors ({', '.join(vision[:4])}); Ferry serves text models only"
        )


def gemma_config_kwargs(arch: str, meta, kwargs: dict) -> dict:
    """The transformers fields of a Gemma file beyond the common ones in `kwargs` (`meta(key,
    default)` reads `{arch}.key`)."""
    layers, rope = kwargs["num_hidden_layers"], kwargs["rope_parameters"]
    scalar = query_pre_attn_scalar(arch, layers, kwargs["hidden_size"], kwargs["num_attention_heads"],
                                   kwargs["head_dim"])
    out = {"query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma2":
        return {**out, "layer_types": layer_types(arch, layers, sliding=True),
                **{name: meta(key, default) for key, (name, default) in _GEMMA2_KEYS.items()}}
    # Gemma 3: no sliding_window key (or 0) means every layer global (llama.cpp: LLAMA_SWA_TYPE_NONE);
    # no attention soft-cap, the final one only where the file has it; the file's rope.* (linear
    # scaling included: gguf.py `_rope_parameters`) are the global layers'.
    window = meta("attention.sliding_window", 0) or None
    return {**out, "sliding_window": window, "layer_types": layer_types(arch, layers, sliding=window is not None),
            "rope_parameters": {"sliding_attention": dict(_GEMMA3_LOCAL_ROPE), "full_attention": rope},
            "final_logit_softcapping": meta("final_logit_softcapping", None) or None}
