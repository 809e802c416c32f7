"""The CPU product on quantized weights (Q8_0, Q4_1, Q4_0) against the float32 packed product,
and both against the memory-read floor.

Workload: the four projections of every layer of a SmolLM2-135M-shaped model (qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576; 30 layers, each with its own weights, so that
they stream from memory as in a decode step), and separately the tied LM head (49152 x 576) as
float32 and Q8_0 (how SmolLM2's Q4_1 GGUF stores its embeddings), for x of each row count
(`--rows`). The quantized weights are random bytes with sane fp16 scales: the time of the
product does not depend on the values. All systems run in one process, in turns, `--repeats`
times; each figure is the best pass.

Reported per system and row count: ms per pass, GB/s of weights read (the bytes held: float32
4 bytes a weight, Q8_0 34/32, Q4_1 20/32, Q4_0 18/32), the speedup over float32, and the share of
the memory floor reached: the floor is the best time of a native streaming sum over a float32
buffer of the same bytes (`csrc/stream_sum_cpu.cpp`: the read alone, on the same threads), so 100%
means the product runs at memory speed.

    python -m bench.quantized_linear                   # rows 1, 4, 16, 32, 128
    python -m bench.quantized_linear --rows 1 --repeats 20
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from bench.common import write_result
from bench.linear_cpu import LAYERS, SHAPES
from bench.models import SMOLLM2_135M
from ferry.kernels.cpu import native as cpu_native
from ferry.kernels.cpu.quantized import BLOCK, FORMATS, QuantizedWeight, pack_quantized_weight

QTYPES = ("Q8_0", "Q4_1", "Q4_0")
HEAD = (SMOLLM2_135M["hidden_size"], SMOLLM2_135M["vocab_size"])  # (in, out)


def random_quantized(out_features: int, in_features: int, qtype: str, gen: torch.Generator):
    """Random GGUF blocks of a 32-weight type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) whose fp16 scales (d,
    and m for Q4_1 and Q5_1, first in every block) are small normal numbers."""
    fmt = FORMATS[qtype]
    if fmt.columns != BLOCK:
        raise ValueError(f"{qtype}: random blocks are made for the 32-weight types only")
    fields = 2 if qtype in ("Q4_1", "Q5_1") else 1
    blocks = in_features // BLOCK
    raw = torch.randint(0, 256, (out_features, blocks, fmt.gguf_bytes), dtype=torch.uint8, generator=gen)
    scales = (torch.randn(out_features, blocks, fields, generator=gen) * 0.01).to(torch.float16)
    raw[..., : 2 * fields] = scales.view(torch.uint8)
    return pack_quantized_weight(raw.reshape(out_features, -1), qtype, out_features, in_features)


def weight_bytes(weight) -> int:
    return weight.nbytes if isinstance(weight, QuantizedWeight) else weight.panels.numel() * 4


def pass_seconds(products: list[tuple[torch.Tensor, object]]) -> float:
    start = time.perf_counter()
    for x, weight in products:
        cpu_native.linear(x, weight)
    return time.perf_counter() - start


def floor_seconds(module, buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    module.stream_sum(buffer)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    module = cpu_native.load()
    if module is None or not (module.linear_packed_supported() and module.linear_quantized_supported()):
        raise SystemExit("bench.quantized_linear: the native products are not available on this machine")
    gen = torch.Generator().manual_seed(0)
    shapes = [(n, k) for _ in range(LAYERS) for k, n in SHAPES.values()]
    layers = {"F32": [cpu_native.pack_weight(torch.randn(n, k, generator=gen)) for n, k in shapes]}
    for qtype in QTYPES:
        layers[qtype] = [random_quantized(n, k, qtype, gen) for n, k in shapes]
    head = {"F32": [cpu_native.pack_weight(torch.randn(HEAD[1], HEAD[0], generator=gen))]}
    head["Q8_0"] = [random_quantized(HEAD[1], HEAD[0], "Q8_0", gen)]
    workloads = {"layers": layers, "head": head}
    nbytes = {w: {s: sum(weight_bytes(m) for m in ms) for s, ms in systems.items()} for w, systems in workloads.items()}
    floors = {size: torch.ones(size // 4) for systems in nbytes.values() for size in systems.values()}

    floor: dict[int, float] = {}  # bytes -> best seconds of the streaming read
    results = []
    rows_list = [int(r) for r in args.rows.split(",")]
    for rows in tqdm(rows_list, desc="row counts", unit="case"):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {*(k for k, _ in SHAPES.values()), HEAD[0]}}
        best: dict[tuple[str, str], float] = {}
        for _ in tqdm(range(args.repeats), desc=f"{rows} rows", unit="repeat", leave=False):
            for workload, systems in workloads.items():  # in turns: a noisy neighbour hits every system alike
                for system, weights in systems.items():
                    seconds = pass_seconds([(xs[w.in_features], w) for w in weights])
                    best[workload, system] = min(best.get((workload, system), float("inf")), seconds)
            for size, buffer in floors.items():
                floor[size] = min(floor.get(size, float("inf")), floor_seconds(module, buffer))
        for workload, systems in workloads.items():
            for system in systems:
                seconds, size = best[workload, system], nbytes[workload][system]
                row = {
                    "rows": rows,
                    "workload": workload,
                    "system": system,
                    "ms": round(seconds * 1e3, 3),
                    "weight_mb": round(size / 1e6, 1),
                    "gb_per_s": round(size / seconds / 1e9, 2),
                    "speedup_vs_f32": round(best[workload, "F32"] / seconds, 3),
                    "floor_ms": round(floor[size] * 1e3, 3),
                    "of_floor": round(floor[size] / seconds, 3),
                }
                results.append(row)
                tqdm.write(
                    f"{workload:6s} rows {rows:4d} {system:4s}: {row['ms']:8.2f} ms {row['gb_per_s']:6.1f} GB/s "
                    f"{row['speedup_vs_f32']:5.2f}x f32, floor {row['floor_ms']:6.2f} ms ({row['of_floor']:.0%})"
                )
    path = write_result(
        "quantized_linear",
        {
            "settings": {
                "shapes": SHAPES,
                "layers": LAYERS,
                "head": HEAD,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "weight_bytes": nbytes,
            },
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
