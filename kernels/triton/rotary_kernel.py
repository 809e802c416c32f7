"""Triton rotary position embedding for q and k in one launch.

One program per token reads its cos/sin row once and rotates every query and key head. Both
layouts of the reference: neox rotates the two halves of a head (x[i], x[i + D/2]); gpt-j
rotates interleaved pairs (x[2i], x[2i+1]). Scaled variants (llama3, linear, ...) differ only in
how the engine builds `cos_sin_cache`, so one kernel serves them all.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    out_ptr,  # [NUM_HEADS, 2 * HALF]: this token's row of the output
    x_ptr,  # [NUM_HEADS, 2 * HALF]: this token's row of the input
    stride_oh,
    stride_xh,
    first,  # [HALF_PAD] offsets of the first element of each rotated pair
    second,  # [HALF_PAD] offsets of the second element
    pair_ok,  # [HALF_PAD]
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    mask = (heads < NUM_HEADS) & pair_ok[None, :]
    x_row = x_ptr + heads * stride_xh
    # Like the reference, multiply by cos/sin rounded to x's dtype.
    c = cos.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    s = sin.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    x1 = tl.load(x_row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + heads * stride_oh
    tl.store(out_row + first[None, :], (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + second[None, :], (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,  # [num_tokens, NUM_HEADS, 2 * HALF]
    k_out_ptr,  # [num_tokens, NUM_KV_HEADS, 2 * HALF]
    q_ptr,  # [num_tokens, NUM_HEADS, 2 * HALF]
    k_ptr,  # [num_tokens, NUM_KV_HEADS, 2 * HALF]
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_positions, 2 * HALF] fp32: cos in [:, :HALF], sin in [:, HALF:]
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    KV_HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    pair_ok = pairs < HALF
    cos = tl.load(cos_sin_ptr + position * stride_cs + pairs, mask=pair_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + pairs, mask=pair_ok, other=0.0)
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    q_out, q_in = q_out_ptr + token * stride_qot, q_ptr + token * stride_qt
    _rotate_heads(q_out, q_in, stride_qoh, stride_qh, first, second, pair_ok, cos, sin, NUM_HEADS, HEADS_PAD)
    k_out, k_in = k_out_ptr + token * stride_kot, k_ptr + token * stride_kt
    _rotate_heads(k_out, k_in, stride_koh, stride_kh, first, second, pair_ok, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD)


def rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.reference.rotary`: new rotated (q, k)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"head_dim {head_dim} must be even and match cos_sin_cache {tuple(cos_sin_cache.shape)}")
    if min(q.stride(-1), k.stride(-1), cos_sin_cache.stride(-1)) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q_out,
        k_out,
        q,
        k,
        positions,
        cos_sin_cache,
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        IS_NEOX=is_neox,
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
        enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
    )
    return q_out, k_out
