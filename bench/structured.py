"""Structured outputs: what a JSON schema costs a step, and what a first-seen schema costs to compile.

On SmolLM2-135M-Instruct (the bundled GGUF; --model for another), greedy, --tokens new tokens per
request (default 64):
  tok/s     output tokens/s over the whole run, batch 1 and 32, without a grammar (EOS ignored,
            so every request runs --tokens) and with a JSON schema whose `bio` must be at least
            400 characters, so that requests also run to --tokens; slowdown = without / with - 1
  mask_ms   p50 / p90 per step of filling and applying the grammar bitmasks (the sampler's
            `apply_grammars`, all constrained rows of the step), at each batch size
  compile   seconds for the first grammar ever (includes scanning the vocabulary once), for a
            first-seen schema after that, and for a schema already cached

    python -m bench.structured [--model PATH] [--tokens 64] [--batches 1,32]

Writes bench/results/structured-<time>.json (and structured-latest.json), bench/plots/structured.png
and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import percentiles, write_result
from bench.plots import plot_structured

REPO = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 400},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "bio": {"type": "string", "minLength": 400, "maxLength": 800},  # long: requests run to --tokens
    },
    "required": ["name", "age", "bio"],
}
PROMPT = "Describe a fictional person as JSON with a name, an age and a long biography."


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.structured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from ferry.worker.engine import LLM, SamplingParams, StructuredOutputs, sampler
    from ferry.worker.models.bundled import smollm2_gguf_path

    llm = LLM(str(args.model or smollm2_gguf_path()), max_num_seqs=64)
    engine = llm.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": PROMPT}])

    # Compile times, on the manager's own thread pool as requests see them.
    def compile_s(spec) -> float:
        start = time.perf_counter()
        engine.structured.compile(spec).result()
        return time.perf_counter() - start

    compile = {
        "first_ever_s": compile_s(StructuredOutputs(json=SCHEMA)),
        "first_seen_s": compile_s(StructuredOutputs(json={**SCHEMA, "title": "another"})),
        "cached_s": compile_s(StructuredOutputs(json=SCHEMA)),
    }

    # Time the mask per step by wrapping the sampler's call (the engine is otherwise untouched).
    mask_times: list[float] = []
    apply = sampler.apply_grammars

    def timed(logits, rows):
        start = time.perf_counter()
        try:
            return apply(logits, rows)
        finally:
            mask_times.append(time.perf_counter() - start)

    sampler.apply_grammars = timed
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    llm.generate([prompt] * 2, [plain, constrained], use_tqdm=False)  # warm-up
    runs = []
    cases = [(b, name, p) for b in map(int, args.batches.split(",")) for name, p in
             (("plain", plain), ("schema", constrained))]
    for batch, name, params in tqdm(cases, desc="bench.structured", unit="run", file=sys.stderr):
        mask_times.clear()
        start = time.perf_counter()
        outs = llm.generate([prompt] * batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        runs.append({
            "batch": batch, "system": name, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 1),
            "mask_ms": {k: None if v is None else round(v * 1000, 3) for k, v in percentiles(mask_times).items()}
            if name == "schema" else None,
            "finish": sorted({o.finish_reason for o in outs}),
        })
    sampler.apply_grammars = apply
    for batch in {r["batch"] for r in runs}:
        base, schema = (next(r for r in runs if r["batch"] == batch and r["system"] == s) for s in ("plain", "schema"))
        schema["slowdown"] = round(base["tok_s"] / schema["tok_s"] - 1, 3)
    payload = {"model": str(args.model or "SmolLM2-135M-Instruct (bundled GGUF)"), "tokens": args.tokens,
               "compile": {k: round(v, 4) for k, v in compile.items()}, "runs": runs}
    path = write_result("structured", payload)
    plot_structured(payload, REPO / "bench" / "plots")
    print(json.dumps({"compile": payload["compile"], "runs": runs}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
