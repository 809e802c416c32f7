"""bench.redis_capacity's cluster part (issue 22): what 3 shards give over 1, and what a job's first
token pays for going through a Redis Cluster instead of one node. Both on loopback clusters of
real `redis-server --cluster-enabled yes` processes (`worker.tools.local_cluster`).

1. shard scaling (server capacity): a cluster of 3 primaries and no replicas, so this measures
   primaries; replication's cost is the WAIT's (`FERRY_REDIS_MIN_REPLICAS`), not measured here.
   For N in (1, 3): N `redis-benchmark` processes at once, process n pointed straight at the
   primary owning shard n's slot, every key under shard n's hash tag (no MOVED, no proxy), on two
   workloads:
   - jobs: EVALSHA of the real ENQUEUE script with the real arguments of one job (a 16-token
     prompt; `worker.protocol.queue._enqueue_call`), its id's timestamp digits replaced by
     `__rand_int__` so every call writes a job hash of its own (and XADDs to the shard's queue);
   - token messages: the publisher's per-step script (`redis_server.emit_like`) with SPUBLISH, as
     the worker runs it on a cluster, on job hashes created on each shard beforehand.
   The rate is all requests over the wall time from the first start to the last exit. Every run
   is checked on the servers (`INFO commandstats` after `CONFIG RESETSTAT`): each used primary ran
   the script exactly `requests` times, and the commands inside it as often; no call failed or
   was rejected; an unused primary ran none. Else the run raises.
   CPU: each used redis-server's utime + stime (/proc/<pid>/stat) and the clients' (getrusage of
   the waited-for children), before and after. On a machine with fewer cores than 3 servers and 3
   clients need, the measured ratio (`scaling_measured` = ops/s at 3 / ops/s at 1) is capped by
   the cores; `scaling_per_core` = 3 x ops per server-CPU-second at 3 / ops per server-CPU-second
   at 1 is what 3 primaries give with a core each. Target: 2.5x.
2. added TTFT: a real `ferry worker` (demo model) on a private single redis-server, and one on a
   cluster of 3 primaries with a replica each (`FERRY_REDIS_CLUSTER=true`, `FERRY_QUEUE_SHARDS=3`,
   no WAIT). Jobs one at a time (16-token prompt, 2 greedy tokens, EOS ignored), ids spread over
   the shards in turn, each after a random pause (`GAP_MS`). Per job: subscribe to its channel
   (SSUBSCRIBE on the cluster) and wait for the confirmation, then t0, enqueue (`enqueue_jobs`:
   the API's script), t1 at the first `token` message; the job's terminal message before the next
   job. TTFT = t1 - t0; `intake_ms` is the `started` event's worker time - the enqueue's wall time
   (the wait for a worker to take the job; before `worker.serve.shard_watch`, an idle worker
   blocked on one shard at a time and this was most of a cluster's added TTFT). The first jobs
   of each round are warm-up. Both workers stay up; rounds alternate node, cluster, node,
   cluster, so background load hits both alike. Target: the cluster's p50 at most 1 ms above
   the node's.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.common import percentiles
from bench.queue import _prompts, _wait_ready, start_worker
from bench.redis_server import BENCH_KEYS, PIPELINE, benchmark_argv, emit_like, start_redis
from ferry.worker.common.connect import connect, is_cluster
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, JobRequest, Keys, enqueue_jobs, lua, new_job_id
from ferry.worker.protocol.queue import _enqueue_call
from ferry.worker.tools.local_cluster import LocalCluster

SHARD_COUNTS = (1, 3)
PRIMARIES = 3
SCALING_TARGET = 2.5  # ops/s with 3 primaries over 1
TTFT_TARGET_MS = 1.0  # the cluster's added TTFT p50
PROMPT_TOKENS = 16
# Pause before each job of the TTFT rounds, drawn from [0, GAP_MS): the worker's default read block,
# so a job arrives anywhere in an idle worker's cycle of blocking reads (back to back, arrivals would
# lock to that cycle's phase and measure one point of it).
GAP_MS = 500
JOB_KEYSPACE = 1_000_000  # `__rand_int__` of a job id: (almost) every enqueue writes a hash of its own


# --- shard scaling -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Primary:
    """The primary that owns one shard's slot: where that shard's redis-benchmark points."""

    shard: int
    port: int
    pid: int  # its redis-server's, for its CPU time


@dataclass(slots=True)
class Workload:
    """One command redis-benchmark sends to each shard's primary, and what one call runs there."""

    name: str  # "jobs" | "token_messages"
    commands: list[list[str]]  # per shard: redis-benchmark's command (`__rand_int__` in its keys)
    keyspace: int  # -r: `__rand_int__` is drawn from [0, keyspace)
    requests: int  # per process (a multiple of the pipeline depth: redis-benchmark then sends exactly it)
    inner: tuple[str, ...]  # commands the script runs once per call: counted to prove it ran to the end
    prepare: Callable[[list[Primary]], None]  # writes what a run needs on an emptied cluster


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields[0] is field 3
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _commandstats(port: int) -> dict[str, dict]:
    """`INFO commandstats` by command name: calls, failed_calls, rejected_calls (Redis 7)."""
    with redis.Redis(port=port) as client:
        return {name.removeprefix("cmdstat_"): stat for name, stat in client.info("commandstats").items()}


