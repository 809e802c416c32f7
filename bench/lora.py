"""Multi-LoRA serving: batched adapters against the base model, a cold adapter from S3, and many
adapters cycling through few device slots.

Model: the SmolLM2-135M shape (hidden 576, 9 heads, 3 KV heads, vocab 49152, tied) with random
weights, float32, `--layers` of its 30 decoder layers (default all 30; made once under
.ferry/bench-models/llama-<layers>l-random by `bench.model_families.family_model`). Adapters are
random PEFT directories written here (adapter_config.json + adapter_model.safetensors, PEFT's
tensor names, A and B drawn from N(0, 0.02), rank `--rank`, lora_alpha 2 x rank), in a temporary
folder removed at the end. Greedy, EOS ignored, `--threads` torch threads (default 2).

1. Throughput. `--batch` prompts (default 32, `--prompt` random tokens each, default 32) and
   `--tokens` new tokens each (default 64), one `LLM.generate` call; output tokens/s over the
   whole call, prefill included, the best of `--repeats` runs (default 3) per system, the systems
   taking turns in every repeat (each one warmed up with an 8-token run first). Prefix caching is
   off, so every run prefills its prompts through its adapters. Systems:
     base          an engine with enable_lora=False
     lora-unused   an engine with enable_lora=True (max_loras 8, max_cpu_loras 16), no adapter rows:
                   what the slots cost when no request uses them (its tokens must equal base's)
     qv            the batch spread over `--adapters` adapters (default 8, batch / adapters requests
                   each) targeting q_proj and v_proj, in their own LoRA engine
     all7          the same with adapters on all seven linear projections (q/k/v/o, gate/up/down)
   The adapters are loaded into host memory before the turns (`Engine.add_lora`), and into their
   slots by the warm-up. Reported: tokens/s, each system over base, every run's seconds. The goal:
   qv and all7 at least 0.75x base.

2. Cold adapter from S3. moto's S3 server on this machine (as bench.cold_start) holds adapters
   (all seven projections) under s3://bench-lora/adapter-<k>/. One engine (enable_lora=True, its
   model cache a fresh temporary folder), warmed on the base model, then for each of
   `--cold-repeats` rounds (default 3): time from `add_request` to the step that returns the first
   token (a `--prompt`-token prompt, new every time) for (a) adapter k, never seen: downloaded
   into the model cache, read, copied into a slot; (b) the same adapter again, now in memory and in
   its slot; (c) the base model. Median and every round's figure.

3. Many adapters, few slots. An engine with max_loras 8, max_cpu_loras 16, max_num_seqs
   `--in-flight`; `--stream-adapters` local adapters (default 100, q/v targets); a stream of
   `--stream-requests` requests (default 200; request i on adapter i % adapters, 16-token prompts,
   `--stream-tokens` new tokens, default 16) fed through the step API so that `--in-flight`
   (default 32) are in the engine at any time (a new one is added whenever one finishes). For each
   request: the adapter loads into host memory (`LoraStats.host_loads`) that completed between its
   add and its first token, how many of them read its own adapter (more than one: it was dropped
   from memory and read again before it ran; from the manager's "LoRA adapter ... loaded" log
   line), the time until its adapter is in memory (`Request.lora_ready`) and its wait (add to first
   token), both also in units of the median time of a single load (`Engine.add_lora` of an unseen
   adapter, `--single-loads` times, default 5). The issue's check, "no request waits for more than
   one load": no request's own adapter is read more than once while it waits (it is never dropped
   and read again); the loads of other adapters that complete meanwhile run on loader threads
   beside it and are reported, as is the stream's host loads in all. With more adapters in flight
   than slots, most of a request's wait is for a slot, not a load.

    python -m bench.lora                  # 30 layers, batch 32 over 8 adapters, 64 tokens, 3 repeats
    python -m bench.lora --quick          # 2 layers, batch 8 over 4 adapters, 8 tokens, small stream
    python -m bench.lora --parts throughput --layers 12
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from bench.common import moto_s3, percentiles, write_result
from bench.model_families import family_model
from bench.models import SMOLLM2_135M
from ferry.worker.common.objectstore import s3_client
from ferry.worker.engine import LLM, FinishReason, LoRARequest, SamplingParams

PARTS = ("throughput", "cold", "stream")
TARGET_SETS = {
    "qv": ("q_proj", "v_proj"),
    "all7": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
GOAL_RATIO = 0.75  # the issue: batched adapters at least 0.75x the base model's tokens/s
GOAL_LOADS = 1  # the issue: no request waits for more than one adapter load
MAX_LORAS, MAX_CPU_LORAS = 8, 16
BUCKET = "bench-lora"
QUICK = dict(layers=2, batch=8, adapters=4, tokens=8, repeats=1, cold_repeats=1, single_loads=2,
             stream_requests=40, stream_adapters=20, in_flight=16, stream_tokens=4)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the SmolLM2-135M shape")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request (parts 1 and 2)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request (part 1)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8, help="adapters the batch is spread over (part 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system (the best counts)")
    parser.add_argument("--cold-repeats", type=int, default=3)
    parser.add_argument("--stream-requests", type=int, default=200)
    parser.add_argument("--stream-adapters", type=int, default=100)
    parser.add_argument("--stream-tokens", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--single-loads", type=int, default=5, help="timed single adapter loads (part 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, batch 8 over 4 adapters, 8 tokens, 1 repeat; 1 cold round; "
                             "40 requests over 20 adapters, 16 in flight, 4 tokens")
    parser.add_argument("--results-dir", type=Path, help="where the JSON goes (default bench/results/)")
    args = parser.parse_args(argv)
    if args.quick:  # its sizes become the defaults; options given still count
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    if args.batch % args.adapters:
        parser.error(f"--batch {args.batch} does not spread evenly over --adapters {args.adapters}")
    if args.adapters > MAX_LORAS:
        parser.error(f"--adapters is at most max_loras={MAX_LORAS}: one batch mixes at most that many")
    return args


# --- adapters ------------------------------------------------------------------------------------


def _projection_shape(module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder projection at the SmolLM2-135M shape."""
    hidden, inter = SMOLLM2_135M["hidden_size"], SMOLLM2_135M["intermediate_size"]
    kv = SMOLLM2_135M["num_key_value_heads"] * hidden // SMOLLM2_135M["num_attention_heads"]
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[module]


