"""Throughput: Ferry's engine against three transformers baselines on one workload, in one run.

Workload (seeded, identical for every system): n requests (default 64), prompt lengths uniform
in [32, 512], output lengths uniform in [16, 256], greedy, EOS ignored, SmolLM2-135M-Instruct (the
bundled model, its GGUF converted to float32). All requests arrive at t=0.

Systems:
  ferry        Engine step loop (continuous batching, paged KV, chunked prefill)
  hf-single    transformers generate, one request at a time
  hf-static8   transformers generate, static left-padded batches of 8 (runs to each batch's longest)
  hf-cb        transformers continuous batching (generate_batch's manager, sdpa attention)

Reported per system: output tokens/s (useful tokens only), wall time, TTFT and TBT percentiles;
for Ferry also KV memory: allocated token slots actually holding KV, and the pool reserved.
Ferry runs first and again after each baseline; a ratio divides the mean of the two Ferry runs
beside that baseline by it (this machine's speed drifts within minutes), and Ferry's reported
figures are its median run. Batch-1 decode steps are set against the weight-read floor in
alternation (see batch1_over_floor).

    python -m bench.throughput --n 64            # the full workload (slow baselines: ~20 min here)
    python -m bench.throughput --n 16 --systems ferry,hf-static8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.common import ferry_beside, percentiles, write_result
from bench.models import smollm2

SYSTEMS = ("ferry", "hf-single", "hf-static8", "hf-cb")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def make(cls, n: int, vocab_size: int, seed: int = 0) -> Workload:
        rng = random.Random(seed)
        prompts = [[rng.randrange(1, vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(n)]
        return cls(prompts, [rng.randint(16, 256) for _ in range(n)])

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class SystemResult:
    system: str
    wall_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)  # one per request
    tbt_s: list[float] = field(default_factory=list)  # every gap between consecutive tokens
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "system": self.system,
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.output_tokens,
            "tokens_per_s": round(self.output_tokens / self.wall_s, 2),
            "ttft_ms": {k: v and round(v * 1e3, 1) for k, v in percentiles(self.ttft_s).items()},
            "tbt_ms": {k: v and round(v * 1e3, 1) for k, v in percentiles(self.tbt_s).items()},
            # Raw samples (seconds) for the CDF plots.
            "ttft_s": [round(v, 4) for v in self.ttft_s],
            "tbt_s": [round(v, 4) for v in self.tbt_s],
            **self.extra,
        }


def _weights_a_step_reads(model) -> list:
    """Every weight a batch-1 decode step reads: each layer's, the final norm and the LM head as
    the engine holds them (of the embedding only a row)."""
    head = model.lm_head_weight if model.lm_head_packed is None else model.lm_head_packed.panels
    return [*model.layers.parameters(), *model.layers.buffers(), model.norm, head]


def _read_once(tensors: list) -> float:
    start = time.perf_counter()
    for t in tensors:
        t.sum()
    return time.perf_counter() - start


def batch1_over_floor(model_dir, pairs: int = 120, context: int = 256) -> dict:
    """Batch-1 decode steps against the weight-read floor (one read of every weight a step reads),
    taken in turn: this machine's memory bandwidth drifts by 25% within minutes, so a floor read
    at another moment than the steps can make the ratio anything from 0.95x to 1.75x. Each step
    (the whole `Engine.step` of one running request with a `context`-token prompt: scheduler,
    model, sampler, outputs) is divided by the read right after it; the median of those ratios
    is the figure."""
    import torch

    from ferry.worker.engine import Engine, SamplingParams

    engine = Engine(str(model_dir), kv_cache_bytes=64 << 20, max_model_len=context + pairs + 64)
    tensors = _weights_a_step_reads(engine.runner.model)
    vocab = engine.arch.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(context)]
    engine.add_request("batch1", prompt, SamplingParams(max_tokens=pairs + 40, temperature=0.0, ignore_eos=True))
    steps, reads = [], []
    with torch.inference_mode():
        for i in range(pairs + 8):  # the prefill and 7 decode steps warm up, unmeasured
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            read = _read_once(tensors)
            if i >= 8:
                steps.append(step)
                reads.append(read)
    engine.abort("batch1")
    size = sum(t.numel() * t.element_size() for t in tensors)
    read_p50 = statistics.median(reads)
    return {
        "bytes": size,
        "pairs": pairs,
        "context": context,
        "seconds": round(read_p50, 5),  # median weight read
        "gb_per_s": round(size / read_p50 / 1e9, 1),
        "batch1_step_ms": round(statistics.median(steps) * 1e3, 2),
        "batch1_tbt_over_floor": round(statistics.median(s / r for s, r in zip(steps, reads, strict=True)), 3),
    }


def run_sweep(model_dir, work: Workload, levels: list[int]) -> list[dict]:
    """Ferry's throughput against how many requests run at once: at each level c, the first
    max(4, 2c) requests of the workload with max_num_seqs = c (so every level is busy for a while)."""
    rows = []
    for c in levels:
        n = min(len(work.prompts), max(4, 2 * c))
        sub = Workload(work.prompts[:n], work.output_lens[:n])
        with tqdm(total=sub.output_tokens, desc=f"ferry c={c}", unit="tok", file=sys.stderr) as bar:
            result = run_ferry(model_dir, sub, c, bar)
        tbt = percentiles(result.tbt_s)
        rows.append({
            "max_num_seqs": c, "requests": n, "output_tokens": result.output_tokens, "wall_s": round(result.wall_s, 3),
            "tokens_per_s": round(result.output_tokens / result.wall_s, 2),
            "tbt_ms": {k: v and round(v * 1e3, 1) for k, v in tbt.items()},
        })
    return rows


def run_ferry(model_dir, work: Workload, max_num_seqs: int, bar: tqdm) -> SystemResult:
    from ferry.worker.engine import Engine, SamplingParams

    engine = Engine(str(model_dir), max_num_seqs=max_num_seqs)
    used_slots, allocated_slots, peak_blocks = [], [], 0
    start = time.monotonic()
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), arrival_time=start
        )
    finished = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        usage = engine.kv_usage()
        if usage.num_used_blocks:
            used_slots.append(usage.num_used_tokens)
            allocated_slots.append(usage.num_used_blocks * engine.block_size)
            peak_blocks = max(peak_blocks, usage.num_used_blocks)
        for out in outputs:
            bar.update(len(out.new_token_ids))
            if out.finished:
                finished.append(out)
    wall = time.monotonic() - start
    pool_tokens = engine.kv.num_blocks * engine.block_size
    return SystemResult(
        "ferry",
        wall,
        sum(o.num_output_tokens for o in finished),
        [o.metrics.ttft for o in finished],
        [gap for o in finished for gap in o.metrics.inter_token_latencies],
        {
            "kv": {
                # Of the token slots in allocated blocks, the share holding KV (internal fragmentation).
                "used_over_allocated_mean": round(sum(used_slots) / sum(allocated_slots), 4),
                "peak_allocated_tokens": peak_blocks * engine.block_size,
                "pool_tokens": pool_tokens,
                "pool_bytes": engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size(),
            },
            "num_preemptions": engine.stats().num_preemptions,
        },
    )


class _StepClock:
    """A transformers logits processor that timestamps every decoding step (one token per row)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.monotonic())
        return scores


