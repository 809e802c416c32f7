"""Stopping the API's background tasks (the batch driver, the heartbeat reader, the pub/sub hub)."""

from __future__ import annotations

import asyncio

_RECANCEL_S = 0.1


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait until it has ended, cancelling again while it goes on. One cancel
    can be lost: on Python 3.11 `asyncio.wait_for` (redis-py's connection code awaits under it)
    drops a cancellation that arrives as the awaited call completes (CPython gh-86296, fixed in
    3.12), and the task's loop goes on; a single cancel-then-await could then wait forever (an
    app's shutdown hung for 10 minutes in a loaded test run)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=_RECANCEL_S)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()
