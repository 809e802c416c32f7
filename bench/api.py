"""What the HTTP API adds: N concurrent streaming clients through `ferry api` vs the worker's own figures.

Workload: N clients (default 256) open one OpenAI-compatible streamed completion each
(`POST /v1/completions`, `stream: true`) at the same moment, through one `ferry api` process
(uvicorn), served by one `ferry worker` subprocess with room for all N at once
(`max_num_seqs = N`); prompts of about P words of seeded random text, exactly M output tokens
each (greedy, EOS ignored). Model: the small demo model by default (a step takes milliseconds,
so the API's share shows most), or `--model DIR`.

Figures:
- client (this process, a minimal asyncio HTTP/1.1 client): TTFT = request sent -> first text chunk; ITL = gaps between
  consecutive text chunks, pooled over all streams; TPOT = per stream (last - first chunk) /
  (tokens - 1). p50 and p99.
- worker (each job's `timings`, measured by the worker from the moment the API accepted the
  job): TTFT, TBT (per-job mean) and queue time, p50 and p99; `api_overhead_ms` is client
  minus worker at p50/p99, `*_ratio` is worker over client (1.0: the API adds nothing).
- API process (/proc): RSS idle (after warm-up) and its high-water mark during the run, RSS per
  open stream = (high-water - idle) / the most streams open at once; CPU seconds (user + system) over the
  run, per stream and per output token.

    python -m bench.api [--clients 256] [--max-tokens 64] [--prompt-words 32] [--model DIR] [--quick]

Writes bench/results/api-<time>.json (and api-latest.json) and prints a summary. Needs Redis
(FERRY_REDIS_URL, default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.common import percentiles, write_result

REPO = Path(__file__).resolve().parents[1]
WORDS = ("ferry serves language models behind an async job API with streaming webhooks worker queue "
         "engine batch token cache prefix snapshot cold start warm redis stream event client").split()
MODEL_NAME = "bench"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.api", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--clients", type=int, default=None, help="concurrent streams (default 256; quick: 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per stream (default 64; quick: 16)")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--model", default=None, help="model directory (default: the small demo model)")
    p.add_argument("--quick", action="store_true", help="64 streams of 16 tokens")
    p.add_argument("--threads", type=int, default=None, help="the worker's torch threads (default: torch's choice)")
    p.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = p.parse_args(argv)
    args.clients = args.clients or (64 if args.quick else 256)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    return args


# --- the stack under test -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_model() -> Path:
    from ferry.worker.tools.demo_model import make_demo_model

    directory = REPO / ".ferry" / "bench-models" / "demo"
    return directory if (directory / "config.json").is_file() else make_demo_model(directory)


@dataclass
class Stack:
    url: str
    api: subprocess.Popen
    worker: subprocess.Popen
    prefix: str
    logs: Path

    def stop(self, redis_url: str) -> None:
        for proc in (self.api, self.worker):
            proc.terminate()
        for proc in (self.api, self.worker):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{self.prefix}:*", count=1000):
            client.delete(key)
        client.close()


def start_stack(model: Path, args: argparse.Namespace) -> Stack:
    prefix = f"ferrybench-{uuid.uuid4().hex}"
    port = _free_port()
    logs = Path(tempfile.mkdtemp(prefix="ferry-bench-api-"))
    env = {
        **os.environ,
        "FERRY_REDIS_URL": args.redis_url, "FERRY_KEY_PREFIX": prefix, "FERRY_MODEL": str(model),
        "FERRY_MODEL_NAME": MODEL_NAME, "FERRY_METRICS_PORT": "0", "FERRY_METRICS_HOST": "127.0.0.1",
        "FERRY_MAX_NUM_SEQS": str(args.clients), "FERRY_MAX_NUM_BATCHED_TOKENS": "4096",
        "FERRY_KV_CACHE_BYTES": str(512 << 20), "FERRY_DRAIN_TIMEOUT_S": "0", "FERRY_LOG_LEVEL": "WARNING",
        "FERRY_HEARTBEAT_INTERVAL_S": "0.5",
    }
    if args.threads:
        env["FERRY_TORCH_THREADS"] = str(args.threads)

    def start(name: str, *cmd: str) -> subprocess.Popen:
        log = (logs / f"{name}.log").open("w")
        return subprocess.Popen([sys.executable, "-m", "ferry.worker.cli", *cmd], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    stack = Stack(f"http://127.0.0.1:{port}", start("api", "api", "--host", "127.0.0.1", "--port", str(port)),
                  start("worker", "worker"), prefix, logs)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for proc, name in ((stack.api, "api"), (stack.worker, "worker")):
            if proc.poll() is not None:
                stack.stop(args.redis_url)
                raise RuntimeError(f"{name} exited: {(logs / f'{name}.log').read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(stack.url + "/readyz", timeout=2).status_code == 200:
                return stack
        time.sleep(0.25)
    stack.stop(args.redis_url)
    raise RuntimeError("the stack was not ready after 600 s")


# --- the API process from /proc ------------------------------------------------------------------


def proc_sample(pid: int) -> tuple[float, float]:
    """(RSS MiB, CPU seconds user + system) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15 of stat)
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    return rss_kb / 1024, cpu


