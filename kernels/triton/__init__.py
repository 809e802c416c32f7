"""The Triton backend of the dispatch in `kernels/ops.py`: one host wrapper per kernel,
each with the same signature as its reference in `kernels/reference.py`."""

from ferry.kernels.triton.fused_moe_kernel import fused_moe
from ferry.kernels.triton.lora_kernel import add_lora
from ferry.kernels.triton.paged_attention_kernel import paged_attention
from ferry.kernels.triton.rms_norm_kernel import rms_norm
from ferry.kernels.triton.rotary_kernel import rotary
from ferry.kernels.triton.write_kv_kernel import write_kv

__all__ = ["add_lora", "fused_moe", "paged_attention", "rms_norm", "rotary", "write_kv"]
