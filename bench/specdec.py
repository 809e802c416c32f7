"""Speculative decoding: greedy output tokens/s with and without it, at batch 1 and batch 8.

Workloads (greedy, EOS ignored, `--tokens` new tokens per request, default 256; prompts are
passages of Python standard-library source, the same on every machine with this Python):
  repeat    a passage, then "# The same code again:" and the passage's first line: a model that
            copies repeats the passage, which n-gram prompt lookup predicts
  complete  the passage alone, to be continued: only a model can predict that

Systems, one Engine each on the same model, same settings otherwise (speculation with its
defaults, as a user gets it: per-request pausing and the speedup governor; --every-step turns
the governor off to show what speculation itself does):
  baseline  no speculation
  ngram     prompt lookup, k proposals (--k, default 4), n-grams up to 4 tokens
  draft     the draft model proposes k tokens

Reported per workload, batch size and system: output tokens/s over the whole run (prefill
included), wall seconds, engine steps, the speedup over the baseline, whether the greedy tokens
equal the baseline's (they must), verifications and proposed / accepted tokens, the acceptance
rate (accepted / proposed) and the mean accepted length (tokens per verification: accepted
proposals + the target's own); the median decode step with and without a verification
(`step_ms`), and at batch 1 the speedup bound: k + 1 tokens per speculating step against the
baseline's one token per step, what full acceptance would give (run with --every-step, so that
every system speculates; that run is written as `specdec-every-step`, apart from the README's).
Each measurement is the best of --repeats runs after a warm-up; the systems take turns run by
run, so that the load of a shared machine hits them alike.

Models: --model (default models/demo) and --draft (default models/draft), the trained pair.
Where they do not exist yet, random-weight stand-ins are made under .ferry/bench-models/ (a
6-layer target and, as its draft, its own first layer): then the JSON says "weights": "random"
and acceptance means little. --model also takes any model name the engine takes; with
--systems baseline,ngram no draft is needed (SmolLM2 has no draft that shares its tokenizer).

    python -m bench.specdec                       # batch 1 and 8, 256 new tokens
    python -m bench.specdec --quick               # 64 new tokens, one repeat
    python -m bench.specdec --model smollm2-135m-instruct --systems baseline,ngram   # the real model
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import write_result

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("baseline", "ngram", "draft")
WORKLOADS = ("repeat", "complete")
# Standard-library functions whose source makes the prompts (one per request at batch 8).
SOURCES = (
    "textwrap.dedent", "shlex.quote", "colorsys.rgb_to_hls", "heapq.nsmallest",
    "base64.b64encode", "fnmatch.filter", "glob.glob", "string.capwords",
)
PASSAGE_TOKENS = 120  # a passage is cut at the last line that fits


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "demo"))
    p.add_argument(
        "--draft", default=None, help="draft model directory (default: models/draft, beside --model's default)"
    )
    p.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 256; quick: 64)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--k", type=int, default=4, help="proposals per step")
    p.add_argument(
        "--repeats", type=int, default=None, help="runs per measurement, the best counts (default 2; quick: 1)"
    )
    p.add_argument(
        "--every-step", action="store_true", help="turn the speedup governor off: speculate whenever proposals exist"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: on a shared CPU, more threads thrash)"
    )
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="no proposals while this many requests run (with --every-step: the simple rule)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems run (baseline always does)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.systems = ["baseline"] + [s for s in args.systems.split(",") if s in SYSTEMS and s != "baseline"]
    args.tokens = args.tokens or (64 if args.quick else 256)
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args


def resolve_models(model: str, draft: str | None, needs_draft: bool = True) -> tuple[Path, Path | None, str]:
    """(target, draft, "trained" | "random"): the given pair, or random stand-ins when absent.
    Without `needs_draft`, the target alone: any model name the engine resolves (a bundled name,
    a GGUF), and no draft."""
    if not needs_draft:
        from ferry.worker.models.loader import resolve_model_path

        return resolve_model_path(model, REPO / ".ferry" / "models"), None, "pretrained"
    target = Path(model)
    draft_dir = Path(draft) if draft else target.parent / "draft"
    if (target / "config.json").is_file() and (draft_dir / "config.json").is_file():
        return target, draft_dir, "trained"
    print(f"bench.specdec: no model pair at {target} and {draft_dir}: using random-weight stand-ins", file=sys.stderr)
    root = REPO / ".ferry" / "bench-models"
    return *_random_pair(root / "specdec-target", root / "specdec-draft"), "random"


def _random_pair(target: Path, draft: Path) -> tuple[Path, Path]:
    if not (target / "config.json").is_file():
        from ferry.worker.tools.demo_model import make_demo_model

        make_demo_model(target, hidden_size=192, num_layers=6)
    if not (draft / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(target)
        model.model.layers = model.model.layers[:1]  # same embeddings and head, one layer
        model.config.num_hidden_layers = 1
        model.save_pretrained(draft)
        AutoTokenizer.from_pretrained(target).save_pretrained(draft)
    return target, draft


def passages(tokenizer, n: int) -> list[str]:
    """n passages of standard-library source, each cut at a line end within PASSAGE_TOKENS tokens."""
    import importlib

    out = []
    for name in SOURCES[:n]:
        module, attr = name.rsplit(".", 1)
        lines = inspect.getsource(getattr(importlib.import_module(module), attr)).splitlines(keepends=True)
        text = ""
        for line in lines:
            if len(tokenizer.encode(text + line)) > PASSAGE_TOKENS:
                break
            text += line
        out.append(text)
    return out


def prompts_for(workload: str, texts: list[str]) -> list[str]:
    if workload == "repeat":
        return [f"{t}\n\n# The same code again:\n{t.splitlines()[0]}\n" for t in texts]
    return texts


def run_once(engine, prompts: list[str], tokens: int) -> dict:
    from ferry.worker.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats().spec_decode
    run = time.monotonic_ns()  # request ids unique across runs on one engine
    ids = [f"{run}-{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    spec = engine.spec
    step_s: dict[str, list[float]] = {"plain": [], "speculating": []}  # decode steps' seconds
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        drafts = spec.stats.num_drafts if spec is not None else 0
        began = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        took = time.perf_counter() - began
        steps += 1
        verified = spec is not None and spec.stats.num_drafts > drafts
        # The first step holds the prompts; a draft's first verification also fed it the prompts.
        if steps > 1 and not (verified and spec.proposer.catch_up_tokens > spec.config.num_speculative_tokens + 1):
            step_s["speculating" if verified else "plain"].append(took)
    wall = time.perf_counter() - start
    generated = sum(len(v) for v in outputs.values())
    result = {
        "tokens_per_s": generated / wall,
        "wall_s": wall,
        "steps": steps,
        "output_tokens": generated,
        "token_ids": [outputs[rid] for rid in ids],
        "step_ms": {f"{kind}_p50": 1000 * statistics.median(times) if times else None for kind, times in step_s.items()}
        | {"speculating_steps": len(step_s["speculating"])},
    }
    after = engine.stats().spec_decode
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        proposed = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        result |= {
            "num_drafts": drafts,
            "num_draft_tokens": proposed,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
        }
    return result


def _bound(baseline: dict, system: dict, k: int) -> float | None:
    """At batch 1, the speedup if every proposal were accepted: k + 1 tokens per speculating
    step against one per plain step of the baseline. A verification costs the same whatever is
    accepted, so this is the most the system can give on this machine (None: it never speculated)."""
    plain, speculating = baseline["step_ms"]["plain_p50"], system["step_ms"]["speculating_p50"]
    return (k + 1) * plain / speculating if plain and speculating else None


def engine_for(system: str, target: Path, draft: Path | None, k: int, max_len: int, every_step: bool,
               disable_by_batch_size: int | None = None):
    from ferry.worker.engine import Engine

    spec = {
        "baseline": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4},
        "draft": {"method": "draft", "num_speculative_tokens": k, "draft_model": str(draft)},
    }[system]
    if spec is not None and every_step:
        spec["measure_speedup"] = False
    if spec is not None and disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = disable_by_batch_size
    return Engine(str(target), speculative=spec, max_model_len=max_len, max_num_seqs=16)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()  # the CPU may be shared: say how busy it was
    target, draft, weights = resolve_models(args.model, args.draft, needs_draft="draft" in args.systems)
    systems = args.systems
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = passages(tokenizer, max(batches))
    max_len = PASSAGE_TOKENS + 64 + args.tokens
    engines = {system: engine_for(system, target, draft, args.k, max_len, args.every_step, args.disable_by_batch_size)
               for system in systems}
    for engine in engines.values():
        run_once(engine, prompts_for("complete", texts[:1]), 8)  # warm-up
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for _ in range(args.repeats):
        for workload in WORKLOADS:
            for b in batches:
                prompts = prompts_for(workload, texts[:b])
                # Systems take turns, so a change in the machine's load hits each of them alike.
                for system in systems:
                    runs.setdefault((workload, b, system), []).append(run_once(engines[system], prompts, args.tokens))
    results: dict = {w: {f"batch{b}": {} for b in batches} for w in WORKLOADS}
    for (workload, b, system), tries in runs.items():
        best = max(tries, key=lambda r: r["tokens_per_s"])
        results[workload][f"batch{b}"][system] = best
        if "num_drafts" not in best:
            detail = ""
        elif best["num_drafts"] == 0:  # acceptance 0.00 would read as rejected proposals
            detail = ", no verifications (the governor kept this run plain)"
        else:
            detail = (f", {best['num_drafts']} verifications, acceptance {best['acceptance_rate']:.2f},"
                      f" mean accepted length {best['mean_accepted_length']:.2f}")
        print(f"{workload:8s} batch {b}: {system:8s} {best['tokens_per_s']:7.1f} tok/s{detail}", file=sys.stderr)
    for workload in WORKLOADS:
        for b in batches:
            row = results[workload][f"batch{b}"]
            base = row["baseline"]
            for system in systems[1:]:
                row[system]["speedup"] = row[system]["tokens_per_s"] / base["tokens_per_s"]
                row[system]["identical_to_baseline"] = row[system]["token_ids"] == base["token_ids"]
                if b == 1:
                    row[system]["speedup_bound_at_full_acceptance"] = _bound(base, row[system], args.k)
            for system in systems:
                del row[system]["token_ids"]
    report = {
        "models": {"target": str(target), "draft": str(draft) if draft else None, "weights": weights,
                   "name": args.model},
        "settings": {"new_tokens": args.tokens, "batches": batches, "k": args.k, "repeats": args.repeats,
                     "governor": not args.every_step, "threads": args.threads, "systems": systems,
                     "disable_by_batch_size": args.disable_by_batch_size,
                     "passage_tokens": PASSAGE_TOKENS, "greedy": True, "quick": args.quick},
        "conditions": {"load_average_before": load_before, "load_average_after": os.getloadavg()},
        "results": results,
    }
    # A run without the governor is a different measurement: it must not replace the README's.
    suite = "specdec" if not args.every_step else (
        "specdec-every-step" if args.disable_by_batch_size is None else "specdec-simple-rule")
    path = write_result(suite, report)
    print(json.dumps({w: {b: {s: round(r.get("speedup", 1.0), 2) for s, r in row.items()} for b, row in rows.items()}
                      for w, rows in results.items()}, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
