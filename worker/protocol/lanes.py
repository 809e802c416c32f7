"""A job's queue lane (its `priority`): the one type every process uses for it.

Lanes in read order: a worker drains `high` before `normal` before `low`. `low` is the background
lane: the Batch API puts its lines there, and a worker lets them give way to live jobs (the
engine schedules them after live prompts, the worker paces them while live traffic is present).
"""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    high = "high"
    normal = "normal"
    low = "low"

    @property
    def rank(self) -> int:
        """The engine's priority of the lane's requests: lower is served first and preempted last."""
        return _READ_ORDER.index(self)

    @property
    def background(self) -> bool:
        """Whether the lane's jobs are background work (they yield to the live lanes)."""
        return self is Priority.low


_READ_ORDER = tuple(Priority)
LIVE_LANES = tuple(p for p in Priority if not p.background)  # what a worker full of batch jobs still reads
