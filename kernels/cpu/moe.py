"""The mixture-of-experts MLP on the cpu backend: each expert's projections packed for the native
product (`native.pack_weight`), the tokens grouped by expert as in `reference.fused_moe`, so an
expert runs one register-blocked product per projection however many tokens chose it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.kernels import reference
from ferry.kernels.cpu import native


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """One projection of every expert ([num_experts, out, in] in the checkpoint), each expert's
    matrix packed for `native.linear`."""

    experts: tuple[native.PackedWeight, ...]
    out_features: int
    in_features: int

    @property
    def held_tensors(self) -> list[torch.Tensor]:
        return [expert.panels for expert in self.experts]


def pack_experts(weights: torch.Tensor) -> PackedExperts | None:  # [num_experts, out, in]
    """Each expert's matrix packed, or None where the packed product cannot run them (not float32,
    no native build): the caller keeps the tensor and gets the reference."""
    packed = [native.pack_weight(weight) for weight in weights]
    if not packed or any(p is None for p in packed):
        return None
    return PackedExperts(tuple(packed), weights.shape[1], weights.shape[2])


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: PackedExperts,  # gate rows then up rows, per expert
    w2: PackedExperts,  # down, per expert
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    out = torch.zeros_like(x)
    for expert, rows, weights in reference.expert_groups(topk_weights, topk_ids, len(w13.experts)):
        hidden = native.silu_and_mul(native.linear(x[rows], w13.experts[expert]))
        out.index_add_(0, rows, (native.linear(hidden, w2.experts[expert]) * weights[:, None]).to(out.dtype))
    return out
