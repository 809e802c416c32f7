"""Triton paged attention against the PyTorch reference, on fresh random inputs per case."""

from __future__ import annotations

import zlib

import pytest
import torch

from ferry.kernels import reference
from ferry.kernels.metadata import AttentionMetadata
from ferry.kernels.triton import paged_attention_kernel
from ferry.kernels.triton.paged_attention_kernel import paged_attention
from tests.kernels.util import assert_close

# name -> (query_lens, seq_lens): one entry per sequence of the flat batch.
BATCHES = {
    "decode": ([1, 1, 1, 1], [37, 16, 5, 70]),
    "prefill": ([20, 16], [20, 16]),
    # Decode tokens beside a whole prompt and a chunk that continues a 16-token context.
    "mixed": ([1, 12, 1, 7], [33, 12, 48, 23]),
    "block_multiple": ([1, 32], [48, 32]),  # lengths that fill their last block exactly
    "length_one": ([1], [1]),
    "spec_verify": ([4, 3], [40, 19]),  # a few query tokens per sequence
    # Chunks after long contexts: query blocks whose first tiles need no causal mask.
    "chunked_prefill": ([40, 6], [150, 100]),
}
GQA = [(2, 2), (8, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 4, 8


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int,
):
    """Random q and cache; block ids drawn shuffled from a pool with spare blocks, so every
    table is non-contiguous and out of order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(pool[used : used + n])
        used += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, meta


def check(q, k_cache, v_cache, meta, *, num_splits=None, out=None) -> None:
    """Poison out with NaN, run the kernel, compare with the reference."""
    scale = q.shape[-1] ** -0.5
    expected = reference.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_on_cpu(meta), scale)
    if out is None:
        out = torch.full_like(q, float("nan"))
    result = paged_attention(q, k_cache, v_cache, meta, scale, out, num_splits=num_splits)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out.cpu(), expected, q.dtype)


def meta_on_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata.build(
        meta.query_lens_host,
        meta.seq_lens_host,
        meta.block_tables.cpu().tolist(),
        meta.block_size,
    )


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def check_case(query_lens, seq_lens, *, seed, num_splits=None, **shape) -> None:
    check(*make_case(query_lens, seq_lens, seed=seed, **shape), num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_batches(batch, heads, dtype, device, run):
    run(
        check_case,
        *BATCHES[batch],
        num_heads=heads[0],
        num_kv_heads=heads[1],
        dtype=dtype,
        device=device,
        seed=seed_of(batch, heads, dtype),
    )


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_head_dims(head_dim, device, run):
    run(
        check_case,
        *BATCHES["mixed"],
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device=device,
        seed=seed_of("head_dim", head_dim),
    )


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_block_sizes(block_size, device, run):
    run(
        check_case,
        *BATCHES["mixed"],
        num_heads=4,
        num_kv_heads=2,
        block_size=block_size,
        device=device,
        seed=seed_of("block_size", block_size),
    )


def test_float16(device, run):
    run(check_case, *BATCHES["mixed"], num_heads=8, num_kv_heads=2, dtype=torch.float16, device=device, seed=7)


# Contexts of several 64-position tiles, so each split owns real work and short sequences
# leave trailing splits empty.
SPLIT_BATCHES = {
    "decode": ([1, 1, 1], [300, 129, 64]),
    "mixed": ([1, 5, 1], [300, 140, 48]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("batch", list(SPLIT_BATCHES))
def test_split_kv(batch, num_splits, dtype, device, run):
    run(
        check_case,
        *SPLIT_BATCHES[batch],
        num_heads=4,
        num_kv_heads=1,
        dtype=dtype,
        device=device,
        num_splits=num_splits,
        seed=seed_of("split", batch, num_splits, dtype),
    )


def check_strided_views(device) -> None:
    q, k_cache, v_cache, meta = make_case(*BATCHES["mixed"], num_heads=4, num_kv_heads=2, device=device, seed=11)
    tokens = q.shape[0]
    qkv = torch.randn(tokens, 8 * 64, generator=torch.Generator().manual_seed(12)).to(device)
    qkv[:, : 4 * 64] = q.reshape(tokens, -1)
    wide = torch.full((tokens, 6, 64), float("nan"), device=device)
    check(qkv[:, : 4 * 64].view(tokens, 4, 64), k_cache, v_cache, meta, out=wide[:, 1:5])
    assert wide[:, 0].isnan().all() and wide[:, 5].isnan().all()


def test_strided_views(device, run):
    """q sliced from a fused qkv projection, out a view of a wider buffer: as a model passes them."""
    run(check_strided_views, device)


def check_plan_reuse(device) -> None:
    q, k_cache, v_cache, meta = make_case(*BATCHES["decode"], num_heads=4, num_kv_heads=2, device=device, seed=13)
    first = paged_attention(q, k_cache, v_cache, meta, 0.125)
    plan = meta.plans.triton
    second = paged_attention(q, k_cache, v_cache, meta, 0.125)  # the next layer of the same step
    assert meta.plans.triton is plan
    assert torch.equal(first, second)


def test_allocates_out_and_reuses_plan(device, run):
    run(check_plan_reuse, device)


def test_split_heuristic(monkeypatch):
    """Splits fill a 132-SM GPU with ~4 programs per SM, never below 4 tiles of context each."""
    monkeypatch.setattr(paged_attention_kernel, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert paged_attention_kernel._num_splits(cuda, 8, 32768, 64) == 66  # batch 1, 8 KV heads
    assert paged_attention_kernel._num_splits(cuda, 8, 1024, 64) == 4  # short: 4 tiles per split
    assert paged_attention_kernel._num_splits(cuda, 2048, 32768, 64) == 1  # the batch fills the GPU
    assert paged_attention_kernel._num_splits(torch.device("cpu"), 8, 32768, 64) == 1


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [None, 4])
def test_long_contexts(num_splits, device, run):
    run(
        check_case,
        [1, 1, 64, 1, 5],
        [1000, 517, 600, 16, 1024],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=torch.bfloat16,
        device=device,
        num_splits=num_splits,
        seed=seed_of("long", num_splits),
    )


# --- sliding window and logit soft-capping ------------------------------------------------------


def oracle_attention(q, k_cache, v_cache, meta, scale, *, window=None, softcap=None) -> torch.Tensor:
    """Paged attention from its definition, in float64, one sequence at a time: gather the
    sequence's K/V position by position through its block table; the query at position
    p = seq_len - query_len + r sees positions j with p - window < j <= p; the scaled logits
    are capped as softcap * tanh(s / softcap); softmax; weighted sum of V."""
    q, k_cache, v_cache = q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double()
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[1], meta.block_size
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        table = meta.block_tables[i].tolist()
        positions = torch.arange(seq_len)
        blocks = torch.tensor([table[j // block_size] for j in range(seq_len)])
        k = k_cache[blocks, :, positions % block_size].repeat_interleave(group, dim=1)  # [seq_len, heads, D]
        v = v_cache[blocks, :, positions % block_size].repeat_interleave(group, dim=1)
        rows = torch.arange(seq_len - query_len, seq_len)[:, None]  # each query's position
        seen = positions[None, :] <= rows
        if window is not None:
            seen &= positions[None, :] > rows - window
        qi = q[start : start + query_len]  # [query_len, heads, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~seen[None], float("-inf")), dim=-1)
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += query_len
    return out


# name -> (query_lens, seq_lens, window), block size 16.
WINDOW_BATCHES = {
    # Decode over contexts of many blocks outside a window of 40 (not a multiple of 16), and a
    # 16-token context that the window covers whole.
    "decode": ([1, 1, 1, 1], [300, 129, 70, 16], 40),
    "decode_block_multiple": ([1, 1, 1], [200, 64, 33], 32),
    "window_one": ([1, 5], [50, 30], 1),  # each query sees only itself
    # Chunks: the first's early rows still see position 0 and its later rows do not (the
    # window edge moves through the chunk); the second starts past the edge; the third is a
    # whole prompt longer than the window.
    "prefill_chunks": ([30, 40, 20], [60, 150, 20], 12),
    "spec_verify": ([4, 3], [40, 19], 10),
    "larger_than_context": ([1, 12, 1, 7], [33, 12, 48, 23], 100),  # = full attention
}
SOFTCAP = 5.0  # with q scaled by 4 below, logits of a few units: the cap bends them visibly


def check_options(q, k_cache, v_cache, meta, *, window=None, softcap=None, num_splits=None) -> None:
    """Triton and the reference, each against the oracle (out poisoned with NaN)."""
    scale = q.shape[-1] ** -0.5
    expected = oracle_attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap).to(q.dtype)
    cpu_meta = meta_on_cpu(meta)
    ref = reference.paged_attention(
        q.cpu(), k_cache.cpu(), v_cache.cpu(), cpu_meta, scale, window=window, softcap=softcap
    )
    assert_close(ref, expected, q.dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, meta, scale, out, num_splits=num_splits, window=window, softcap=softcap)
    assert_close(out.cpu(), expected, q.dtype)


def check_options_case(query_lens, seq_lens, *, seed, window=None, softcap=None, num_splits=None, **shape) -> None:
    q, k_cache, v_cache, meta = make_case(query_lens, seq_lens, seed=seed, **shape)
    if softcap is not None:
        q = q * 4
    check_options(q, k_cache, v_cache, meta, window=window, softcap=softcap, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("batch", list(WINDOW_BATCHES))
def test_window(batch, heads, dtype, device, run):
    query_lens, seq_lens, window = WINDOW_BATCHES[batch]
    run(
        check_options_case,
        query_lens,
        seq_lens,
        window=window,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        dtype=dtype,
        device=device,
        seed=seed_of("window", batch, heads, dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_softcap(batch, dtype, device, run):
    run(
        check_options_case,
        *BATCHES[batch],
        softcap=SOFTCAP,
        num_heads=8,
        num_kv_heads=2,
        dtype=dtype,
        device=device,
        seed=seed_of("softcap", batch, dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", list(WINDOW_BATCHES))
def test_window_and_softcap(batch, dtype, device, run):
    query_lens, seq_lens, window = WINDOW_BATCHES[batch]
    run(
        check_options_case,
        query_lens,
        seq_lens,
        window=window,
        softcap=SOFTCAP,
        num_heads=8,
        num_kv_heads=2,
        dtype=dtype,
        device=device,
        seed=seed_of("window_softcap", batch, dtype),
    )


# Split-KV under a window: the splits cut the window's range (a long context's early splits
# would otherwise all be empty), and splits past a short sequence's end stay neutral.
SPLIT_WINDOW_BATCHES = {
    "decode": ([1, 1, 1], [1000, 300, 30], 200),
    "mixed": ([1, 5, 1], [700, 140, 48], 90),
}


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["window", "window_softcap"])
@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("batch", list(SPLIT_WINDOW_BATCHES))
def test_split_kv_window(batch, num_splits, softcap, device, run):
    query_lens, seq_lens, window = SPLIT_WINDOW_BATCHES[batch]
    run(
        check_options_case,
        query_lens,
        seq_lens,
        window=window,
        softcap=softcap,
        num_heads=4,
        num_kv_heads=1,
        device=device,
        num_splits=num_splits,
        seed=seed_of("split_window", batch, num_splits, softcap),
    )


def poison_outside_window(k_cache, v_cache, meta, window: int, tile: int = 64) -> None:
    """NaN into every pool block that lies wholly before the tile (of `tile` positions, a
    multiple of the block size) holding each sequence's first query row's window start: a
    kernel that reads any of them (even masked: 0 * NaN) returns NaN."""
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        window_start = max(0, seq_len - query_len - window + 1) // tile * tile
        for b in range(window_start // meta.block_size):
            block = int(meta.block_tables[i, b])
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")


def check_window_skips_blocks(device, num_splits) -> None:
    window = 100
    q, k_cache, v_cache, meta = make_case([1, 3, 1], [1000, 517, 90], num_heads=4, num_kv_heads=2, seed=21)
    scale = q.shape[-1] ** -0.5
    expected = oracle_attention(q, k_cache, v_cache, meta, scale, window=window)
    poison_outside_window(k_cache, v_cache, meta, window)
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)
    ref = reference.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta_on_cpu(meta), scale, window=window)
    assert_close(ref, expected.float(), torch.float32)
    gpu_meta = AttentionMetadata.build(
        meta.query_lens_host, meta.seq_lens_host, meta.block_tables.tolist(), meta.block_size, device
    )
    got = paged_attention(q, k_cache, v_cache, gpu_meta, scale, num_splits=num_splits, window=window)
    assert_close(got.cpu(), expected.float(), torch.float32)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_window_skips_blocks_outside(num_splits, device, run):
    """Blocks wholly before the window are never read: poisoned with NaN, the result is exact."""
    run(check_window_skips_blocks, device, num_splits)


def check_options_off_unchanged(device) -> None:
    q, k_cache, v_cache, meta = make_case(*BATCHES["mixed"], num_heads=8, num_kv_heads=2, device=device, seed=23)
    plain = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, window=None, softcap=None), plain)
    cpu_meta = meta_on_cpu(meta)
    plain = reference.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), cpu_meta, 0.125)
    again = reference.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), cpu_meta, 0.125, window=None, softcap=None)
    assert torch.equal(again, plain)


def test_options_off_unchanged(device, run):
    run(check_options_off_unchanged, device)


@pytest.mark.parametrize(("window", "softcap"), [(0, None), (-3, None), (2.5, None), (None, 0.0), (None, -1.0)])
def test_rejects_bad_options(window, softcap):
    q, k_cache, v_cache, meta = make_case(*BATCHES["decode"], num_heads=2, num_kv_heads=2, seed=1)
    with pytest.raises(ValueError, match="window|softcap"):
        reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
    with pytest.raises(ValueError, match="window|softcap"):
        paged_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
