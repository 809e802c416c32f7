"""`ferry bench`: run the named benchmark suites, each against its baseline, then draw the plots.

    ferry bench --suite throughput                 # one suite, its full workload
    ferry bench --suite prefix --suite queue --quick
    ferry bench --suite all --quick                # every suite this machine can run, small workloads
    ferry bench --suite throughput -- --n 16       # arguments after -- go to the (single) suite
    ferry bench --plots-only                       # redraw bench/plots/ from the latest JSON

Each suite runs as `python -m <module>` in its own process, so one suite's threads, memory and
torch state never leak into the next, and a failing suite does not stop the others. A suite
writes its JSON (machine, versions, commit, config, every figure) to bench/results/; the newest
file it wrote is also kept as bench/results/<suite>-latest.json, which `python -m bench.report`
and the plots read. Suites that need something absent here (kernels: a CUDA GPU; queue and api:
Redis) are skipped with the reason.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.common import RESULTS_DIR

REPO = Path(__file__).resolve().parents[1]
PLOTS_DIR = REPO / "bench" / "plots"


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # run as `python -m <module>`
    quick: tuple[str, ...]  # arguments for a small run (--quick)
    needs: str | None = None  # "cuda" | "redis": skip when absent
    takes_model: bool = True  # accepts --model DIR


SUITES = {
    s.name: s
    for s in (
        Suite("throughput", "bench.throughput", ("--n", "8", "--systems", "ferry,hf-single,hf-static8")),
        Suite("prefix", "bench.prefix", ("--quick",)),  # includes the snapshot cold start
        Suite("queue", "bench.queue", ("--quick",), needs="redis"),
        Suite("api", "bench.api", ("--quick",), needs="redis"),
        Suite("tracing", "bench.tracing", ("--quick",), needs="redis"),
        Suite("batch", "bench.batch", ("--quick",), needs="redis"),
        Suite("specdec", "bench.specdec", ("--quick",)),
        Suite("cold_start", "bench.cold_start", ("--quick",), needs="redis"),
        Suite("s3_readers", "bench.s3_readers", ("--runs", "1"), takes_model=False),
        Suite("redis_capacity", "bench.redis_capacity", ("--quick",), needs="redis"),
        Suite("structured", "bench.structured", ("--tokens", "32", "--batches", "1,8")),
        Suite("kernels", "bench.kernels", ("--quick",), needs="cuda", takes_model=False),
        Suite("linear_cpu", "bench.linear_cpu", ("--rows", "1,32,512", "--repeats", "2"), takes_model=False),
        Suite("quantized_linear", "bench.quantized_linear", ("--rows", "1,32", "--repeats", "2"), takes_model=False),
        Suite("attention_cpu", "bench.attention_cpu", ("--repeats", "5"), takes_model=False),
        Suite("quantized", "bench.quantized", ("--quick",), takes_model=False),
        Suite("tensor_parallel", "bench.tensor_parallel", ("--quick",), takes_model=False),
        Suite("model_families", "bench.model_families", ("--quick",), takes_model=False),
        Suite("lora", "bench.lora", ("--quick",), takes_model=False),
        Suite("lora_fleet", "bench.lora_fleet", ("--quick",), needs="redis", takes_model=False),
    )
}


@dataclass
class SuiteRun:
    """What one suite did in this invocation."""

    suite: str
    status: str  # "ok" | "failed" | "skipped"
    seconds: float = 0.0
    detail: str = ""  # skip reason or exit code
    files: list[Path] = field(default_factory=list)  # JSON files it wrote


def missing_requirement(suite: Suite) -> str | None:
    """Why `suite` cannot run here, or None."""
    module_file = REPO / (suite.module.replace(".", "/") + ".py")
    if not module_file.is_file():
        return f"{module_file.relative_to(REPO)} does not exist yet"
    if suite.needs == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if suite.needs == "redis":
        import redis

        url = os.environ.get("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0")
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        except (redis.RedisError, OSError):
            return f"needs Redis at {url}"
    return None


def _json_snapshot() -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in RESULTS_DIR.glob("*.json")} if RESULTS_DIR.is_dir() else {}


def run_suite(suite: Suite, args: argparse.Namespace, extra: list[str]) -> SuiteRun:
    reason = missing_requirement(suite)
    if reason:
        return SuiteRun(suite.name, "skipped", detail=reason)
    argv = [*(suite.quick if args.quick else ()), *extra]
    if args.model and suite.takes_model:
        argv += ["--model", args.model]
    before = _json_snapshot()
    start = time.monotonic()
    # The suite's own progress bars and summary go straight to this terminal.
    rc = subprocess.run([sys.executable, "-m", suite.module, *argv], cwd=REPO).returncode
    seconds = time.monotonic() - start
    written = sorted((p for p, m in _json_snapshot().items() if before.get(p) != m), key=lambda p: p.stat().st_mtime)
    written = [p for p in written if not p.name.endswith("-latest.json")]
    if rc != 0:
        return SuiteRun(suite.name, "failed", seconds, f"exit code {rc}", written)
    if written:
        shutil.copyfile(written[-1], RESULTS_DIR / f"{suite.name}-latest.json")
    return SuiteRun(suite.name, "ok", seconds, "" if written else "wrote no JSON", written)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, extra = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="ferry bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", action="append", choices=[*SUITES, "all"], help="repeatable; 'all' runs every suite")
    parser.add_argument(
        "--quick", action="store_true", help="each suite's small workload (minutes, not tens of minutes)"
    )
    parser.add_argument("--model", help="model directory for the suites that take one (default: each suite's own)")
    parser.add_argument("--plots-only", action="store_true", help="run nothing; redraw the plots from the latest JSON")
    parser.add_argument("--no-plots", action="store_true", help="skip drawing the plots")
    parser.add_argument("--update-readme", action="store_true", help="also rewrite README.md's results table")
    args = parser.parse_args(argv)
    if not args.suite and not args.plots_only:
        parser.error("name at least one --suite (or 'all'), or --plots-only")
    if args.suite and "all" in args.suite:
        args.suite = list(SUITES)
    if extra and len(args.suite or []) != 1:
        parser.error("arguments after -- go to one suite: name exactly one --suite")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = _parse(list(sys.argv[1:] if argv is None else argv))
    runs: list[SuiteRun] = []
    names = [] if args.plots_only else list(dict.fromkeys(args.suite))
    with tqdm(names, desc="ferry bench", unit="suite", file=sys.stderr, disable=not names) as bar:
        for name in bar:
            bar.set_postfix(suite=name)
            run = run_suite(SUITES[name], args, extra)
            tqdm.write(
                f"[{run.suite}] {' '.join(filter(None, (run.status, run.detail)))} ({run.seconds:.0f} s)",
                file=sys.stderr,
            )
            runs.append(run)
    for run in runs:
        files = ", ".join(_shown(p) for p in run.files) or "-"
        print(f"{run.suite:<11} {run.status:<8} {run.seconds:>7.0f} s  {run.detail or files}")
    if not args.no_plots:
        from bench.plots import render_all
        from bench.report import latest_results

        for path in render_all(latest_results(), PLOTS_DIR):
            print("plot:", _shown(path))
    if args.update_readme:
        from bench import report

        report.main(["--write"])
    return 1 if any(r.status == "failed" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
