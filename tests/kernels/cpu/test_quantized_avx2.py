"""The float32-activation product (csrc/quantized_linear_cpu.cpp) on every GGUF format, built for
AVX2 whatever this CPU is: on an AVX512_VNNI machine the rest of the suite runs the int16 kernel,
and an AVX2-only machine (many cloud CPUs) would run this one. `ATEN_CPU_CAPABILITY=avx2` makes
torch, and so native.py's build, target AVX2 in a child process (its own cache entry, compiled
once: about two minutes; on an AVX2-only machine, the build the suite already made)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import numpy as np, torch
    from ferry.kernels.cpu import native
    from tests.kernels.cpu.test_quantized import QTYPES, fit, gguf_weight

    torch.set_num_threads(2)
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    module = native.load()
    assert module is not None and module.linear_quantized_supported() and not module.linear_quantized_int16()
    for qtype in QTYPES:
        for out_features, in_features in [(13, 32), (37, 96), (100, 576), (40, 1536)]:
            in_features = fit(qtype, in_features)
            weight, dequantized = gguf_weight(out_features, in_features, qtype, seed=out_features + in_features)
            for rows in (1, 2, 5, 7, 33):
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                bias = torch.randn(out_features, generator=torch.Generator().manual_seed(rows + 1))
                got = native.linear(x, weight, bias)
                expected = torch.nn.functional.linear(x, dequantized, bias)
                scale = x.abs() @ dequantized.abs().T + bias.abs()
                worst = ((got - expected).abs() / scale).max().item()
                assert worst <= 1e-5, f"{qtype} [{out_features}, {in_features}] x {rows} rows: {worst:.3g}"
                alone = native.linear(x[-1:], weight, bias)[0]
                assert torch.equal(alone, got[-1]), f"{qtype}: the last row differs alone and in a batch"
        print(qtype, "ok")
    """
)


def test_the_avx2_product_matches_gguf_on_every_format():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [word for qtype in
                                   ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
                                   for word in (qtype, "ok")]
