"""Decode attention on the CPU (`csrc/paged_attention_cpu.cpp`) against the memory-read floor.

Workload: one decode step's attention for `--seqs` sequences (default 32) of `--context` tokens
(default 150, the mean context of `bench.quantized`'s 256-token batch-32 run), SmolLM2-135M's
shape (9 query heads, 3 KV heads, head dim 64, float32 KV, 16-token blocks) over its 30 layers,
each layer with its own KV pool and the blocks placed at random in it, as a growing batch leaves
them. Reported, each the best of `--repeats` passes:
  attention        ms per step, and the KV bytes read over that time (GB/s)
  cache-resident   the same with one layer's pool read 30 times (it fits the L3): what the
                   kernel's arithmetic costs when memory is not in the way
  floor            a native streaming sum over as many bytes (`csrc/stream_sum_cpu.cpp`): the
                   machine's read rate on these threads
and attention's share of the floor's rate (100% = the kernel reads at memory speed).

    python -m bench.attention_cpu
    python -m bench.attention_cpu --seqs 8 --context 1024
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from bench.common import write_result
from ferry.kernels.cpu import native as cpu_native

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16  # SmolLM2-135M


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    module = cpu_native.load()
    if module is None:
        raise SystemExit("the native CPU kernels did not build (g++ and ninja are needed)")
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // BLOCK)
    pool_blocks = args.seqs * blocks_per_seq
    pools = [(torch.randn(pool_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen),
              torch.randn(pool_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen)) for _ in range(LAYERS)]
    tables = torch.randperm(pool_blocks, generator=gen).to(torch.int32).reshape(args.seqs, blocks_per_seq)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    starts = torch.arange(args.seqs + 1, dtype=torch.int32)
    seq_indices = torch.arange(args.seqs, dtype=torch.int64)
    q = torch.randn(args.seqs, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in pools)

    def step(layer_pools) -> None:
        for k, v in layer_pools:
            module.paged_attention_short(q, k, v, tables, lens, starts, seq_indices, HEAD_DIM ** -0.5, out, 0, 0.0)

    floor_buffer = torch.randn(kv_bytes // 4, generator=gen)
    runs = {
        "attention": lambda: step(pools),
        "cache-resident": lambda: step([pools[0]] * LAYERS),
        "floor": lambda: module.stream_sum(floor_buffer),
    }
    results = {}
    for name, run in tqdm(runs.items(), desc="attention_cpu", unit="case"):
        run()  # warm-up
        seconds = best_seconds(run, args.repeats)
        results[name] = {"ms": round(seconds * 1e3, 2), "gb_per_s": round(kv_bytes / seconds / 1e9, 1)}
        tqdm.write(f"{name:15s} {seconds * 1e3:7.2f} ms  {kv_bytes / seconds / 1e9:5.1f} GB/s")
    share = results["attention"]["gb_per_s"] / results["floor"]["gb_per_s"]
    print(f"attention reads at {100 * share:.0f}% of the streaming-read rate")
    path = write_result("attention_cpu", {
        "settings": {"seqs": args.seqs, "context": args.context, "layers": LAYERS, "heads": HEADS,
                     "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK, "threads": args.threads,
                     "repeats": args.repeats, "kv_mb": round(kv_bytes / 1e6, 1)},
        "results": results,
        "factors": {"attention_over_floor_rate": round(share, 3)},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
