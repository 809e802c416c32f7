"""Lua scripts in pipelines without redis-py's extra round trip.

redis-py checks `SCRIPT EXISTS` before every pipeline that holds a script: one more round trip
per engine step. Here a pipeline sends EVALSHA directly; when Redis does not know a script
(first use, restart, SCRIPT FLUSH) nothing of that script ran, so the scripts are loaded and the
whole pipeline is built and sent once more.
"""

from __future__ import annotations

from collections.abc import Callable

from redis.commands.core import Script
from redis.exceptions import NoScriptError


def add(pipe, script: Script, keys: list[str], args: list) -> None:
    """Queue `script` on `pipe` as a bare EVALSHA."""
    pipe.evalsha(script.sha, len(keys), *keys, *args)


def execute(build: Callable[[], object], scripts: list[Script]) -> list:
    """Run the pipeline `build()` returns (errors come back as results), loading `scripts` if Redis lacks them."""
    results = build().execute(raise_on_error=False)
    if any(isinstance(r, NoScriptError) for r in results):
        for script in scripts:
            script.sha = script.registered_client.script_load(script.script)
        results = build().execute(raise_on_error=False)
    return results
