"""The one matrix product the Triton kernels use."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, FP32: tl.constexpr):
    # FP32: float32 operands want IEEE products, not TF32; and the interpreter (triton 3.9)
    # multiplies bfloat16 operands as their raw uint16 bits, so CPU runs take this path too.
    if FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c
