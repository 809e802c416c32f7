"""Prefix caching and prefix-cache snapshots: what they save in time to first token.

Three measurements on one model (default: SmolLM2-135M-Instruct, the bundled model):

1. shared prefix: a long system prompt + short user turns, requests sent one after another
   (each TTFT is pure prefill, no queueing), prefix caching on vs off: TTFT p50 / p99;
2. cold start: a fresh engine's first requests with a snapshot restored at construction vs
   without: TTFT of each, and the restore time;
3. restore vs recompute: fill the cache with about `--restore-gib` of KV (the prefill time is
   the recompute time), save a snapshot, restore it into a fresh engine: seconds for each.

    python -m bench.prefix [--model DIR] [--quick]

Writes bench/results/prefix-<time>.json (and prefix-latest.json) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, percentiles, write_result


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.prefix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run: 1024-token system prompt, 100-token turns, 8 requests, 0.05 GiB restore",
    )
    p.add_argument("--system-tokens", type=int, default=None, help="shared system prompt length (default 2000)")
    p.add_argument("--user-tokens", type=int, default=None, help="user turn length (default 200)")
    p.add_argument("--requests", type=int, default=None, help="requests in the shared-prefix run (default 32)")
    p.add_argument(
        "--cold-requests", type=int, default=None, help="first requests measured on a fresh engine (default 8)"
    )
    p.add_argument("--restore-gib", type=float, default=None, help="KV restored in part 3 (default 1.0)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON output (default: bench/results/prefix-<time>.json and -latest)"
    )
    args = p.parse_args(argv)
    defaults = (1024, 100, 8, 4, 0.05) if args.quick else (2000, 200, 32, 8, 1.0)
    for name, value in zip(
        ("system_tokens", "user_tokens", "requests", "cold_requests", "restore_gib"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(_default_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    users = [
        [rng.randrange(vocab) for _ in range(args.user_tokens)] for _ in range(max(args.requests, args.cold_requests))
    ]
    max_len = args.system_tokens + args.user_tokens + 16
    engine_kwargs = dict(dtype=args.dtype, max_model_len=max_len, max_num_seqs=16)

    report = {
        "model": Path(model).name,
        "quick": args.quick,
        "settings": {k: getattr(args, k) for k in ("system_tokens", "user_tokens", "requests", "cold_requests",
                                                   "restore_gib", "dtype")},
    }
    report["shared_prefix"] = shared_prefix(model, system, users[: args.requests], engine_kwargs)
    report["cold_start"] = cold_start(model, system, users[: args.cold_requests], engine_kwargs)
    report["restore_vs_recompute"] = restore_vs_recompute(model, vocab, args.restore_gib, args.dtype, rng)

    if args.out:
        out = args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"suite": "prefix", "machine": machine(), **report}, indent=2) + "\n")
    else:
        out = write_result("prefix", report)
    _print_summary(report, out)
    return 0


def _default_model() -> Path:
    from bench.models import smollm2

    return smollm2()


def _ttfts(engine, prompts: list[list[int]]) -> list[dict]:
    """Send prompts one after another; TTFT (s) and cached tokens of each."""
    from ferry.worker.engine import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rows = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    rows.append({"ttft_s": out.metrics.ttft, "cached_tokens": out.num_cached_tokens})
    return rows


def _warm_up(engine) -> None:
    """One short unrelated request, so the first measured one does not pay one-off allocations."""
    _ttfts(engine, [[1, 2, 3, 4, 5, 6, 7, 8]])


def _stats(ttfts: list[float]) -> dict:
    points = percentiles(ttfts, (50, 99))
    return {"p50_s": points["p50"], "p99_s": points["p99"], "mean_s": statistics.fmean(ttfts)}


def _kv_bytes_per_token(model: str, dtype: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 2 if dtype in ("bfloat16", "float16") else 4
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * element


def _kv_bytes_for(model: str, tokens: int, dtype: str) -> int:
    """KV pool bytes that hold `tokens` tokens of this model, plus headroom."""
    return int(tokens * _kv_bytes_per_token(model, dtype) * 1.1) + (64 << 20)


def _interleaved(engines: dict[str, object], prompts: list[list[int]]) -> dict[str, list[dict]]:
    """Each prompt on every engine in turn: on a shared machine, load drifts hit all alike."""
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    for prompt in prompts:
        for name, engine in engines.items():
            rows[name] += _ttfts(engine, [prompt])
    return rows


def shared_prefix(model: str, system: list[int], users: list[list[int]], engine_kwargs: dict) -> dict:
    from ferry.worker.engine import Engine

    prompts = [system + u for u in users]
    # Room for the running request plus the cached system prompt and a few turns.
    kv_bytes = _kv_bytes_for(model, 4 * len(prompts[0]), engine_kwargs["dtype"])
    engines = {
        "on": Engine(model, kv_cache_bytes=kv_bytes, enable_prefix_caching=True, **engine_kwargs),
        "off": Engine(model, kv_cache_bytes=kv_bytes, enable_prefix_caching=False, **engine_kwargs),
    }
    for engine in engines.values():
        _warm_up(engine)
    rows = _interleaved(engines, prompts)
    result = {
        name: {
            **_stats([r["ttft_s"] for r in runs]),
            "first_ttft_s": runs[0]["ttft_s"],
            "cached_tokens": [r["cached_tokens"] for r in runs],
        }
        for name, runs in rows.items()
    }
    result["p50_speedup"] = result["off"]["p50_s"] / result["on"]["p50_s"]
    result["p99_speedup"] = result["off"]["p99_s"] / result["on"]["p99_s"]
    return result


def cold_start(model: str, system: list[int], users: list[list[int]], engine_kwargs: dict) -> dict:
    from ferry.worker.engine import Engine
    from ferry.worker.snapshots import restore_snapshot, save_snapshot

    kv_bytes = _kv_bytes_for(model, 4 * (len(system) + len(users[0])), engine_kwargs["dtype"])
    with tempfile.TemporaryDirectory(prefix="ferry-bench-snapshot-") as tmp:
        url = Path(tmp).as_uri()
        warm = Engine(model, kv_cache_bytes=kv_bytes, **engine_kwargs)
        _ttfts(warm, [system])  # the system prompt alone: what a pre-warm (`ferry snapshot save --system`) stores
        saved = save_snapshot(warm, url)
        del warm
        engines, start_s, restore_s = {}, {}, {}
        for name, snapshot_url in (("restored", url), ("cold", None)):
            started = time.perf_counter()
            engines[name] = Engine(model, kv_cache_bytes=kv_bytes, **engine_kwargs)
            restored = restore_snapshot(engines[name], snapshot_url) if snapshot_url else None
            start_s[name] = time.perf_counter() - started
            restore_s[name] = restored.seconds if restored else 0.0
    rows = _interleaved(engines, [system + u for u in users])
    result = {
        "snapshot": {"blocks": saved.blocks, "tokens": saved.tokens, "bytes": saved.bytes, "save_s": saved.seconds}
    }
    for name, runs in rows.items():
        result[name] = {
            "engine_start_s": start_s[name],
            "restore_s": restore_s[name],
            "ttft_s": [r["ttft_s"] for r in runs],
            "cached_tokens": [r["cached_tokens"] for r in runs],
            "first_ttft_s": runs[0]["ttft_s"],
            "mean_ttft_s": statistics.fmean(r["ttft_s"] for r in runs),
        }
    result["first_ttft_speedup"] = result["cold"]["first_ttft_s"] / result["restored"]["first_ttft_s"]
    return result


def restore_vs_recompute(model: str, vocab: int, gib: float, dtype: str, rng: random.Random) -> dict:
    from ferry.worker.engine import Engine, SamplingParams
    from ferry.worker.snapshots import load_snapshot, save_snapshot

    max_positions = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
    chunk = min(2048, max_positions - 16)  # tokens per prompt that fills the cache
    tokens = max(int(gib * 2**30 / _kv_bytes_per_token(model, dtype)), 64)
    prompts = [[rng.randrange(vocab) for _ in range(min(chunk, tokens - start))] for start in range(0, tokens, chunk)]
    kv_bytes = _kv_bytes_for(model, tokens + chunk, dtype)
    kwargs = dict(dtype=dtype, kv_cache_bytes=kv_bytes, max_model_len=chunk + 16, max_num_seqs=len(prompts))
    engine = Engine(model, **kwargs)
    _warm_up(engine)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):  # all at once: the recompute at full batch throughput
        engine.add_request(f"fill-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recompute_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="ferry-bench-snapshot-") as tmp:
        url = Path(tmp).as_uri()
        saved = save_snapshot(engine, url)
        del engine
        fresh = Engine(model, **kwargs)
        restored = load_snapshot(fresh, url)
    return {
        "tokens": saved.tokens,
        "gib": saved.bytes / 2**30,
        "recompute_s": recompute_s,
        "save_s": saved.seconds,
        "restore_s": restored.seconds,
        "restored_blocks": restored.blocks,
        "restore_gib_per_s": saved.bytes / 2**30 / restored.seconds,
        "restore_speedup_vs_recompute": recompute_s / restored.seconds,
    }


def _print_summary(report: dict, out: Path) -> None:
    sp, cs, rr = report["shared_prefix"], report["cold_start"], report["restore_vs_recompute"]
    ms = lambda s: f"{s * 1e3:.0f} ms"
    print(f"model {report['model']}, {report['settings']}")
    print(
        f"shared prefix: TTFT p50 {ms(sp['on']['p50_s'])} on vs {ms(sp['off']['p50_s'])} off "
        f"({sp['p50_speedup']:.1f}x), "
        f"p99 {ms(sp['on']['p99_s'])} vs {ms(sp['off']['p99_s'])} ({sp['p99_speedup']:.1f}x)"
    )
    print(f"cold start: first TTFT {ms(cs['restored']['first_ttft_s'])} restored vs {ms(cs['cold']['first_ttft_s'])} "
          f"cold ({cs['first_ttft_speedup']:.1f}x); restore {ms(cs['restored']['restore_s'])} "
          f"for {cs['snapshot']['tokens']} tokens; mean TTFT of first {len(cs['cold']['ttft_s'])}: "
          f"{ms(cs['restored']['mean_ttft_s'])} vs {ms(cs['cold']['mean_ttft_s'])}")
    print(f"restore vs recompute: {rr['gib']:.2f} GiB ({rr['tokens']} tokens): restore {rr['restore_s']:.2f} s, "
          f"recompute {rr['recompute_s']:.2f} s ({rr['restore_speedup_vs_recompute']:.1f}x), save {rr['save_s']:.2f} s")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
