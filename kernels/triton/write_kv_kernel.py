"""Triton reshape-and-cache: scatter one step's new K/V rows into the paged pool.

One program per token copies all of its KV heads for both K and V. A program whose slot is -1
(a token whose K/V is not kept, e.g. padding) returns at once.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    value_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM]
    slot_mapping_ptr,  # [num_tokens] int64: block_id * BLOCK_SIZE + offset, -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_vcb,
    stride_vch,
    stride_vct,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kcb + heads * stride_kch + in_block * stride_kct + dims,
        key.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vcb + heads * stride_vch + in_block * stride_vct + dims,
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset, -1 = skip
) -> None:
    """Same contract as `kernels.reference.write_kv`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = k_cache.shape[2]
    if num_tokens == 0:
        return
    if min(key.stride(-1), value.stride(-1), k_cache.stride(-1), v_cache.stride(-1)) != 1:
        raise ValueError("key, value and the caches need a contiguous last dimension")
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
    )
