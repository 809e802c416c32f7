"""Structured outputs: does a hostile schema stall the other tenants? (issue 35, fault 4)

A worker's engine loop on SmolLM2-135M-Instruct (the bundled GGUF; --model for another) serves a
neighbour: one plain chat request at a time, one token each (its TTFT). Measured first with
nothing else on the worker (idle), then while --hostile structured-output jobs arrive, each with
a spec of its own that is expensive to compile (100,000-value enums, thousands of optional
properties, patterns and grammars with huge or nested repetitions, 256 long choices), until every
hostile job has ended (or --hostile-s has passed), then idle again. Each hostile job goes the way
a real one does: an API process validates it first (the wire's check; what it refuses is answered
422 and never reaches a worker; the API is another service, so this happens before the
measurement), then the worker's intake thread parses what was queued and the engine loop makes
its `SamplingParams` and adds it; so whatever the worker spends on it, the GIL included, is in the
neighbour's numbers.

  idle / hostile   the neighbour's TTFT p50 / p90 / p99 in ms; idle is --idle-s of probes before
                   the hostile jobs arrive (as long as a hostile phase, so that another tenant's
                   burst on a shared machine is as likely to land in either), idle_after as many
                   after they all ended (a check on drift; on a baseline whose compiles outlive
                   --hostile-s, not idle)
  ratio_p90        hostile p90 / idle p90 (the target: <= 2); ratio_p50 likewise
  outcomes         per hostile job: refused by the API (`schema_too_complex`, ...),
                   failed in the engine (its compile over the budget: SchemaTooComplexError),
                   finished, or still compiling when --hostile-s ended the phase
  hostile_s        how long the hostile phase lasted

    python -m bench.structured_isolation [--model PATH] [--idle-s 30] [--hostile 37] [--hostile-s 120]

Writes bench/results/structured_isolation-<time>.json (and -latest.json) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed

from bench.common import percentiles, write_result

NEIGHBOUR = [{"role": "user", "content": "Say hello."}]
HOSTILE_PROMPT = "Answer:"


def hostile_specs(count: int) -> list[dict]:
    """`count` structured_outputs specs, each distinct (no two share a compile), round robin over
    the families."""
    families = [
        lambda i: {"json": {"enum": [f"v{i}_{n:06d}" for n in range(100_000)]}},
        lambda i: {"json": {"enum": [f"w{i}_{n:05d}" for n in range(30_000)]}},
        lambda i: {"json": {"type": "object", "properties": {f"p{i}_{n}": {"type": "integer"} for n in range(2000)}}},
        lambda i: {"json": {"type": "string", "pattern": f"^[a-{chr(ord('c') + i % 20)}]{{50000}}$"}},
        lambda i: {"json": {"type": "string",
                            "pattern": f"^(([a-{chr(ord('c') + i % 20)}]{{1,10}}){{1,10}}){{1,10}}$"}},
        lambda i: {"choice": [f"choice {i} number {n} " * 16 for n in range(256)]},
        lambda i: {"regex": f"[a-{chr(ord('c') + i % 20)}0-9]{{1,20000}}"},
        lambda i: {"grammar": f"root ::= [a-{chr(ord('c') + i % 20)}]{{0, 100000}}"},
        lambda i: {"json": {"type": "object", "properties": {f"q{i}_{n}": {"type": "string", "maxLength": 10}
                                                             for n in range(256)}}},
    ]
    return [families[i % len(families)](i) for i in range(count)]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.structured_isolation", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--idle-s", type=float, default=30.0, help="how long each idle phase probes")
    p.add_argument("--hostile", type=int, default=37, help="hostile structured-output jobs")
    p.add_argument("--hostile-s", type=float, default=120.0, help="the longest the hostile phase lasts")
    return p.parse_args(argv)


def api_check(body: str) -> str | None:
    """In the API's process: None if the job would be queued, else the 422's error type."""
    from pydantic import ValidationError

    from ferry.worker.protocol import JobRequest

    try:
        JobRequest.model_validate_json(body)
    except ValidationError as exc:
        return exc.errors()[0]["type"]
    return None


class Loop:
    """The engine loop of a worker, reduced to what matters here: it steps the engine, admits
    hostile jobs handed over by the intake thread, and times the neighbour's first token."""

    def __init__(self, engine) -> None:
        from ferry.worker.engine import SamplingParams

        self.engine = engine
        self.SamplingParams = SamplingParams
        self.prompt = engine.apply_chat_template(NEIGHBOUR)
        self.neighbour = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.inbox: queue.Queue = queue.Queue()  # JobRequests parsed by the intake thread
        self.outcomes: dict[str, str] = {}  # hostile job id -> what became of it
        self._next = 0

    def probe(self) -> float:
        """One neighbour request: seconds from its arrival to its first token."""
        self._next += 1
        request_id = f"probe-{self._next}"
        start = time.perf_counter()
        self.engine.add_request(request_id, self.prompt, self.neighbour)
        while True:
            self._admit()
            for out in self.engine.step():
                if out.request_id == request_id and out.new_token_ids:
                    return time.perf_counter() - start
                self._note(out)

    def settle(self, seconds: float) -> None:
        """Step (and admit) for a while between two probes, as a worker's loop would."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self._admit()
            for out in self.engine.step():
                self._note(out)

    def _admit(self) -> None:
        while True:
            try:
                job_id, request = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                params = self.SamplingParams(**request.sampling_kwargs())
                self.engine.add_request(job_id, HOSTILE_PROMPT, params)
                self.outcomes[job_id] = "compiling"
            except ValueError as exc:
                self.outcomes[job_id] = f"refused by the engine: {type(exc).__name__}"

    def _note(self, out) -> None:
        if out.request_id in self.outcomes and out.finished:
            failed = out.error is not None
            self.outcomes[out.request_id] = f"failed: {type(out.error).__name__}" if failed else "finished"


def api(specs: list[dict]) -> tuple[dict[str, str], dict[str, str]]:
    """The API's answer to each hostile job, in a process of its own: (queued job id -> body,
    refused job id -> the 422's error type)."""
    bodies = {f"hostile-{i}": json.dumps({"model": "bench", "prompt": HOSTILE_PROMPT, "max_tokens": 1,
                                          "structured_outputs": spec}) for i, spec in enumerate(specs)}
    queued, refused = {}, {}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        checks = {pool.submit(api_check, body): job_id for job_id, body in bodies.items()}
        for done in as_completed(checks):
            job_id = checks[done]
            if done.result() is None:
                queued[job_id] = bodies[job_id]
            else:
                refused[job_id] = done.result()
    return queued, refused


