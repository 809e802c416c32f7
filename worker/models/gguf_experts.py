"""The mixture-of-experts part of a GGUF (llama.cpp's `llama` with experts = Mixtral, `qwen2moe`,
`qwen3moe`), read as the per-expert tensors of a transformers checkpoint.

llama.cpp stacks each layer's experts into one 3-D tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`: [E, I, H], `ffn_down_exps`: [E, H, I]) and names the router `ffn_gate_inp`. The checkpoint gets one
tensor per expert under the family's own names (Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`,
Qwen `mlp.experts.{e}.gate_proj/up_proj/down_proj`), which both transformers and Ferry's loader
read. Each expert's tensor is a slice of the file's blocks (a quantized row's blocks run along
the row, so slicing experts and rows is exact).
"""

from __future__ import annotations

import re

from ferry.worker.models.config import UnsupportedModelError

_MIXTRAL = {"router": "block_sparse_moe.gate", "gate": "block_sparse_moe.experts.{e}.w1",
            "up": "block_sparse_moe.experts.{e}.w3", "down": "block_sparse_moe.experts.{e}.w2"}
_QWEN = {"router": "mlp.gate", "gate": "mlp.experts.{e}.gate_proj", "up": "mlp.experts.{e}.up_proj",
         "down": "mlp.experts.{e}.down_proj"}
EXPERT_NAMES = {"llama": _MIXTRAL, "qwen2moe": _QWEN, "qwen3moe": _QWEN}

# The stacked tensors and the piece of each expert they hold (a file with another expert tensor,
# such as a fused ffn_gate_up_exps, is refused by name as a tensor Ferry has no place for).
_STACKED = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
# Qwen2-MoE's shared expert; its gate is 1-D [H] in the file, [1, H] in the checkpoint.
SHARED_NAMES = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# llama.cpp's default for renormalising the top-k weights, per architecture (its graph code),
# unless the file says (`{arch}.expert_weights_norm`).
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def is_moe(arch: str, meta) -> bool:
    return arch in EXPERT_NAMES and int(meta("expert_count", 0) or 0) > 0


def moe_config_kwargs(arch: str, meta, path) -> dict:
    """The transformers config fields of the file's experts (`meta(key, default)` reads `{arch}.key`)."""
    gating = meta("expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise UnsupportedModelError(f"{path}: {arch}.expert_gating_func = {gating}; Ferry routes by softmax only")
    experts, used = int(meta("expert_count")), int(meta("expert_used_count"))
    if arch == "llama":  # Mixtral: experts as wide as feed_forward_length
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    kwargs = {"num_experts": experts, "num_experts_per_tok": used, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "moe_intermediate_size": int(meta("expert_feed_forward_length")),
              "norm_topk_prob": bool(meta("expert_weights_norm", _NORM_TOPK[arch]))}
    if arch == "qwen2moe":
        kwargs["shared_expert_intermediate_size"] = int(meta("expert_shared_feed_forward_length"))
    return kwargs


def map_expert_tensor(tensor, arch: str, layer: str, key: str, kind: str, make):
    """The checkpoint tensors one expert-related GGUF tensor becomes, via `make(hf_name, shape,
    data)`; None when `key` is not an expert key. `tensor.shape` is the file's (reversed) shape."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    names = EXPERT_NAMES[arch]
    prefix = f"model.layers.{layer}."
    if key == "ffn_gate_inp":
        return [make(f"{prefix}{names['router']}.{kind}", shape, tensor.data)]
    if key in SHARED_NAMES:
        shape = (1, *shape) if key == "ffn_gate_inp_shexp" and len(shape) == 1 else shape
        return [make(f"{prefix}{SHARED_NAMES[key]}.{kind}", shape, tensor.data)]
    if key not in _STACKED:
        return None
    if len(shape) != 3:
        return None  # not stacked experts: refused as an unknown tensor
    num_experts, rows, cols = shape
    data = tensor.data.reshape(num_experts, rows, -1)  # [E, rows, bytes or values per row]
    template = names[_STACKED[key]]
    return [make(f"{prefix}{template.format(e=e)}.{kind}", (rows, cols), data[e]) for e in range(num_experts)]


_STACKED_HF = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")


def on_disk_names(expected: dict[str, tuple[int, ...]], arch: str) -> dict[str, tuple[int, ...]]:
    """transformers 5's in-memory names and shapes of a MoE model's state (experts stacked, the
    router under `mlp.gate`) as the per-expert checkpoint names and shapes written here."""
    names = EXPERT_NAMES[arch]
    out = {}
    for name, shape in expected.items():
        match = _STACKED_HF.match(name)
        if match is None:
            router = name.endswith(".mlp.gate.weight")
            out[name.replace(".mlp.gate.", f".{names['router']}.") if router else name] = shape
            continue
        prefix, which = match.groups()
        num_experts, rows, cols = shape
        pieces = ("gate", "up") if which == "gate_up_proj" else ("down",)
        for e in range(num_experts):
            for piece in pieces:
                out[f"{prefix}{names[piece].format(e=e)}.weight"] = (rows // len(pieces), cols)
    return out

