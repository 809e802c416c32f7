"""The cpu backend's mixture-of-experts MLP (kernels/cpu/moe.py: each expert packed for the
native product) against `reference.fused_moe` and against a per-token loop written from the
definition, so the grouping by expert is checked too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.kernels import ops, reference
from ferry.kernels.cpu import moe as cpu_moe
from ferry.kernels.cpu import native


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, used: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, used, generator=g)  # only the first `used` experts are ever chosen
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def _per_token(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


CASES = {  # tokens, hidden, inter, experts, top_k, experts in use
    "decode": (1, 64, 48, 8, 2, 8),
    "batch": (33, 96, 80, 8, 2, 8),
    "unused-experts": (17, 64, 40, 6, 3, 3),
    "top1": (9, 64, 16, 4, 1, 4),
    "narrow": (5, 24, 20, 16, 4, 16),  # widths not a multiple of the 16-column panels
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_experts_match_the_reference(case):
    assert native.available()
    x, w13, w2, weights, ids = _case(*CASES[case], seed=len(case))
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(expected, _per_token(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)
    packed13, packed2 = cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2)
    assert packed13 is not None and len(packed13.experts) == w13.shape[0]
    got = ops.fused_moe(x, packed13, packed2, weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_row_is_the_same_alone_and_in_a_batch():
    x, w13, w2, weights, ids = _case(*CASES["batch"], seed=3)
    packed13, packed2 = cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2)
    batched = ops.fused_moe(x, packed13, packed2, weights, ids)
    alone = ops.fused_moe(x[5:6], packed13, packed2, weights[5:6], ids[5:6])
    torch.testing.assert_close(alone[0], batched[5], rtol=1e-6, atol=1e-6)


def test_half_precision_experts_are_not_packed():
    assert cpu_moe.pack_experts(torch.zeros(2, 32, 16, dtype=torch.bfloat16)) is None
