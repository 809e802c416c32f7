"""The mixture-of-experts MLP on the cpu backend: each expert's projections packed for the native
product (`native.pack_weight`), the tokens grouped by expert as in `reference.fused_moe`, so an
expert runs one register-blocked product per projection however many tokens chose it. The rows
are gathered once and scattered back once per layer (not once per expert): on a busy 2-core host
each small two-thread op waits for a paused thread, and per-expert ones added up to most of a step."""

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
    groups = list(reference.expert_groups(topk_weights, topk_ids, len(w13.experts)))
    rows = torch.cat([group_rows for _, group_rows, _ in groups])  # [T * top_k] tokens, grouped by expert
    gathered = x.index_select(0, rows)  # [T * top_k, hidden]
    products = torch.empty(rows.numel(), w2.out_features, dtype=torch.float32)
    start = 0
    for expert, group_rows, weights in groups:
        end = start + group_rows.numel()
        hidden = native.silu_and_mul(native.linear(gathered[start:end], w13.experts[expert]))
        torch.mul(native.linear(hidden, w2.experts[expert]), weights[:, None], out=products[start:end])
        start = end
    # One scatter: index_add_ adds the rows in order, so each token's experts are summed in
    # ascending order from zero, as reference.fused_moe (and transformers) sum them.
    return torch.zeros_like(x).index_add_(0, rows, products.to(x.dtype))
