"""Tensor parallelism on the CPU: 2 ranks of 1 thread each against 1 rank of 1 thread.

The model: SmolLM2-135M's matrices with random weights (float32), but 12 heads of 48 and 4 kv
heads instead of 9 of 64 and 3 (the same q/k/v/o sizes: SmolLM2's 9 heads do not split in
two). Greedy decode, EOS ignored, at batch 1 and 32 (`--batches`): prompts of `--prompt`
tokens, `--tokens` new tokens each. Reported per system and batch: decode tokens/s (the steps
after every request has its first token), the median decode step, and for 2 ranks the time rank
0 spends inside the decoder's all-reduces per step (waiting for the other rank included: it is
what splitting costs). Each measurement is the best of --repeats runs; the systems take turns.

    python -m bench.tensor_parallel            # batch 1 and 32
    python -m bench.tensor_parallel --quick    # fewer tokens, one repeat
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import write_result
from bench.models import SMOLLM2_135M

SHAPE = {**SMOLLM2_135M, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 48}


def _model(directory: Path = Path(".ferry/bench-models/smollm2-135m-tp-random")) -> Path:
    if (directory / "config.json").is_file():
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


class _AllReduceClock:
    """Seconds rank 0 spends in torch.distributed.all_reduce (the decoder's two per layer)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = dist.all_reduce

    def __enter__(self) -> _AllReduceClock:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._inner


def _run(engine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from ferry.worker.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"r{batch}-{i}-{time.monotonic_ns()}",
                           torch.randint(10, 40000, (prompt_len,), generator=gen).tolist(), params)
    steps, tokens = [], 0
    with _AllReduceClock() as clock:
        reduce_at_start = 0.0
        while engine.has_unfinished_requests():
            decoding = engine.num_waiting == 0 and all(r.num_output_tokens for r in engine.scheduler.running)
            before, reduce_before = time.perf_counter(), clock.seconds
            outputs = engine.step()
            if decoding:
                steps.append(time.perf_counter() - before)
                tokens += sum(len(o.new_token_ids) for o in outputs)
                reduce_at_start += clock.seconds - reduce_before
    return {
        "decode_tok_s": tokens / sum(steps),
        "step_ms_p50": 1000 * statistics.median(steps),
        "all_reduce_ms_per_step": 1000 * reduce_at_start / len(steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.repeats = 16, 1
    torch.set_num_threads(1)  # the engine's process, and so each rank it spawns
    from ferry.worker.engine import Engine

    model_dir = _model()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {size: Engine(str(model_dir), tensor_parallel_size=size, max_model_len=args.prompt + args.tokens + 16,
                            max_num_seqs=max(batches), max_num_batched_tokens=2048)
               for size in (1, 2)}
    results = []
    try:
        for batch in batches:
            best: dict[int, dict] = {}
            for _ in range(args.repeats):
                for size, engine in engines.items():  # in turns: a noisy neighbour hits both alike
                    run = _run(engine, batch, args.prompt, args.tokens)
                    if size not in best or run["decode_tok_s"] > best[size]["decode_tok_s"]:
                        best[size] = run
            row = {"batch": batch, **{f"ranks_{s}": {k: round(v, 3) for k, v in r.items()} for s, r in best.items()},
                   "speedup": round(best[2]["decode_tok_s"] / best[1]["decode_tok_s"], 3)}
            results.append(row)
            print(f"batch {batch:3d}: 1 rank {best[1]['decode_tok_s']:7.1f} tok/s, 2 ranks "
                  f"{best[2]['decode_tok_s']:7.1f} tok/s ({row['speedup']:.2f}x), all-reduce "
                  f"{best[2]['all_reduce_ms_per_step']:.2f} ms of a {best[2]['step_ms_p50']:.1f} ms step")
    finally:
        engines[2].close()
    path = write_result("tensor_parallel", {
        "settings": {"shape": SHAPE, "prompt_tokens": args.prompt, "new_tokens": args.tokens,
                     "repeats": args.repeats, "threads_per_rank": 1, "weights": "random"},
        "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
