"""Quantized weights end to end: Ferry on SmolLM2-135M-Instruct's GGUF kept quantized, against
Ferry on the same file dequantized to float32 and against llama.cpp on the same file.

Systems (one model file: `--model`, or `--variant Q4_K_M|Q5_K_M|Q6_K|...`, the bundled file made
into that llama.cpp type by llama.cpp's own quantizer (bench/gguf_variants.py); default the
bundled SmolLM2-135M-Instruct Q4_1):
  ferry-fp32   Engine(quantization="none"): the file dequantized to float32 (its cached conversion)
  ferry-gguf   Engine(quantization="gguf"): Q4_1 layers and the Q8_0 tied embedding/head kept in
               their blocks, multiplied by the fused-dequantization kernels
  llama.cpp    llama-cpp-python (a bench-only baseline, never a test dependency), run by the
               Python of a separate virtual environment (`--tools-python`, default .venv-tools/);
               where that environment or the package is missing it is built there first
               (`pip install llama-cpp-python==0.3.36`, from /tmp/pkgs/ when a source archive is
               there), with `--llama-cpp-isa`'s CMake flags: `native` (-DGGML_NATIVE=ON: all this
               CPU has), `avx512` (AVX-512 with VNNI and BF16 but not AMX: llama-cpp-python
               0.3.36's AMX path crashed (SIGSEGV) on the first decode of SmolLM2 on a Sapphire
               Rapids-class Xeon) or `avx2` (as on an AVX2-only CPU: no AVX-512, AVX-VNNI or
               AMX), each in its own environment (.venv-tools/, .venv-tools-avx512/,
               .venv-tools-avx2/). The default follows Ferry's side: avx2 when torch is held to
               AVX2 (`ATEN_CPU_CAPABILITY=avx2`), so an AVX2 row sets the two projects' AVX2
               kernels against each other; avx512 on a CPU with AMX; else native. If it cannot be
               built the baseline is skipped and the JSON says why.

Workloads (greedy, EOS ignored, `--tokens` new tokens per request, default 256):
  batch1   one request at a time
  batch32  32 requests at once (`--batch`), each prompt numbered so no two share a prefix
           (Ferry only: llama-cpp-python decodes one sequence at a time; its batch-1 figure is
           the comparison, which is how a llama.cpp user serves 32 requests with it)

Reported per system and workload: output tokens/s over the whole run (prefill included), wall
seconds; per system the resident weight bytes (Ferry: every tensor its model holds, KV cache
and rotary table excluded; llama.cpp: its model's tensor bytes, `llama_model_size`), and
ferry-gguf's over the file's tensor bytes; which product kernel ran (int16 activations on
AVX512_VNNI's vpdpwssd or AVX2's vpmaddwd, the same floats: `ATEN_CPU_CAPABILITY=avx2` measures the
AVX2 build on any x86 machine); whether
ferry-gguf's batch-1 tokens equal ferry-fp32's; and the speedups that bench/README.md quotes.
Each figure is the best of `--repeats` runs after a short warm-up, the systems taking turns.
Threads: `--threads` (default 2) for torch and for llama.cpp alike.

    python -m bench.quantized                     # batch 1 and 32, 256 tokens
    python -m bench.quantized --quick             # 64 tokens, batch 8, no repeats
    python -m bench.quantized --variant Q4_K_M    # the K-quant mix people download
    ATEN_CPU_CAPABILITY=avx2 python -m bench.quantized --variant Q4_K_M   # both projects' AVX2 kernels
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import write_result
from bench.gguf_variants import bench_model, tensor_bytes, tensor_types

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP = "llama-cpp-python==0.3.36"
LLAMA_CPP_ARCHIVE = Path("/tmp/pkgs/llama_cpp_python-0.3.36.tar.gz")
# CMake flags per llama.cpp build (--llama-cpp-isa). avx2 is what an AVX2-only CPU (Zen 2/3,
# Haswell to Skylake client) compiles natively: AVX2, FMA, F16C and BMI2, none of AVX-512, AVX-VNNI or AMX.
LLAMA_CPP_CMAKE = {
    "native": "-DGGML_NATIVE=ON",
    "avx512": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
              "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
              "-DGGML_AMX_INT8=OFF",
    "avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
            "-DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_INT8=OFF",
}
TOOLS_VENV = {"native": ".venv-tools", "avx512": ".venv-tools-avx512", "avx2": ".venv-tools-avx2"}
PROMPT = "Write a short story about a ferry that crosses a wide river every morning."

# Run by the tools environment's Python: argv = model, threads, tokens, repeats; prints one JSON line.
_LLAMA_CPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama, llama_model_size
model, threads, tokens, repeats, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = Llama(model_path=model, n_ctx=tokens + 128, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = llm.tokenize(prompt.encode(), add_bos=True)

def run(n):
    llm.reset()
    start, out = time.perf_counter(), []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return time.perf_counter() - start, out

run(8)
seconds, out = min(run(tokens) for _ in range(repeats))
size = llama_model_size(llm.model)
print(json.dumps({"seconds": seconds, "tokens": len(out), "token_ids": out, "weight_bytes": size}))
"""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    parser.add_argument("--variant", default=None, help="the bundled file in this llama.cpp type (Q4_K_M, ...)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tools-python", default=None,
                        help="the llama.cpp baseline's Python (default: the --llama-cpp-isa build's own "
                             "environment, TOOLS_VENV)")
    parser.add_argument("--llama-cpp-isa", choices=sorted(LLAMA_CPP_CMAKE), default=None,
                        help="llama.cpp's build: native, avx512 (no AMX) or avx2 as on an AVX2-only CPU "
                             "(default: avx2 when torch is held to AVX2, avx512 on a CPU with AMX, else native)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    parser.add_argument("--quick", action="store_true", help="64 tokens, batch 8")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.batch, args.repeats = 64, 8, 1
    if args.llama_cpp_isa is None:
        args.llama_cpp_isa = default_llama_cpp_isa()
    if args.tools_python is None:
        args.tools_python = str(REPO / TOOLS_VENV[args.llama_cpp_isa] / "bin" / "python")
    return args


def default_llama_cpp_isa() -> str:
    """avx2 when torch runs AVX2 code, avx512 where the CPU has AMX (llama.cpp's AMX path crashed
    there), else native."""
    from ferry.kernels.cpu import native

    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        return "avx2"
    return "avx512" if native.cpu_has_amx() else "native"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, packed panels and quantized tiles, which
    are registered as buffers), the rotary table excepted; each storage counted once."""
    seen, total = set(), 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name == "cos_sin" or tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        total += tensor.untyped_storage().nbytes()
    return total


def ferry_run(llm, prompts: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    from ferry.worker.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def tools_python(path: str, isa: str = "native") -> tuple[Path | None, str | None]:
    """The tools environment's Python with llama-cpp-python importable, building it if needed
    with `isa`'s CMake flags (LLAMA_CPP_CMAKE); (None, why) when that fails."""
    python = Path(path)
    if not python.exists():
        venv = python.parent.parent
        tqdm.write(f"llama.cpp baseline: creating {venv}")
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if made.returncode:
            return None, f"could not create {venv}: {made.stderr.strip()[-300:]}"
    if subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python, None
    source = str(LLAMA_CPP_ARCHIVE) if LLAMA_CPP_ARCHIVE.exists() else LLAMA_CPP
    tqdm.write(f"llama.cpp baseline: building {source} (several minutes on first use)")
    env = {**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE[isa]}
    built = subprocess.run([str(python), "-m", "pip", "install", "-q", source], capture_output=True, text=True, env=env)
    if built.returncode:
        return None, f"pip install {source} failed: {built.stderr.strip()[-300:]}"
    return python, None