def intake(loop: Loop, queued: dict[str, str]) -> None:
    """The worker's intake: parse each queued job and hand it to the engine loop."""
    from ferry.worker.protocol import JobRequest

    for job_id, body in queued.items():
        loop.inbox.put((job_id, JobRequest.model_validate_json(body)))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from ferry.worker.engine import Engine, SamplingParams, StructuredOutputs
    from ferry.worker.models.bundled import smollm2_gguf_path

    specs = hostile_specs(args.hostile)
    start = time.perf_counter()
    queued, refused = api(specs)
    api_s = time.perf_counter() - start
    engine = Engine(str(args.model or smollm2_gguf_path()), max_num_seqs=64)
    loop = Loop(engine)
    # Warm: the first grammar ever scans the vocabulary; the first step builds the model's caches.
    warm = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    engine.add_request("warm", HOSTILE_PROMPT, warm)
    while engine.has_unfinished_requests():
        engine.step()
    for _ in range(5):
        loop.probe()

    def probe_once(into: list[float]) -> None:
        into.append(loop.probe())
        loop.settle(0.02)

    def idle_phase() -> list[float]:
        seconds: list[float] = []
        end = time.perf_counter() + args.idle_s
        while time.perf_counter() < end:
            probe_once(seconds)
        return seconds

    before = idle_phase()

    loop.outcomes.update({job_id: f"refused by the API: {why}" for job_id, why in refused.items()})
    ended = ("refused", "failed", "finished")
    reader = threading.Thread(target=intake, args=(loop, queued), name="intake", daemon=True)
    started = time.perf_counter()
    reader.start()
    hostile: list[float] = []
    while time.perf_counter() - started < args.hostile_s and (
        len(loop.outcomes) < len(specs) or not all(o.startswith(ended) for o in loop.outcomes.values())
    ):
        probe_once(hostile)
    hostile_s = time.perf_counter() - started
    outcomes = Counter(loop.outcomes.get(f"hostile-{i}", "not checked yet") for i in range(len(specs)))
    after = idle_phase()

    ms = {name: {k: None if v is None else round(v * 1000, 2) for k, v in percentiles(values).items()}
          for name, values in (("idle", before), ("hostile", hostile), ("idle_after", after))}
    payload = {
        "model": str(args.model or "SmolLM2-135M-Instruct (bundled GGUF)"),
        "idle_s": args.idle_s,
        "probes": {"idle": len(before), "hostile": len(hostile), "idle_after": len(after)},
        "hostile_jobs": len(specs),
        "ttft_ms": ms,
        "ratio_p90": round(ms["hostile"]["p90"] / ms["idle"]["p90"], 2),
        "ratio_p50": round(ms["hostile"]["p50"] / ms["idle"]["p50"], 2),
        "hostile_s": round(hostile_s, 2),
        "api_s": round(api_s, 2),  # the API's checks of every hostile job, before the measurement
        "outcomes": dict(sorted(outcomes.items())),
        "idle_ms": [round(v * 1000, 2) for v in before],
        "hostile_ms": [round(v * 1000, 2) for v in hostile],
        "idle_after_ms": [round(v * 1000, 2) for v in after],
    }
    path = write_result("structured_isolation", payload)
    print(json.dumps({k: v for k, v in payload.items() if not k.endswith("_ms")}, indent=1))
    print(f"wrote {path}")
    os._exit(0)  # compiles still running in the engine's threads (a baseline's) are not waited for


if __name__ == "__main__":
    raise SystemExit(main())
