"""The backlog autoscaler (`ferry autoscale`) for platforms without KEDA (ECS, plain ASGs).

`policy` decides, `redis_source` observes, `publish` reports and actuates, `loop` ties one
tick together, `simulate` replays traces, `cli.main(argv)` is the command.
"""

from ferry.autoscaler.cli import main

__all__ = ["main"]
