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
