"""The many-rows quantized product on AMX (csrc/quantized_linear_amx.cpp), on CPUs with AMX-INT8
(Sapphire Rapids and later). It splits each int16 activation into a low and a high byte and adds
the tile unit's exact byte sums back into the vpdpwssd kernel's int32 block sums, then folds them
in that kernel's order: so its floats must equal the vpdpwssd kernel's bit for bit (switched off
with set_linear_quantized_amx(False) in the same process), on every GGUF format, shape and row
count from where it takes over (24 rows), and a row's floats must not depend on its batch.
Elsewhere the build has no AMX kernel and these comparisons cannot run (the first test checks that
the build matches the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from ferry.kernels.cpu import native
from tests.kernels.cpu.test_quantized import assert_product_close, gguf_weight
from tests.kernels.cpu.test_quantized_avx2 import inputs

SHAPES = [(13, 32), (40, 96), (100, 576), (24, 1536), (37, 256)]
ROWS = (24, 31, 32, 33, 47, 70)  # one and two row tiles, full and partial, and several steps

# Runs where the products do take the tile unit: the CPU has AMX-INT8 and Linux granted the tile
# state (5.16 and later); the first test fails where the CPU has it and the path is still off.
requires_amx = pytest.mark.skipif(not native.load().linear_quantized_amx(),
                                  reason="no AMX-INT8 on this CPU (or Linux refused the tile state)")


def _cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split() for line in cpuinfo if line.startswith("flags")), [])


def test_the_amx_product_is_built_exactly_where_the_cpu_has_amx():
    flags = _cpu_flags()
    expected = (torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_vnni" in flags
                and "amx_tile" in flags and "amx_int8" in flags)
    module = native.load()
    assert module.__name__.endswith("_amx") == expected  # the cache entry built with -mamx-tile -mamx-int8
    kernel = tuple(int(part) for part in os.uname().release.split(".")[:2])
    if expected and kernel >= (5, 16):  # Linux grants the tile state on request from 5.16
        assert module.linear_quantized_amx()


@pytest.fixture
def amx_switch():
    """The module, with AMX switched back on whatever the test did."""
    module = native.load()
    yield module
    assert module.set_linear_quantized_amx(True)


@requires_amx
def test_amx_products_equal_the_vpdpwssd_kernel_bit_for_bit_on_every_format(amx_switch):
    for key, weight, _, x, bias in inputs(SHAPES, ROWS):
        assert amx_switch.set_linear_quantized_amx(True)
        ran = amx_switch.linear_quantized_amx_products()
        tiles = native.linear(x, weight, bias)
        # Q6_K (a scale per 16 columns) stays on vpdpwssd; every other format takes the tiles.
        assert amx_switch.linear_quantized_amx_products() - ran == (key[0] != "Q6_K"), key
        assert not amx_switch.set_linear_quantized_amx(False)
        ran = amx_switch.linear_quantized_amx_products()
        vnni = native.linear(x, weight, bias)
        assert amx_switch.linear_quantized_amx_products() == ran
        assert torch.equal(tiles, vnni), f"{key}: AMX and vpdpwssd products differ"
        assert_product_close(tiles, x, weight, bias)
        # The last row alone runs the batch-1 kernel: the same floats as in the batch.
        assert torch.equal(native.linear(x[-1:], weight, bias)[0], tiles[-1]), f"{key}: batch-dependent row"


@requires_amx
def test_strided_rows_and_an_out_buffer_take_the_amx_path_unchanged(amx_switch):
    """x as a row-strided view (the fused qkv output's slices are) and a preallocated out."""
    weight, _ = gguf_weight(48, 512, "Q4_K", seed=3)
    wide = torch.randn(40, 700, generator=torch.Generator().manual_seed(5))
    x = wide[:, 100:612]
    assert x.stride(0) == 700
    out = torch.empty(40, 48)
    ran = amx_switch.linear_quantized_amx_products()
    native.linear(x, weight, None, out=out)
    assert amx_switch.linear_quantized_amx_products() == ran + 1
    assert not amx_switch.set_linear_quantized_amx(False)
    assert torch.equal(out, native.linear(x.contiguous(), weight, None))