def llama_cpp_run(python: Path, model: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run(
        [str(python), "-c", _LLAMA_CPP_SCRIPT, str(model), str(args.threads), str(args.tokens), str(args.repeats),
         PROMPT],
        capture_output=True, text=True,
    )
    if done.returncode:  # negative: killed by that signal (llama.cpp's AMX path died of SIGSEGV on one Xeon)
        raise RuntimeError(f"exit status {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    from ferry.worker.engine import LLM

    model = bench_model(args.model, args.variant, args.tools_python)
    batch_prompts = [f"{i + 1}. {PROMPT}" for i in range(args.batch)]
    workloads = {"batch1": [PROMPT], f"batch{args.batch}": batch_prompts}
    kv_bytes = args.batch * (args.tokens + 64) * 30 * 2 * 3 * 64 * 4 * 5 // 4  # SmolLM2's KV, with room
    results: dict[str, dict] = {}
    tokens: dict[str, list[list[int]]] = {}
    systems = {"ferry-fp32": "none", "ferry-gguf": "gguf"}
    with tqdm(total=len(systems) * len(workloads) + (not args.no_llama_cpp), desc="quantized", unit="run") as bar:
        engines = {}
        for system, quantization in systems.items():
            bar.set_postfix_str(f"loading {system}")
            llm = LLM(str(model), quantization=quantization, max_model_len=args.tokens + 128, kv_cache_bytes=kv_bytes)
            ferry_run(llm, [PROMPT], 8)  # warm-up: native kernels loaded, first-step allocations made
            engines[system] = llm
            results[system] = {"weight_mb": round(weight_bytes(llm.engine.runner.model) / 1e6, 1)}
        for workload, prompts in workloads.items():
            for system, llm in engines.items():
                bar.set_postfix_str(f"{system} {workload}")
                best = None
                for _ in range(args.repeats):
                    seconds, out = ferry_run(llm, prompts, args.tokens)
                    best = seconds if best is None else min(best, seconds)
                generated = args.tokens * len(prompts)
                results[system][workload] = {"seconds": round(best, 3), "tokens": generated,
                                             "tokens_per_s": round(generated / best, 1)}
                tokens[f"{system}/{workload}"] = out
                tqdm.write(f"{system:10s} {workload:8s}: {generated / best:7.1f} tok/s ({best:.2f} s)")
                bar.update()
        del engines
        llama_cpp_note = None
        if not args.no_llama_cpp:
            bar.set_postfix_str("llama.cpp batch1")
            python, llama_cpp_note = tools_python(args.tools_python, args.llama_cpp_isa)
            if python is not None:
                try:
                    run = llama_cpp_run(python, model, args)
                    results["llama.cpp"] = {
                        "weight_mb": round(run["weight_bytes"] / 1e6, 1),
                        "batch1": {"seconds": round(run["seconds"], 3), "tokens": run["tokens"],
                                   "tokens_per_s": round(run["tokens"] / run["seconds"], 1)},
                    }
                    tqdm.write(f"llama.cpp  batch1  : {results['llama.cpp']['batch1']['tokens_per_s']:7.1f} tok/s")
                except (RuntimeError, ValueError, json.JSONDecodeError) as exc:
                    llama_cpp_note = f"llama.cpp run failed: {exc}"
            if llama_cpp_note:
                tqdm.write(f"llama.cpp baseline skipped: {llama_cpp_note}")
            bar.update()

    big = f"batch{args.batch}"

    def rate(system: str, workload: str) -> float | None:
        return results.get(system, {}).get(workload, {}).get("tokens_per_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    factors = {
        "batch1_gguf_vs_fp32_speedup": ratio(rate("ferry-gguf", "batch1"), rate("ferry-fp32", "batch1")),
        f"{big}_gguf_vs_fp32_speedup": ratio(rate("ferry-gguf", big), rate("ferry-fp32", big)),
        "batch1_gguf_vs_llama_cpp_speedup": ratio(rate("ferry-gguf", "batch1"), rate("llama.cpp", "batch1")),
        f"{big}_gguf_vs_llama_cpp_batch1_speedup": ratio(rate("ferry-gguf", big), rate("llama.cpp", "batch1")),
        "weight_memory_fp32_over_gguf_ratio": ratio(results["ferry-fp32"]["weight_mb"],
                                                    results["ferry-gguf"]["weight_mb"]),
    }
    from ferry.kernels.cpu import native

    file_mb = tensor_bytes(model) / 1e6
    factors["gguf_resident_over_file_tensors_ratio"] = round(results["ferry-gguf"]["weight_mb"] / file_mb, 3)
    vnni = bool(native.load() and native.load().linear_quantized_vnni())
    amx = bool(native.load() and native.load().linear_quantized_amx())
    # One result file per file type and kernel, so the README keeps the Q4_1 rows beside the K-quant ones.
    suite = "quantized" + (f"_{args.variant.lower()}" if args.variant else "") + ("" if vnni else "_avx2")
    path = write_result(
        suite,
        {
            "settings": {"model": model.name, "tokens": args.tokens, "batch": args.batch, "repeats": args.repeats,
                         "threads": args.threads, "prompt": PROMPT},
            "kernel": ("int16 activations (AVX512_VNNI" + (", AMX-INT8 from 24 rows)" if amx else ")")) if vnni else
                      f"int16 activations ({torch.backends.cpu.get_cpu_capability()})",
            "file": {"tensor_mb": round(file_mb, 1), "matrix_types": dict(tensor_types(model))},
            "results": results,
            "factors": {k: v for k, v in factors.items() if v is not None},
            "same_greedy_tokens_batch1": tokens["ferry-gguf/batch1"] == tokens["ferry-fp32/batch1"],
            "same_greedy_tokens_batched": sum(a == b for a, b in zip(tokens[f"ferry-gguf/{big}"],
                                                                     tokens[f"ferry-fp32/{big}"], strict=True)),
            "llama_cpp": llama_cpp_note or "ran",
            "llama_cpp_build": {"isa": args.llama_cpp_isa, "cmake_args": LLAMA_CPP_CMAKE[args.llama_cpp_isa]},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
