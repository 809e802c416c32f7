"""Triton RMSNorm (with and without the fused residual add) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import reference
from ferry.kernels.triton.rms_norm_kernel import rms_norm
from tests.kernels.util import assert_close


def check_rms_norm(shape, dtype, with_residual, device, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype) if with_residual else None
    normed_ref, residual_ref = reference.rms_norm(x, weight, 1e-6, residual)
    x_dev = x.to(device)
    normed, residual_out = rms_norm(x_dev, weight.to(device), 1e-6, None if residual is None else residual.to(device))
    assert_close(normed.cpu(), normed_ref, dtype)
    if residual is None:
        assert residual_out is x_dev
    else:
        assert_close(residual_out.cpu(), residual_ref, dtype)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(9, 64), (2, 3, 96)], ids=["2d", "3d-non-pow2"])
def test_rms_norm(shape, dtype, with_residual, device, run):
    run(check_rms_norm, shape, dtype, with_residual, device, seed=shape[-1] + with_residual)
