"""The kernels compile to GPU code for NVIDIA targets with Triton's bundled ptxas; no GPU needed.

The interpreter tests check what the kernels compute; this checks what only the real compiler
sees (dot shapes, early returns, shared memory per program) for the configurations the host
wrappers choose. It runs in the pytest process itself, where triton is not in interpreter mode.
"""

from __future__ import annotations

import os

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ferry.kernels.metadata import AttentionMetadata
from ferry.kernels.triton.fused_moe_kernel import _down_kernel, _gate_up_kernel
from ferry.kernels.triton.lora_kernel import Tiles, _expand_kernel, _shrink_kernel
from ferry.kernels.triton.paged_attention_kernel import _launch_config, _merge_splits_kernel, _paged_attention_kernel
from ferry.kernels.triton.rms_norm_kernel import _rms_norm_kernel
from ferry.kernels.triton.rotary_kernel import _rotary_kernel
from ferry.kernels.triton.write_kv_kernel import _write_kv_kernel

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this process"),
]

# Shared memory a program may use: H100/H200 (sm_90) and A100 (sm_80).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
FLOAT_ARGS = {"scale_log2", "softcap_log2", "eps"}


def compile_for(capability: int, kernel, constexprs: dict, pointers: dict, num_warps: int, num_stages: int = 2):
    """Compile `kernel` with int32 scalars, fp32 `FLOAT_ARGS` and `pointers` (default *bf16)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    source = ASTSource(kernel, signature, constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    assert compiled.metadata.shared <= SHARED_LIMIT[capability], compiled.metadata.shared
    return compiled


ATTENTION_POINTERS = {
    "part_acc_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "work_ptr": "*i32",
}


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize(
    ("window", "softcap"), [(False, False), (True, False), (True, True)], ids=["plain", "window", "window_softcap"]
)
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("query_len", [1, 512], ids=["decode", "prefill"])
def test_paged_attention_compiles(query_len, split, window, softcap, capability):
    group, head_dim = 4, 128
    meta = AttentionMetadata.build([query_len], [4096], [list(range(256))], 16)
    config = _launch_config(meta, group, head_dim)
    constexprs = dict(
        GROUP=group,
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        TILE=config.tile,
        BLOCK_SIZE=16,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim,
        SPLIT=split,
        FP32_DOT=False,
        WINDOW=window,
        SOFTCAP=softcap,
    )
    compiled = compile_for(
        capability, _paged_attention_kernel, constexprs, ATTENTION_POINTERS, config.num_warps, config.num_stages
    )
    assert ("wgmma" in compiled.asm["ptx"]) or ("mma.sync" in compiled.asm["ptx"])  # tensor cores in use


def test_paged_attention_other_shapes_compile():
    """head_dim 80 (padded to 128) in float16, and a float32 cache (IEEE dots) with both options."""
    for head_dim, dtype, fp32 in ((80, "*fp16", False), (64, "*fp32", True)):
        constexprs = dict(GROUP=8, BLOCK_Q=2, BLOCK_M=16, TILE=64, BLOCK_SIZE=32, SPLIT=False, FP32_DOT=fp32)
        constexprs.update(WINDOW=fp32, SOFTCAP=fp32)
        constexprs.update(HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim))
        pointers = dict(ATTENTION_POINTERS, out_ptr=dtype, q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype)
        compile_for(90, _paged_attention_kernel, constexprs, pointers, num_warps=4)


def test_small_kernels_compile():
    compile_for(90, _merge_splits_kernel, dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=32), ATTENTION_POINTERS, 4)
    compile_for(
        90,
        _write_kv_kernel,
        dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16),
        {"slot_mapping_ptr": "*i64"},
        num_warps=4,
    )
    for residual in (False, True):
        compile_for(90, _rms_norm_kernel, dict(HAS_RESIDUAL=residual, BLOCK=4096), {}, num_warps=8)
    for neox in (True, False):
        constexprs = dict(
            NUM_HEADS=32, NUM_KV_HEADS=8, HEADS_PAD=32, KV_HEADS_PAD=8, HALF=64, HALF_PAD=64, IS_NEOX=neox
        )
        compile_for(90, _rotary_kernel, constexprs, {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32"}, num_warps=4)


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("block_m", [16, 64], ids=["decode", "prefill"])
def test_fused_moe_compiles(block_m, dtype, capability):
    """Both grouped GEMMs as `fused_moe` launches them: BLOCK_N 64, BLOCK_K and FP32_DOT by dtype."""
    fp32 = dtype == "*fp32"
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32 if fp32 else 64, FP32_DOT=fp32)
    pointers = {"sorted_ids_ptr": "*i64", "block_expert_ptr": "*i64", "weights_ptr": "*fp32"}
    pointers.update(dict.fromkeys(("h_ptr", "x_ptr", "w13_ptr", "w2_ptr", "out_ptr"), dtype))
    for kernel, extra in ((_gate_up_kernel, {"TOP_K": 8}), (_down_kernel, {})):
        compiled = compile_for(capability, kernel, constexprs | extra, pointers, num_warps=4, num_stages=3)
        if not fp32:
            assert ("wgmma" in compiled.asm["ptx"]) or ("mma.sync" in compiled.asm["ptx"])  # tensor cores in use


@pytest.mark.parametrize("capability", [90, 80])
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("rank", [8, 48, 256], ids=["r8", "qkv_r48", "r256"])
def test_lora_compiles(rank, dtype, capability):
    """Shrink and expand with the tile sizes `add_lora` picks for the rank, at a decode's 8 splits."""
    tiles = Tiles.for_rank(rank)
    pointers = {"s_ptr": "*fp32", "slot_ptr": "*i64"}
    pointers.update(dict.fromkeys(("x_ptr", "a_ptr", "y_ptr", "b_ptr"), dtype))
    shrink = dict(SPLIT_K=8, R_PAD=tiles.r_pad, BLOCK_K=tiles.block_k)
    compile_for(capability, _shrink_kernel, shrink, pointers, num_warps=4)
    expand = dict(SPLIT_K=8, R_PAD=tiles.r_pad, BLOCK_N=tiles.block_n)
    compile_for(capability, _expand_kernel, expand, pointers, num_warps=4)
