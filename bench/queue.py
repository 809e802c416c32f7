"""What the Redis path costs: 32 concurrent jobs through a worker vs the same requests straight into the engine.

- direct: one in-process `Engine`, all requests added at once, stepped to the end; TTFT is
  first token - add time, as the engine records it.
- queue: a real `ferry worker` subprocess with the same engine settings; the bench enqueues the
  jobs in one round trip (`enqueue_jobs`: the API's atomic enqueue, pipelined) and follows the
  tokens on pub/sub; TTFT is the arrival of the first token event - the enqueue time, both taken
  in this process.

Reported: added TTFT p50/p99 (queue - direct) and the throughput ratio (queue / direct, output
tokens per second over the whole batch); also the added TTFT of single jobs sent one at a time
(the hop itself, with no batch to wait for). Targets: under 5 ms added at p50, ratio at least 0.95.
Runs alternate between the two paths so background load hits both alike; the median run counts.
Every batch is new to both engines (its own prompts), so no run is served from the prefix cache.

A batch's TTFT is mostly its prefill steps (seconds on the default model), whose time drifts by
more than the queue's cost from run to run on a shared machine; so the Redis path's own share is
also measured per job, from the events' worker timestamps (`ts`, wall clock, same machine):
  intake    enqueue -> `started` written (the worker read, decided and handed the job over)
  delivery  first `token` event written -> received here (publisher, Redis, pub/sub)
A later job's intake overlaps the engine's first steps (a step holds only so many prompt tokens),
so what the queue puts on the TTFT's critical path is the batch's first intake (the engine can
start no sooner) plus a token's delivery: `queue_critical_path_ms` is, per run, the least intake
plus the median delivery, median over runs. `added_ttft_paired_p50_ms` is the median over runs
of each run pair's difference of TTFT p50s (the two runs of a pair are adjacent in time).

    python -m bench.queue [--model DIR] [--quick]

Writes bench/results/queue[-quick].json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.common import machine

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.queue", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct, the bundled model; "
                   "quick: the small demo model, where a step takes milliseconds and the queue's cost shows most)")
    p.add_argument("--quick", action="store_true", help="a small run: the demo model, shorter prompts and outputs")
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (quick: 32)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 64 (quick: 32)")
    p.add_argument("--runs", type=int, default=None, help="runs per path (default 3)")
    p.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--threads", type=int, default=None, help="torch threads for both paths (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/queue[-quick].json)")
    args = p.parse_args(argv)
    for name, full, quick in (("prompt_tokens", 128, 32), ("max_tokens", 64, 32), ("runs", 3, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def _engine_kwargs(jobs: int) -> dict:
    # Both paths get exactly these (the worker through FERRY_* variables).
    return {"max_num_seqs": max(jobs, 1), "max_num_batched_tokens": 1024, "kv_cache_bytes": 512 << 20}


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _summary(ttfts: list[float], tokens: int, seconds: float, **extra) -> dict:
    return {"ttft_p50_ms": 1000 * _pct(ttfts, 50), "ttft_p99_ms": 1000 * _pct(ttfts, 99),
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **extra}


# --- direct ------------------------------------------------------------------------------------------


def run_direct(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from ferry.worker.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run = uuid.uuid4().hex[:8]
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{run}-{i}", prompt, params)
    ttfts, tokens = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                ttfts[out.request_id] = out.metrics.ttft
    return _summary(list(ttfts.values()), tokens, time.monotonic() - started)


# --- through Redis -----------------------------------------------------------------------------------


class QueueClient:
    """Enqueues jobs like the API and follows every job's events on pub/sub."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        import redis

        from ferry.worker.protocol import Keys

        self.client = redis.Redis.from_url(redis_url, decode_responses=True)
        self.keys = Keys(prefix)

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from ferry.worker.protocol import JobRequest, enqueue_jobs, new_job_id

        ids = [new_job_id() for _ in prompts]
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        started_ts: dict[str, float] = {}  # the `started` event's worker wall time
        first_delivery: dict[str, float] = {}  # first token: received here - written by the worker (wall clock)
        tokens = [0]
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.psubscribe(f"{self.keys.prefix}:job:*")
        pubsub.get_message(timeout=1.0)

        def listen() -> None:
            while len(done) < len(ids):
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                now, wall = time.monotonic(), time.time()
                job_id = message["channel"].rsplit(":", 1)[1]
                event = json.loads(message["data"])  # plain JSON: the client's own CPU should not weigh on the worker
                if event["type"] == "token":
                    if job_id not in first:
                        first[job_id] = now
                        first_delivery[job_id] = wall - event["ts"]
                    tokens[0] += len(event["token_ids"])
                elif event["type"] == "started":
                    started_ts.setdefault(job_id, event["ts"])
                else:
                    done[job_id] = now

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        requests = [JobRequest(model="bench", prompt=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    for p in prompts]
        # All at once, as the direct path adds them: one round trip for the whole batch.
        enqueued, enqueued_wall = dict.fromkeys(ids, time.monotonic()), time.time()
        enqueue_jobs(self.client, self.keys, requests, job_ids=ids)
        listener.join(600)
        pubsub.close()
        if missing := [j for j in ids if j not in first]:
            raise RuntimeError(f"jobs without tokens (failed?): {missing[:3]}; see the worker log")
        ttfts = [first[j] - enqueued[j] for j in ids]
        # Per job, in ms: what the Redis path itself took (see the module docstring).
        intake = [1000 * (started_ts[j] - enqueued_wall) for j in ids if j in started_ts]
        delivery = [1000 * first_delivery[j] for j in ids]
        return _summary(ttfts, tokens[0], max(done.values()) - min(enqueued.values()), intake_ms=intake,
                        delivery_ms=delivery, critical_path_ms=min(intake, default=0.0) + _pct(delivery, 50))

    def cleanup(self) -> None:
        for key in self.client.scan_iter(f"{self.keys.prefix}:*"):
            self.client.delete(key)
        self.client.close()


def start_worker(
    model: Path, redis_url: str, prefix: str, jobs: int, threads: int | None, log: Path,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """A `ferry worker` subprocess serving `model` as "bench"; `extra_env`: more FERRY_* settings
    (a cluster's FERRY_REDIS_CLUSTER and FERRY_QUEUE_SHARDS)."""
    kw = _engine_kwargs(jobs)
    env = {
        **os.environ,
        "FERRY_REDIS_URL": redis_url,
        "FERRY_KEY_PREFIX": prefix,
        "FERRY_MODEL": str(model),
        "FERRY_MODEL_NAME": "bench",
        "FERRY_METRICS_PORT": "0",
        "FERRY_METRICS_HOST": "127.0.0.1",
        "FERRY_WORKER_ID": f"bench-{prefix[-6:]}",
        "FERRY_MAX_NUM_SEQS": str(kw["max_num_seqs"]),
        "FERRY_MAX_NUM_BATCHED_TOKENS": str(kw["max_num_batched_tokens"]),
        "FERRY_KV_CACHE_BYTES": str(kw["kv_cache_bytes"]),
        "FERRY_DRAIN_TIMEOUT_S": "0",
    }
    if threads:
        env["FERRY_TORCH_THREADS"] = str(threads)
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, "-m", "ferry.worker.serve.main"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _wait_ready(client, keys, worker_id: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 600
    while client.hget(keys.worker(worker_id), "state") != "ready":
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("worker not ready after 600 s")
        time.sleep(0.2)


# --- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    from ferry.worker.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else _default_model(args.quick)
    prefix = f"ferrybench-{uuid.uuid4().hex}"
    log = Path(tempfile.gettempdir()) / f"{prefix}.worker.log"
    worker = start_worker(model, args.redis_url, prefix, args.jobs, args.threads, log)
    queue = QueueClient(args.redis_url, prefix)
    try:
        engine = Engine(str(model), **_engine_kwargs(args.jobs))
        vocab = engine.arch.vocab_size
        _wait_ready(queue.client, queue.keys, f"bench-{prefix[-6:]}", worker, log)
        # The first full-size batch pays one-off costs on both paths (the KV pool's pages, the
        # allocator's growth): a whole batch with short outputs, unmeasured.
        warm = _prompts(args.jobs, args.prompt_tokens, vocab, seed=0)
        run_direct(engine, warm, 4)
        queue.run(warm, 4)
        # Every measured batch is new to both engines (its own seed): a prompt seen before would
        # be a prefix-cache hit, and the runs would measure the cache instead of the queue.
        # One job at a time: the queue's own latency, with no batch to wait for.
        singles = _prompts(8, args.prompt_tokens, vocab, seed=1)
        single = [(run_direct(engine, [p], 2)["ttft_p50_ms"], queue.run([p], 2)["ttft_p50_ms"]) for p in singles]
        direct, queued = [], []
        for i in range(args.runs):
            prompts = _prompts(args.jobs, args.prompt_tokens, vocab, seed=2 + i)
            direct.append(run_direct(engine, prompts, args.max_tokens))
            queued.append(queue.run(prompts, args.max_tokens))
            print(
                f"run {i + 1}: direct {direct[-1]['tokens_per_s']:.1f} tok/s "
                f"TTFT p50 {direct[-1]['ttft_p50_ms']:.1f} ms | "
                f"queue {queued[-1]['tokens_per_s']:.1f} tok/s TTFT p50 {queued[-1]['ttft_p50_ms']:.1f} ms",
                flush=True,
            )
    finally:
        worker.terminate()
        worker.wait(60)
        queue.cleanup()
    d = _median_run(direct)
    q = _median_run(queued)
    critical = sorted(run["critical_path_ms"] for run in queued)
    intake = [h for run in queued for h in run["intake_ms"]]
    delivery = [h for run in queued for h in run["delivery_ms"]]
    paired = sorted(qr["ttft_p50_ms"] - dr["ttft_p50_ms"] for dr, qr in zip(direct, queued, strict=True))
    result = {
        "bench": "queue",
        "model": str(model),
        "jobs": args.jobs,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "engine": _engine_kwargs(args.jobs),
        "direct": d,
        "queue": q,
        "added_ttft_p50_ms": q["ttft_p50_ms"] - d["ttft_p50_ms"],
        "added_ttft_p99_ms": q["ttft_p99_ms"] - d["ttft_p99_ms"],
        "throughput_ratio": q["tokens_per_s"] / d["tokens_per_s"],
        "added_ttft_paired_p50_ms": paired[len(paired) // 2],
        "queue_critical_path_ms": critical[len(critical) // 2],
        "queue_intake_ms": {"p50": _pct(intake, 50), "p99": _pct(intake, 99)},
        "queue_delivery_ms": {"p50": _pct(delivery, 50), "p99": _pct(delivery, 99)},
        "single_job_added_ttft_p50_ms": _pct([qs - ds for ds, qs in single], 50),
        "single_job_ttft_ms": [{"direct": ds, "queue": qs} for ds, qs in single],
        "all_runs": {"direct": direct, "queue": queued},
        "machine": machine() | {"platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = args.out or RESULTS / ("queue-quick.json" if args.quick else "queue.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.jobs} jobs: added TTFT p50 {result['added_ttft_p50_ms']:+.1f} ms, "
        f"p99 {result['added_ttft_p99_ms']:+.1f} ms; "
        f"throughput ratio {result['throughput_ratio']:.3f} (queue / direct); one job at a time: added TTFT p50 "
        f"{result['single_job_added_ttft_p50_ms']:+.1f} ms; "
        f"per-run pairs: added TTFT p50 {result['added_ttft_paired_p50_ms']:+.1f} ms; "
        f"Redis path on the critical path (first intake + delivery): {result['queue_critical_path_ms']:.1f} ms "
        f"-> {out}"
    )
    return 0


def _default_model(quick: bool) -> Path:
    if not quick:
        from bench.models import smollm2

        return smollm2()
    from ferry.worker.tools.demo_model import make_demo_model

    directory = Path(".ferry/bench-models/demo")
    return directory if (directory / "config.json").is_file() else make_demo_model(directory)


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (keeps each run's figures together)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


if __name__ == "__main__":
    sys.exit(main())
