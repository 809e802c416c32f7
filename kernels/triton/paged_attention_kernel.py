"""Triton paged attention over the block pool, for the flat varlen batch of one engine step.

One kernel serves prefill chunks, decode tokens and speculative verification alike. A program
owns BLOCK_Q consecutive query tokens of one sequence and one KV head; its BLOCK_M rows are
those tokens times the GROUP query heads that share the KV head (grouped-query attention), so
each K/V tile is loaded once for the whole group. The program walks its sequence's context in
tiles of TILE positions, looking up each position's pool block in the block table, and keeps a
float32 online softmax (log2 domain).

Split-KV (flash decoding): when the batch has too few (sequence, query block, KV head) programs
to fill the GPU, a third grid axis cuts every context into `num_splits` ranges; each program
writes an unnormalised partial result and `_merge_splits_kernel` combines them. The host
wrapper `paged_attention` picks tile sizes and the split count from the step's metadata.

Per-layer options, each a constexpr flag beside its runtime value (off: the kernel is the one
without them):
- WINDOW (sliding window, `window` positions): a program's walk starts at the tile holding its
  first row's oldest visible position, so tiles wholly before every row's window are never
  loaded; the splits cut that shorter range. Tiles that straddle some row's window edge take
  the mask, the ones every row sees whole stay unmasked.
- SOFTCAP (Gemma 2): the natural-scale logits s become softcap * tanh(s / softcap). In the
  log2 domain, with s2 = s * log2(e), that is softcap_log2 * tanh(s2 / softcap_log2) with
  softcap_log2 = softcap * log2(e): the same cap, no extra multiply.

The file names end in `_kernel` because `kernels/ops.py` defines functions with the bare
names (`kernels.paged_attention`); a submodule of the same name would replace them on import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

import triton
import triton.language as tl
from ferry.kernels.metadata import AttentionMetadata
from ferry.kernels.reference import check_attention_options
from ferry.kernels.triton.dot import dot

_LOG2E = 1.4426950408889634
# Split-KV aims for this many programs per streaming multiprocessor ...
_PROGRAMS_PER_SM = 4
# ... but gives every split at least this many KV tiles, so the merge stays a small cost.
_MIN_TILES_PER_SPLIT = 4


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter and every GPU target have it): sign(x) (1 - e) / (1 + e)
    with e = exp(-2 |x|) in (0, 1], which neither overflows nor loses the sign."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e): a literal, jit code reads no globals
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32: unnormalised output so far
    m_i,  # [BLOCK_M] fp32: running max of the scores (log2 domain)
    l_i,  # [BLOCK_M] fp32: running softmax denominator
    q,  # [BLOCK_M, HEAD_DIM_PAD] in the cache dtype
    k_head,  # k_cache_ptr advanced to this program's KV head
    v_head,  # v_cache_ptr advanced to this program's KV head
    block_table,  # [max_blocks_per_seq] int32: this sequence's row of block_tables
    lo,  # first context position (a multiple of TILE)
    hi,  # one past the last position this call walks
    kv_hi,  # one past the last position that exists for this program
    last_visible,  # [BLOCK_M] int32: last position each row sees
    scale_log2,
    window,  # sliding window (WINDOW only): row sees last_visible - window < pos <= last_visible
    softcap_log2,  # softcap * log2(e) (SOFTCAP only)
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    dims,  # [HEAD_DIM_PAD] int32
    dim_ok,  # [HEAD_DIM_PAD] bool
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # apply the causal, window and end-of-context mask (else every position is visible)
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax over positions lo .. hi in TILE steps, gathering K/V through the block table."""
    offs = tl.arange(0, TILE)
    for tile_start in range(lo, hi, TILE):
        pos = tile_start + offs
        pos_ok = pos < kv_hi
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        # k: [HEAD_DIM_PAD, TILE], already transposed for q @ k
        k = tl.load(
            k_head + block[None, :] * stride_kb + in_block[None, :] * stride_kt + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        s = dot(q, k, FP32_DOT) * scale_log2
        if SOFTCAP:
            s = softcap_log2 * _tanh(s / softcap_log2)
        if MASKED:
            visible = pos_ok[None, :] & (pos[None, :] <= last_visible[:, None])
            if WINDOW:
                visible = visible & (pos[None, :] > last_visible[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead of inf - inf.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(s - m_new_safe[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # v: [TILE, HEAD_DIM_PAD]
        v = tl.load(
            v_head + block[:, None] * stride_vb + in_block[:, None] * stride_vt + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, FP32_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM] (unused when SPLIT)
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32 (SPLIT only)
    part_max_ptr,  # [num_tokens, num_heads, num_splits] fp32: running max, log2 domain (SPLIT only)
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] fp32: softmax denominator (SPLIT only)
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    work_ptr,  # [num_work, 2] int32: (sequence, query block) of each program along axis 0
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window in positions (read when WINDOW)
    softcap_log2,  # logit soft-cap * log2(e) (read when SOFTCAP)
    tiles_per_split,  # KV tiles in each split's range
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP rounded up to a power of two
    TILE: tl.constexpr,  # KV positions per loop iteration
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    SPLIT: tl.constexpr,  # write partial results for _merge_splits_kernel
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding-window attention
    SOFTCAP: tl.constexpr,  # logit soft-capping
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(work_ptr + 2 * work)
    q_block = tl.load(work_ptr + 2 * work + 1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r is query token q_pos of this sequence, query head `head`.
    rows = tl.arange(0, BLOCK_M)
    q_pos = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_pos < q_len)
    token = (q_start + q_pos).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)

    # Causal: query token q_pos sees context positions 0 .. context_len + q_pos.
    last_visible = context_len + q_pos
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    if WINDOW:
        # The first row's window starts earliest; whole tiles before it are skipped.
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0) // TILE * TILE
    else:
        kv_start = 0
    kv_lo = kv_start + split * tiles_per_split * TILE
    kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * TILE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # Every row sees the positions before context_len + q_block * BLOCK_Q + 1: whole tiles there
    # need no causal mask (most of a long prefill, all but the last tile of a decode).
    all_visible = tl.minimum(kv_hi, context_len + q_block * BLOCK_Q + 1)
    if WINDOW:
        # ... and, with a window, only from the last real row's oldest visible position on: the
        # tiles before that straddle some row's window edge and take the mask.
        q_last = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
        in_all_windows = context_len + q_last - window + 1
        unmasked_lo = tl.minimum(kv_hi, tl.maximum(kv_lo, (in_all_windows + TILE - 1) // TILE * TILE))
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_head, v_head, block_table, kv_lo, unmasked_lo, kv_hi, last_visible, scale_log2,
            window, softcap_log2, stride_kb, stride_kt, stride_vb, stride_vt, dims, dim_ok, TILE, BLOCK_SIZE, True,
            FP32_DOT, WINDOW, SOFTCAP,
        )  # fmt: skip
    else:
        unmasked_lo = kv_lo
    unmasked_hi = tl.maximum(unmasked_lo, all_visible // TILE * TILE)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_head, v_head, block_table, unmasked_lo, unmasked_hi, kv_hi, last_visible, scale_log2,
        window, softcap_log2, stride_kb, stride_kt, stride_vb, stride_vt, dims, dim_ok, TILE, BLOCK_SIZE, False,
        FP32_DOT, WINDOW, SOFTCAP,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_head, v_head, block_table, unmasked_hi, kv_hi, kv_hi, last_visible, scale_log2,
        window, softcap_log2, stride_kb, stride_kt, stride_vb, stride_vt, dims, dim_ok, TILE, BLOCK_SIZE, True,
        FP32_DOT, WINDOW, SOFTCAP,
    )  # fmt: skip

    if SPLIT:
        num_splits = tl.num_programs(2)
        part = (token * (tl.num_programs(1) * GROUP) + head) * num_splits + split
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM_PAD] fp32
    part_max_ptr,  # [num_tokens, num_heads, num_splits] fp32
    part_sum_ptr,  # [num_tokens, num_heads, num_splits] fp32
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * tl.num_programs(1) + head
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = row * num_splits + splits
    # Some split holds each token's own position, which it always sees: m_max is finite. A split
    # that saw nothing of this token (past a short context, or before a sliding window) has
    # m = -inf, l = 0 and acc = 0: it weighs 0.
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)
    total = tl.sum(weight * tl.load(part_sum_ptr + part, mask=split_ok, other=0.0), 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass(frozen=True)
class _LaunchConfig:
    block_m: int  # rows per program
    block_q: int  # query tokens per program
    tile: int  # KV positions per iteration
    num_warps: int
    num_stages: int
    split_kv: bool  # decode-like: few rows per program, so long contexts may be split


@dataclass
class TritonPlan:
    """Per-step work lists, shared by every layer of the step (kept in meta.plans.triton)."""

    work: dict[int, torch.Tensor] = field(default_factory=dict)  # block_q -> [num_work, 2] int32


def _launch_config(meta: AttentionMetadata, group: int, head_dim_pad: int) -> _LaunchConfig:
    """Small row blocks when every sequence brings few query tokens (decode, speculative
    verification); large ones for prefill chunks, where K/V reuse across rows matters."""
    if meta.max_query_len * group <= 16:
        block_m = max(16, triton.next_power_of_2(group))
        return _LaunchConfig(block_m, block_m // group, tile=64, num_warps=4, num_stages=2, split_kv=True)
    block_m = max(128 if head_dim_pad <= 128 else 64, triton.next_power_of_2(group))
    num_warps = 8 if head_dim_pad >= 128 else 4
    return _LaunchConfig(block_m, block_m // group, tile=64, num_warps=num_warps, num_stages=2, split_kv=False)


def _work(meta: AttentionMetadata, block_q: int) -> torch.Tensor:
    """(sequence, query block) pairs, the longest context first so the GPU's last wave is short."""
    plan = meta.plans.triton
    if plan is None:
        plan = meta.plans.triton = TritonPlan()
    cached = plan.work.get(block_q)
    if cached is not None:
        return cached
    items = []
    for seq, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        context_len = seq_len - q_len
        for q_block in range(-(-q_len // block_q)):
            kv_end = min(seq_len, context_len + (q_block + 1) * block_q)
            items.append((kv_end, seq, q_block))
    items.sort(key=lambda item: -item[0])
    work = torch.tensor([[seq, q_block] for _, seq, q_block in items], dtype=torch.int32).view(-1, 2)
    work = work.to(meta.query_start_loc.device)
    plan.work[block_q] = work
    return work


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(device: torch.device, num_programs: int, max_seq_len: int, tile: int) -> int:
    """Enough KV splits to give every SM a few programs, none shorter than a few tiles."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: more of them only cost time
    sms = _sm_count(device)
    wanted = -(-_PROGRAMS_PER_SM * sms // num_programs)
    most = max(1, -(-max_seq_len // tile) // _MIN_TILES_PER_SPLIT)
    return max(1, min(wanted, most))


def choose_variant(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    meta: AttentionMetadata,
    num_splits: int | None = None,
    window: int | None = None,
) -> tuple[_LaunchConfig, torch.Tensor, int, int]:
    """Launch configuration, work list, split count and KV tiles per split for one call."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    config = _launch_config(meta, num_heads // num_kv_heads, triton.next_power_of_2(q.shape[2]))
    work = _work(meta, config.block_q)
    # The longest range of positions one program walks: the whole context, or with a window
    # from the tile holding its first row's window start (up to TILE - 1 before it) through
    # its BLOCK_Q rows.
    span = meta.max_seq_len
    if window is not None:
        span = min(span, window + config.block_q + config.tile - 2)
    if num_splits is None:
        # Prefill programs have rows enough to keep an SM busy; decode ones need the splits.
        num_programs = work.shape[0] * num_kv_heads
        num_splits = _num_splits(q.device, num_programs, span, config.tile) if config.split_kv else 1
    total_tiles = -(-span // config.tile)
    tiles_per_split = -(-total_tiles // max(1, num_splits))
    return config, work, -(-total_tiles // tiles_per_split), tiles_per_split


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,  # force the split-KV count (tests, benchmarks); None = choose
    window: int | None = None,  # sliding window in positions; None = full causal attention
    softcap: float | None = None,  # logit soft-cap; None = none
) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention`."""
    check_attention_options(window, softcap)
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two, got {block_size}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    if meta.num_seqs == 0:
        return out
    head_dim_pad = triton.next_power_of_2(head_dim)
    config, work, num_splits, tiles_per_split = choose_variant(q, k_cache, meta, num_splits, window)
    split = num_splits > 1
    tokens = meta.num_tokens
    if split:
        part_acc = torch.empty(tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_max = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched when SPLIT is off
    _paged_attention_kernel[(work.shape[0], num_kv_heads, num_splits)](
        out,
        part_acc,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        work,
        scale * _LOG2E,
        0 if window is None else int(window),
        0.0 if softcap is None else softcap * _LOG2E,
        tiles_per_split,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        TILE=config.tile,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLIT=split,
        FP32_DOT=k_cache.dtype == torch.float32 or not q.is_cuda,
        WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
    )
    if split:
        _merge_splits_kernel[(tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim_pad * num_splits >= 4096 else 2,
            enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
        )
    return out
