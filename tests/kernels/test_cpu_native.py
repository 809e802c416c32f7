"""The native CPU attention (kernels/cpu_native.py) against the PyTorch reference.

Runs in-process (no Triton involved). The extension must build here: this machine has g++ and
ninja, and a silent fallback would leave the engine's default CPU path untested.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_native, reference
from tests.kernels.test_paged_attention import BATCHES, make_case

# (num_heads, num_kv_heads, head_dim): the register paths (32, 64, 128) and the portable loop (48, 80).
HEADS = [(2, 2, 64), (9, 3, 64), (8, 1, 32), (4, 2, 128), (4, 2, 48), (6, 3, 80)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def native():
    assert cpu_native.available(), "the native CPU attention did not build (g++ and ninja are needed)"


def reference_and_native(q, k_cache, v_cache, meta, scale=0.125):
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    meta.backend_cache.clear()
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, scale)
    return expected, got


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
def test_matches_reference_fp32(batch, num_heads, num_kv_heads, head_dim):
    q, k_cache, v_cache, meta = make_case(
        *BATCHES[batch], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=head_dim + num_heads
    )
    expected, got = reference_and_native(q, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", ["decode", "mixed", "spec_verify"])
def test_matches_reference_half_precision(dtype, batch):
    q, k_cache, v_cache, meta = make_case(*BATCHES[batch], num_heads=8, num_kv_heads=2, dtype=dtype, seed=3)
    expected, got = reference_and_native(q, k_cache, v_cache, meta)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes_and_long_contexts(block_size):
    # Query runs of 1 .. 16 (the native limit) and one of 17 (the reference's), over contexts of
    # several hundred tokens, so the online softmax rescales across many blocks.
    query_lens = [1, 5, 16, 17, 1]
    seq_lens = [700, 301, 16, 400, 1]
    q, k_cache, v_cache, meta = make_case(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, block_size=block_size, seed=block_size
    )
    # Large logits: a max that moves block after block exercises the rescaling.
    q = q * 6
    expected, got = reference_and_native(q, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)


def test_writes_only_its_rows_into_out():
    q, k_cache, v_cache, meta = make_case(*BATCHES["mixed"], num_heads=4, num_kv_heads=2, seed=9)
    out = torch.full_like(q, float("nan"))
    result = cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    meta.backend_cache.clear()
    torch.testing.assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.125), rtol=0, atol=2e-5)


def test_default_cpu_dispatch_is_native(monkeypatch):
    monkeypatch.delenv("FERRY_ATTENTION_BACKEND", raising=False)
    q, k_cache, v_cache, meta = make_case(*BATCHES["decode"], num_heads=4, num_kv_heads=2, seed=4)
    assert kernels.backend_for(q) == "cpu"
    dispatched = kernels.paged_attention(q, k_cache, v_cache, meta, 0.125)
    meta.backend_cache.clear()
    assert torch.equal(dispatched, cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125))


def test_rejects_mismatched_dtypes():
    q, k_cache, v_cache, meta = make_case(*BATCHES["decode"], num_heads=4, num_kv_heads=2, seed=5)
    module = cpu_native.load()
    short = torch.arange(meta.num_seqs, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="dtype"):
        module.paged_attention_short(
            q.double(), k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, short, 0.1, q.double()
        )
