"""The `ferry` command: one entry point, one subcommand per process or tool.

Each subcommand lives in its own module as `main(argv) -> int` and is imported only when
run, so `ferry api` never imports torch and `ferry worker` never imports FastAPI. `ferry bench`
runs the checkout's `bench/` (benchmarks are not part of the installed package).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]  # the repository, when Ferry runs from one (editable install)

# name -> (module, function, one-line help)
COMMANDS = {
    "generate": ("ferry.worker.tools.generate", "main", "generate completions offline with the engine (LLM.generate)"),
    "worker": ("ferry.worker.serve.main", "main", "run a worker: Redis Streams in, tokens out"),
    "api": ("ferry.api.main", "main", "run the HTTP API (FastAPI + uvicorn)"),
    "webhooks": ("ferry.worker.webhooks.cli", "main", "run the Celery worker that delivers signed webhooks"),
    "up": ("ferry.worker.tools.up", "main", "run the whole stack on this machine (--demo streams a few completions)"),
    "models": ("ferry.worker.models.cli", "main", "pull, list (ls) or remove (rm) models in the node's cache"),
    "snapshot": ("ferry.worker.snapshots.cli", "main", "save, load or inspect prefix-cache snapshots"),
    "autoscale": ("ferry.autoscaler", "main", "compute and publish the desired worker count from queue backlog"),
    "bench": ("bench.cli", "main", "run benchmark suites and write JSON + plots to bench/results/"),
}
CHECKOUT_ONLY = {"bench"}  # top-level packages of the repository that are not installed
# name -> (module, function(argv)) run before the command's module is imported: `ferry worker`
# starts its model's download there, ahead of its imports (worker/serve/early_start.py)
EARLY = {"worker": ("ferry.worker.serve.early_start", "start")}


def _usage() -> str:
    lines = ["usage: ferry <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ferry: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[name]
    checkout_package = module_name.partition(".")[0]
    if checkout_package in CHECKOUT_ONLY:
        if not (CHECKOUT / checkout_package).is_dir():
            print(f"ferry: {name!r} runs from a checkout of Ferry's repository (its {checkout_package}/ folder)",
                  file=sys.stderr)
            return 2
        if str(CHECKOUT) not in sys.path:
            sys.path.insert(0, str(CHECKOUT))
    if name in EARLY:
        early_module, early_function = EARLY[name]
        getattr(importlib.import_module(early_module), early_function)(rest)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(
                f"ferry: command {name!r} is not available in this installation ({exc.name} missing)", file=sys.stderr
            )
            return 2
        raise
    return int(getattr(module, function)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