def write_adapter(directory: Path, layers: int, targets: tuple[str, ...], rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter, as peft's save_pretrained lays it out (written directly: 100 of
    them through peft would take minutes)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = _projection_shape(module)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def _dir_mib(directory: Path) -> float:
    return round(sum(p.stat().st_size for p in directory.iterdir()) / 2**20, 2)


# --- engines -------------------------------------------------------------------------------------


def _engine(model: Path, args: argparse.Namespace, max_len: int, seqs: int, **kwargs):
    kv_per_token = args.layers * 2 * SMOLLM2_135M["num_key_value_heads"] * 64 * 4
    return LLM(str(model), max_model_len=max_len, kv_cache_bytes=2 * seqs * max_len * kv_per_token,
               max_num_seqs=seqs, **kwargs)


def _lora_kwargs(args: argparse.Namespace, **overrides) -> dict:
    return {"enable_lora": True, "max_loras": MAX_LORAS, "max_lora_rank": args.rank,
            "max_cpu_loras": MAX_CPU_LORAS, **overrides}


def _prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1, SMOLLM2_135M["vocab_size"]) for _ in range(length)] for _ in range(count)]


def _params(tokens: int):
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


# --- 1. throughput -------------------------------------------------------------------------------


def bench_throughput(model: Path, args: argparse.Namespace, work: Path, bar: tqdm) -> dict:
    max_len = args.prompt + args.tokens + 16
    prompts = _prompts(random.Random(0), args.batch, args.prompt)
    per_adapter = args.batch // args.adapters
    engines = {"base": _engine(model, args, max_len, args.batch, enable_prefix_caching=False)}
    rows: dict[str, list] = {"base": [None] * args.batch}
    adapter_mib = {}
    for set_index, (name, targets) in enumerate(TARGET_SETS.items()):
        engines[name] = _engine(model, args, max_len, args.batch, enable_prefix_caching=False, **_lora_kwargs(args))
        loras = [LoRARequest(f"{name}-{i}", i + 1, str(write_adapter(work / f"tp-{name}-{i}", args.layers, targets,
                                                                     args.rank, seed=1000 * set_index + i)))
                 for i in range(args.adapters)]
        for lora in loras:
            engines[name].engine.add_lora(lora)
        rows[name] = [loras[i // per_adapter] for i in range(args.batch)]
        adapter_mib[name] = _dir_mib(Path(loras[0].lora_path))
    engines["lora-unused"], rows["lora-unused"] = engines["qv"], [None] * args.batch

    def run(system: str, tokens: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        out = engines[system].generate(prompts, _params(tokens), use_tqdm=False, lora_request=rows[system])
        return time.perf_counter() - start, [list(o.token_ids) for o in out]

    systems = ["base", "lora-unused", *TARGET_SETS]
    for system in systems:
        bar.set_postfix_str(f"throughput: warm-up {system}")
        run(system, 8)
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    tokens: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for system in systems:
            bar.set_postfix_str(f"throughput: {system} {repeat + 1}/{args.repeats}")
            elapsed, tokens[system] = run(system, args.tokens)
            seconds[system].append(elapsed)
    slot_stats = {name: _stats(engines[name]) for name in TARGET_SETS}
    for name, llm in engines.items():
        if name != "lora-unused":
            llm.close()
    generated = args.batch * args.tokens
    rate = {s: generated / min(seconds[s]) for s in systems}
    result = {
        "systems": {s: {"tokens_per_s": round(rate[s], 1), "over_base": round(rate[s] / rate["base"], 3),
                        "runs_s": [round(x, 3) for x in seconds[s]]} for s in systems},
        "lora_unused_same_tokens_as_base": sum(a == b for a, b in zip(tokens["lora-unused"], tokens["base"],
                                                                      strict=True)),
        "adapters_changed_tokens": {name: sum(a != b for a, b in zip(tokens[name], tokens["base"], strict=True))
                                    for name in TARGET_SETS},
        "requests": args.batch, "adapters": args.adapters, "requests_per_adapter": per_adapter,
        "adapter_mib": adapter_mib, "lora_stats": slot_stats,
        "goal": {name: {"target_over_base": GOAL_RATIO, "over_base": round(rate[name] / rate["base"], 3),
                        "met": rate[name] / rate["base"] >= GOAL_RATIO} for name in TARGET_SETS},
    }
    bar.update()
    return result


def _stats(llm) -> dict:
    stats = llm.engine.core.lora.stats
    return {"host_loads": stats.host_loads, "slot_loads": stats.slot_loads, "load_failures": stats.load_failures}


# --- 2. cold adapter from S3 ---------------------------------------------------------------------


def _first_token_s(llm, request_id: str, prompt: list[int], lora) -> float:
    """Seconds from add_request to the step that returns the request's first token (it then runs
    to its end, one more token)."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(request_id, prompt, _params(2), lora_request=lora)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids and first is None:
                first = time.perf_counter() - start
            if out.request_id == request_id and out.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"{request_id} failed: {out}")
    return first


def bench_cold(model: Path, args: argparse.Namespace, work: Path, bar: tqdm) -> dict:
    with moto_s3(BUCKET):
        client = s3_client()
        for k in range(args.cold_repeats):
            bar.set_postfix_str(f"cold: uploading adapter {k}")
            local = write_adapter(work / f"cold-{k}", args.layers, TARGET_SETS["all7"], args.rank, seed=5000 + k)
            for path in local.iterdir():
                client.upload_file(str(path), BUCKET, f"adapter-{k}/{path.name}")
        cache = work / "model-cache"
        llm = _engine(model, args, args.prompt + 16, 8, model_cache_dir=str(cache), **_lora_kwargs(args))
        rng = random.Random(1)
        _first_token_s(llm, "warm", _prompts(rng, 1, args.prompt)[0], None)
        rounds = []
        for k in range(args.cold_repeats):
            bar.set_postfix_str(f"cold: round {k + 1}/{args.cold_repeats}")
            lora = LoRARequest(f"adapter-{k}", k + 1, f"s3://{BUCKET}/adapter-{k}/")
            first, again, base = _prompts(rng, 3, args.prompt)
            rounds.append({"cold_adapter_s": _first_token_s(llm, f"cold-{k}", first, lora),
                           "warm_adapter_s": _first_token_s(llm, f"again-{k}", again, lora),
                           "base_s": _first_token_s(llm, f"base-{k}", base, None)})
        stats = _stats(llm)
        llm.close()
    medians = {key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}
    bar.update()
    return {"ttft_median_s": medians, "rounds": [{k: round(v, 4) for k, v in r.items()} for r in rounds],
            "adapter_mib": _dir_mib(work / "cold-0"), "targets": list(TARGET_SETS["all7"]), "lora_stats": stats}


# --- 3. many adapters through few slots ----------------------------------------------------------


def bench_stream(model: Path, args: argparse.Namespace, work: Path, bar: tqdm) -> dict:
    bar.set_postfix_str("stream: writing adapters")
    loras = [LoRARequest(f"s-{i}", i + 1, str(write_adapter(work / f"stream-{i}", args.layers, TARGET_SETS["qv"],
                                                            args.rank, seed=9000 + i)))
             for i in range(args.stream_adapters + args.single_loads)]
    loras, unseen = loras[:args.stream_adapters], loras[args.stream_adapters:]
    llm = _engine(model, args, 16 + args.stream_tokens + 16, args.in_flight, **_lora_kwargs(args))
    engine, stats = llm.engine, llm.engine.core.lora.stats
    reads = _AdapterReads()  # which adapter each host load read, from the manager's log line
    single = []
    for lora in unseen:  # on this thread, nothing else running: a load's own cost
        start = time.perf_counter()
        engine.add_lora(lora)
        single.append(time.perf_counter() - start)
    single_s = statistics.median(single)
    rng = random.Random(2)
    _first_token_s(llm, "warm", _prompts(rng, 1, 16)[0], None)
    prompts = _prompts(rng, args.stream_requests, 16)
    params = _params(args.stream_tokens)
    loads_at_start = stats.host_loads
    added: dict[str, tuple[float, int, int]] = {}  # request id -> (added at, host loads then, reads logged then)
    ready: dict[str, float] = {}  # request id -> add to its adapter in memory (Request.lora_ready), seconds
    # request id -> (add to first token s, loads completed meanwhile, reads of its own adapter among them)
    waited: dict[str, tuple[float, int, int]] = {}
    next_index, in_flight = 0, 0
    bar.set_postfix_str("stream: requests")
    with reads, tqdm(total=args.stream_requests, desc="stream", unit="req", leave=False) as reqs:
        while next_index < args.stream_requests or in_flight:
            while in_flight < args.in_flight and next_index < args.stream_requests:
                request_id = f"r{next_index}"
                added[request_id] = (time.perf_counter(), stats.host_loads, len(reads.names))
                engine.add_request(request_id, prompts[next_index], params,
                                   lora_request=loras[next_index % len(loras)])
                next_index, in_flight = next_index + 1, in_flight + 1
            outputs = engine.step()
            now = time.perf_counter()
            for request_id, request in engine.scheduler.requests.items():
                if request_id not in ready and request.lora_ready:
                    ready[request_id] = now - added[request_id][0]
            for out in outputs:
                if out.request_id not in ready:  # finished within the step it became ready
                    ready[out.request_id] = now - added[out.request_id][0]
                if out.new_token_ids and out.request_id not in waited:
                    at, loads, read_index = added[out.request_id]
                    own = reads.names[read_index:].count(loras[int(out.request_id[1:]) % len(loras)].lora_name)
                    waited[out.request_id] = (time.perf_counter() - at, stats.host_loads - loads, own)
                if out.finished:
                    if out.finish_reason is FinishReason.ERROR:
                        raise RuntimeError(f"{out.request_id} failed: {out}")
                    in_flight -= 1
                    reqs.update()
    final = _stats(llm)
    llm.close()
    loads = [n for _, n, _ in waited.values()]
    own_reads = [n for _, _, n in waited.values()]
    waits = [s for s, _, _ in waited.values()]
    worst = max(own_reads)
    ready_waits = list(ready.values())
    bar.update()
    return {
        "single_load_s": {"median": round(single_s, 4), "runs": [round(s, 4) for s in single]},
        "loads_waited": {"max": max(loads), "distribution": dict(sorted(Counter(loads).items())),
                         **{k: v for k, v in percentiles(loads).items()}},
        "own_adapter_reads_waited": {"max": max(own_reads), "distribution": dict(sorted(Counter(own_reads).items()))},
        "wait_s": {k: round(v, 4) for k, v in percentiles(waits).items()} | {"max": round(max(waits), 4)},
        "wait_in_single_loads": {k: round(v / single_s, 1) for k, v in percentiles(waits).items()}
        | {"max": round(max(waits) / single_s, 1)},
        "adapter_ready_s": {k: round(v, 4) for k, v in percentiles(ready_waits).items()}
        | {"max": round(max(ready_waits), 4)},
        "adapter_ready_in_single_loads": {k: round(v / single_s, 1) for k, v in percentiles(ready_waits).items()}
        | {"max": round(max(ready_waits) / single_s, 1)},
        "host_loads_during_stream": final["host_loads"] - loads_at_start,
        "requests": args.stream_requests, "adapters": args.stream_adapters, "in_flight": args.in_flight,
        "lora_stats": final, "adapter_mib": _dir_mib(Path(loras[0].lora_path)),
        "goal": {"target_max_own_adapter_reads": GOAL_LOADS, "max_own_adapter_reads": worst,
                 "met": worst <= GOAL_LOADS},
        "per_request": {rid: {"wait_s": round(s, 4), "loads_waited": n, "own_adapter_reads": own}
                        for rid, (s, n, own) in waited.items()},
    }


class _AdapterReads(logging.Handler):
    """The names of the adapters read into host memory, in order, from the LoRA manager's
    "LoRA adapter <name> loaded" log line (written on its loader threads)."""

    LOGGER = "ferry.worker.engine.lora.manager"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.names: list[str] = []
        self._logger = logging.getLogger(self.LOGGER)
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("LoRA adapter %s loaded"):
            self.names.append(record.args[0])

    def __enter__(self) -> _AdapterReads:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


# --- report --------------------------------------------------------------------------------------


STREAM_CAUSE = (
    "some request's own adapter was read more than once while it waited: it was dropped from host "
    "memory before the request ran (worker/engine/lora/manager.py keeps the adapters the first "
    "waiting requests need; see its poll and _make_room)"
)


def summary(results: dict) -> str:
    lines = []
    if "throughput" in results:
        tp = results["throughput"]
        lines.append(f"throughput (batch {tp['requests']} over {tp['adapters']} adapters):")
        for system, row in tp["systems"].items():
            lines.append(f"  {system:12s} {row['tokens_per_s']:8.1f} tok/s  {row['over_base']:5.2f}x base")
        for name, goal in tp["goal"].items():
            lines.append(f"  goal {name} >= {GOAL_RATIO}x base: {'met' if goal['met'] else 'NOT met'} "
                         f"({goal['over_base']}x)")
    if "cold" in results:
        med = results["cold"]["ttft_median_s"]
        lines.append(f"cold adapter from S3 ({results['cold']['adapter_mib']} MiB), TTFT median: "
                     f"cold {med['cold_adapter_s'] * 1e3:.0f} ms, same adapter again "
                     f"{med['warm_adapter_s'] * 1e3:.0f} ms, base {med['base_s'] * 1e3:.0f} ms")
    if "stream" in results:
        st = results["stream"]
        lines.append(f"stream ({st['requests']} requests over {st['adapters']} adapters, {MAX_LORAS} slots, "
                     f"{MAX_CPU_LORAS} in memory, {st['in_flight']} in flight): single load "
                     f"{st['single_load_s']['median'] * 1e3:.1f} ms; host loads {st['host_loads_during_stream']}")
        lines.append(f"  loads waited: max {st['loads_waited']['max']}, p50 {st['loads_waited']['p50']}, "
                     f"p90 {st['loads_waited']['p90']}; distribution {st['loads_waited']['distribution']}")
        lines.append(f"  reads of its own adapter while it waited: max {st['own_adapter_reads_waited']['max']}, "
                     f"distribution {st['own_adapter_reads_waited']['distribution']}")
        ready = st["adapter_ready_in_single_loads"]
        lines.append(f"  add -> adapter in memory, in single loads: p50 {ready['p50']}, p90 {ready['p90']}, "
                     f"max {ready['max']}")
        lines.append(f"  add -> first token, in single loads: p50 {st['wait_in_single_loads']['p50']}, "
                     f"p90 {st['wait_in_single_loads']['p90']}, max {st['wait_in_single_loads']['max']} "
                     "(the rest is waiting for a slot: more adapters in flight than slots)")
        if st["goal"]["met"]:
            lines.append(f"  goal: no request waits for more than {GOAL_LOADS} load of its adapter: met")
        else:
            lines.append(f"  goal: no request waits for more than {GOAL_LOADS} load of its adapter: NOT met "
                         f"(max {st['goal']['max_own_adapter_reads']}): {STREAM_CAUSE}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    model = family_model("llama", args.layers)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-lora-"))
    load_before = os.getloadavg()  # this machine is shared: say how busy it was
    benches = {"throughput": bench_throughput, "cold": bench_cold, "stream": bench_stream}
    results: dict[str, dict] = {}
    try:
        with tqdm(total=len(args.parts), desc="lora", unit="part") as bar:
            for part in args.parts:
                results[part] = benches[part](model, args, work, bar)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "stream" in results and not results["stream"]["goal"]["met"]:
        results["stream"]["goal"]["why"] = STREAM_CAUSE
    payload = {
        "settings": {"parts": args.parts, "layers": args.layers, "model": model.name, "dtype": "float32",
                     "rank": args.rank, "prompt_tokens": args.prompt, "tokens": args.tokens, "batch": args.batch,
                     "adapters": args.adapters, "repeats": args.repeats, "cold_repeats": args.cold_repeats,
                     "stream_requests": args.stream_requests, "stream_adapters": args.stream_adapters,
                     "stream_tokens": args.stream_tokens, "in_flight": args.in_flight, "max_loras": MAX_LORAS,
                     "max_cpu_loras": MAX_CPU_LORAS, "threads": args.threads, "quick": args.quick,
                     "target_sets": {k: list(v) for k, v in TARGET_SETS.items()}},
        "results": results,
        "load_average_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
    }
    path = write_result("lora", payload, args.results_dir)
    print(summary(results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
