"""The AVX2 build of the int16 product (csrc/quantized_linear_int16_avx2.cpp) on every GGUF format,
whatever this CPU is: on an AVX512_VNNI machine the rest of the suite runs the vpdpwssd kernel, and
an AVX2-only machine (many cloud CPUs) runs this one. `ATEN_CPU_CAPABILITY=avx2` makes torch, and so
native.py's build, target AVX2 in a child process (its own cache entry, compiled once: about two
minutes; on an AVX2-only machine, the build the suite already made).

Both kernels round x to int16 per block and fold the same exact int32 sums in the same order, so
on a VNNI machine the child's floats must equal this process's bit for bit: a model gives the same
tokens on either CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ferry.kernels.cpu import native
from tests.kernels.cpu.test_quantized import QTYPES, assert_product_close, fit, gguf_weight

SHAPES = [(13, 32), (37, 96), (100, 576), (40, 1536)]
ROWS = (1, 2, 5, 7, 33)

CHILD = textwrap.dedent(
    """
    import sys, torch
    from ferry.kernels.cpu import native
    from tests.kernels.cpu.test_quantized_avx2 import products

    torch.set_num_threads(2)
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    module = native.load()
    assert module is not None and module.linear_quantized_supported() and not module.linear_quantized_vnni()
    torch.save(products(), sys.argv[1])
    """
)


def inputs(shapes=SHAPES, row_counts=ROWS):
    """(qtype, out_features, rows) -> (packed weight, dequantized weight, x, bias), the same in both
    processes (and in test_quantized_amx.py, over its own shapes and row counts)."""
    for qtype in QTYPES:
        for out_features, in_features in shapes:
            in_features = fit(qtype, in_features)
            weight, dequantized = gguf_weight(out_features, in_features, qtype, seed=out_features + in_features)
            for rows in row_counts:
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                bias = torch.randn(out_features, generator=torch.Generator().manual_seed(rows + 1))
                yield (qtype, out_features, rows), weight, dequantized, x, bias


def products() -> dict:
    """Every input's product and its last row's product alone, by this process's build."""
    return {key: (native.linear(x, weight, bias), native.linear(x[-1:], weight, bias)[0])
            for key, weight, _, x, bias in inputs()}


def test_the_avx2_product_matches_gguf_and_the_vnni_kernel_on_every_format(tmp_path):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = tmp_path / "avx2.pt"
    done = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, env=env,
                          timeout=900, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    avx2 = torch.load(out)
    here = products() if native.load().linear_quantized_vnni() else None
    for key, weight, _, x, bias in inputs():
        got, alone = avx2[key]
        assert_product_close(got, x, weight, bias)
        assert torch.equal(alone, got[-1]), f"{key}: the last row differs alone and in a batch"
        if here is not None:
            assert torch.equal(got, here[key][0]), f"{key}: the AVX2 and AVX512_VNNI kernels differ"
    assert len(avx2) == len(QTYPES) * len(SHAPES) * len(ROWS)
