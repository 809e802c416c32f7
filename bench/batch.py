"""The Batch API against the same requests as individual jobs, and what a batch costs live traffic.

Workload: N chat requests (default 2,000) of about P words of seeded random text, exactly M
output tokens each (greedy, EOS ignored), through one `ferry api` and one `ferry worker`:
1. as individual jobs: all N `POST /v1/jobs` in the `low` lane (as a batch's lines are), wall
   time from the first submit to the last job finished;
2. as one batch: the same N lines uploaded (`POST /v1/files`), `POST /v1/batches`, wall time from
   the create to `completed` (target: within 1.1x of 1.);
3. live traffic: up to L streamed chat completions, one every `--live-gap-s`, first with nothing
   else running, then while a batch of the N lines runs (only those sent before it finished);
   TTFT = request sent -> first content chunk (target: p50 with the batch at most 1.3x without).
   That batch's wall time is reported too: live traffic slows it (the worker paces its batch
   work while live jobs come, `FERRY_BACKGROUND_PAUSE_RATIO`).

    python -m bench.batch [--lines 2000] [--max-tokens 16] [--live 40] [--model DIR] [--quick]

Writes bench/results/batch-<time>.json (and batch-latest.json) and bench/plots/batch.png. Needs
Redis (FERRY_REDIS_URL, default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from bench.api import MODEL_NAME, WORDS, _default_model, start_stack
from bench.common import percentiles, write_result
from bench.plots import plot_batch
from ferry.worker.protocol import Keys

REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--live", type=int, default=40, help="live streamed requests per phase")
    p.add_argument("--live-gap-s", type=float, default=0.1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--quick", action="store_true", help="200 lines x 8 tokens, 10 live requests")
    args = p.parse_args(argv)
    if args.quick:
        args.lines, args.max_tokens, args.live = 200, 8, 10
    args.clients = args.max_num_seqs  # bench.api's stack sizes the worker by it
    return args


def _body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def individual_jobs(client: httpx.AsyncClient, prompts: list[str], max_tokens: int) -> float:
    """Wall seconds from the first submit to the last job's `finished_at` (as the worker stamped it,
    so the polling below adds nothing)."""
    started = time.time()
    limit = asyncio.Semaphore(32)

    async def submit(prompt: str) -> str:
        job = {"input": _body(prompt, max_tokens), "priority": "low"}
        async with limit:
            answer = await client.post("/v1/jobs", json=job)
        answer.raise_for_status()
        return answer.json()["id"]

    ids = await asyncio.gather(*(submit(p) for p in prompts))
    pending = set(ids)
    finished: list[float] = []
    while pending:
        for job_id in list(pending):
            job = (await client.get(f"/v1/jobs/{job_id}")).json()
            if job["status"] in ("succeeded", "failed", "cancelled", "timed_out"):
                pending.discard(job_id)
                finished.append(job["finished_at"])
        await asyncio.sleep(0.2)
    return max(finished) - started


async def start_batch(client: httpx.AsyncClient, prompts: list[str], max_tokens: int) -> tuple[str, float]:
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": _body(p, max_tokens)}) + "\n" for i, p in enumerate(prompts))
    upload = await client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("bench.jsonl", io.BytesIO(lines.encode()))})
    upload.raise_for_status()
    started = time.perf_counter()
    batch = await client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                   "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    batch.raise_for_status()
    return batch.json()["id"], started


async def wait_batch(client: httpx.AsyncClient, batch_id: str, started: float) -> tuple[float, dict]:
    while True:
        batch = (await client.get(f"/v1/batches/{batch_id}")).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return time.perf_counter() - started, batch
        await asyncio.sleep(0.1)


@dataclass(slots=True)
class LiveRequest:
    """One live streamed request: its TTFT, and when (unix s) it was sent and its first token came."""
    ttft_ms: float
    job_id: str
    sent_at: float
    received_at: float


async def live_ttfts(client: httpx.AsyncClient, prompts: list[str], gap_s: float,
                     while_batch: str | None = None) -> list[LiveRequest]:
    """TTFTs of the prompts sent one every `gap_s`; with `while_batch`, only those sent while that
    batch was still running (sending stops when it finishes)."""

    async def running() -> bool:
        status = (await client.get(f"/v1/batches/{while_batch}")).json()["status"]
        return status in ("validating", "in_progress")

    async def one(prompt: str) -> LiveRequest:
        sent, sent_at = time.perf_counter(), time.time()
        async with client.stream("POST", "/v1/chat/completions", json=_body(prompt, 8) | {"stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    ttft_ms, received_at = (time.perf_counter() - sent) * 1000, time.time()
                    job_id = json.loads(line.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
                    return LiveRequest(ttft_ms, job_id, sent_at, received_at)
        raise RuntimeError("a live request streamed no content")

    tasks = []
    for prompt in prompts:
        if while_batch is not None and not await running():
            break
        tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.sleep(gap_s)
    return list(await asyncio.gather(*tasks))


async def run(url: str, prefix: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(args.lines)]
    live = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(args.live)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await live_ttfts(client, live[:2], 0)  # warm-up
        jobs_s = await individual_jobs(client, prompts, args.max_tokens)
        batch_id, started = await start_batch(client, prompts, args.max_tokens)
        batch_s, batch = await wait_batch(client, batch_id, started)
        idle = await live_ttfts(client, live, args.live_gap_s)
        batch_id, started = await start_batch(client, prompts, args.max_tokens)
        loaded = await live_ttfts(client, live, args.live_gap_s, while_batch=batch_id)
        batch_with_live_s, _ = await wait_batch(client, batch_id, started)
    return {"jobs_wall_s": jobs_s, "batch_wall_s": batch_s, "batch_with_live_wall_s": batch_with_live_s,
            "batch": batch["request_counts"],
            "ttft_idle_ms": [r.ttft_ms for r in idle], "ttft_with_batch_ms": [r.ttft_ms for r in loaded],
            **stage_results("idle", idle, args.redis_url, prefix),
            **stage_results("with_batch", loaded, args.redis_url, prefix)}


STAGES = ("accept", "queue", "engine", "delivery")


def ttft_stages(requests: list[LiveRequest], redis_url: str, prefix: str) -> list[dict[str, float]]:
    """Where each live TTFT went, ms per stage, from the job hash's timestamps (one clock: all
    processes run here): accept = sent -> the API accepted it (created_at), queue = -> a worker
    started it, engine = -> its first token was written, delivery = -> the client had it."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(prefix)
    out = []
    for r in requests:
        created, started, first = client.hmget(keys.job(r.job_id), "created_at", "started_at", "first_token_at")
        if None in (created, started, first):
            continue
        marks = [r.sent_at, float(created), float(started), float(first), r.received_at]
        out.append({"ttft": r.ttft_ms} | {name: 1000 * (b - a) for name, (a, b) in
                                          zip(STAGES, itertools.pairwise(marks), strict=True)})
    client.close()
    return out