def check_counts(stats: dict[str, dict], expected: dict[str, int]) -> None:
    """Raise unless the server ran each command of `expected` exactly that often, and no command
    failed or was rejected (a MOVED, an error inside the script)."""
    bad = {name: stat for name, stat in stats.items() if stat.get("failed_calls", 0) or stat.get("rejected_calls", 0)}
    if bad:
        raise RuntimeError(f"commands failed or were rejected: {bad}")
    ran = {name: stats.get(name, {}).get("calls", 0) for name in expected}
    if ran != expected:
        raise RuntimeError(f"the server ran {ran}, expected {expected}")


def run_shards(workload: Workload, primaries: list[Primary], shards: int) -> dict:
    """One redis-benchmark per shard of the first `shards`, all at once, each at its shard's primary,
    on an emptied cluster; raises unless the servers' counters show every request ran to the end."""
    used, idle = primaries[:shards], primaries[shards:]
    for primary in primaries:
        with redis.Redis(port=primary.port) as client:
            client.flushall()
    workload.prepare(used)
    for primary in primaries:
        with redis.Redis(port=primary.port) as client:
            client.config_resetstat()
    server_before = [_cpu_s(p.pid) for p in used]
    client_before = _children_cpu_s()
    started = time.perf_counter()
    procs = [subprocess.Popen(benchmark_argv(p.port, workload.requests, workload.commands[p.shard], workload.keyspace),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for p in used]
    stderr = [proc.communicate()[1] for proc in procs]
    seconds = time.perf_counter() - started
    client_cpu = _children_cpu_s() - client_before
    server_cpu = [_cpu_s(p.pid) - before for p, before in zip(used, server_before, strict=True)]
    if failed := [err for proc, err in zip(procs, stderr, strict=True) if proc.returncode]:
        raise RuntimeError(f"redis-benchmark failed: {failed}")
    for primary in used:
        check_counts(_commandstats(primary.port),
                     {"evalsha": workload.requests, **dict.fromkeys(workload.inner, workload.requests)})
    for primary in idle:
        check_counts(_commandstats(primary.port), {"evalsha": 0})
    requests = workload.requests * shards
    return {"shards": shards, "requests": requests, "seconds": seconds, "ops_per_s": requests / seconds,
            "server_cpu_s": sum(server_cpu), "server_cpu_share": [c / seconds for c in server_cpu],
            "ops_per_server_cpu_s": requests / sum(server_cpu), "client_cpu_s": client_cpu}


def scaling_ratios(one: dict, many: dict) -> dict:
    """`scaling_measured`: ops/s of `many` shards over `one`'s, as this machine ran them;
    `scaling_per_core`: the same if each primary had a core of its own (its ops per CPU second,
    times the primaries)."""
    return {"scaling_measured": many["ops_per_s"] / one["ops_per_s"],
            "scaling_per_core": (many["shards"] * many["ops_per_server_cpu_s"])
            / (one["shards"] * one["ops_per_server_cpu_s"])}


def _round_up(requests: int) -> int:
    return -(-requests // PIPELINE) * PIPELINE


def _jobs_workload(keys: Keys, sha: str, requests: int) -> Workload:
    """The API's enqueue of a 16-token job, exactly as `enqueue_job` sends it, one job id per call."""
    commands = []
    for shard in range(keys.shards):
        request = JobRequest(model="bench", prompt=list(range(3, 3 + PROMPT_TOKENS)), max_tokens=2,
                             temperature=0.0, ignore_eos=True)
        job_id = new_job_id(shard=shard)
        redis_keys, args = _enqueue_call(keys, request, job_id, None, 0)
        varied = "__rand_int__" + job_id[12:]  # its 12 timestamp digits -> 12 random ones
        commands.append(["EVALSHA", sha, str(len(redis_keys)), *(x.replace(job_id, varied) for x in redis_keys + args)])
    return Workload("jobs", commands, JOB_KEYSPACE, _round_up(requests), ("hset", "xadd"), lambda used: None)


def _token_workload(keys: Keys, sha: str, requests: int, event_bytes: int) -> Workload:
    """The publisher's per-step write of one token event on BENCH_KEYS jobs of each shard."""
    def job(shard: int, n: str) -> str:
        return f"{keys.prefix}:job:{keys.shard_tag(shard)}:{n}"

    def prepare(used: list[Primary]) -> None:
        for primary in used:
            with redis.Redis(port=primary.port) as client:
                pipe = client.pipeline(transaction=False)
                for i in range(BENCH_KEYS):  # redis-benchmark writes __rand_int__ as 12 digits
                    pipe.hset(job(primary.shard, f"{i:012d}"), "state", "running")
                pipe.execute()

    payload = "x" * max(1, event_bytes)
    commands = [["EVALSHA", sha, "2", job(s, "__rand_int__") + ":events", job(s, "__rand_int__"), payload]
                for s in range(keys.shards)]
    return Workload("token_messages", commands, BENCH_KEYS, _round_up(requests), ("exists", "xadd", "spublish"),
                    prepare)


def shard_scaling(job_requests: int, token_requests: int, event_bytes: int, progress: Callable[[str], None]) -> dict:
    """Both workloads at 1 and 3 shards on a fresh 3-primary cluster (see the module docstring)."""
    keys = Keys(f"ferrybench-{uuid.uuid4().hex[:8]}", PRIMARIES)
    cluster = LocalCluster(primaries=PRIMARIES, replicas=0).start()
    try:
        primaries = []
        for shard in range(PRIMARIES):
            port = cluster.primary_for_slot(keys.shard_slot(shard))
            primaries.append(Primary(shard, port, next(n.proc.pid for n in cluster.nodes if n.port == port)))
        if len({p.port for p in primaries}) != PRIMARIES:
            raise RuntimeError(f"shards share a primary: {primaries}")
        for primary in primaries:  # a script's sha is its source's: the same on every node
            with redis.Redis(port=primary.port) as client:
                enqueue_sha, emit_sha = client.script_load(lua.ENQUEUE), client.script_load(emit_like("SPUBLISH"))
        workloads = [_jobs_workload(keys, enqueue_sha, job_requests),
                     _token_workload(keys, emit_sha, token_requests, event_bytes)]
        out = {}
        for workload in workloads:
            runs = {}
            for shards in SHARD_COUNTS:
                progress(f"cluster: {workload.name}, {shards} shard(s), {workload.requests} requests each")
                runs[str(shards)] = run_shards(workload, primaries, shards)
            out[workload.name] = {"requests_per_process": workload.requests, "runs": runs,
                                  **scaling_ratios(runs["1"], runs[str(SHARD_COUNTS[-1])])}
    finally:
        cluster.stop()
    return {"primaries": PRIMARIES, "replicas": 0, "target": SCALING_TARGET, "cpu_count": os.cpu_count(),
            "measures": "primaries only (no replicas): replication's cost is the WAIT's (FERRY_REDIS_MIN_REPLICAS)",
            "workloads": out}


# --- added TTFT --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Setting:
    """A Redis (one node or a cluster) with a worker on it, and the client that enqueues and follows."""

    name: str  # "node" | "cluster"
    client: redis.Redis | redis.RedisCluster
    keys: Keys


def _subscribe(client, channel: str) -> tuple[object, Callable[[float], dict | None]]:
    """A pub/sub connection on `channel` (SSUBSCRIBE on a cluster), its subscription confirmed (so
    no message published after this returns is missed); returns it and `receive(timeout)`."""
    pubsub = client.pubsub()
    if is_cluster(client):
        pubsub.ssubscribe(channel)
        node = client.get_node_from_key(channel)

        def receive(timeout: float) -> dict | None:
            return pubsub.get_sharded_message(timeout=timeout, target_node=node)
        confirmation = "ssubscribe"
    else:
        pubsub.subscribe(channel)

        def receive(timeout: float) -> dict | None:
            return pubsub.get_message(timeout=timeout)
        confirmation = "subscribe"
    deadline = time.monotonic() + 10
    while (message := receive(1.0)) is None or message["type"] != confirmation:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {confirmation} confirmation for {channel}")
    return pubsub, receive


def time_job(setting: Setting, request: JobRequest, job_id: str) -> dict:
    """One job's TTFT as a client sees it: enqueue -> first token message (ms), and its intake."""
    pubsub, receive = _subscribe(setting.client, setting.keys.channel(job_id))
    first = started = None
    try:
        t0, wall0 = time.perf_counter(), time.time()
        enqueue_jobs(setting.client, setting.keys, [request], job_ids=[job_id])
        while True:
            message = receive(1.0)
            now = time.perf_counter()
            if message is None:
                if now - t0 > 60:
                    raise RuntimeError(f"{setting.name}: job {job_id} did not end within 60 s")
                continue
            if message["type"] not in ("message", "smessage"):
                continue
            event = json.loads(message["data"])
            if event["type"] == "started":
                started = 1000 * (event["ts"] - wall0)
            elif event["type"] == "token" and first is None:
                first = 1000 * (now - t0)
            elif event["type"] in TERMINAL_EVENT_TYPES:
                break
    finally:
        pubsub.close()
    if first is None or event["type"] != "completed":
        raise RuntimeError(f"{setting.name}: job {job_id} ended {event['type']}: {event}")
    return {"ttft_ms": first, "intake_ms": started, "shard": Keys.shard_of(job_id)}


def ttft_round(setting: Setting, prompts: list[list[int]], gaps_s: list[float], warmup: int) -> dict:
    """Jobs one after another, each after its pause, their ids in shard 0, 1, 2, 0, ... (the first
    `warmup` unreported)."""
    jobs = []
    for i, (prompt, gap) in enumerate(zip(prompts, gaps_s, strict=True)):
        time.sleep(gap)
        request = JobRequest(model="bench", prompt=prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
        jobs.append(time_job(setting, request, new_job_id(shard=i % setting.keys.shards)))
    jobs = jobs[warmup:]
    return {"setting": setting.name, "ttft_ms": [j["ttft_ms"] for j in jobs],
            "intake_ms": [j["intake_ms"] for j in jobs], "shard": [j["shard"] for j in jobs]}


def _p50(values: list[float]) -> float | None:
    return percentiles(values, (50,))["p50"]


def ttft_summary(rounds: list[dict]) -> dict:
    """Per setting, TTFT p50/p90 over all its rounds (ms), each round's p50, and p50 per shard; the
    cluster's p50 over the node's, pooled (`added_p50_ms`) and per pair of rounds (the k-th node
    round with the k-th cluster round: adjacent in time)."""
    out = {}
    for name in ("node", "cluster"):
        mine = [r for r in rounds if r["setting"] == name]
        jobs = [(t, shard) for r in mine for t, shard in zip(r["ttft_ms"], r["shard"], strict=True)]
        out[name] = {
            **percentiles([t for t, _ in jobs], (50, 90)),
            "rounds_p50": [_p50(r["ttft_ms"]) for r in mine],
            "intake_p50_ms": _p50([t for r in mine for t in r["intake_ms"] if t is not None]),
            "by_shard_p50": {str(n): _p50([t for t, s in jobs if s == n]) for n in sorted({s for _, s in jobs})},
        }
    out["added_p50_ms"] = out["cluster"]["p50"] - out["node"]["p50"]
    out["added_p50_ms_by_round"] = [c - n for n, c in zip(out["node"]["rounds_p50"], out["cluster"]["rounds_p50"],
                                                          strict=False)]
    return out


def added_ttft(model: Path, jobs: int, warmup: int, rounds: int, progress: Callable[[str], None]) -> dict:
    """TTFT through a worker on one node vs on a 3-shard cluster (see the module docstring)."""
    scratch = Path(tempfile.mkdtemp(prefix="ferry-redis-cluster-"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    server, port = start_redis(scratch)
    cluster = LocalCluster(primaries=PRIMARIES, replicas=1)
    workers: list[subprocess.Popen] = []
    settings: list[Setting] = []
    try:
        cluster.start()
        progress(f"cluster: added TTFT, starting workers (node on :{port}, cluster of {len(cluster.nodes)} nodes)")
        for name, url, shards, env in (
            ("node", f"redis://127.0.0.1:{port}/0", 1, {}),
            ("cluster", cluster.url, PRIMARIES, {"FERRY_REDIS_CLUSTER": "true", "FERRY_QUEUE_SHARDS": str(PRIMARIES)}),
        ):
            prefix = f"ferrybench-{uuid.uuid4().hex}"
            workers.append(start_worker(model, url, prefix, 4, 1, scratch / f"worker-{name}.log", extra_env=env))
            client = connect(url, cluster=shards > 1, decode_responses=True)
            settings.append(Setting(name, client, Keys(prefix, shards)))
        for setting, worker in zip(settings, workers, strict=True):  # both load the model at once
            _wait_ready(setting.client, setting.keys, f"bench-{setting.keys.prefix[-6:]}", worker,
                        scratch / f"worker-{setting.name}.log")
        results = []
        for r in range(rounds):
            prompts = _prompts(warmup + jobs, PROMPT_TOKENS, vocab, seed=100 + r)  # new to both workers
            pause = random.Random(100 + r)
            gaps_s = [pause.uniform(0, GAP_MS / 1000) for _ in prompts]
            for setting in settings:
                progress(f"cluster: added TTFT, round {r + 1}/{rounds}, {setting.name}, {jobs} jobs")
                results.append(ttft_round(setting, prompts, gaps_s, warmup))
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(60)
        for setting in settings:
            setting.client.close()
        cluster.stop()
        server.terminate()
        server.wait(30)
    shutil.rmtree(scratch, ignore_errors=True)  # the workers' logs: kept when a round failed
    return {"jobs_per_round": jobs, "warmup_jobs": warmup, "gap_ms": [0, GAP_MS], "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": 2, "target_ms": TTFT_TARGET_MS, "cluster_nodes": {"primaries": PRIMARIES, "replicas_each": 1},
            "rounds": results, **ttft_summary(results)}


# --- the suite ---------------------------------------------------------------------------------------


def run(model: Path, *, quick: bool, event_bytes: int, token_requests: int, progress: Callable[[str], None]) -> dict:
    """The payload's `cluster` part: shard scaling, then the added TTFT."""
    scaling = shard_scaling(20_000 if quick else 100_000, token_requests, event_bytes, progress)
    ttft = added_ttft(model, jobs=20 if quick else 60, warmup=3 if quick else 5, rounds=2, progress=progress)
    return {"shard_scaling": scaling, "added_ttft": ttft}


def report_lines(result: dict) -> list[str]:
    """The printout's cluster rows."""
    scaling = result["shard_scaling"]
    lines = [f"cluster: {scaling['primaries']} primaries, no replicas, on {scaling['cpu_count']} cores",
             f"{'workload':<15} {'shards':>6} {'ops/s':>10} {'server CPU s':>12} {'ops/CPU s':>10} "
             f"{'client CPU s':>12}"]
    for name, workload in scaling["workloads"].items():
        for shards, row in workload["runs"].items():
            lines.append(f"{name:<15} {shards:>6} {row['ops_per_s']:>10.0f} {row['server_cpu_s']:>12.2f} "
                         f"{row['ops_per_server_cpu_s']:>10.0f} {row['client_cpu_s']:>12.2f}")
        lines.append(f"  {name}: 3 vs 1 shards {workload['scaling_measured']:.2f}x measured, "
                     f"{workload['scaling_per_core']:.2f}x with a core per primary (target {scaling['target']}x)")
    ttft = result["added_ttft"]
    for name in ("node", "cluster"):
        row = ttft[name]
        lines.append(f"TTFT through a {name:<7}: p50 {row['p50']:.2f} ms, p90 {row['p90']:.2f} ms "
                     f"(rounds' p50 {', '.join(f'{p:.2f}' for p in row['rounds_p50'])}; intake p50 "
                     f"{row['intake_p50_ms']:.2f} ms; by shard p50 "
                     f"{', '.join(f'{s}: {p:.2f}' for s, p in row['by_shard_p50'].items())})")
    lines.append(f"added TTFT through the cluster: p50 {ttft['added_p50_ms']:+.2f} ms (per round "
                 f"{', '.join(f'{d:+.2f}' for d in ttft['added_p50_ms_by_round'])}; target at most "
                 f"+{ttft['target_ms']:.0f} ms)")
    return lines
