"""The cpu backend's mixture-of-experts MLP (kernels/cpu/moe.py: each expert packed for the
native product) against `reference.fused_moe` and against a per-token loop written from the
definition, so the grouping by expert is checked too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

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


def _quantized(weights: torch.Tensor, qtype: str) -> list:  # [E, out, in] -> each expert in qtype's blocks
    kind = GGMLQuantizationType[qtype]
    return [ops.pack_quantized_weight(torch.from_numpy(quantize(w.numpy(), kind)), qtype, *w.shape) for w in weights]


def test_quantized_experts_match_the_reference_on_their_dequantized_weights():
    """Experts kept in blocks (a GGUF's): w13 with each expert's gate and up rows in two types
    side by side, w2 in one; then a float w2 beside quantized w13 (a file whose down experts are
    in a type the product cannot read). The product rounds x per block to int16, hence the bound."""
    x, w13, w2, weights, ids = _case(33, 64, 64, 8, 2, 8, seed=9)
    gate_up = [ops.QuantizedParts((gate, up)) for gate, up in zip(_quantized(w13[:, :64], "Q8_0"),
                                                                  _quantized(w13[:, 64:], "Q4_0"), strict=True)]
    q13, q2 = ops.quantized_experts(gate_up), ops.quantized_experts(_quantized(w2, "Q5_1"))
    assert (q13.qtype, q2.qtype, q13.out_features, q2.in_features) == ("Q8_0+Q4_0", "Q5_1", 128, 64)
    assert len(q13.held_tensors) == 16 and len(q2.held_tensors) == 8
    deq13 = torch.stack([e.dequantize() for e in q13.experts])
    deq2 = torch.stack([e.dequantize() for e in q2.experts])
    expected = reference.fused_moe(x, deq13, deq2, weights, ids)
    torch.testing.assert_close(ops.fused_moe(x, q13, q2, weights, ids), expected, rtol=2e-3, atol=2e-3)
    float2 = cpu_moe.pack_experts(w2)
    torch.testing.assert_close(ops.fused_moe(x, q13, float2, weights, ids),
                               reference.fused_moe(x, deq13, w2, weights, ids), rtol=2e-3, atol=2e-3)
    alone = ops.fused_moe(x[4:5], q13, q2, weights[4:5], ids[4:5])
    assert torch.equal(alone[0], ops.fused_moe(x, q13, q2, weights, ids)[4])  # a row's floats, whatever its batch


def test_quantized_experts_of_different_shapes_are_refused():
    experts = _quantized(torch.randn(2, 32, 64), "Q8_0") + _quantized(torch.randn(1, 16, 64), "Q8_0")
    with pytest.raises(ValueError, match="share one shape"):
        ops.quantized_experts(experts)


def test_products_write_a_row_range_of_one_buffer():
    """`native.linear(..., out=)`: each kind of expert matrix fills exactly its rows of a shared
    buffer with the floats it returns without `out`; an out of the wrong shape is refused."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 64, generator=g)
    x = torch.randn(5, 64, generator=g)
    parts = ops.QuantizedParts((ops.quantize_int8_weight(weight[:24]), _quantized(weight[None, 24:], "Q4_0")[0]))
    for matrix in (native.pack_weight(weight), ops.quantize_int8_weight(weight), parts, weight):
        buffer = torch.full((9, 40), 7.0)
        returned = native.linear(x, matrix, out=buffer[2:7])
        assert returned.data_ptr() == buffer[2:7].data_ptr()
        assert torch.equal(buffer[2:7], native.linear(x, matrix))
        assert (buffer[:2] == 7).all() and (buffer[7:] == 7).all()
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        native.linear(x, ops.quantize_int8_weight(weight), out=torch.empty(5, 41))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        native.linear(x, native.pack_weight(weight), out=torch.empty(10, 40)[::2])
