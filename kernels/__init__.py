"""Kernel dispatch: the engine calls only these functions.

Triton kernels run on CUDA tensors, the PyTorch reference on everything else.
`FERRY_ATTENTION_BACKEND=triton|torch` overrides the choice (triton on CPU tensors needs
`TRITON_INTERPRET=1`, which is how the kernel tests run here).
"""

from __future__ import annotations

import os

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "backend_for", "paged_attention", "rms_norm", "rotary", "write_kv"]

_BACKENDS = ("triton", "torch")


def backend_for(tensor: torch.Tensor) -> str:
    """The backend used for a call whose main input is `tensor`."""
    forced = os.environ.get("FERRY_ATTENTION_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"FERRY_ATTENTION_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if tensor.is_cuda else "torch"


def _triton():
    # Imported lazily: CPU-only installs need no triton.
    from kernels import triton_ops

    return triton_ops


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None):
    if backend_for(q) == "triton":
        return _triton().paged_attention(q, k_cache, v_cache, meta, scale, out)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale, out)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if backend_for(key) == "triton":
        return _triton().write_kv(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def rms_norm(x, weight, eps: float, residual=None):
    if backend_for(x) == "triton":
        return _triton().rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary(q, k, positions, cos_sin_cache, is_neox: bool = True):
    if backend_for(q) == "triton":
        return _triton().rotary(q, k, positions, cos_sin_cache, is_neox)
    return reference.rotary(q, k, positions, cos_sin_cache, is_neox)
