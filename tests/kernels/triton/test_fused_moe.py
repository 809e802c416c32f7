"""Triton fused MoE (sorted, block-padded grouped GEMMs) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import reference
from ferry.kernels.triton.fused_moe_kernel import _align_blocks, fused_moe
from tests.kernels.util import assert_close


def check_fused_moe(tokens, hidden, inter, experts, top_k, used_experts, dtype, device, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    # Distinct experts per token, drawn from the first `used_experts` only (the rest get no tokens).
    topk_ids = torch.stack([torch.randperm(used_experts, generator=gen)[:top_k] for _ in range(tokens)])
    # Not normalised, so top_k = 1 still checks that the weight is applied.
    topk_weights = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen)
    ref = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    out = fused_moe(x.to(device), w13.to(device), w2.to(device), topk_weights.to(device), topk_ids.to(device))
    assert_close(out.cpu(), ref, dtype)


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, used_experts, dtype",
    [
        (1, 64, 48, 4, 2, 4, torch.float32),
        (13, 96, 80, 8, 2, 8, torch.float32),
        (33, 64, 40, 6, 3, 3, torch.float32),
        (13, 96, 80, 8, 2, 8, torch.bfloat16),
        (7, 64, 48, 4, 1, 4, torch.float32),
        (5, 48, 24, 5, 4, 5, torch.float32),
        (70, 32, 24, 2, 2, 2, torch.float32),
    ],
    ids=["decode", "non-pow2", "unused-experts", "bf16", "top1", "top4", "multi-block"],
)
def test_fused_moe(tokens, hidden, inter, experts, top_k, used_experts, dtype, device, run):
    run(check_fused_moe, tokens, hidden, inter, experts, top_k, used_experts, dtype, device, seed=tokens + top_k)


def test_align_blocks():
    """Pairs grouped by expert in order, each group padded to whole blocks; unused blocks -1."""
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 2]])  # expert 1 has no pairs
    sorted_ids, block_expert = _align_blocks(topk_ids, num_experts=4, block_m=4)
    pad = 8  # num_pairs
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, 6, 7, pad, pad, pad, 3, pad, pad, pad] + [pad] * 4
    assert block_expert.tolist() == [0, 2, 2, 3, -1]
