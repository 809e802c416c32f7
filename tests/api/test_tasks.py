"""Stopping background tasks: a cancellation the task drops (as Python 3.11's asyncio.wait_for can)
must not leave the shutdown waiting forever."""

from __future__ import annotations

import asyncio

import pytest

from ferry.api.tasks import cancel_and_wait


def test_a_task_that_drops_a_cancellation_is_cancelled_again_until_it_ends():
    async def main():
        dropped = 0

        async def stubborn():
            nonlocal dropped
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    dropped += 1
                    if dropped == 3:
                        raise

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait(task), timeout=10)
        return task, dropped

    task, dropped = asyncio.run(main())
    assert task.cancelled() and dropped == 3


def test_a_task_that_failed_reports_its_error():
    async def main():
        async def broken():
            raise ValueError("boom")

        task = asyncio.create_task(broken())
        await asyncio.sleep(0)
        await cancel_and_wait(task)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(main())
