"""The CPU matrix product: Ferry's packed-weight kernel against torch's F.linear (BLAS).

Workload: the four projections of every layer of a SmolLM2-135M-shaped model (qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576; 30 layers, each with its own random float32
weights, 425 MB, so that weights stream from memory as in a real step rather than sitting in
cache), for x of each row count (`--rows`: a decode batch's sequences or a prefill chunk's
tokens). Both systems compute the same products in one run, in turns; each figure is the best
of `--repeats` passes. Reported: GFLOP/s per system and the ratio packed / torch.

    python -m bench.linear_cpu                    # rows 1 .. 512
    python -m bench.linear_cpu --rows 1,32 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from bench.common import write_result
from bench.models import SMOLLM2_135M
from ferry.kernels.cpu import native as cpu_native


def _projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each fused projection of one layer, as worker.models.llama builds them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = hidden + 2 * config["num_key_value_heads"] * head_dim
    return {"qkv": (hidden, qkv), "o": (hidden, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}


SHAPES = _projection_shapes(SMOLLM2_135M)
LAYERS = SMOLLM2_135M["num_hidden_layers"]


def _pass_seconds(products: list[tuple[torch.Tensor, object]], linear) -> float:
    start = time.perf_counter()
    for x, weight in products:
        linear(x, weight)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,16,32,48,64,96,128,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_native.available() or cpu_native.pack_weight(torch.zeros(1, 1)) is None:
        raise SystemExit("bench.linear_cpu: the native packed product is not available on this machine")
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) for k, n in SHAPES.values()] for _ in range(LAYERS)]
    packed = [[cpu_native.pack_weight(w) for w in layer] for layer in weights]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in tqdm(rows_list, desc="row counts", unit="case"):
        xs = [torch.randn(rows, k, generator=gen) for k, _ in SHAPES.values()]
        plain = [(x, w) for layer in weights for x, w in zip(xs, layer, strict=True)]
        fast = [(x, w) for layer in packed for x, w in zip(xs, layer, strict=True)]
        best = {"torch": float("inf"), "packed": float("inf")}
        for _ in range(args.repeats):  # in turns: a noisy neighbour hits both alike
            best["torch"] = min(best["torch"], _pass_seconds(plain, torch.nn.functional.linear))
            best["packed"] = min(best["packed"], _pass_seconds(fast, cpu_native.linear))
        flops = 2 * rows * LAYERS * sum(k * n for k, n in SHAPES.values())
        row = {
            "rows": rows,
            "torch_gflops": round(flops / best["torch"] / 1e9, 1),
            "packed_gflops": round(flops / best["packed"] / 1e9, 1),
            "speedup": round(best["torch"] / best["packed"], 3),
        }
        results.append(row)
        tqdm.write(
            f"rows {rows:4d}: torch {row['torch_gflops']:6.1f} GFLOP/s, "
            f"packed {row['packed_gflops']:6.1f} ({row['speedup']:.2f}x)"
        )
    path = write_result(
        "linear_cpu",
        {
            "settings": {
                "shapes": SHAPES,
                "layers": LAYERS,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
            },
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