def _hf_model(model_dir, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", attn_implementation=attn).eval()


def run_hf_batches(model_dir, work: Workload, batch_size: int, bar: tqdm) -> SystemResult:
    import torch
    from transformers import LogitsProcessorList

    model = _hf_model(model_dir)
    name = "hf-single" if batch_size == 1 else f"hf-static{batch_size}"
    ttft, tbt = [], []
    start = time.monotonic()
    for b in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[b : b + batch_size]
        lens = work.output_lens[b : b + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False,
                eos_token_id=None, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
            )
        for n in lens:  # request i's tokens are the batch's first n steps; the rest is wasted work
            ttft.append(clock.times[0] - start)
            tbt.extend(b2 - a for a, b2 in zip(clock.times[: n - 1], clock.times[1:n], strict=True))
        bar.update(sum(lens))
    return SystemResult(name, time.monotonic() - start, work.output_tokens, ttft, tbt)


def run_hf_continuous(model_dir, work: Workload, bar: tqdm) -> SystemResult:
    from transformers import GenerationConfig

    model = _hf_model(model_dir)  # the manager switches sdpa to its paged variant itself
    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.monotonic()
    start_perf = time.perf_counter()
    ids = [
        manager.add_request(prompt, max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
        for prompt, n in zip(work.prompts, work.output_lens, strict=True)
    ]
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
            bar.update(len(result.generated_tokens))
    wall = time.monotonic() - start
    manager.stop(block=True)
    ttft, tbt, tokens = [], [], 0
    for result in results.values():
        tokens += len(result.generated_tokens)
        stamps = result.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start_perf)
            tbt.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return SystemResult("hf-cb", wall, tokens, ttft, tbt)


def _run_system(system: str, model_dir, work: Workload, args) -> SystemResult:
    with tqdm(total=work.output_tokens, desc=system, unit="tok", file=sys.stderr) as bar:
        if system == "ferry":
            return run_ferry(model_dir, work, args.max_num_seqs, bar)
        if system == "hf-single":
            return run_hf_batches(model_dir, work, 1, bar)
        if system == "hf-static8":
            return run_hf_batches(model_dir, work, 8, bar)
        return run_hf_continuous(model_dir, work, bar)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=64, help="requests (every system runs the same list)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--sweep", default="1,4,16", help="extra Ferry runs at these max_num_seqs ('' to skip); "
                        "the main run is the --max-num-seqs level")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    model_dir = args.model or smollm2()
    import json

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    work = Workload.make(args.n, vocab, args.seed)
    # Ferry runs before the first baseline and again after each one, and each ratio takes the
    # mean of the two Ferry runs beside its baseline: this machine's speed drifts by up to 25%
    # within minutes, and a baseline runs for 5-11 of them.
    baselines = [s for s in systems if s != "ferry"]
    ferry_runs = [_run_system("ferry", model_dir, work, args)] if "ferry" in systems else []
    baseline_results = []
    for system in baselines:
        baseline_results.append(_run_system(system, model_dir, work, args))
        if ferry_runs:
            ferry_runs.append(_run_system("ferry", model_dir, work, args))
    results = baseline_results
    if ferry_runs:
        results = [
            sorted(ferry_runs, key=lambda r: r.output_tokens / r.wall_s)[len(ferry_runs) // 2],
            *baseline_results,
        ]
    sweep, floor = [], None
    if "ferry" in systems and args.sweep:
        sweep = run_sweep(model_dir, work, [int(c) for c in args.sweep.split(",") if c])
        floor = batch1_over_floor(model_dir)
        single = next((row for row in sweep if row["max_num_seqs"] == 1), None)
        if single and single["tbt_ms"]["p50"]:
            floor["sweep_batch1_tbt_p50_ms"] = single["tbt_ms"]["p50"]
        main_ferry = next(r for r in results if r.system == "ferry")
        tbt = percentiles(main_ferry.tbt_s)
        sweep.append(
            {
                "max_num_seqs": args.max_num_seqs,
                "requests": len(work.prompts),
                "output_tokens": main_ferry.output_tokens,
                "wall_s": round(main_ferry.wall_s, 3),
                "tokens_per_s": round(main_ferry.output_tokens / main_ferry.wall_s, 2),
                "tbt_ms": {k: v and round(v * 1e3, 1) for k, v in tbt.items()},
            }
        )
    summaries = [r.summary() for r in results]
    ratios = {}
    ferry_rates = [r.output_tokens / r.wall_s for r in ferry_runs]
    for i, baseline in enumerate(baseline_results):
        if ferry_rates:
            beside = ferry_beside(ferry_rates, i)
            ratios[f"ferry_over_{baseline.system}"] = round(beside / (baseline.output_tokens / baseline.wall_s), 2)
    path = write_result(
        "throughput",
        {
            "workload": {
                "n": args.n, "seed": args.seed, "prompt_len": [32, 512], "output_len": [16, 256],
                "output_tokens": work.output_tokens, "prompt_tokens": sum(map(len, work.prompts)),
                "mean_prompt_len": statistics.mean(map(len, work.prompts)), "model": str(model_dir), "dtype": "float32",
            },
            "results": summaries,
            "ratios": ratios,
            "ferry_runs_tokens_per_s": [round(r, 2) for r in ferry_rates],  # in run order, around the baselines
            "concurrency_sweep": sweep,
            "weight_read_floor": floor,
        },
    )
    for s in summaries:
        print(
            f"{s['system']:<11} {s['tokens_per_s']:>8.1f} tok/s  wall {s['wall_s']:>7.1f}s  "
            f"TTFT p50 {s['ttft_ms']['p50']} ms  TBT p50 {s['tbt_ms']['p50']} ms"
        )
    print("ratios:", ratios)
    if floor:
        print(
            f"batch-1 decode step {floor['batch1_step_ms']} ms = {floor['batch1_tbt_over_floor']}x "
            "the weight-read floor "
            f"({floor['bytes'] / 1e6:.0f} MB at {floor['gb_per_s']} GB/s; median of {floor['pairs']} step/read pairs)"
        )
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
