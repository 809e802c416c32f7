"""Helpers shared by the kernel tests (imported by the interpreter child process too)."""

from __future__ import annotations

import os

import torch

# Relative error bound per dtype: float32 must match to rounding, 16-bit types to a few ulps.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def enable_interpreter() -> None:
    """Process initializer of the kernel-test child: runs before anything imports triton."""
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a NaN anywhere in out (an unwritten element) gives NaN."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    return float((out64 - ref64).norm() / ref64.norm())


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    error = rel_error(out, ref)
    assert error < TOLERANCE[dtype], f"relative error {error:.3e} (bound {TOLERANCE[dtype]:.0e})"
