"""Kernel dispatch: the engine calls only these functions.

Triton kernels run on CUDA tensors. On everything else the backend is `cpu`: attention for
short query runs (decode, verification) in native code compiled on first use
(`kernels/cpu/native.py`), everything else the PyTorch reference. `torch` is the pure reference.
`FERRY_ATTENTION_BACKEND=triton|cpu|torch` overrides the choice (triton on CPU tensors needs
`TRITON_INTERPRET=1`, which is how the kernel tests run here).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ferry.kernels import reference
from ferry.kernels.cpu.quantized import QuantizedParts, QuantizedWeight, pack_quantized_weight, quantize_int8_weight
from ferry.kernels.metadata import AttentionMetadata, LoraMapping
from ferry.kernels.stack_layer import StackLayer

__all__ = [
    "AttentionMetadata",
    "LoraMapping",
    "QuantizedParts",
    "QuantizedWeight",
    "StackLayer",
    "add_lora",
    "backend_for",
    "decoder_stack",
    "embedding",
    "fused_moe",
    "gelu_tanh_and_mul",
    "pinned_backend",
    "linear",
    "pack_experts",
    "quantized_experts",
    "pack_linear_weight",
    "paged_attention",
    "pack_quantized_weight",
    "quantize_int8_weight",
    "rms_norm",
    "rotary",
    "rotary_and_write_kv",
    "silu_and_mul",
    "write_kv",
]

_BACKENDS = ("triton", "cpu", "torch")


_pinned = threading.local()  # .backend: set by `pinned_backend` for this thread's current forward pass


def backend_for(tensor: torch.Tensor) -> str:
    """The backend used for a call whose main input is `tensor`."""
    pinned = getattr(_pinned, "backend", None)
    if pinned is not None:
        return pinned
    return _resolve(tensor)


@contextmanager
def pinned_backend(tensor: torch.Tensor) -> Iterator[str]:
    """Resolve the backend once for a whole forward pass: every call inside it (a few hundred per
    step) then skips the environment lookup, a visible share of a batch-1 CPU step."""
    outer = getattr(_pinned, "backend", None)
    _pinned.backend = outer or _resolve(tensor)
    try:
        yield _pinned.backend
    finally:
        _pinned.backend = outer


def _resolve(tensor: torch.Tensor) -> str:
    forced = os.environ.get("FERRY_ATTENTION_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"FERRY_ATTENTION_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if tensor.is_cuda else "cpu"


def _triton():
    # Imported lazily: CPU-only installs need no triton.
    from ferry.kernels import triton as triton_backend

    return triton_backend


def paged_attention(
    q,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    out=None,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """Causal paged attention (`reference.paged_attention` documents the contract). Per-layer
    options, None = off: `window`, sliding-window attention (a query at position p sees
    positions p - window < j <= p, as transformers' sliding_window); `softcap`, Gemma 2's
    attn_logit_softcapping (scaled logits s become softcap * tanh(s / softcap))."""
    backend = backend_for(q)
    if backend == "triton":
        return _triton().paged_attention(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)
    if backend == "cpu":
        return _cpu().paged_attention(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if backend_for(key) == "triton":
        return _triton().write_kv(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


@functools.cache
def _cpu():
    # Imported on first use: importing the native module may compile it.
    from ferry.kernels.cpu import native

    return native


def rms_norm(x, weight, eps: float, residual=None):
    """(normalised, residual_out). The cpu backend adds into `residual` in place: pass one that
    is not read again (the decoder's residual stream)."""
    backend = backend_for(x)
    if backend == "triton":
        return _triton().rms_norm(x, weight, eps, residual)
    if backend == "cpu":
        return _cpu().rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_and_write_kv(q, k, v, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping):
    """Rotary on q and k, then k and v into the pool; returns the rotated q (the cpu backend
    rotates q and k in place)."""
    backend = backend_for(q)
    if backend == "cpu":
        return _cpu().rotary_and_write_kv(q, k, v, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping)
    q, k = rotary(q, k, positions, cos_sin_cache, is_neox)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def linear(x, weight, bias=None):
    """x @ weight^T (+ bias), nn.Linear's product. `weight` is a tensor [out, in], or what
    `pack_linear_weight` / `pack_quantized_weight` / `quantize_int8_weight` made of one (which
    only the cpu backend reads)."""
    if backend_for(x) == "cpu" or not isinstance(weight, torch.Tensor):
        return _cpu().linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def embedding(input_ids, weight):
    """Rows `input_ids` of an embedding table: a tensor [vocab, hidden], or a `QuantizedWeight`
    (a GGUF's quantized table, also the tied LM head), whose rows come back dequantized."""
    if isinstance(weight, QuantizedWeight):
        return _cpu().embedding(input_ids, weight)
    return torch.nn.functional.embedding(input_ids, weight)


def pack_linear_weight(weight: torch.Tensor):
    """`weight` [out, in] in the layout the cpu backend's product reads fastest (a
    `kernels.cpu.native.PackedWeight`), or None where that backend would not run it (another backend,
    not float32, no native build). Done once, when a model is loaded."""
    if backend_for(weight) != "cpu":
        return None
    return _cpu().pack_weight(weight)


def decoder_stack(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float, final_norm, layers):
    """Every decoder layer plus the final norm as one call (`layers`: one `StackLayer` each), for
    the steps the backend can run that way; None where it has no such path (the model then
    runs layer by layer). Its `forward(x, positions, cos_sin, kv_cache, slot_mapping, meta)`
    returns the final-normed hidden states, or None for a step it does not cover."""
    if backend_for(final_norm) != "cpu":
        return None
    return _cpu().decoder_stack(num_heads, num_kv_heads, head_dim, eps, scale, final_norm, layers)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    """The mixture-of-experts MLP (`reference.fused_moe`): `w13` [num_experts, 2 * inter, hidden]
    and `w2` [num_experts, hidden, inter] tensors, or what `pack_experts` made of them (which only
    the cpu backend reads)."""
    if not isinstance(w13, torch.Tensor):
        return _cpu_moe().fused_moe(x, w13, w2, topk_weights, topk_ids)
    backend = backend_for(x)
    if backend == "triton":
        return _triton().fused_moe(x, w13, w2, topk_weights, topk_ids)
    return reference.fused_moe(x, w13, w2, topk_weights, topk_ids)


def add_lora(y, x, lora_a, lora_b, mapping: LoraMapping) -> None:
    """In place, the LoRA term of every adapted row (`reference.add_lora`): y [T, out] +=
    lora_b[s] @ (lora_a[s] @ x[t]) for each row t with slot s >= 0. Triton: one shrink and one
    expand launch for the whole batch, whatever mix of adapters; elsewhere the reference's grouped
    products (one per slot present), which is the CPU implementation."""
    if not mapping.active:
        return
    if backend_for(x) == "triton":
        _triton().add_lora(y, x, lora_a, lora_b, mapping)
        return
    reference.add_lora(y, x, lora_a, lora_b, mapping)


def pack_experts(weights: torch.Tensor, unpacked_ok: bool = False):
    """[num_experts, out, in] packed expert by expert for the cpu backend's product, or None
    where that backend would not run it (as `pack_linear_weight`). `unpacked_ok`: on the cpu
    backend, where the packed product cannot run them, the experts' matrices as they are
    instead of None (a layer whose other projection is kept quantized runs the cpu path)."""
    if backend_for(weights) != "cpu":
        return None
    packed = _cpu_moe().pack_experts(weights)
    return _cpu_moe().unpacked_experts(weights) if packed is None and unpacked_ok else packed


def quantized_experts(weights):
    """One projection of every expert kept in quantized blocks: a sequence of `QuantizedWeight` /
    `QuantizedParts` (expert e's matrix at e), as `fused_moe` reads it on the cpu backend."""
    return _cpu_moe().quantized_experts(weights)


@functools.cache
def _cpu_moe():
    from ferry.kernels.cpu import moe

    return moe


def silu_and_mul(gate_up):
    if backend_for(gate_up) == "cpu":
        return _cpu().silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up):
    """GeGLU (Gemma): the reference on every backend."""
    return reference.gelu_tanh_and_mul(gate_up)


def rotary(q, k, positions, cos_sin_cache, is_neox: bool = True):
    if backend_for(q) == "triton":
        return _triton().rotary(q, k, positions, cos_sin_cache, is_neox)
    return reference.rotary(q, k, positions, cos_sin_cache, is_neox)
