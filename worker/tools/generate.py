"""`ferry generate`: stream a few completions straight from the engine and print TTFT / TBT.

With no model at the path given, a small local demo model is made first (no network).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from worker.serve.settings import SHIPPED_DEMO_MODEL

DEFAULT_MODEL = SHIPPED_DEMO_MODEL
DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "The worker pulls jobs from Redis",
    "import os\nimport sys\n",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ferry generate", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory or cached hub id")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three demo prompts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args(argv)


def ensure_model(path: str) -> str:
    """The model directory to load: `path` itself, made with the demo builder when missing."""
    directory = Path(path)
    if directory.exists() or path != DEFAULT_MODEL:
        return path
    from worker.tools.demo_model import make_demo_model

    print(f"no model at {directory}: making a small local demo model there", file=sys.stderr)
    make_demo_model(directory)
    return path


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from worker.engine import Engine, SamplingParams

    try:
        engine = Engine(ensure_model(args.model), dtype=args.dtype)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as exc:
        print(f"ferry generate: {exc}", file=sys.stderr)
        return 2
    for i, prompt in enumerate(args.prompt or DEFAULT_PROMPTS):
        print(f"\n--- completion {i + 1} ---\n{prompt}", end="", flush=True)
        engine.add_request(str(i), prompt, params)
        last = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text, end="", flush=True)
                last = out
        gaps = last.metrics.inter_token_latencies
        tbt = f"{statistics.median(gaps) * 1e3:.1f} ms" if gaps else "n/a"
        print(
            f"\n[{last.num_output_tokens} tokens, finish={last.finish_reason}, "
            f"TTFT {last.metrics.ttft * 1e3:.1f} ms, median TBT {tbt}]"
        )
    return 0
