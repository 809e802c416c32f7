"""Benchmark the Triton kernels on a CUDA GPU; prints tables and writes JSON.

    python -m bench.kernels                      # full grid, Llama-3-8B attention shape, bf16
    python -m bench.kernels --quick              # a few cases, for a smoke run
    python -m bench.kernels --out results.json   # default: bench/results/kernels-<device>.json
    python -m bench.kernels --dry-run            # tiny cases on the CPU under Triton's interpreter:
                                                 # checks the benchmark runs; its times mean nothing

Paged attention, decode (batch 1-256, context 512-32k): achieved HBM bandwidth, counting the
K/V and q read and the output written, against the device's measured copy bandwidth (target:
80% or more at large batch x context), and against the split-KV variant switched off.
Prefill (one causal chunk of 512-8k tokens): TFLOP/s against
`torch.nn.functional.scaled_dot_product_attention`'s flash backend on the same data laid out
contiguously (target: within 1.3x). Both compare outputs with SDPA as a sanity check.
write_kv, rms_norm and rotary: time against the PyTorch reference on the GPU, which says
whether each fused kernel pays.

Times are CUDA-event medians after warm-up, with L2 flushed before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "results"
DECODE_BATCHES = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXTS = [512, 2048, 8192, 32768]
PREFILL_CHUNKS = [512, 1024, 2048, 4096, 8192]
QUICK = {"batches": [1, 64], "contexts": [2048, 8192], "chunks": [1024, 4096]}
DRY_RUN = {"batches": [1, 3], "contexts": [48], "chunks": [40]}
DRY_RUN_SHAPE = {"dtype": "float32", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden": 64}
FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2
TARGET_TIME_S = 0.5  # measuring time per case, which sets the number of runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size for rms_norm")
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny float32 cases on the CPU under Triton's interpreter: the benchmark runs; its times mean nothing",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON path (default bench/results/kernels-<device>.json)"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN_SHAPE.items():
            setattr(args, key, value)
    args.device = torch.device("cpu" if args.dry_run else "cuda")
    return args


class Timer:
    """Median CUDA-event time of a callable, after warm-up, with the L2 cache flushed before each run."""

    def __init__(self, device: torch.device) -> None:
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)

    def __call__(self, fn: Callable[[], object], min_runs: int = 10, max_runs: int = 200) -> float:
        """Milliseconds."""
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        estimate = self._runs(fn, 3)
        runs = int(min(max_runs, max(min_runs, TARGET_TIME_S * 1e3 / max(estimate, 1e-3))))
        return self._runs(fn, runs)

    def _runs(self, fn: Callable[[], object], runs: int) -> float:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


class WallTimer:
    """Median wall-clock time of two runs after one warm-up: the dry run's timer on the CPU."""

    def __call__(self, fn: Callable[[], object], min_runs: int = 2, max_runs: int = 2) -> float:
        """Milliseconds."""
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def copy_bandwidth(timer: Timer, device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e6


def paged_copy(contiguous: torch.Tensor, tables: torch.Tensor, cache: torch.Tensor) -> None:
    """Scatter [B, Hkv, S, D] K or V into the pool's blocks named by tables [B, S / block_size]."""
    batch, heads, seq_len, dim = contiguous.shape
    block_size = cache.shape[2]
    per_chunk = max(1, (1 << 30) // max(1, contiguous[0].numel() * contiguous.element_size()))
    for b in range(0, batch, per_chunk):
        part = contiguous[b : b + per_chunk]
        blocks = part.view(part.shape[0], heads, seq_len // block_size, block_size, dim).transpose(1, 2)
        cache[tables[b : b + per_chunk].reshape(-1).long()] = blocks.reshape(-1, heads, block_size, dim)


def sdpa(q, k, v, *, causal: bool, scale: float) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA on contiguous [B, H, L, D] q and [B, Hkv, S, D] k/v: a callable and the backend it uses.
    The flash backend with native GQA where it runs, else flash on K/V expanded to H heads, else
    whatever PyTorch picks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    expanded = None
    for backend, expand in (("flash", False), ("flash", True), ("default", True)):
        if expand and group > 1 and expanded is None:
            expanded = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        kk, vv = expanded if expand and group > 1 else (k, v)
        gqa = group > 1 and not expand

        def call(kk=kk, vv=vv, gqa=gqa, backend=backend) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if backend == "flash" else nullcontext():
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, scale=scale, enable_gqa=gqa)

        try:
            call()
        except RuntimeError:
            continue
        return call, backend + ("+expanded-kv" if expand and group > 1 else "")
    raise RuntimeError("no SDPA backend ran")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_decode(args, timer: Timer, copy_gbps: float, batch: int, context: int) -> dict | None:
    """One decode step of `batch` sequences of `context` tokens; None when it does not fit."""
    from ferry.kernels.metadata import AttentionMetadata
    from ferry.kernels.triton.paged_attention_kernel import choose_variant, paged_attention

    device, dtype = args.device, getattr(torch, args.dtype)
    heads, kv_heads, dim, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * kv_heads * context * dim * elem
    if device.type == "cuda" and 2.2 * kv_bytes > torch.cuda.mem_get_info()[0]:  # paged pool + SDPA's copy
        return None
    blocks_per_seq = context // bs
    tables = torch.randperm(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables.tolist(), bs, device)
    k = torch.randn(batch, kv_heads, context, dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    k_cache = torch.empty(batch * blocks_per_seq, kv_heads, bs, dim, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    paged_copy(k, tables, k_cache)
    paged_copy(v, tables, v_cache)
    q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    scale = dim**-0.5

    ms = timer(lambda: paged_attention(q, k_cache, v_cache, meta, scale, out))
    ms_unsplit = timer(lambda: paged_attention(q, k_cache, v_cache, meta, scale, out, num_splits=1))
    # A decode token's query heads sharing a KV head are that head's query rows: plain MHA for SDPA.
    q_rows = q.view(batch, kv_heads, heads // kv_heads, dim)
    sdpa_call, sdpa_backend = sdpa(q_rows, k, v, causal=False, scale=scale)
    ms_sdpa = timer(sdpa_call)
    error = rel_error(paged_attention(q, k_cache, v_cache, meta, scale), sdpa_call().reshape(batch, heads, dim))
    moved = kv_bytes + 2 * q.numel() * elem
    splits = choose_variant(q, k_cache, meta)[2]
    return {
        "batch": batch,
        "context": context,
        "num_splits": splits,
        "us": ms * 1e3,
        "gbps": moved / ms / 1e6,
        "copy_frac": moved / ms / 1e6 / copy_gbps,
        "us_no_split": ms_unsplit * 1e3,
        "sdpa_us": ms_sdpa * 1e3,
        "sdpa_backend": sdpa_backend,
        "sdpa_gbps": moved / ms_sdpa / 1e6,
        "rel_error_vs_sdpa": error,
    }


def bench_prefill(args, timer: Timer, chunk: int) -> dict:
    """A fresh prompt of `chunk` tokens: causal attention over itself."""
    from ferry.kernels.metadata import AttentionMetadata
    from ferry.kernels.triton.paged_attention_kernel import paged_attention

    device, dtype = args.device, getattr(torch, args.dtype)
    heads, kv_heads, dim, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    blocks = -(-chunk // bs)
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(1, blocks)
    meta = AttentionMetadata.build([chunk], [chunk], tables.tolist(), bs, device)
    k = torch.randn(1, kv_heads, blocks * bs, dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    k_cache = torch.empty(blocks, kv_heads, bs, dim, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    paged_copy(k, tables, k_cache)
    paged_copy(v, tables, v_cache)
    k, v = k[:, :, :chunk], v[:, :, :chunk]
    q = torch.randn(chunk, heads, dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    scale = dim**-0.5

    ms = timer(lambda: paged_attention(q, k_cache, v_cache, meta, scale, out))
    q_sdpa = q.transpose(0, 1).unsqueeze(0).contiguous()
    sdpa_call, sdpa_backend = sdpa(q_sdpa, k.contiguous(), v.contiguous(), causal=True, scale=scale)
    ms_sdpa = timer(sdpa_call)
    error = rel_error(paged_attention(q, k_cache, v_cache, meta, scale), sdpa_call()[0].transpose(0, 1))
    flops = 4 * heads * dim * chunk * (chunk + 1) / 2  # QK^T and PV over the causal triangle
    return {
        "chunk": chunk,
        "us": ms * 1e3,
        "tflops": flops / ms / 1e9,
        "sdpa_us": ms_sdpa * 1e3,
        "sdpa_backend": sdpa_backend,
        "sdpa_tflops": flops / ms_sdpa / 1e9,
        "vs_sdpa": ms / ms_sdpa,
        "rel_error_vs_sdpa": error,
    }


def bench_small_kernels(args, timer: Timer) -> list[dict]:
    """The fused kernels against the reference on the same GPU tensors."""
    token_counts = (1, 4) if args.dry_run else (1, 64, 4096)
    return [row for tokens in token_counts for row in _small_kernel_rows(args, timer, tokens)]


def _small_kernel_rows(args, timer: Timer, tokens: int) -> list[dict]:
    from ferry.kernels import reference
    from ferry.kernels import triton as triton_ops

    device, dtype = args.device, getattr(torch, args.dtype)
    heads, kv_heads, dim, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    x = torch.randn(tokens, args.hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(args.hidden, dtype=dtype, device=device)
    q = torch.randn(tokens, heads, dim, dtype=dtype, device=device)
    k = torch.randn(tokens, kv_heads, dim, dtype=dtype, device=device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    cos_sin = torch.randn(8192, dim, device=device)
    num_blocks = 2 * -(-tokens // bs)
    k_cache = torch.empty(num_blocks, kv_heads, bs, dim, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * bs, device=device)[:tokens]
    cases = {
        "rms_norm+residual": lambda m: m.rms_norm(x, weight, 1e-6, residual),
        "rotary(neox)": lambda m: m.rotary(q, k, positions, cos_sin, True),
        "write_kv": lambda m: m.write_kv(k, k, k_cache, v_cache, slots),
    }
    rows = []
    for name, call in cases.items():
        ms = timer(lambda call=call: call(triton_ops))
        ms_ref = timer(lambda call=call: call(reference))
        rows.append({"kernel": name, "tokens": tokens, "us": ms * 1e3, "reference_us": ms_ref * 1e3})
    return rows


# (row key, format) per printed column
DECODE_COLUMNS = [
    ("batch", "{}"),
    ("context", "{}"),
    ("num_splits", "{}"),
    ("us", "{:.1f}"),
    ("gbps", "{:.0f}"),
    ("copy_frac", "{:.0%}"),
    ("us_no_split", "{:.1f}"),
    ("sdpa_us", "{:.1f}"),
    ("sdpa_gbps", "{:.0f}"),
    ("sdpa_backend", "{}"),
    ("rel_error_vs_sdpa", "{:.1e}"),
]
PREFILL_COLUMNS = [
    ("chunk", "{}"),
    ("us", "{:.1f}"),
    ("tflops", "{:.1f}"),
    ("sdpa_us", "{:.1f}"),
    ("sdpa_tflops", "{:.1f}"),
    ("vs_sdpa", "{:.2f}x"),
    ("sdpa_backend", "{}"),
    ("rel_error_vs_sdpa", "{:.1e}"),
]
SMALL_COLUMNS = [("kernel", "{}"), ("tokens", "{}"), ("us", "{:.1f}"), ("reference_us", "{:.1f}")]


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    cells = [[fmt.format(row[key]) if key in row else "-" for key, fmt in columns] for row in rows]
    widths = [max(len(key), *(len(c[i]) for c in cells)) for i, (key, _) in enumerate(columns)]
    print("  ".join(key.rjust(w) for (key, _), w in zip(columns, widths, strict=True)))
    for c in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(c, widths, strict=True)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        # Before the first import of triton: its language helpers are bound at import.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is False).")
    import triton
    from tqdm import tqdm

    device = args.device
    if args.dry_run:
        name, timer = "cpu-dry-run", WallTimer()
        copy_gbps = copy_bandwidth(timer, device, nbytes=1 << 20)
    else:
        name, timer = torch.cuda.get_device_name(device), Timer(device)
        copy_gbps = copy_bandwidth(timer, device)
    grid = DRY_RUN if args.dry_run else QUICK if args.quick else None
    batches = grid["batches"] if grid else DECODE_BATCHES
    contexts = grid["contexts"] if grid else DECODE_CONTEXTS
    chunks = grid["chunks"] if grid else PREFILL_CHUNKS
    decode, skipped, prefill = [], [], []
    with tqdm(total=len(batches) * len(contexts) + len(chunks) + 1, desc="kernels", unit="case") as bar:
        for batch in batches:
            for context in contexts:
                bar.set_postfix_str(f"decode b={batch} ctx={context}")
                row = bench_decode(args, timer, copy_gbps, batch, context)
                if row is None:
                    skipped.append({"batch": batch, "context": context})
                else:
                    decode.append(row)
                empty_cache(device)
                bar.update()
        for chunk in chunks:
            bar.set_postfix_str(f"prefill {chunk}")
            prefill.append(bench_prefill(args, timer, chunk))
            empty_cache(device)
            bar.update()
        bar.set_postfix_str("rms_norm / rotary / write_kv")
        small = bench_small_kernels(args, timer)
        bar.update()

    shape = f"H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size} {args.dtype}"
    print(f"\n{name}: measured copy bandwidth {copy_gbps:.0f} GB/s; {shape}")
    print_table("decode (paged attention, one token per sequence)", decode, DECODE_COLUMNS)
    if skipped:
        print("skipped (not enough GPU memory):", ", ".join(f"b={s['batch']} ctx={s['context']}" for s in skipped))
    print_table("prefill (one causal chunk)", prefill, PREFILL_COLUMNS)
    print_table("fused kernels vs the PyTorch reference", small, SMALL_COLUMNS)
    big = [r for r in decode if r["batch"] * r["context"] >= 64 * 8192]
    summary = {
        "decode_copy_frac_at_large_batch_x_context": min((r["copy_frac"] for r in big), default=None),
        "decode_target": 0.8,
        "prefill_worst_vs_sdpa": max((r["vs_sdpa"] for r in prefill), default=None),
        "prefill_target": 1.3,
    }
    print("\nsummary:", json.dumps(summary))
    out = args.out or RESULTS_DIR / f"kernels-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "device": name,
        "dry_run": args.dry_run,
        "copy_bandwidth_gbps": copy_gbps,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "shape": {k: getattr(args, k) for k in ("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size")},
        "summary": summary,
        "decode": decode,
        "decode_skipped": skipped,
        "prefill": prefill,
        "fused_kernels": small,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
