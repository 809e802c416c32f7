"""Triton write_kv (reshape-and-cache) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import reference
from ferry.kernels.triton.write_kv_kernel import write_kv


def check_write_kv(num_kv_heads, head_dim, block_size, dtype, device, seed) -> None:
    """Scatter into NaN-filled caches: a slot the kernel misses stays NaN, a skipped one gets a value."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, num_tokens = 7, 12
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    # K and V as views of a fused qkv buffer, the way the model produces them.
    width = num_kv_heads * head_dim
    kv = torch.randn(num_tokens, 3 * width, generator=gen).to(dtype)
    key = kv[:, width : 2 * width].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, 2 * width :].view(num_tokens, num_kv_heads, head_dim)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_ref = torch.full(shape, float("nan"), dtype=dtype)
    v_ref = torch.full(shape, float("nan"), dtype=dtype)
    reference.write_kv(key, value, k_ref, v_ref, slots)
    k_cache, v_cache = k_ref.new_full(shape, float("nan")).to(device), v_ref.new_full(shape, float("nan")).to(device)
    write_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    torch.testing.assert_close(k_cache.cpu(), k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (1, 80, 8), (3, 128, 32)])
def test_write_kv(num_kv_heads, head_dim, block_size, dtype, device, run):
    run(check_write_kv, num_kv_heads, head_dim, block_size, dtype, device, seed=head_dim + block_size)
