"""The `ferry` command: one entry point, one subcommand per process or tool.

Each subcommand lives in its own module as `main(argv) -> int` and is imported only when
run, so `ferry api` never imports torch and `ferry worker` never imports FastAPI.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS = {
    "generate": ("worker.tools.generate", "main", "generate completions offline with the engine (LLM.generate)"),
    "worker": ("worker.serve.main", "main", "run a worker: Redis Streams in, tokens out"),
    "api": ("api.main", "main", "run the HTTP API (FastAPI + uvicorn)"),
    "webhooks": ("worker.webhooks.cli", "main", "run the Celery worker that delivers signed webhooks"),
    "up": ("worker.tools.up", "main", "run the whole stack on this machine (--demo streams a few completions)"),
    "snapshot": ("worker.snapshots.cli", "main", "save, load or inspect prefix-cache snapshots"),
    "autoscale": ("infra.autoscaler", "main", "compute and publish the desired worker count from queue backlog"),
    "bench": ("bench.cli", "main", "run benchmark suites and write JSON + plots to bench/results/"),
}


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