def stage_results(phase: str, requests: list[LiveRequest], redis_url: str, prefix: str) -> dict:
    """p50 per stage, and the stages of the slowest tenth of the requests (where the tail goes)."""
    stages = ttft_stages(requests, redis_url, prefix)
    slowest = sorted(stages, key=lambda s: s["ttft"])[-max(1, len(stages) // 10):]
    return {f"stages_{phase}_ms": {name: percentiles([s[name] for s in stages])["p50"] for name in STAGES},
            f"slowest_{phase}_ms": [{k: round(v, 2) for k, v in s.items()} for s in slowest]}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    model = Path(args.model) if args.model else _default_model()
    os.environ["FERRY_FILES_URL"] = Path(tempfile.mkdtemp(prefix="ferry-bench-files-")).as_uri()
    stack = start_stack(model, args)
    try:
        raw = asyncio.run(run(stack.url, stack.prefix, args))
    finally:
        stack.stop(args.redis_url)
    idle, loaded = percentiles(raw["ttft_idle_ms"]), percentiles(raw["ttft_with_batch_ms"])
    result = {
        "model": str(model), "lines": args.lines, "max_tokens": args.max_tokens, "live": args.live,
        "load": os.getloadavg(), "batch_backlog": os.environ.get("FERRY_BATCH_BACKLOG", "default"), **raw,
        "batch_over_jobs": round(raw["batch_wall_s"] / raw["jobs_wall_s"], 3),
        "ttft_idle": idle, "ttft_with_batch": loaded,
        "ttft_p50_ratio": round(loaded["p50"] / idle["p50"], 3) if loaded["p50"] else None,
    }
    path = write_result("batch", result)
    plot_batch(result, REPO / "bench" / "plots")
    print(f"{args.lines} lines x {args.max_tokens} tokens: jobs {raw['jobs_wall_s']:.1f} s, batch "
          f"{raw['batch_wall_s']:.1f} s ({result['batch_over_jobs']}x; target <= 1.1), "
          f"{raw['batch_with_live_wall_s']:.1f} s with the live requests\n"
          f"live TTFT p50 {idle['p50']:.0f} ms idle, {loaded['p50']:.0f} ms with a batch running "
          f"({result['ttft_p50_ratio']}x; target <= 1.3)")
    for phase in ("idle", "with_batch"):
        stages = raw[f"stages_{phase}_ms"]
        print(f"  {phase:>10}: " + ", ".join(f"{name} {stages[name] or 0:.1f}" for name in STAGES) + " ms (p50)")
        for slow in raw[f"slowest_{phase}_ms"]:
            print(f"  {'':>10}  slowest tenth, {slow['ttft']:.0f} ms: "
                  + ", ".join(f"{name} {slow[name]:.1f}" for name in STAGES))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
