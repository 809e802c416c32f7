"""Triton fused mixture-of-experts MLP, designed like vLLM's fused_moe: grouped GEMMs over
(token, slot) pairs sorted by expert, so each program multiplies one expert's weight tiles
by a block of that expert's tokens, instead of one product per expert launched from Python.

1. Host (`_align_blocks`, torch, no host sync): sort the T * top_k pairs by expert and pad
   each expert's group to a multiple of BLOCK_M, giving `sorted_ids` (pair ids, padding =
   num_pairs) and `block_expert` (the expert of each M-block, -1 past the used blocks).
2. `_gate_up_kernel`: per M-block and N-tile of the intermediate dim, gate and up tiles of
   x[tokens] @ w13[e]^T in float32, epilogue silu(gate) * up -> h [num_pairs, inter].
3. `_down_kernel`: per M-block and N-tile of hidden, h @ w2[e]^T, epilogue times the pair's
   routing weight -> per-pair rows [num_pairs, hidden].
4. Host: sum each token's top_k rows (float32), cast to x's dtype.

Rounding: the epilogues work in float32 and round only what is stored (h, the per-pair rows,
the output) to x's dtype; the reference also rounds gate, up and silu. Fewer roundings keep
bfloat16 runs under the interpreter, which truncates float32 -> bfloat16, within tolerance.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from ferry.kernels.triton.dot import dot


@triton.jit
def _gate_up_kernel(
    h_ptr,  # [num_pairs, inter]: silu(gate) * up of each (token, slot) pair
    x_ptr,  # [num_tokens, hidden]
    w13_ptr,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int64: pair ids grouped by expert, num_pairs = padding
    block_expert_ptr,  # [num_blocks] int64: expert of each M-block, -1 = unused block
    num_pairs,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns of the intermediate dim per program
    BLOCK_K: tl.constexpr,  # hidden per loop iteration
    FP32_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate columns
    col_ok = cols < inter
    w = w13_ptr + expert * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        # a: [BLOCK_M, BLOCK_K] rows of x; gate, up: [BLOCK_K, BLOCK_N], w13[e] rows transposed
        a = tl.load(x_ptr + token[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        up = tl.load(w + (inter + cols[None, :]) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc_gate += dot(a, gate, FP32_DOT)
        acc_up += dot(a, up, FP32_DOT)
    act = acc_gate / (1.0 + tl.exp(-acc_gate))  # silu(gate)
    tl.store(
        h_ptr + pair.to(tl.int64)[:, None] * stride_ht + cols[None, :],
        (act * acc_up).to(h_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    out_ptr,  # [num_pairs, hidden]: routing weight * down(h) of each pair
    h_ptr,  # [num_pairs, inter]
    w2_ptr,  # [num_experts, hidden, inter]
    weights_ptr,  # [num_pairs] float32: routing weights
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int64
    block_expert_ptr,  # [num_blocks] int64
    num_pairs,
    hidden,
    inter,
    stride_we,
    stride_wn,
    stride_ht,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # hidden columns per program
    BLOCK_K: tl.constexpr,  # intermediate dim per loop iteration
    FP32_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    row_ok = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns
    col_ok = cols < hidden
    w = w2_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        # a: [BLOCK_M, BLOCK_K] rows of h; b: [BLOCK_K, BLOCK_N], w2[e] rows transposed
        a = tl.load(h_ptr + pair[:, None] * stride_ht + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += dot(a, b, FP32_DOT)
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # [BLOCK_M]
    out = (acc * weight[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + pair[:, None] * stride_ot + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def _align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks * block_m], block_expert [num_blocks]), sized for the worst case
    (every used expert's group padded by block_m - 1), so nothing waits on the device."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    # Pair i of the sorted order is the (i - start[e])-th of its expert e: slot padded_start[e] + that.
    expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[(padded_end - padded)[expert] + rank] = order
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """Same contract as `kernels.reference.fused_moe`."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    # Small blocks when each expert gets few pairs (decode): less padding, fewer wasted rows.
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    sorted_ids, block_expert = _align_blocks(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    fp32_dot = x.dtype == torch.float32 or not x.is_cuda
    block_k = 32 if x.dtype == torch.float32 else 64
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [num_pairs, inter]
    block_n = min(64, max(16, triton.next_power_of_2(inter)))
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        h, x, w13, sorted_ids, block_expert, num_pairs, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot,
        num_warps=4, num_stages=3, enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
    )  # fmt: skip
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [num_pairs, hidden]
    block_n = min(64, max(16, triton.next_power_of_2(hidden)))
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        per_pair, h, w2, topk_weights.reshape(-1).to(torch.float32).contiguous(), sorted_ids, block_expert,
        num_pairs, hidden, inter, w2.stride(0), w2.stride(1), h.stride(0), per_pair.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot,
        num_warps=4, num_stages=3, enable_fp_fusion=True,
    )  # fmt: skip
    # Pair t * top_k + j is token t's slot j: sum the slots in float32, round once.
    return per_pair.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
