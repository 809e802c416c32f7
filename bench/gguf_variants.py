"""Other GGUF types of the bundled SmolLM2-135M-Instruct, made by llama.cpp's own quantizer
(`llama_model_quantize` in llama-cpp-python, run by the bench tools environment's Python, which
bench/quantized.py builds on first use): what people download is mostly Q4_K_M, Q5_K_M or Q6_K,
and llama.cpp decides per tensor which type each gets (Q5_0 / Q8_0 where a row is no multiple of
256, more bits for some layers' attn_v and ffn_down), so only its quantizer makes the real mix.

The source is the bundled Q4_1 file (requantized: llama.cpp dequantizes it first), so a variant's
weights are those of the Q4_1 file at another precision, not of the original float checkpoint.
Variants are cached under `.ferry/bench-gguf/` and written atomically (a killed run leaves no
file that looks complete).

    python -m bench.gguf_variants Q4_K_M Q5_K_M Q6_K     # make (or find) them, print their types
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".ferry" / "bench-gguf"
# llama.cpp's `enum llama_ftype` values for the files it writes.
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}

_QUANTIZE_SCRIPT = """
import sys
import llama_cpp
source, target, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftype
params.allow_requantize = True
params.nthread = 2
code = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
sys.exit(code)
"""


def variant_path(name: str, tools_python: Path, source: Path | None = None) -> Path:
    """The bundled SmolLM2 file as llama.cpp type `name` (a key of FTYPES), made on first use.
    Raises ValueError for an unknown type and RuntimeError when llama.cpp's quantizer fails."""
    from ferry.worker.models.bundled import smollm2_gguf_path

    if name not in FTYPES:
        raise ValueError(f"unknown llama.cpp file type {name!r} (known: {', '.join(FTYPES)})")
    source = source or smollm2_gguf_path()
    target = CACHE / f"{source.stem.rsplit('.', 1)[0]}.{name}.gguf"
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    print(f"making {target.name} with llama.cpp's quantizer (from {source.name})", flush=True)
    done = subprocess.run([str(tools_python), "-c", _QUANTIZE_SCRIPT, str(source), str(partial), str(FTYPES[name])],
                          capture_output=True, text=True)
    if done.returncode or not partial.exists():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize to {name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    partial.replace(target)
    return target


def bench_model(model: str | None, variant: str | None, tools_python: str) -> Path:
    """The GGUF a benchmark runs: `model`, else the bundled SmolLM2 made into `variant` by
    llama.cpp's quantizer (the tools environment built on first use), else the bundled file.
    Exits with the reason when a variant is asked for and llama.cpp is not available."""
    from bench.quantized import tools_python as find_tools_python
    from ferry.worker.models.bundled import smollm2_gguf_path

    if model:
        return Path(model)
    if not variant:
        return smollm2_gguf_path()
    python, why = find_tools_python(tools_python)
    if python is None:
        raise SystemExit(f"--variant needs llama.cpp's quantizer: {why}")
    return variant_path(variant, python)


def tensor_types(path: Path) -> Counter:
    """How many of the file's matrices hold each GGML type."""
    from gguf import GGUFReader

    return Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)


def tensor_bytes(path: Path) -> int:
    """The bytes of all the file's tensors (what llama.cpp holds; metadata excluded)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def main(argv: list[str] | None = None) -> None:
    from bench.quantized import tools_python

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="+", choices=sorted(FTYPES))
    parser.add_argument("--tools-python", default=str(REPO / ".venv-tools" / "bin" / "python"))
    args = parser.parse_args(argv)
    python, why = tools_python(args.tools_python)
    if python is None:
        raise SystemExit(f"llama.cpp is not available: {why}")
    for name in args.types:
        path = variant_path(name, python)
        types = ", ".join(f"{count} {kind}" for kind, count in tensor_types(path).most_common())
        print(f"{path}: {tensor_bytes(path) / 1e6:.1f} MB of tensors; matrices: {types}")


if __name__ == "__main__":
    main()
