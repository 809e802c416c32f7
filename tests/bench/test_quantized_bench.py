"""bench.quantized's choice of llama.cpp build: the baseline runs the instruction set Ferry's side
runs (an AVX2 row against llama.cpp built for AVX2 only), each build in its own environment."""

from __future__ import annotations

import torch

from bench import quantized
from ferry.kernels.cpu import native


def test_each_llama_cpp_build_has_its_own_environment_and_flags():
    for isa, venv in quantized.TOOLS_VENV.items():
        args = quantized._parse(["--llama-cpp-isa", isa])
        assert args.tools_python == str(quantized.REPO / venv / "bin" / "python")
    avx2 = quantized.LLAMA_CPP_CMAKE["avx2"]
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_NATIVE=OFF" in avx2
    assert "-DGGML_AMX_INT8=OFF" in quantized.LLAMA_CPP_CMAKE["avx512"]
    assert quantized._parse(["--tools-python", "/x/python"]).tools_python == "/x/python"


def test_the_default_build_follows_the_instruction_set_torch_runs():
    expected = ("avx2" if torch.backends.cpu.get_cpu_capability() == "AVX2"
                else "avx512" if native.cpu_has_amx() else "native")
    assert quantized._parse([]).llama_cpp_isa == expected
