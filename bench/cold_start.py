"""Cold start: from `ferry worker` launched to `/readyz` answering 200, on a GGUF model.

Runs the worker process `--runs` times against one empty model cache: the first start converts
the GGUF (dequantizes every tensor, writes safetensors + config + tokenizer), every later start
finds the conversion and maps its safetensors. Reported per start: seconds to ready, and the
split the worker logs itself ("engine loaded" seconds). The ratio first / later is what the
cache saves each cold worker; the Docker image converts at build time, so in production every
start is a later one.

    python -m bench.cold_start                          # the bundled SmolLM2, 3 starts
    python -m bench.cold_start --model path/to.gguf --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from tqdm import tqdm

from bench.common import write_result

REPO = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.cold_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a .gguf file or bundled model name")
    p.add_argument("--runs", type=int, default=3, help="worker starts (the first converts)")
    p.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="two starts")
    args = p.parse_args(argv)
    if args.quick:
        args.runs = 2
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start_once(model: str, cache_dir: Path, redis_url: str, timeout_s: float) -> dict:
    """One worker start: seconds to ready, and what the worker logged about loading."""
    port = _free_port()
    env = dict(os.environ, FERRY_MODEL=model, FERRY_MODEL_CACHE_DIR=str(cache_dir), FERRY_REDIS_URL=redis_url,
               FERRY_KEY_PREFIX=f"bench-cold-{uuid.uuid4().hex[:8]}", FERRY_METRICS_PORT=str(port),
               FERRY_DRAIN_TIMEOUT_S="0")
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "ferry.worker.cli", "worker"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            while not _ready(port):
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the worker exited with {proc.returncode}:\n{log.read()[-3000:]}")
                if time.perf_counter() - started > timeout_s:
                    raise TimeoutError(f"the worker was not ready after {timeout_s:.0f} s")
                time.sleep(0.05)
            ready_s = time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait(60)
        log.seek(0)
        loaded = [json.loads(line) for line in log if '"engine loaded"' in line]
    return {"ready_s": ready_s, "engine_load_s": loaded[0]["seconds"] if loaded else None}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cache_dir = Path(tempfile.mkdtemp(prefix="ferry-cold-start-"))
    try:
        starts = []
        for i in tqdm(range(args.runs), desc="worker starts", unit="start"):
            result = start_once(args.model, cache_dir, args.redis_url, args.timeout_s)
            starts.append({"start": i + 1, "cache": "empty" if i == 0 else "converted", **result})
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    first = starts[0]["ready_s"]
    later = statistics.median(s["ready_s"] for s in starts[1:]) if len(starts) > 1 else None
    report = {
        "model": args.model,
        "settings": {"runs": args.runs, "quick": args.quick},
        "conditions": {"load_average": os.getloadavg()},
        "starts": starts,
        "first_start_s": first,
        "later_start_s_p50": later,
        "speedup_from_cache": first / later if later else None,
    }
    path = write_result("cold_start", report)
    for s in starts:
        print(f"start {s['start']} ({s['cache']} cache): ready in {s['ready_s']:.1f} s, "
              f"engine loaded in {s['engine_load_s']} s", file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
