"""Triton batched multi-LoRA (Punica's BGMV): y[t] += lora_b[s] @ (lora_a[s] @ x[t]), s the slot of
row t, for a batch that mixes many adapters and rows without any, in two launches whatever the mix.

1. `_shrink_kernel`: per row and split of the input dim, the partial products x[t] @ lora_a[s]^T
   in float32 -> s_part [T, SPLIT_K, R]. Splitting the input dim gives a decode batch of a few
   rows enough programs to fill the GPU; each split writes its own partial (no atomics, so the
   result does not depend on the order programs run in).
2. `_expand_kernel`: per row and block of output columns, the sum of the row's partials (its
   [R] intermediate, never rounded) times lora_b[s] rows, added to y in float32, rounded once.

Each program reads its row's slot and indexes the stacked weights with it; rows with slot -1
return at once, in both kernels (their s_part rows are never written nor read). The products
are plain reductions, not `tl.dot`: one row against a rank of 8 to a few hundred is far below a
tensor-core tile, and the kernels are bound by reading the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from ferry.kernels.metadata import LoraMapping

# Programs the shrink aims for (about two per SM of an H100), and the fewest input columns a split
# covers: past that, more splits only add partials to sum.
_TARGET_PROGRAMS = 256
_MIN_SPLIT_COLUMNS = 512
_MAX_SPLITS = 16
_TILE = 4096  # elements of a weight tile per program and loop iteration


@triton.jit
def _shrink_kernel(
    s_ptr,  # [num_tokens, SPLIT_K, rank] float32: partial x[t] @ lora_a[s]^T of each input split
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [num_slots, rank, in_features]
    slot_ptr,  # [num_tokens] int64: the row's slot, -1 = no adapter
    rank,
    in_features,
    k_per_split,  # input columns per split, a multiple of BLOCK_K
    stride_xt,
    stride_as,
    stride_ar,
    stride_st,
    SPLIT_K: tl.constexpr,  # splits of the input dim, a power of two
    R_PAD: tl.constexpr,  # rank rounded up to a power of two (at least 16)
    BLOCK_K: tl.constexpr,  # input columns per loop iteration
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    rs = tl.arange(0, R_PAD)
    r_ok = rs < rank
    a = a_ptr + slot * stride_as
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)  # a split past the end sums nothing: zeros
    acc = tl.zeros([R_PAD], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        xk = tl.load(x_ptr + row * stride_xt + ks, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        # ak: [R_PAD, BLOCK_K], rows of lora_a[slot]
        ak = tl.load(a + rs[:, None] * stride_ar + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    tl.store(s_ptr + row * stride_st + split * rank + rs, acc, mask=r_ok)


@triton.jit
def _expand_kernel(
    y_ptr,  # [num_tokens, out_features]: updated in place
    s_ptr,  # [num_tokens, SPLIT_K, rank] float32: the shrink's partials
    b_ptr,  # [num_slots, out_features, rank]
    slot_ptr,  # [num_tokens] int64: the row's slot, -1 = no adapter
    rank,
    out_features,
    stride_yt,
    stride_bs,
    stride_bn,
    stride_st,
    SPLIT_K: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output columns per program
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    rs = tl.arange(0, R_PAD)
    r_ok = rs < rank
    splits = tl.arange(0, SPLIT_K)
    parts = tl.load(s_ptr + row * stride_st + splits[:, None] * rank + rs[None, :], mask=r_ok[None, :], other=0.0)
    s = tl.sum(parts, axis=0)  # [R_PAD]: lora_a[slot] @ x[row]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    col_ok = cols < out_features
    # b: [BLOCK_N, R_PAD], rows of lora_b[slot]
    b = tl.load(
        b_ptr + slot * stride_bs + cols[:, None] * stride_bn + rs[None, :],
        mask=col_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * s[None, :], axis=1)  # [BLOCK_N]
    y = tl.load(y_ptr + row * stride_yt + cols, mask=col_ok, other=0.0)
    tl.store(y_ptr + row * stride_yt + cols, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def _num_splits(num_tokens: int, in_features: int) -> int:
    """Splits of the input dim per row, a power of two: enough programs for a few rows, each
    split still at least `_MIN_SPLIT_COLUMNS` wide."""
    wanted = triton.next_power_of_2(triton.cdiv(_TARGET_PROGRAMS, num_tokens))
    widest = max(1, in_features // _MIN_SPLIT_COLUMNS)
    return min(wanted, 1 << (widest.bit_length() - 1), _MAX_SPLITS)


@dataclass(frozen=True)
class Tiles:
    """Tile sizes for a rank: each weight tile [R_PAD, BLOCK_K] or [BLOCK_N, R_PAD] holds about `_TILE` elements."""

    r_pad: int  # rank rounded up to a power of two, at least 16
    block_k: int  # shrink: input columns per loop iteration
    block_n: int  # expand: output columns per program

    @classmethod
    def for_rank(cls, rank: int) -> Tiles:
        r_pad = max(16, triton.next_power_of_2(rank))
        return cls(r_pad, block_k=max(16, min(256, _TILE // r_pad)), block_n=max(16, min(128, _TILE // r_pad)))


def add_lora(
    y: torch.Tensor,  # [T, out]: updated in place; its last dim must be contiguous
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [num_slots, R, in]
    lora_b: torch.Tensor,  # [num_slots, out, R]
    mapping: LoraMapping,
) -> None:
    """Same contract as `kernels.reference.add_lora`."""
    num_tokens, out_features = y.shape
    num_slots, rank, in_features = lora_a.shape
    if x.shape != (num_tokens, in_features) or lora_b.shape != (num_slots, out_features, rank):
        raise ValueError(
            f"add_lora shapes disagree: y {tuple(y.shape)}, x {tuple(x.shape)}, "
            f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}"
        )
    if mapping.slot_of_row.shape != (num_tokens,):
        raise ValueError(f"mapping has {mapping.slot_of_row.shape[0]} rows, the batch {num_tokens}")
    if y.stride(1) != 1:
        raise ValueError("add_lora writes y in place: its last dimension must be contiguous")
    if num_tokens == 0 or not mapping.active:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()  # no copy for the stacks the engine holds
    split_k = _num_splits(num_tokens, in_features)
    tiles = Tiles.for_rank(rank)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), tiles.block_k) * tiles.block_k
    s_part = torch.empty(num_tokens, split_k, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens, split_k)](
        s_part, x, lora_a, mapping.slot_of_row, rank, in_features, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), s_part.stride(0),
        SPLIT_K=split_k, R_PAD=tiles.r_pad, BLOCK_K=tiles.block_k,
        num_warps=4, enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
    )  # fmt: skip
    _expand_kernel[(num_tokens, triton.cdiv(out_features, tiles.block_n))](
        y, s_part, lora_b, mapping.slot_of_row, rank, out_features,
        y.stride(0), lora_b.stride(0), lora_b.stride(1), s_part.stride(0),
        SPLIT_K=split_k, R_PAD=tiles.r_pad, BLOCK_N=tiles.block_n,
        num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