# --- the clients ---------------------------------------------------------------------------------


@dataclass
class Stream:
    job_id: str = ""
    sent: float = 0.0
    sent_wall: float = 0.0  # time.time() when sent, to line up with the job's wall-clock timestamps
    first_chunk_wall: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    tokens: int = 0  # usage.completion_tokens


async def sse_data(host: str, port: int, path: str, body: dict) -> AsyncIterator[str]:
    """POST `body` and yield each SSE `data:` payload: a minimal HTTP/1.1 client (chunked bodies),
    so the clients' own CPU use, on the same cores as the API, stays small next to the API's."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status.decode().strip()}: {(await reader.read(2000)).decode()}")
        while (await reader.readline()).strip():
            pass  # headers: uvicorn streams with chunked transfer encoding
        pending = b""
        while size := int((await reader.readline()).strip(), 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:].decode()
    finally:
        writer.close()


async def one_stream(host: str, port: int, prompt: str, max_tokens: int, start: asyncio.Event,
                     open_streams: list[int]) -> Stream:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Stream()
    await start.wait()
    result.sent, result.sent_wall = time.perf_counter(), time.time()
    open_streams[0] += 1
    try:
        async for data in sse_data(host, port, "/v1/completions", body):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            result.job_id = chunk["id"].removeprefix("cmpl-")
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                result.chunk_times.append(time.perf_counter())
                result.first_chunk_wall = result.first_chunk_wall or time.time()
    finally:
        open_streams[0] -= 1
    return result


async def run_clients(url: str, api_pid: int, prompts: list[str], max_tokens: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    await one_stream(host, int(port), prompts[0], 4, _set(asyncio.Event()), [0])  # warm-up
    idle_rss, cpu_before = proc_sample(api_pid)
    start, open_streams = asyncio.Event(), [0]
    tasks = [asyncio.create_task(one_stream(host, int(port), p, max_tokens, start, open_streams)) for p in prompts]
    peak = {"rss_mb": idle_rss, "open": 0}  # high-water marks: RSS, and streams open at once

    async def sample() -> None:
        while True:
            peak["rss_mb"] = max(peak["rss_mb"], proc_sample(api_pid)[0])
            peak["open"] = max(peak["open"], open_streams[0])
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    began = time.perf_counter()
    start.set()
    streams = await asyncio.gather(*tasks)
    wall = time.perf_counter() - began
    sampler.cancel()
    _, cpu_after = proc_sample(api_pid)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        jobs = [(await client.get(f"/v1/jobs/{s.job_id}")).json() for s in streams]
    return {"streams": streams, "jobs": jobs, "wall_s": wall, "idle_rss_mb": idle_rss, "peak": peak,
            "api_cpu_s": cpu_after - cpu_before}


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


def _ms(values: list[float]) -> dict:
    return {k: (None if v is None else round(v * 1000, 2)) for k, v in percentiles(values, (50, 99)).items()}


def summarize(run: dict, args: argparse.Namespace) -> dict:
    streams, jobs = run["streams"], run["jobs"]
    tokens = sum(s.tokens for s in streams)
    client_ttft = [s.chunk_times[0] - s.sent for s in streams if s.chunk_times]
    itl = [b - a for s in streams for a, b in zip(s.chunk_times, s.chunk_times[1:], strict=False)]
    tpot = [(s.chunk_times[-1] - s.chunk_times[0]) / (s.tokens - 1) for s in streams if s.tokens > 1 and s.chunk_times]
    timings = [j["timings"] for j in jobs if j.get("timings")]
    worker_ttft = [t["ttft_s"] for t in timings if t["ttft_s"] is not None]
    worker_tbt = [t["tbt_s"] for t in timings if t["tbt_s"] is not None]
    client = {"ttft_ms": _ms(client_ttft), "itl_ms": _ms(itl), "tpot_ms": _ms(tpot)}
    worker = {"ttft_ms": _ms(worker_ttft), "tbt_ms": _ms(worker_tbt),
              "queue_ms": _ms([t["queue_s"] for t in timings if t["queue_s"] is not None])}
    # Where a client's TTFT goes: sent -> accepted by the API (intake), accepted -> first token
    # written by the worker, written -> first text chunk at the client (delivery).
    pairs = [(s, j) for s, j in zip(streams, jobs, strict=True) if s.first_chunk_wall and j.get("timings")]
    intake = [j["created_at"] - s.sent_wall for s, j in pairs]
    delivery = [s.first_chunk_wall - (j["created_at"] + j["timings"]["ttft_s"]) for s, j in pairs]
    peak = run["peak"]
    return {
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "completed_streams": sum(1 for s in streams if s.tokens == args.max_tokens),
        "output_tokens": tokens,
        "wall_s": round(run["wall_s"], 3),
        "tokens_per_s": round(tokens / run["wall_s"], 1),
        "client": client,
        "worker": worker,
        "api_overhead_ms": {
            "ttft": {p: _sub(client["ttft_ms"][p], worker["ttft_ms"][p]) for p in ("p50", "p99")},
            "tbt": {p: _sub(client["tpot_ms"][p], worker["tbt_ms"][p]) for p in ("p50", "p99")},
        },
        "ttft_breakdown_ms": {"intake": _ms(intake), "worker": worker["ttft_ms"], "delivery": _ms(delivery)},
        "ttft_p50_ratio": _div(worker["ttft_ms"]["p50"], client["ttft_ms"]["p50"]),
        "tbt_p50_ratio": _div(worker["tbt_ms"]["p50"], client["tpot_ms"]["p50"]),
        "api_process": {
            "idle_rss_mb": round(run["idle_rss_mb"], 1),
            "peak_rss_mb": round(peak["rss_mb"], 1),
            "max_open_streams": peak["open"],
            "rss_kb_per_open_stream": round((peak["rss_mb"] - run["idle_rss_mb"]) * 1024 / peak["open"], 1)
            if peak["open"] else None,
            "cpu_s": round(run["api_cpu_s"], 3),
            "cpu_ms_per_stream": round(run["api_cpu_s"] * 1000 / len(streams), 2),
            "cpu_us_per_token": round(run["api_cpu_s"] * 1e6 / tokens, 1) if tokens else None,
            "cpu_utilisation": round(run["api_cpu_s"] / run["wall_s"], 3),
        },
    }


def _sub(a, b):
    return None if a is None or b is None else round(a - b, 2)


def _div(a, b):
    return None if a is None or not b else round(a / b, 3)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    model = Path(args.model) if args.model else _default_model()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(args.clients)]
    stack = start_stack(model, args)
    try:
        gc.collect()
        gc.freeze()  # the client's own collector pauses are not the API's latency
        run = asyncio.run(run_clients(stack.url, stack.api.pid, prompts, args.max_tokens))
    finally:
        stack.stop(args.redis_url)
    result = {"model": str(model), **summarize(run, args)}
    path = write_result("api", result)
    c, w, a = result["client"], result["worker"], result["api_process"]
    print(
        f"{args.clients} streams x {args.max_tokens} tokens in {result['wall_s']} s ({result['tokens_per_s']} tok/s)\n"
        f"TTFT ms client p50 {c['ttft_ms']['p50']} p99 {c['ttft_ms']['p99']} | worker p50 {w['ttft_ms']['p50']} "
        f"p99 {w['ttft_ms']['p99']} (client p50 = intake {result['ttft_breakdown_ms']['intake']['p50']} + worker + "
        f"delivery {result['ttft_breakdown_ms']['delivery']['p50']})\n"
        f"TBT ms client TPOT p50 {c['tpot_ms']['p50']} p99 {c['tpot_ms']['p99']} (ITL p50 {c['itl_ms']['p50']} "
        f"p99 {c['itl_ms']['p99']}) | worker p50 {w['tbt_ms']['p50']} p99 {w['tbt_ms']['p99']}\n"
        f"API RSS idle {a['idle_rss_mb']} MiB, peak {a['peak_rss_mb']} MiB with up to {a['max_open_streams']} open "
        f"({a['rss_kb_per_open_stream']} KiB/stream); CPU {a['cpu_s']} s = {a['cpu_ms_per_stream']} ms/stream, "
        f"{a['cpu_us_per_token']} us/token -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
