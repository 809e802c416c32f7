"""PEFT LoRA adapters: read from a directory (adapter_config.json + adapter_model.safetensors) and
checked against the base model before a slot ever holds them.

An adapter adds `scaling * B @ A @ x` to some of a decoder layer's projections. Ferry adapts the
projections of its native decoder, in the base checkpoint's names: q/k/v/o_proj and
gate/up/down_proj (and Phi-3's fused qkv_proj and gate_up_proj). Each one lands in a *part* of
one of Ferry's fused projections (`PROJECTIONS`): q_proj is the q rows of qkv_proj, a fused
qkv_proj target is all three parts with one A. The scaling (lora_alpha / r, or / sqrt(r) with
rsLoRA; alpha_pattern per module) is folded into B here, once.

Anything else changes the math in a way the batched kernels do not compute and is refused by
name: DoRA, trained biases, `modules_to_save` (a fine-tuned head or embedding), embedding or
expert targets, a rank over the engine's limit, shapes of another base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ferry.worker.models.config import ModelArch

# Ferry's projections that take adapters, and the parts (checkpoint tensors) each one fuses.
PROJECTIONS: dict[str, tuple[str | None, ...]] = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": (None,),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": (None,),
}
# A checkpoint module an adapter targets -> (Ferry projection, the parts its B rows fill in order).
TARGETS: dict[str, tuple[str, tuple[str | None, ...]]] = {
    "q_proj": ("self_attn.qkv_proj", ("q",)),
    "k_proj": ("self_attn.qkv_proj", ("k",)),
    "v_proj": ("self_attn.qkv_proj", ("v",)),
    "qkv_proj": ("self_attn.qkv_proj", ("q", "k", "v")),
    "o_proj": ("self_attn.o_proj", (None,)),
    "gate_proj": ("mlp.gate_up_proj", ("gate",)),
    "up_proj": ("mlp.gate_up_proj", ("up",)),
    "gate_up_proj": ("mlp.gate_up_proj", ("gate", "up")),
    "down_proj": ("mlp.down_proj", (None,)),
}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w\-]+)?\.weight$")
_WEIGHTS = "adapter_model.safetensors"
_CONFIG = "adapter_config.json"


class AdapterFormatError(ValueError):
    """An adapter directory Ferry cannot serve; the message says why (the engine names the adapter)."""


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One low-rank update of one part of a projection, the whole model's (not a rank's shard)."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [part rows, r], scaling folded in


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """An adapter's tensors, keyed (layer, projection, part), in the engine's dtype on the CPU."""

    pairs: dict[tuple[int, str, str | None], LoraPair]
    rank: int  # the largest r of any module
    fingerprint: str  # sha256 of the config and the weights: the prefix cache's namespace for its KV
    nbytes: int

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(projection for _, projection, _ in self.pairs)


def read_adapter(directory: Path, arch: ModelArch, max_rank: int, dtype: torch.dtype) -> LoraWeights:
    """The adapter in `directory`, checked against `arch` (AdapterFormatError says what is wrong)."""
    config_path, weights_path = directory / _CONFIG, directory / _WEIGHTS
    if not config_path.is_file():
        raise AdapterFormatError(f"{directory} has no {_CONFIG} (a PEFT LoRA adapter directory)")
    if not weights_path.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        other = "adapter_model.bin (a pickle: convert it to safetensors)" if pickled else "no weights"
        raise AdapterFormatError(f"{directory} has no {_WEIGHTS}: {other}")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as exc:
        raise AdapterFormatError(f"{_CONFIG} is not JSON: {exc}") from None
    _check_config(config)
    digest = hashlib.sha256(config_bytes)
    tensors: dict[tuple[int, str, str], torch.Tensor] = {}  # (layer, "self_attn.q_proj", "A" | "B") -> tensor
    try:
        with safe_open(weights_path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = _TENSOR.search(key)
                if match is None:
                    raise AdapterFormatError(f"tensor {key!r} adapts something Ferry does not: it adapts "
                                             f"{', '.join(TARGETS)} of the decoder layers")
                layer, block, module, which = match.groups()
                tensors[(int(layer), f"{block}.{module}", which)] = f.get_tensor(key)
    except AdapterFormatError:
        raise
    except Exception as exc:  # safetensors raises its own types for a truncated or garbled file
        raise AdapterFormatError(f"{_WEIGHTS} is unreadable: {type(exc).__name__}: {exc}") from None
    digest.update(weights_path.read_bytes())
    if not tensors:
        raise AdapterFormatError(f"{_WEIGHTS} holds no LoRA tensors")
    pairs, rank = _pairs(tensors, config, arch, max_rank, dtype)
    nbytes = sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in pairs.values())
    return LoraWeights(pairs, rank, digest.hexdigest(), nbytes)


def _check_config(config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFormatError(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    refusals = {
        "use_dora": "DoRA (weight-decomposed LoRA)",
        "lora_bias": "trained LoRA biases",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    }
    for field, what in refusals.items():
        if config.get(field):
            raise AdapterFormatError(f"{field}=true: {what} is not served")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"bias={config['bias']!r}: trained biases are not served (only bias='none')")
    if config.get("modules_to_save"):
        raise AdapterFormatError(f"modules_to_save={config['modules_to_save']!r}: fully fine-tuned modules "
                                 "are not served, only low-rank updates")
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field, 8), (int, float)) or config.get(field, 8) <= 0:
            raise AdapterFormatError(f"{field} must be a positive number, got {config.get(field)!r}")


def _pairs(tensors: dict[tuple[int, str, str], torch.Tensor], config: dict, arch: ModelArch, max_rank: int,
           dtype: torch.dtype) -> tuple[dict[tuple[int, str, str | None], LoraPair], int]:
    pairs: dict[tuple[int, str, str | None], LoraPair] = {}
    rank = 0
    sparse = arch.moe.sparse_layers if arch.moe is not None else frozenset()
    for (layer, path, which), tensor in sorted(tensors.items()):
        if which == "B":
            continue
        name, module = f"layers.{layer}.{path}", path.split(".")[-1]
        if module not in TARGETS or not path.startswith(TARGETS[module][0].split(".")[0]):
            raise AdapterFormatError(f"{name} is not a module Ferry adapts ({', '.join(TARGETS)})")
        b = tensors.get((layer, path, "B"))
        if b is None:
            raise AdapterFormatError(f"{name} has lora_A but no lora_B")
        if layer >= arch.num_layers:
            raise AdapterFormatError(f"{name}: the base model has {arch.num_layers} layers")
        projection, parts = TARGETS[module]
        if projection.startswith("mlp.") and layer in sparse:
            raise AdapterFormatError(f"{name}: layer {layer} is a mixture-of-experts layer; its experts take "
                                     "no adapters")
        r = tensor.shape[0]
        if tensor.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise AdapterFormatError(f"{name}: lora_A {tuple(tensor.shape)} and lora_B {tuple(b.shape)} are no "
                                     "low-rank pair")
        if r > max_rank:
            raise AdapterFormatError(f"{name} has rank {r}, over max_lora_rank={max_rank}")
        in_features, rows = _shape(arch, projection, parts)
        if tensor.shape[1] != in_features or b.shape[0] != sum(rows):
            raise AdapterFormatError(
                f"{name}: shapes A {tuple(tensor.shape)}, B {tuple(b.shape)} do not fit the base model "
                f"({in_features} inputs, {sum(rows)} outputs): the adapter was trained for another base model")
        scale = _alpha(config, name) / (math.sqrt(r) if config.get("use_rslora") else r)
        b_scaled = (b.float() * scale).to(dtype)
        a = tensor.to(dtype)
        for part, b_rows in zip(parts, b_scaled.split(rows), strict=True):
            pairs[(layer, projection, part)] = LoraPair(a, b_rows.contiguous())
        rank = max(rank, r)
    if not pairs:
        raise AdapterFormatError("the adapter holds lora_B tensors without their lora_A")
    return pairs, rank


def _shape(arch: ModelArch, projection: str, parts: tuple[str | None, ...]) -> tuple[int, list[int]]:
    """(in_features, rows of each part) of a projection in the whole (unsharded) model."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    part_rows = {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}
    if projection == "self_attn.o_proj":
        return q, [arch.hidden_size]
    if projection == "mlp.down_proj":
        return inter, [arch.hidden_size]
    return arch.hidden_size, [part_rows[p] for p in parts]


def _alpha(config: dict, module_name: str) -> float:
    """lora_alpha, or the alpha_pattern entry matching this module (peft's rule: the pattern
    matches the module's name or a dotted suffix of it)."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return float(alpha)
    return float(config.get("lora_alpha", 8))
