"""The one-shot GPU check: what a session lent a GPU should run first, in at most 8 minutes.

    python -m bench.gpu_check                  # on a CUDA machine: JSON into bench/results/gpu_check-<stamp>/
    python -m bench.gpu_check --out "$OUT"     # into a folder of your choice (the device tool's $OUT)
    python -m bench.gpu_check --dry-run        # every step at tiny sizes on the CPU: proves it starts

Steps, in order, each in its own process under its own time limit (a hang or a CUDA fault in one
leaves the others running; a step that runs out of time keeps what it wrote so far):

  environment   versions, device, memory, measured copy bandwidth, which of Ferry's imports are missing
  kernel_tests  tests/kernels/triton compiled on the GPU (TRITON_INTERPRET=0) against the PyTorch reference
  parity        greedy tokens of Ferry against transformers generate on the same random weights
                (llama with GQA, qwen2 with biases, qwen3 with q/k norms, mixtral through the Triton
                fused-MoE kernel, gemma2 through windowed and soft-capped Triton attention), in float32
                and bfloat16
  kernel_bench  `python -m bench.kernels --quick`: decode attention GB/s against the copy bandwidth,
                prefill against SDPA, the fused kernels against the reference
  serving       random weights in the Llama-3.1-8B shape, bf16: TTFT, TBT and tokens/s with 1, 16, 64
                and 256 requests arriving at once

Writes `<step>.json` per step, `summary.json` (each step's status, seconds and headline numbers)
and `gpu_check.log` (every step's output): seven files, within the eight the device tool brings back.
The --dry-run runs the same code on the CPU (kernels under Triton's interpreter, tiny models): its
numbers mean nothing; it is the test that the check starts and writes what it should.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS_DIR, percentiles, to_json

# Seconds per step; they add up to the 8-minute budget. A step gets what is left if less.
STEP_BUDGET_S = {"environment": 30, "kernel_tests": 100, "parity": 70, "kernel_bench": 110, "serving": 170}
STEPS = tuple(STEP_BUDGET_S)
TOTAL_BUDGET_S = 480

# Modules the engine imports that a GPU image may lack (the device tool's README: carry them as wheels).
ENGINE_IMPORTS = ("gguf", "xgrammar", "jsonschema", "pydantic", "redis", "safetensors", "transformers", "triton")

LLAMA_3_1_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY_LLAMA = dict(
    LLAMA_3_1_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)

# Parity models: tiny, and wide initial weights so greedy ties never hinge on rounding.
PARITY_ARCHS = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=2),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    # a 16-token window (prompts of up to 48 tokens + 32 new), attention logits capped at 5
    "gemma2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                   attn_logit_softcapping=5.0, query_pre_attn_scalar=16),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the JSON (default bench/results/gpu_check-<stamp>/)"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks that every step runs")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="wall-clock budget for all steps")
    parser.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # internal: run one step in this process
    args = parser.parse_args(argv)
    out = args.out or RESULTS_DIR / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        STEP_FUNCTIONS[args.step](out, args.dry_run)
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; known: {list(STEPS)}")
    return run_all(steps, out, args.dry_run, args.budget_s)


def run_all(steps: list[str], out: Path, dry_run: bool, budget_s: float) -> int:
    """Each step in a child process with min(its budget, what is left); summary.json after each."""
    deadline = time.monotonic() + budget_s
    log_path = out / "gpu_check.log"
    summary = {"dry_run": dry_run, "budget_s": budget_s, "steps": {}}
    with log_path.open("w") as log:
        for step in steps:
            left = deadline - time.monotonic()
            limit = min(STEP_BUDGET_S[step] * budget_s / TOTAL_BUDGET_S, left)
            if limit < 5:
                summary["steps"][step] = {"status": "skipped", "reason": "budget spent"}
                continue
            print(f"gpu_check: {step} (limit {limit:.0f} s)", file=sys.stderr, flush=True)
            log.write(f"\n===== {step} (limit {limit:.0f} s) =====\n")
            log.flush()
            summary["steps"][step] = _run_step(step, out, dry_run, limit, log)
            (out / "summary.json").write_text(to_json(summary))
    summary["ok"] = all(s["status"] == "ok" for s in summary["steps"].values())
    (out / "summary.json").write_text(to_json(summary))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if summary["ok"] else 1


def _run_step(step: str, out: Path, dry_run: bool, limit: float, log) -> dict:
    command = [sys.executable, "-m", "bench.gpu_check", "--step", step, "--out", str(out)]
    if dry_run:
        command.append("--dry-run")
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # start_new_session: a timeout kills the step's whole process group (pytest's children too).
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc = child.wait(timeout=limit)
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        child.wait()
        rc, status = None, "timeout"
    record = {"status": status, "rc": rc, "seconds": round(time.monotonic() - start, 1)}
    result = out / f"{step}.json"
    if result.is_file():
        record["headline"] = json.loads(result.read_text()).get("headline")
    return record


def _write(out: Path, step: str, payload: dict) -> None:
    (out / f"{step}.json").write_text(to_json({"step": step, **payload}))


# --- steps ------------------------------------------------------------------------------------------


def step_environment(out: Path, dry_run: bool) -> None:
    import importlib.util

    import torch

    missing = [name for name in ENGINE_IMPORTS if importlib.util.find_spec(name) is None]
    record: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "missing_imports": missing,
        "versions": {name: _version(name) for name in ENGINE_IMPORTS if name not in missing},
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        record["device"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_total_gib": round(total / 2**30, 1),
            "memory_free_gib": round(free / 2**30, 1),
        }
        record["nvidia_smi"] = _nvidia_smi()
    from bench.kernels import Timer, WallTimer, copy_bandwidth

    if torch.cuda.is_available() and not dry_run:
        gbps = copy_bandwidth(Timer(torch.device("cuda")), torch.device("cuda"))
    else:
        gbps = copy_bandwidth(WallTimer(), torch.device("cpu"), nbytes=64 << 20)
    record["copy_bandwidth_gbps"] = round(gbps, 1)
    record["headline"] = {"copy_bandwidth_gbps": record["copy_bandwidth_gbps"], "missing_imports": missing}
    _write(out, "environment", record)
    if missing:
        sys.exit(f"missing modules the engine imports: {missing} (carry them as wheels: README, 'One-shot GPU check')")


def step_kernel_tests(out: Path, dry_run: bool) -> None:
    """pytest on the Triton kernel tests; compiled on CUDA, or (dry run) two of them interpreted on the CPU."""
    import xml.etree.ElementTree as ET

    repo = Path(__file__).resolve().parents[1]
    targets = (
        ["tests/kernels/triton/test_rms_norm.py", "tests/kernels/triton/test_write_kv.py"]
        if dry_run
        else ["tests/kernels/triton"]
    )
    report = out / "kernel_tests.xml"
    env = dict(os.environ)
    if not dry_run:
        env["TRITON_INTERPRET"] = "0"  # tests/kernels/conftest.py: compiled kernels on CUDA tensors
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *targets],
        cwd=repo,
        env=env,
        check=False,
    )
    suite = ET.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failures = [
        case.get("classname", "") + "::" + case.get("name", "")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    report.unlink()
    _write(
        out,
        "kernel_tests",
        {
            "targets": targets,
            "rc": proc.returncode,
            **counts,
            "failed": failures,
            "headline": {**counts, "rc": proc.returncode},
        },
    )
    if proc.returncode != 0:
        sys.exit(proc.returncode)


def step_parity(out: Path, dry_run: bool) -> None:
    """Greedy tokens, Ferry against transformers, on each architecture and dtype (one prompt at a time,
    so the reference has no padding)."""
    import tempfile

    import torch

    device = "cpu" if dry_run or not torch.cuda.is_available() else "cuda"
    prompts, new_tokens = (2, 8) if dry_run else (8, 32)
    archs = ["llama"] if dry_run else list(PARITY_ARCHS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            model_dir = random_checkpoint(
                Path(tmp) / arch, arch, dict(TINY_LLAMA, **PARITY_ARCHS[arch]), initializer_range=0.25
            )
            generator = torch.Generator().manual_seed(0)
            token_prompts = [
                torch.randint(3, 512, (int(n),), generator=generator).tolist()
                for n in torch.randint(4, 48, (prompts,), generator=generator)
            ]
            for dtype in ("float32", "bfloat16"):
                ours = _ferry_greedy(model_dir, token_prompts, new_tokens, dtype, device)
                reference = _hf_greedy(model_dir, token_prompts, new_tokens, dtype, device)
                divergence = [_first_difference(a, b) for a, b in zip(ours, reference, strict=True)]
                rows.append(
                    {
                        "arch": arch,
                        "dtype": dtype,
                        "device": device,
                        "prompts": prompts,
                        "new_tokens": new_tokens,
                        "identical": sum(d is None for d in divergence),
                        "first_divergence": divergence,
                    }
                )
                _write(out, "parity", _parity_record(rows))
    record = _parity_record(rows)
    _write(out, "parity", record)
    if not record["headline"]["float32_all_identical"]:
        sys.exit("float32 greedy tokens differ from transformers")


def _parity_record(rows: list[dict]) -> dict:
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    return {
        "rows": rows,
        "headline": {
            "float32_all_identical": all(r["identical"] == r["prompts"] for r in fp32),
            "bfloat16_identical": f"{sum(r['identical'] for r in bf16)}/{sum(r['prompts'] for r in bf16)}",
        },
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ferry_greedy(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str, device: str
) -> list[list[int]]:
    from ferry.worker.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, device=device, max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.token_ids) for o in outputs]


def _hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    result = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            result.append(generated[0, len(prompt) :].tolist())
    return result


def step_kernel_bench(out: Path, dry_run: bool) -> None:
    from bench import kernels as kernel_bench

    target = out / "kernel_bench.json"
    kernel_bench.main(["--dry-run" if dry_run else "--quick", "--out", str(target)])
    record = json.loads(target.read_text())
    record["headline"] = record["summary"]
    _write(out, "kernel_bench", record)


def step_serving(out: Path, dry_run: bool) -> None:
    """The Llama-3.1-8B shape with random bf16 weights through Ferry's engine: at each level c, c
    requests of 512 prompt tokens and 128 output tokens arrive at once."""
    import tempfile

    import torch

    cuda = torch.cuda.is_available() and not dry_run
    shape = LLAMA_3_1_8B if cuda else TINY_LLAMA
    levels, prompt_len, output_len = ([1, 16, 64, 256], 512, 128) if cuda else ([1, 4], 16, 8)
    record: dict = {
        "shape": {k: v for k, v in shape.items() if k != "rope_scaling"},
        "dtype": "bfloat16",
        "prompt_tokens": prompt_len,
        "output_tokens": output_len,
        "levels": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        model_dir = random_checkpoint(
            Path(tmp) / "llama-3.1-8b-random", "llama", shape, device="cuda" if cuda else "cpu", dtype="bfloat16"
        )
        record["checkpoint_write_s"] = round(time.monotonic() - start, 1)
        from ferry.worker.engine import Engine, SamplingParams

        start = time.monotonic()
        engine = Engine(
            str(model_dir),
            dtype="bfloat16",
            device="cuda" if cuda else "cpu",
            max_num_seqs=max(levels),
            max_model_len=prompt_len + output_len + 16,
        )
        record["engine_load_s"] = round(time.monotonic() - start, 1)
        _write(out, "serving", record)
        generator = torch.Generator().manual_seed(0)
        vocab = shape["vocab_size"]
        # Warm-up, not reported: the first steps compile the kernels for these shapes.
        _serve(engine, SamplingParams, _random_prompts(generator, vocab, prompt_len, 2), 4)
        for c in levels:
            prompts = _random_prompts(generator, vocab, prompt_len, c)
            record["levels"].append({"concurrency": c, **_serve(engine, SamplingParams, prompts, output_len)})
            record["headline"] = {
                f"c{r['concurrency']}": {k: r[k] for k in ("ttft_ms_p50", "tbt_ms_p50", "tokens_per_s")}
                for r in record["levels"]
            }
            _write(out, "serving", record)


def _random_prompts(generator, vocab_size: int, length: int, count: int) -> list[list[int]]:
    import torch

    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def _serve(engine, sampling_params, prompts: list[list[int]], output_len: int) -> dict:
    params = sampling_params(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    base = f"{time.monotonic_ns()}-"
    for i, prompt in enumerate(prompts):
        engine.add_request(base + str(i), prompt, params, arrival_time=start)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    wall = time.monotonic() - start
    tokens = sum(o.num_output_tokens for o in finished)
    ttft = percentiles([o.metrics.ttft * 1e3 for o in finished])
    tbt = percentiles([gap * 1e3 for o in finished for gap in o.metrics.inter_token_latencies])
    return {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_ms_p50": _round(ttft["p50"]),
        "ttft_ms_p90": _round(ttft["p90"]),
        "tbt_ms_p50": _round(tbt["p50"]),
        "tbt_ms_p90": _round(tbt["p90"]),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def random_checkpoint(
    directory: Path,
    arch: str,
    shape: dict,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    initializer_range: float = 0.02,
) -> Path:
    """A random-weight checkpoint of `shape` (a LlamaConfig's fields) for `arch`, made on `device`
    (on a GPU an 8B model initializes in seconds) and saved without a tokenizer: prompts are token ids."""
    import torch
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[arch]
    fields = dict(shape)
    if arch != "llama":
        fields.pop("rope_scaling", None)
    config = config_class(**fields, initializer_range=initializer_range, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory, max_shard_size="5GB")
    del model
    return directory


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version({"pydantic": "pydantic", "redis": "redis"}.get(module, module))
    except PackageNotFoundError:
        return None


def _nvidia_smi() -> str | None:
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


STEP_FUNCTIONS = {
    "environment": step_environment,
    "kernel_tests": step_kernel_tests,
    "parity": step_parity,
    "kernel_bench": step_kernel_bench,
    "serving": step_serving,
}


if __name__ == "__main__":
    sys.exit(main())
