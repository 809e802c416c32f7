"""Cold start: from `ferry worker` launched to `/readyz` answering 200, and to the first token of a
job queued before it started, for the same SmolLM2-135M-Instruct weights (the bundled GGUF
converted to safetensors, float32, 538 MB) from:

- `local`: a directory on this machine (weights baked into the image);
- `s3`: `s3://bench/smollm2/` on moto's S3 server on this machine, an empty node cache;
- `hub`: `hf://HuggingFaceTB/SmolLM2-135M-Instruct` on a local server speaking the Hub's API
  (bench/hub_server.py, `HF_ENDPOINT`), an empty node cache;
- `s3-cached`: the same s3:// reference with the node cache already holding it (a second worker
  on the node, or a restart);

each without and with a prefix snapshot. Without: the snapshot URL names an empty folder (nothing
restored), and the drain saves the job's prefix there; with: the next start restores it, and the
queued job (the same long prompt) hits the restored blocks. The worker logs its phases (download,
load, warmup; download and load overlap, see docs/models.md), and the raw ranged-GET throughput
of the S3 server is measured alone, so the S3 load throughput (bytes / download phase) can be set
against it.

    python -m bench.cold_start                  # every source, with and without a snapshot
    python -m bench.cold_start --sources local s3 --runs 2
    python -m bench.cold_start --conversion     # the GGUF conversion cache: first start vs later
    python -m bench.cold_start --weights-dtype bfloat16   # the weights as the Hub publishes them

`--weights-dtype bfloat16` stores the same weights in bfloat16 (269 MB, as the Hub's checkpoint of
SmolLM2-135M-Instruct is) for every source, local included; the engine still computes in float32
(FERRY_DTYPE=float32: the weights are widened as they load). Its results go to `cold_start_bf16-*.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
from tqdm import tqdm

from bench.common import free_port, moto_s3, write_result
from bench.hub_server import HubServer

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("local", "s3", "hub", "s3-cached")
HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUCKET, PREFIX = "bench", "smollm2"
PROMPT = ("Ferry serves language models behind an async job API with streaming and webhooks. " * 60).strip()
LINE_RATE_GBPS = 10  # the node the per-GB projection is for (Gb/s)
PROJECTED_GB = 16.0  # an 8B model in bf16


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.cold_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    p.add_argument("--runs", type=int, default=1, help="starts per source and snapshot setting (the median is kept)")
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the stored weights' dtype (the engine computes in float32 either way)")
    p.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="local and s3 only")
    p.add_argument("--conversion", action="store_true", help="measure the GGUF conversion cache instead")
    p.add_argument("--model", default="smollm2-135m-instruct", help="--conversion: a .gguf file or bundled name")
    args = p.parse_args(argv)
    if args.quick:
        args.sources = ["local", "s3"]
    return args


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start_once(model: str, env_extra: dict[str, str], redis_url: str, timeout_s: float) -> dict:
    """One worker start with one greedy job (PROMPT, 1 token) queued before it: seconds to ready
    and to the job's first token, and the phases the worker logged. The worker is then stopped
    with SIGTERM (a drain: it saves a snapshot when a URL is set)."""
    from ferry.worker.protocol import JobRequest, Keys
    from ferry.worker.protocol.queue import enqueue_job

    port, prefix = free_port(), f"bench-cold-{uuid.uuid4().hex[:8]}"
    client, keys = redis.Redis.from_url(redis_url, decode_responses=True), Keys(prefix)
    job = enqueue_job(client, keys, JobRequest(model="bench", prompt=PROMPT, max_tokens=1, temperature=0.0)).job_id
    env = dict(os.environ, FERRY_MODEL=model, FERRY_MODEL_NAME="bench", FERRY_REDIS_URL=redis_url,
               FERRY_KEY_PREFIX=prefix, FERRY_METRICS_PORT=str(port), FERRY_DRAIN_TIMEOUT_S="5", **env_extra)
    ready_s = first_token_s = None
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "ferry.worker.cli", "worker"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            while first_token_s is None:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the worker exited with {proc.returncode}:\n{log.read()[-3000:]}")
                if time.perf_counter() - started > timeout_s:
                    raise TimeoutError(f"no first token after {timeout_s:.0f} s")
                if ready_s is None and _ready(port):
                    ready_s = time.perf_counter() - started
                if any(f.get("type") == "token" for _, f in client.xrange(keys.events(job))):
                    first_token_s = time.perf_counter() - started
                time.sleep(0.01)
        finally:
            proc.terminate()
            proc.wait(120)
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)
            client.close()
        log.seek(0)
        lines = [json.loads(line) for line in log if line.startswith("{")]
    loaded = next((x for x in lines if x.get("msg") == "engine loaded"), {})
    restored = next((x for x in lines if "restored" in x.get("msg", "")), None)
    return {"ready_s": ready_s, "first_token_s": first_token_s, "engine_load_s": loaded.get("seconds"),
            **{k: loaded.get(k) for k in ("download_s", "load_s", "warmup_s")},
            "snapshot_restored": restored is not None}


def raw_get_throughput(client, files: list[str], parallel: int = 16, range_bytes: int = 16 << 20) -> float:
    """Bytes/s of ranged GETs alone (bodies read and dropped), with the model reader's parallelism."""
    jobs = []
    for key in files:
        size = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        jobs += [(key, start, min(start + range_bytes, size) - 1) for start in range(0, size, range_bytes)]

    def get(job) -> int:
        key, start, end = job
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end}")["Body"]
        return sum(len(chunk) for chunk in body.iter_chunks(1 << 20))

    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        total = sum(pool.map(get, jobs))
    return total / (time.perf_counter() - started)


