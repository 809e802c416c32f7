"""Triton RMSNorm with an optional fused residual add (one read of x and the residual, one
write of each output, instead of the reference's separate add, cast, square and scale passes).

Rounding follows the reference (transformers' LlamaRMSNorm): the residual sum is rounded to
x's dtype, statistics are float32, the normalised row is rounded to x's dtype before the weight.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden] (HAS_RESIDUAL only)
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    hidden,
    eps,
    stride_o,
    stride_ro,
    stride_x,
    stride_r,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.reference.rms_norm`: (normalised, residual_out)."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        residual_rows = residual.reshape(-1, hidden).contiguous()
        residual_out = torch.empty_like(rows)
    else:
        residual_rows = residual_out = rows  # never touched when HAS_RESIDUAL is off
    block = triton.next_power_of_2(hidden)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out,
            residual_out,
            rows,
            residual_rows,
            weight,
            hidden,
            eps,
            out.stride(0),
            residual_out.stride(0),
            rows.stride(0),
            residual_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
            enable_fp_fusion=True,  # explicit: Triton 3.9 warns when left to its default
        )
    out = out.view(x.shape)
    return out, (residual_out.view(x.shape) if residual is not None else x)
