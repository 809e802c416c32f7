"""Two workers with adapters split between them: the LoRA affinity (`worker.serve.lora_affinity`: a
job goes to the worker holding its adapter) against every worker serving what it reads
(`FERRY_LORA_AFFINITY=false`), on the same stream of jobs.

Setup, the same for both modes: moto's S3 server on this machine holds `--adapters` adapters
(default 8: all seven projections, rank 16, random) under s3://bench-lora-fleet/adapter-<k>/; the
SmolLM2-135M shape with `--layers` layers (default 12, random weights, float32,
`bench.model_families.family_model`); Redis at FERRY_REDIS_URL (default the local one) under a
fresh key prefix, deleted at the end. Two `ferry worker` processes (one torch thread each), each with
its own model cache, as two nodes would be (an adapter one of them downloaded is not on the other's
disk), `FERRY_MAX_LORAS=2` and `FERRY_MAX_CPU_LORAS=4`: each holds at most half of the adapters.
Worker A starts with adapters 0..n/2-1 as its `FERRY_LORA_MODULES`, worker B with the rest, so
between them they hold every adapter once.

The stream: `--jobs` jobs (default 64), each on an adapter drawn at random (seeded: the same
sequence in both modes), a `--prompt`-word prompt and `--tokens` new tokens (greedy, EOS ignored),
`--in-flight` jobs outstanding at any time (default 8: a new one is queued as one ends). Per mode:
adapter reads after both workers were ready (the engine's "LoRA adapter ... loaded" log lines: a
download from S3 into the worker's cache, if not already there, plus the read), hand-offs (the
"job handed to the worker holding its LoRA adapter" lines), time to first token (the job record's
`first_token_at - created_at`), where each job ran, and the stream's wall time.

    python -m bench.lora_fleet                 # 12 layers, 8 adapters, 64 jobs, 8 in flight
    python -m bench.lora_fleet --quick         # 2 layers, 4 adapters, 16 jobs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from tqdm import tqdm

from bench.common import moto_s3, percentiles, write_result
from bench.lora import TARGET_SETS, write_adapter
from bench.model_families import family_model
from bench.models import SMOLLM2_135M
from ferry.worker.common.objectstore import s3_client
from ferry.worker.protocol import JobRecord, JobRequest, Keys, enqueue_job

BUCKET = "bench-lora-fleet"
MODEL_NAME = "fleet-base"
MODES = {"affinity": "true", "no-affinity": "false"}
LOADED = ("LoRA adapter ", " loaded from ")  # the engine's "LoRA adapter <name> loaded from <path>: ..." line
HANDED = "job handed to the worker holding its LoRA adapter"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--adapters", type=int, default=8, help="even: half start on each worker")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--quick", action="store_true", help="2 layers, 4 adapters, 16 jobs, 4 in flight")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.adapters, args.jobs, args.in_flight, args.tokens = 2, 4, 16, 4, 8
    if args.adapters < 2 or args.adapters % 2:
        parser.error("--adapters must be even and at least 2")
    return args


class Fleet:
    """Two `ferry worker` processes on one key prefix, each with its half of the adapters."""

    def __init__(self, model: Path, args: argparse.Namespace, work: Path, s3_env: dict, affinity: str) -> None:
        self.prefix = f"ferrybench-fleet-{uuid.uuid4().hex[:8]}"
        self.client = redis.Redis.from_url(args.redis_url, decode_responses=True)
        self.keys = Keys(self.prefix)
        half = args.adapters // 2
        work.mkdir(parents=True, exist_ok=True)
        self.workers: dict[str, tuple[subprocess.Popen, Path]] = {}
        for n, adapters in enumerate((range(half), range(half, args.adapters))):
            worker_id = f"fleet-{'ab'[n]}-{uuid.uuid4().hex[:4]}"
            modules = ",".join(f"adapter-{k}=s3://{BUCKET}/adapter-{k}/" for k in adapters)
            env = {**os.environ, **s3_env, "FERRY_REDIS_URL": args.redis_url, "FERRY_KEY_PREFIX": self.prefix,
                   "FERRY_MODEL": str(model), "FERRY_MODEL_NAME": MODEL_NAME, "FERRY_WORKER_ID": worker_id,
                   "FERRY_MODEL_CACHE": str(work / f"cache-{worker_id}"), "FERRY_LORA_MODULES": modules,
                   "FERRY_MAX_LORAS": "2", "FERRY_MAX_CPU_LORAS": str(half), "FERRY_MAX_LORA_RANK": str(args.rank),
                   "FERRY_LORA_AFFINITY": affinity, "FERRY_MAX_NUM_SEQS": str(args.in_flight),
                   "FERRY_TORCH_THREADS": "1", "FERRY_METRICS_PORT": "0", "FERRY_HEARTBEAT_INTERVAL_S": "0.5"}
            log_path = work / f"{worker_id}.log"
            proc = subprocess.Popen([sys.executable, "-m", "ferry.worker.serve.main"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
            self.workers[worker_id] = (proc, log_path)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        for worker_id, (proc, log_path) in self.workers.items():
            while self.client.hget(self.keys.worker(worker_id), "state") != "ready":
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {worker_id} exited:\n{log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {worker_id} not ready after {timeout_s}s")
                time.sleep(0.2)

    def log_lines(self) -> dict[str, list[dict]]:
        out = {}
        for worker_id, (_, log_path) in self.workers.items():
            lines = []
            for raw in log_path.read_text().splitlines():
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    continue  # a line not from the JSON log (a library's own print)
            out[worker_id] = lines
        return out

    def stop(self) -> None:
        for proc, _ in self.workers.values():
            proc.terminate()
        for proc, _ in self.workers.values():
            proc.wait(60)
        for key in self.client.scan_iter(f"{self.prefix}:*"):
            self.client.delete(key)
        self.client.close()


def _is_read(line: dict) -> bool:
    msg = line.get("msg", "")
    return msg.startswith(LOADED[0]) and LOADED[1] in msg


def _stream(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """(adapter, prompt token ids) per job (the random model has no tokenizer): the same sequence in
    every mode."""
    rng = random.Random(args.seed)
    vocab = SMOLLM2_135M["vocab_size"]
    return [(f"adapter-{rng.randrange(args.adapters)}", [rng.randrange(1, vocab) for _ in range(args.prompt)])
            for _ in range(args.jobs)]


def run_mode(fleet: Fleet, args: argparse.Namespace, jobs: list[tuple[str, list[int]]], bar: tqdm) -> dict:
    """Feed the stream with `--in-flight` jobs outstanding; the mode's figures."""
    fleet.wait_ready()
    loaded_before = {w: sum(map(_is_read, lines)) for w, lines in fleet.log_lines().items()}
    pending: list[str] = []
    done: list[JobRecord] = []
    todo = list(jobs)
    started = time.perf_counter()
    while todo or pending:
        while todo and len(pending) < args.in_flight:
            adapter, prompt = todo.pop(0)
            request = JobRequest(model=MODEL_NAME, prompt=prompt, max_tokens=args.tokens, temperature=0.0,
                                 ignore_eos=True, lora=adapter)
            pending.append(enqueue_job(fleet.client, fleet.keys, request).job_id)
        pipe = fleet.client.pipeline(transaction=False)
        for job_id in pending:
            pipe.hgetall(fleet.keys.job(job_id))
        records = [JobRecord.from_redis(raw) for raw in pipe.execute()]
        ended = [(job_id, r) for job_id, r in zip(pending, records, strict=True) if r is not None and r.terminal]
        for job_id, record in ended:
            pending.remove(job_id)
            done.append(record)
            bar.update()
        if not ended:
            time.sleep(0.01)
    wall_s = time.perf_counter() - started
    failed = [(r.id, r.error_code, r.error_message) for r in done if r.state != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs failed, the first: {failed[:3]}")
    lines = fleet.log_lines()
    reads = {w: sum(map(_is_read, lines[w])) - loaded_before[w] for w in lines}
    handed = {w: sum(line.get("msg", "") == HANDED for line in lines[w]) for w in lines}
    ttft = [r.first_token_at - r.created_at for r in done]
    return {
        "adapter_reads_after_ready": sum(reads.values()),
        "adapter_reads_by_worker": reads,
        "hand_offs": sum(handed.values()),
        "jobs_by_worker": {w: sum(r.worker_id == w for r in done) for w in lines},
        "ttft_s": {**{k: round(v, 4) for k, v in percentiles(ttft).items()}, "max": round(max(ttft), 4),
                   "mean": round(sum(ttft) / len(ttft), 4)},
        "wall_s": round(wall_s, 3),
    }


def _upload(args: argparse.Namespace, work: Path) -> None:
    client = s3_client()
    for k in range(args.adapters):
        local = write_adapter(work / f"adapter-{k}", args.layers, TARGET_SETS["all7"], args.rank, seed=7000 + k)
        for path in local.iterdir():
            client.upload_file(str(path), BUCKET, f"adapter-{k}/{path.name}")


def summary(results: dict) -> str:
    lines = []
    for mode, row in results["modes"].items():
        lines.append(f"{mode:12s} adapter reads after ready {row['adapter_reads_after_ready']:3d}  "
                     f"hand-offs {row['hand_offs']:3d}  TTFT p50 {row['ttft_s']['p50'] * 1e3:6.0f} ms  "
                     f"p90 {row['ttft_s']['p90'] * 1e3:6.0f} ms  max {row['ttft_s']['max'] * 1e3:6.0f} ms  "
                     f"wall {row['wall_s']:.1f} s  jobs by worker {list(row['jobs_by_worker'].values())}")
    ratios = results["affinity_over_no_affinity"]
    lines.append(f"affinity / no affinity: TTFT p50 {ratios['ttft_p50']}x, p90 {ratios['ttft_p90']}x, "
                 f"wall {ratios['wall']}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    model = family_model("llama", args.layers)
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-lora-fleet-"))
    load_before = os.getloadavg()  # this machine is shared: say how busy it was
    jobs = _stream(args)
    modes: dict[str, dict] = {}
    try:
        with moto_s3(BUCKET) as moto:
            _upload(args, work)
            with tqdm(total=len(MODES) * args.jobs, desc="lora fleet", unit="job") as bar:
                for mode, affinity in MODES.items():
                    bar.set_postfix_str(mode)
                    fleet = Fleet(model, args, work / mode, moto.env, affinity)
                    try:
                        modes[mode] = run_mode(fleet, args, jobs, bar)
                    finally:
                        fleet.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on, off = modes["affinity"], modes["no-affinity"]
    results = {"modes": modes, "affinity_over_no_affinity": {
        "ttft_p50": round(on["ttft_s"]["p50"] / off["ttft_s"]["p50"], 3),
        "ttft_p90": round(on["ttft_s"]["p90"] / off["ttft_s"]["p90"], 3),
        "wall": round(on["wall_s"] / off["wall_s"], 3)}}
    payload = {
        "settings": {"model": model.name, "layers": args.layers, "adapters": args.adapters, "rank": args.rank,
                     "targets": list(TARGET_SETS["all7"]), "jobs": args.jobs, "in_flight": args.in_flight,
                     "prompt_tokens": args.prompt, "tokens": args.tokens, "seed": args.seed, "max_loras": 2,
                     "max_cpu_loras": args.adapters // 2, "workers": 2, "torch_threads_per_worker": 1,
                     "quick": args.quick},
        "results": results,
        "load_average_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
    }
    path = write_result("lora_fleet", payload, args.results_dir)
    print(summary(results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