def _median_run(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("ready_s", "first_token_s", "engine_load_s", "download_s", "load_s", "warmup_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def compare_sources(args: argparse.Namespace) -> dict:
    from ferry.worker.common.objectstore import s3_client
    from ferry.worker.models.bundled import SMOLLM2_SERVED_NAME
    from ferry.worker.models.loader import resolve_model_path

    weights = resolve_model_path(SMOLLM2_SERVED_NAME, REPO / ".ferry" / "models")
    work = Path(tempfile.mkdtemp(prefix="ferry-cold-start-"))
    if args.weights_dtype == "bfloat16":
        weights = bfloat16_copy(weights, work / "weights-bf16")
    files = [p for p in weights.iterdir() if p.name != "source.json"]
    model_bytes = sum(p.stat().st_size for p in files)
    try:
        with moto_s3(BUCKET) as moto:
            s3_env = {**moto.env, "FERRY_DTYPE": "float32"}
            os.environ.update(s3_env)
            client = s3_client(max_connections=16)
            for path in tqdm(files, desc="uploading to S3", unit="file"):
                client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")
            raw = raw_get_throughput(client, [f"{PREFIX}/{p.name}" for p in files])
            with HubServer() as hub:
                hub.add(HUB_REPO, weights)
                starts = _start_each_source(args, weights, s3_env, hub.url, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _report(starts, model_bytes, raw, args.weights_dtype)


def _start_each_source(args: argparse.Namespace, weights: Path, s3_env: dict[str, str], hub_url: str,
                       work: Path) -> list[dict]:
    """The median start of each source in `args.sources`, without and with a snapshot."""
    models = {"local": str(weights), "s3": f"s3://{BUCKET}/{PREFIX}/", "hub": f"hf://{HUB_REPO}",
              "s3-cached": f"s3://{BUCKET}/{PREFIX}/"}
    starts = []
    for source in tqdm(args.sources, desc="sources", unit="source"):
        snapshot = work / f"snapshot-{source}"
        for with_snapshot in (False, True):
            runs = []
            for _ in range(args.runs):
                cache = work / ("cache-warm" if source == "s3-cached" else f"cache-{uuid.uuid4().hex[:8]}")
                if source == "s3-cached" and not cache.exists():
                    start_once(models[source], {**s3_env, "FERRY_MODEL_CACHE": str(cache)}, args.redis_url,
                               args.timeout_s)  # fills the node cache
                if not with_snapshot:
                    shutil.rmtree(snapshot, ignore_errors=True)  # nothing to restore; the drain saves one
                env = {**s3_env, "HF_ENDPOINT": hub_url, "FERRY_MODEL_CACHE": str(cache),
                       "FERRY_SNAPSHOT_URL": snapshot.as_uri()}
                runs.append(start_once(models[source], env, args.redis_url, args.timeout_s))
                if source != "s3-cached":
                    shutil.rmtree(cache, ignore_errors=True)
            starts.append({"source": source, "snapshot": with_snapshot, **_median_run(runs)})
    return starts


def bfloat16_copy(weights: Path, directory: Path) -> Path:
    """`weights` (a float32 checkpoint) with its safetensors stored in bfloat16 and its config saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True)
    for path in weights.iterdir():
        if path.name == "source.json":
            continue
        if path.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()}
            save_file(tensors, directory / path.name, metadata={"format": "pt"})
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = "bfloat16"
            (directory / path.name).write_text(json.dumps(config, indent=2))
        else:
            shutil.copy(path, directory / path.name)
    return directory


def _report(starts: list[dict], model_bytes: int, raw_bytes_per_s: float, weights_dtype: str = "float32") -> dict:
    by = {(s["source"], s["snapshot"]): s for s in starts}
    local = by.get(("local", False))
    s3 = by.get(("s3", False))
    s3_load_bytes_per_s = model_bytes / s3["download_s"] if s3 and s3["download_s"] else None
    report = {
        "model": f"SmolLM2-135M-Instruct ({weights_dtype} safetensors)",
        "model_bytes": model_bytes,
        "starts": starts,
        "s3_raw_get_bytes_per_s": raw_bytes_per_s,
        "s3_load_bytes_per_s": s3_load_bytes_per_s,
        "s3_load_vs_raw_get": s3_load_bytes_per_s / raw_bytes_per_s if s3_load_bytes_per_s else None,
        "s3_ready_vs_local": s3["ready_s"] / local["ready_s"] if s3 and local else None,
        "conditions": {"load_average": os.getloadavg()},
    }
    if local and s3_load_bytes_per_s:
        # An 8B model (bf16) on a node whose network, not the reader, limits the download: the line
        # rate times the reader's measured efficiency (load / raw GET), plus this machine's load
        # phase per GB (reading safetensors into the engine) scaled to the size.
        line = LINE_RATE_GBPS / 8 * 1e9 * min(1.0, report["s3_load_vs_raw_get"])
        load_per_gb = local["load_s"] / (model_bytes / 1e9)
        report["projection_8b_10gbps"] = {
            "gb": PROJECTED_GB, "download_s": PROJECTED_GB * 1e9 / line, "load_s": PROJECTED_GB * load_per_gb,
            "load_s_per_gb_here": load_per_gb, "line_rate_gbps": LINE_RATE_GBPS,
        }
    return report


def conversion(args: argparse.Namespace) -> dict:
    """The GGUF conversion cache: the first start converts, every later one maps the conversion."""
    cache_dir = Path(tempfile.mkdtemp(prefix="ferry-cold-start-"))
    try:
        starts = []
        for i in tqdm(range(max(args.runs, 2)), desc="worker starts", unit="start"):
            result = start_once(args.model, {"FERRY_MODEL_CACHE": str(cache_dir)}, args.redis_url, args.timeout_s)
            starts.append({"start": i + 1, "cache": "empty" if i == 0 else "converted", **result})
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    first, later = starts[0]["ready_s"], statistics.median(s["ready_s"] for s in starts[1:])
    return {"model": args.model, "starts": starts, "first_start_s": first, "later_start_s_p50": later,
            "speedup_from_cache": first / later}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = conversion(args) if args.conversion else compare_sources(args)
    report["settings"] = {"sources": args.sources, "runs": args.runs, "conversion": args.conversion,
                          "weights_dtype": args.weights_dtype}
    bf16 = args.weights_dtype == "bfloat16" and not args.conversion
    path = write_result("cold_start_bf16" if bf16 else "cold_start", report)
    for s in report["starts"]:
        label = s.get("source", s.get("cache"))
        print(f"{label:<10} snapshot={s.get('snapshot', '-')!s:<5} ready {s['ready_s']:.2f} s, first token "
              f"{s['first_token_s']:.2f} s (download {s['download_s']} s, load {s['load_s']} s, "
              f"warmup {s['warmup_s']} s)", file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
