"""The mixture-of-experts MLP on the cpu backend: each expert's projections packed for the native
product (`native.pack_weight`) or kept in quantized blocks (a GGUF file's, or int8 made at load:
`quantized_experts`), the tokens grouped by expert as in `reference.fused_moe`, so an expert runs
one register-blocked (or fused-dequantization) product per projection however many tokens chose it. The rows
are gathered once and scattered back once per layer (not once per expert): on a busy 2-core host
each small two-thread op waits for a paused thread, and per-expert ones added up to most of a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferry.kernels import reference
from ferry.kernels.cpu import native
from ferry.kernels.cpu.quantized import QuantizedParts, QuantizedWeight

# One expert's matrix as `native.linear` reads it: packed float32, kept quantized (one type, or
# gate and up rows in two), or a plain tensor (F.linear) where neither native product runs it.
ExpertMatrix = native.PackedWeight | QuantizedWeight | QuantizedParts | torch.Tensor


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """One projection of every expert ([num_experts, out, in] in the checkpoint), each expert's
    matrix as `native.linear` reads it."""

    experts: tuple[ExpertMatrix, ...]
    out_features: int
    in_features: int

    @property
    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors holding the experts' bytes (a module registers them, so they count as weights)."""
        held = []
        for expert in self.experts:
            if isinstance(expert, QuantizedParts):
                held.extend(part.tiles for part in expert.parts)
            elif isinstance(expert, QuantizedWeight):
                held.append(expert.tiles)
            else:
                held.append(expert if isinstance(expert, torch.Tensor) else expert.panels)
        return held

    @property
    def qtype(self) -> str:  # for logs and repr: the experts' types, "packed" or "float"
        kinds = {getattr(e, "qtype", "float" if isinstance(e, torch.Tensor) else "packed") for e in self.experts}
        return "/".join(sorted(kinds))


def pack_experts(weights: torch.Tensor) -> PackedExperts | None:  # [num_experts, out, in]
    """Each expert's matrix packed, or None where the packed product cannot run them (not float32,
    no native build): the caller keeps the tensor and gets the reference."""
    packed = [native.pack_weight(weight) for weight in weights]
    if not packed or any(p is None for p in packed):
        return None
    return PackedExperts(tuple(packed), weights.shape[1], weights.shape[2])


def unpacked_experts(weights: torch.Tensor) -> PackedExperts:  # [num_experts, out, in]
    """Each expert's matrix as it is (F.linear): for the float projection of a layer whose other
    projection is kept quantized, where no native build packs it."""
    return PackedExperts(tuple(weights.unbind(0)), weights.shape[1], weights.shape[2])


def quantized_experts(weights: Sequence[QuantizedWeight | QuantizedParts]) -> PackedExperts:
    """One projection of every expert kept in quantized blocks (expert e's matrix: weights[e]).
    Raises ValueError unless the experts share one shape."""
    shapes = {(w.out_features, w.in_features) for w in weights}
    if len(shapes) != 1:
        raise ValueError(f"the experts of one projection must share one shape, got {sorted(shapes)}")
    (out_features, in_features), = shapes
    return PackedExperts(tuple(weights), out_features, in_features)


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: PackedExperts,  # gate rows then up rows, per expert
    w2: PackedExperts,  # down, per expert
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    rows, weights, spans = reference.sort_by_expert(topk_weights, topk_ids, len(w13.experts))
    gathered = x.index_select(0, rows)  # [T * top_k, hidden]: tokens grouped by expert
    # Each expert's products write their own row range of one buffer, so the activation and the
    # router weights run once for the layer (per expert, these small calls were ~4% of a step).
    gate_up = torch.empty(rows.numel(), w13.out_features, dtype=torch.float32)
    for expert, start, end in spans:
        native.linear(gathered[start:end], w13.experts[expert], out=gate_up[start:end])
    hidden = native.silu_and_mul(gate_up)  # [T * top_k, inter]
    products = torch.empty(rows.numel(), w2.out_features, dtype=torch.float32)
    for expert, start, end in spans:
        native.linear(hidden[start:end], w2.experts[expert], out=products[start:end])
    products.mul_(weights.unsqueeze(1))
    # One scatter: index_add_ adds the rows in order, so each token's experts are summed in
    # ascending order from zero, as reference.fused_moe (and transformers) sum them.
    return torch.zeros_like(x).index_add_(0, rows, products.to(x.dtype))
