"""Triton rotary embedding (neox and gpt-j layouts) against the PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch

from ferry.kernels import reference
from ferry.kernels.triton.rotary_kernel import rotary
from tests.kernels.util import assert_close


def llama3_cos_sin_cache(head_dim: int, max_positions: int, theta: float = 500000.0) -> torch.Tensor:
    """[max_positions, head_dim] fp32, cos then sin, with Llama 3.1's frequency scaling
    (factor 8, low/high frequency factors 1 and 4, original context 8192)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    scaled = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * scaled[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def check_rotary(num_heads, num_kv_heads, head_dim, dtype, is_neox, device, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_tokens, max_positions = 7, 9000
    cache = llama3_cos_sin_cache(head_dim, max_positions)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)  # q and k as views of a fused qkv
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    q_ref, k_ref = reference.rotary(q, k, positions, cache, is_neox)
    q_out, k_out = rotary(q.to(device), k.to(device), positions.to(device), cache.to(device), is_neox)
    assert_close(q_out.cpu(), q_ref, dtype)
    assert_close(k_out.cpu(), k_ref, dtype)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 80)])
def test_rotary(num_heads, num_kv_heads, head_dim, dtype, is_neox, device, run):
    run(check_rotary, num_heads, num_kv_heads, head_dim, dtype, is_neox, device, seed=head_dim + is_neox)
