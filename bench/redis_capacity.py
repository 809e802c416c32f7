"""How many Redis shards a fleet needs: Redis commands and bytes per job and per token, measured
on a real `ferry worker`, against the ops/s one Redis node sustains on the token path.

1. cost: a private `redis-server` (so no other client's commands are counted) and a real worker
   on it; two batches of J jobs that differ only in max_tokens. Between `CONFIG RESETSTAT` and
   `INFO commandstats` / `INFO stats` each batch costs `J * per_job + T * per_token` commands
   (and bytes), T its output tokens, once the idle rate (heartbeats, blocking reads, measured
   first) is taken out; two batches give both unknowns. The enqueue and one pub/sub follower
   per batch (as the API's SSE stream) are counted: they are the fleet's load too.
2. capacity: `redis-benchmark` (the C client, pipelined like the publisher) against the same
   server: token events/s (a script that checks the job hash, XADDs to its event stream and
   PUBLISHes on its channel, as the publisher's EMIT does per job per step, with the measured
   event size) and plain commands/s (HSET): one node, i.e. one shard's primary.
3. sizing: a fleet of G GPUs at T tokens/s each, jobs of `--tokens-per-job` output tokens;
   a shard's busy share is G*T*events_per_token / events/s + G*T/tokens_per_job * per_job /
   commands/s; shards = that over `--headroom` (half a node's ceiling keeps p99 latency flat).

4. cluster (`bench.redis_cluster`, skipped with `--no-cluster`): jobs/s and token messages/s with
   1 vs 3 shards on a local cluster of 3 primaries, and the TTFT a job adds through a cluster
   over a single node.

    python -m bench.redis_capacity [--quick] [--no-cluster] [--model DIR]

Writes bench/results/redis_capacity-<stamp>.json (and -latest) and prints the sizing table.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

from bench import redis_cluster
from bench.common import write_result
from bench.queue import _default_model, _prompts, _wait_ready, start_worker
from bench.redis_server import BENCH_KEYS, benchmark_argv, emit_like, start_redis
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, JobRequest, Keys, enqueue_jobs, new_job_id

FLEETS = (10, 100, 1000)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.redis_capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the small demo model)")
    p.add_argument("--quick", action="store_true", help="fewer jobs and benchmark requests")
    p.add_argument("--jobs", type=int, default=None, help="jobs per batch (default 32, quick 8)")
    p.add_argument("--short-tokens", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=40)
    p.add_argument("--gpu-tokens-per-s", type=float, default=2560.0,
                   help="output tokens/s of one GPU worker (default: 40 steps/s x 64 running jobs)")
    p.add_argument("--tokens-per-job", type=int, default=256, help="output tokens of a typical job")
    p.add_argument("--headroom", type=float, default=0.5, help="share of a node's measured ops/s to plan for")
    p.add_argument("--requests", type=int, default=None, help="redis-benchmark requests per command (default 200k)")
    p.add_argument("--no-cluster", action="store_true", help="skip the cluster part (bench.redis_cluster)")
    args = p.parse_args(argv)
    args.jobs = args.jobs or (8 if args.quick else 32)
    args.requests = args.requests or (50_000 if args.quick else 200_000)
    return args


def _counters(client: redis.Redis) -> dict:
    """Commands by name, and network bytes in and out, since the last CONFIG RESETSTAT."""
    commands = {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in client.info("commandstats").items()}
    stats = client.info("stats")
    return {"commands": commands, "bytes": stats["total_net_input_bytes"] + stats["total_net_output_bytes"]}


def run_batch(client: redis.Redis, keys: Keys, prompts: list[list[int]], max_tokens: int) -> dict:
    """J jobs through the worker, followed on pub/sub; returns the server's counters for them."""
    ids = [new_job_id() for _ in prompts]
    tokens, done = [0], set()
    follower = client.pubsub(ignore_subscribe_messages=True)
    follower.psubscribe(f"{keys.prefix}:job:*")
    follower.get_message(timeout=1.0)

    def follow() -> None:
        while len(done) < len(ids):
            message = follower.get_message(timeout=1.0)
            if message is None:
                continue
            event = json.loads(message["data"])
            if event["type"] == "token":
                tokens[0] += len(event["token_ids"])
            elif event["type"] in TERMINAL_EVENT_TYPES:
                done.add(message["channel"].rsplit(":", 1)[1])

    thread = threading.Thread(target=follow, daemon=True)
    client.config_resetstat()
    started = time.monotonic()
    thread.start()
    requests = [JobRequest(model="bench", prompt=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                for p in prompts]
    enqueue_jobs(client, keys, requests, job_ids=ids)
    thread.join(600)
    seconds = time.monotonic() - started
    follower.close()
    if len(done) < len(ids):
        raise RuntimeError(f"{len(ids) - len(done)} jobs did not finish")
    return {"jobs": len(ids), "tokens": tokens[0], "seconds": seconds, **_counters(client)}


def idle_rate(client: redis.Redis, seconds: float = 3.0) -> dict:
    """Commands/s and bytes/s of an idle worker (heartbeat, blocking reads), to take out of a batch."""
    client.config_resetstat()
    time.sleep(seconds)
    counters = _counters(client)
    return {"commands_per_s": sum(counters["commands"].values()) / seconds, "bytes_per_s": counters["bytes"] / seconds}


def solve_costs(short: dict, long: dict, idle: dict) -> dict:
    """Per job and per token costs from two batches of equal job counts (see the module docstring)."""
    def net(batch, what):
        total = sum(batch["commands"].values()) if what == "commands" else batch["bytes"]
        return total - idle[f"{what}_per_s"] * batch["seconds"]

    costs = {}
    for what in ("commands", "bytes"):
        per_token = (net(long, what) - net(short, what)) / (long["tokens"] - short["tokens"])
        costs[f"{what}_per_token"] = per_token
        costs[f"{what}_per_job"] = (net(short, what) - per_token * short["tokens"]) / short["jobs"]
    return costs


def _benchmark(port: int, requests: int, command: list[str]) -> float:
    """Requests/s of one command from redis-benchmark."""
    out = subprocess.run(benchmark_argv(port, requests, command), capture_output=True, text=True, check=True).stdout
    return float(list(csv.reader(io.StringIO(out)))[-1][1])  # a header row, then "test","rps",...


def node_ops_per_s(port: int, requests: int, event_bytes: int) -> dict:
    """What one node sustains: token events/s (EMIT_LIKE) and plain commands/s (HSET)."""
    client = redis.Redis(port=port)
    pipe = client.pipeline(transaction=False)
    for i in range(BENCH_KEYS):  # redis-benchmark writes __rand_int__ as 12 digits
        pipe.hset(f"bench:job:{i:012d}", "state", "running")
    pipe.execute()
    sha = client.script_load(emit_like("PUBLISH"))
    payload = "x" * max(1, event_bytes)
    events = _benchmark(port, requests, ["EVALSHA", sha, "2", "bench:job:__rand_int__:events",
                                         "bench:job:__rand_int__", payload])
    plain = _benchmark(port, requests, ["HSET", "bench:job:__rand_int__", "state", "running"])
    client.close()
    return {"token_events_per_s": events, "commands_per_s": plain, "event_bytes": len(payload)}


def shards_needed(costs: dict, node: dict, gpus: int, gpu_tokens_per_s: float, tokens_per_job: int,
                  headroom: float) -> dict:
    """A shard's busy share is its token events over the node's event rate plus the jobs' other
    commands over its plain-command rate; shards = the fleet's busy share over `headroom`."""
    tokens_per_s = gpus * gpu_tokens_per_s
    jobs_per_s = tokens_per_s / tokens_per_job
    busy = (tokens_per_s * costs["events_per_token"] / node["token_events_per_s"]
            + jobs_per_s * costs["commands_per_job"] / node["commands_per_s"])
    return {
        "gpus": gpus,
        "jobs_per_s": jobs_per_s,
        "commands_per_s": tokens_per_s * costs["commands_per_token"] + jobs_per_s * costs["commands_per_job"],
        "bytes_per_s": tokens_per_s * costs["bytes_per_token"] + jobs_per_s * costs["bytes_per_job"],
        "shards": max(1, math.ceil(busy / headroom)),
    }


def _progress(started: float, line: str) -> None:
    print(f"[{time.monotonic() - started:4.0f} s] {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    progress = functools.partial(_progress, started)
    model = Path(args.model) if args.model else _default_model(quick=True)
    scratch = Path(tempfile.mkdtemp(prefix="ferry-redis-capacity-"))
    server, port = start_redis(scratch)
    url = f"redis://127.0.0.1:{port}/0"
    prefix = f"ferrybench-{uuid.uuid4().hex}"
    keys = Keys(prefix)
    client = redis.Redis.from_url(url, decode_responses=True)
    log = scratch / "worker.log"
    worker = start_worker(model, url, prefix, args.jobs, 1, log)
    try:
        progress(f"node: starting a worker on a private redis-server (:{port})")
        _wait_ready(client, keys, f"bench-{prefix[-6:]}", worker, log)
        progress(f"node: cost of {args.jobs}-job batches, {args.short_tokens} vs {args.long_tokens} tokens")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        run_batch(client, keys, _prompts(args.jobs, 16, vocab, seed=0), 2)  # warm-up, unmeasured
        idle = idle_rate(client)
        short = run_batch(client, keys, _prompts(args.jobs, 16, vocab, seed=1), args.short_tokens)
        long = run_batch(client, keys, _prompts(args.jobs, 16, vocab, seed=2), args.long_tokens)
        costs = solve_costs(short, long, idle)
        # Token events: the EMIT script calls beyond the per-job ones (one per job per step).
        costs["events_per_token"] = (long["commands"].get("evalsha", 0) - short["commands"].get("evalsha", 0)) / (
            long["tokens"] - short["tokens"])
        progress(f"node: redis-benchmark, {args.requests} requests per command")
        node = node_ops_per_s(port, args.requests, int(costs["bytes_per_token"] / max(costs["events_per_token"], 1e-9)))
    finally:
        worker.terminate()
        worker.wait(60)
        server.terminate()
        server.wait(30)
    shutil.rmtree(scratch, ignore_errors=True)  # the worker's log: kept when a batch failed
    cluster = None if args.no_cluster else redis_cluster.run(
        model, quick=args.quick, event_bytes=node["event_bytes"], token_requests=args.requests, progress=progress)
    fleet = [shards_needed(costs, node, g, args.gpu_tokens_per_s, args.tokens_per_job, args.headroom)
             for g in FLEETS]
    payload = {
        "model": str(model), "jobs": args.jobs, "short_tokens": args.short_tokens, "long_tokens": args.long_tokens,
        "idle": idle, "batches": {"short": short, "long": long}, "costs": costs, "node_ops_per_s": node,
        "sizing": {"gpu_tokens_per_s": args.gpu_tokens_per_s, "tokens_per_job": args.tokens_per_job,
                   "headroom": args.headroom, "fleets": fleet},
        "cluster": cluster,  # None with --no-cluster
        "seconds": time.monotonic() - started,
    }
    path = write_result("redis_capacity", payload)
    print(f"per job: {costs['commands_per_job']:.1f} commands, {costs['bytes_per_job']:.0f} bytes; "
          f"per token: {costs['commands_per_token']:.2f} commands, {costs['bytes_per_token']:.0f} bytes")
    print(f"token events per token: {costs['events_per_token']:.2f}; one node: {node['token_events_per_s']:.0f} "
          f"token events/s, {node['commands_per_s']:.0f} plain commands/s")
    print(f"{'GPUs':>6} {'commands/s':>12} {'MB/s':>8} {'shards':>7}  (at {args.gpu_tokens_per_s:.0f} tok/s per GPU, "
          f"{args.headroom:.0%} of a node)")
    for row in fleet:
        print(f"{row['gpus']:>6} {row['commands_per_s']:>12.0f} {row['bytes_per_s'] / 1e6:>8.1f} {row['shards']:>7}")
    for line in redis_cluster.report_lines(cluster) if cluster else []:
        print(line)
    print(f"took {payload['seconds']:.0f} s")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
