"""What tracing costs: `bench.api`'s workload on a stack with OpenTelemetry on (every job sampled,
exported over OTLP/HTTP to a local receiver) against the same stack with it off.

Two stacks (`ferry api` + `ferry worker` each, `bench.api.start_stack`) run side by side, one
started with `OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_TRACES_SAMPLER=always_on`, one without; the
receiver is a process of its own that decodes every export (`ExportTraceServiceRequest`), as a
collector would, on the same cores. Rounds alternate between the stacks (pair i: off then on, or
on then off, alternating), each with prompts of its own (the same for both stacks of a pair), so
background load and the prefix cache hit both alike.

Reported per pair: output tokens/s on / off and client TTFT p50 on - off; the medians over pairs
are the figures (targets: throughput at least 0.97x, TTFT p50 at most 1 ms more). A burst's TTFT
(hundreds of ms, all prefill) and its wall time drift by more than that between rounds on a shared
machine, so two steadier figures go with them: the CPU seconds the worker and the API spend per
output token, on / off over all rounds (what throughput goes by on a CPU-bound machine), and the
TTFT of lone jobs (`--single` of them per stack, 2 tokens each, sent one at a time, alternating
between the stacks job by job): median on - median off, and the median of the adjacent pairs'
differences. Also the spans
the receiver got per job, and the CPU time the tracing code itself takes per job, measured in this
process on the same code paths: the API's request and enqueue spans (on the request's way), and
the worker's spans, which its tracing thread makes (no thread a job waits on does).

    python -m bench.tracing [--pairs 4] [bench.api's options: --clients 256 --max-tokens 64 --model DIR --quick]

Writes bench/results/tracing-<time>.json (and tracing-latest.json) and prints a summary. Needs Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import random
import socket
import statistics
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.api import WORDS, _default_model, _set, one_stream, proc_sample, run_clients, start_stack, summarize
from bench.api import _parse as parse_api_args
from bench.common import write_result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """`--pairs`, and every option of `bench.api` (`--clients`, `--max-tokens`, `--model`, `--quick`, ...)."""
    p = argparse.ArgumentParser(prog="bench.tracing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4, help="rounds per stack (default 4; quick: 2); "
                   "the other options are bench.api's")
    p.add_argument("--single", type=int, default=100, help="lone jobs per stack (default 100; quick: 20)")
    ours, rest = p.parse_known_args(argv)
    args = parse_api_args(rest)
    args.pairs = 2 if args.quick else ours.pairs
    args.single = 20 if args.quick else ours.single
    return args


# --- the receiver: a process of its own, decoding every export as a collector would ----------------


def _receive(port: int, counts) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["content-length"])))
            with counts.get_lock():
                counts.value += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the tracing code's own CPU time per job ------------------------------------------------------


def span_costs(endpoint: str, jobs: int = 2000) -> dict:
    """Microseconds of CPU per job of each process's tracing code, exporting to `endpoint`."""
    from ferry.api.tracing import end_request_span, enqueue_span, in_span, start_request_span
    from ferry.worker.common.tracing import tracing_from_env
    from ferry.worker.serve.job_trace import AttemptStart, AttemptTrace, JobTracer, _Ended

    tracing = tracing_from_env("bench", {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": "always_on"})
    tracer = JobTracer(tracing, "bench", "bench-worker")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "scheme": "http", "http_version": "1.1",
             "client": ("127.0.0.1", 5000), "headers": [(b"content-type", b"application/json")]}

    def api() -> str:
        span = start_request_span(tracing, scope)
        with in_span(span), enqueue_span(tracing, "bench", "0" * 32) as traceparent:
            pass
        end_request_span(span, scope, 200)
        return traceparent

    parents = [api() for _ in range(50)]
    now = time.time()
    timed = {}
    began = time.thread_time()
    parents = [api() for _ in range(jobs)]
    timed["api_request_and_enqueue_us"] = (time.thread_time() - began) / jobs * 1e6
    tracer.close()  # its thread's work is timed here, on this thread
    starts = [AttemptStart(f"job-{i}", p, 1, "text_completion", now - 1, now - 0.5, now - 0.5, now - 0.4, 0)
              for i, p in enumerate(parents)]
    began = time.thread_time()
    for start in starts:
        tracer._started(start)
    timed["worker_tracer_thread_start_us"] = (time.thread_time() - began) / jobs * 1e6
    ends = [_Ended(AttemptTrace(f"job-{i}", now - 0.4, now - 0.39, now - 0.38, now - 0.3, now, "succeeded", 32, 0, 64,
                                64, "length"), now, now + 0.001) for i in range(jobs)]
    began = time.thread_time()
    for end in ends:
        tracer._ended(end)
    timed["worker_tracer_thread_end_us"] = (time.thread_time() - began) / jobs * 1e6
    tracing.shutdown()
    return {k: round(v, 1) for k, v in timed.items()}


# --- the paired runs ------------------------------------------------------------------------------


def _stack(model: Path, args: argparse.Namespace, otel: dict[str, str]):
    """`bench.api.start_stack` with `otel` in the processes' environment."""
    saved = {k: os.environ.get(k) for k in otel}
    os.environ.update(otel)
    try:
        return start_stack(model, args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


async def lone_jobs(stacks: dict, prompts: list[str]) -> dict[str, list[float]]:
    """Client TTFT (s) of one 2-token job at a time, alternating between the stacks job by job."""
    ttft: dict[str, list[float]] = {mode: [] for mode in stacks}
    for i, prompt in enumerate(prompts):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            host, port = stacks[mode].url.removeprefix("http://").split(":")
            stream = await one_stream(host, int(port), prompt, 2, _set(asyncio.Event()), [0])
            ttft[mode].append(stream.chunk_times[0] - stream.sent)
    return ttft


def _cpu_per_token(summary: dict) -> float:
    """CPU seconds of the worker and the API per output token, in one round."""
    return (summary["worker_cpu_s"] + summary["api_process"]["cpu_s"]) / summary["output_tokens"]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    model = Path(args.model) if args.model else _default_model()
    port = _free_port()
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this one's threads
    counts = spawn.Value("q", 0)
    receiver = spawn.Process(target=_receive, args=(port, counts), daemon=True)
    receiver.start()
    endpoint = f"http://127.0.0.1:{port}"
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
    stacks = {"off": _stack(model, args, {}), "on": _stack(model, args, otel)}
    rng = random.Random(0)
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        gc.collect()
        gc.freeze()
        for i in range(args.pairs):
            prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(args.clients)]
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                stack = stacks[mode]
                worker_cpu = proc_sample(stack.worker.pid)[1]
                run = asyncio.run(run_clients(stack.url, stack.api.pid, prompts, args.max_tokens))
                summary = summarize(run, args)
                summary["worker_cpu_s"] = round(proc_sample(stack.worker.pid)[1] - worker_cpu, 3)
                rounds[mode].append(summary)
        lone = asyncio.run(lone_jobs(stacks, [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                                              for _ in range(args.single)]))
    finally:
        for stack in stacks.values():
            stack.stop(args.redis_url)
    spans = counts.value
    costs = span_costs(endpoint)
    receiver.terminate()
    pairs = [{"tokens_per_s_ratio": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
              "cpu_per_token_ratio": round(_cpu_per_token(on) / _cpu_per_token(off), 3),
              "client_ttft_p50_added_ms": round(on["client"]["ttft_ms"]["p50"] - off["client"]["ttft_ms"]["p50"], 2),
              "worker_ttft_p50_added_ms": round(on["worker"]["ttft_ms"]["p50"] - off["worker"]["ttft_ms"]["p50"], 2)}
             for off, on in zip(rounds["off"], rounds["on"], strict=True)]
    result = {
        "model": str(model), "clients": args.clients, "max_tokens": args.max_tokens, "pairs": args.pairs,
        "tokens_per_s_ratio_median": statistics.median(p["tokens_per_s_ratio"] for p in pairs),
        # Less noisy on a shared machine: CPU seconds (worker + API) per output token, on / off, over all
        # rounds. On a CPU-bound machine throughput goes as its inverse.
        "cpu_per_token_ratio": round(sum(map(_cpu_per_token, rounds["on"])) / sum(map(_cpu_per_token, rounds["off"])),
                                     3),
        "cpu_us_per_token": {mode: round(statistics.mean(map(_cpu_per_token, rs)) * 1e6, 1)
                             for mode, rs in rounds.items()},
        "client_ttft_p50_added_ms_median": statistics.median(p["client_ttft_p50_added_ms"] for p in pairs),
        "worker_ttft_p50_added_ms_median": statistics.median(p["worker_ttft_p50_added_ms"] for p in pairs),
        "per_pair": pairs,
        "lone_jobs": {
            "n": args.single,
            "ttft_p50_ms": {mode: round(statistics.median(v) * 1000, 2) for mode, v in lone.items()},
            "ttft_p50_added_ms": round((statistics.median(lone["on"]) - statistics.median(lone["off"])) * 1000, 3),
            "ttft_paired_added_ms_median": round(statistics.median(
                on - off for on, off in zip(lone["on"], lone["off"], strict=True)) * 1000, 3),
        },
        "spans_received": spans,
        # Each round: its streams and a warm-up one, each also read back once (GET /v1/jobs: a span); and the lone jobs.
        "spans_per_job": round(spans / (args.pairs * (args.clients + 1) + args.single), 2),
        "tracing_cpu_us_per_job": costs,
        "rounds": rounds,
    }
    path = write_result("tracing", result)
    print(f"{args.pairs} pairs of {args.clients} streams x {args.max_tokens} tokens: CPU (worker + API) per token "
          f"on/off {result['cpu_per_token_ratio']} ({result['cpu_us_per_token']} us); tokens/s on/off median "
          f"{result['tokens_per_s_ratio_median']} (pairs {[p['tokens_per_s_ratio'] for p in pairs]}); client TTFT "
          f"p50 added median {result['client_ttft_p50_added_ms_median']} ms "
          f"(pairs {[p['client_ttft_p50_added_ms'] for p in pairs]}); lone jobs {result['lone_jobs']}; "
          f"{result['spans_per_job']} spans/job; "
          f"tracing CPU per job {costs} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
