"""How background work (the Batch API's lines) gives way to live traffic on the worker's side.

The engine's scheduler already schedules background requests after live prompts. While live
traffic is present (a live job ran or was admitted within `window_s`), each step that ran
background work alone is also followed by a pause of `ratio` times that step's length (at most
`max_pause_s`: one slow step, a long batch prefill, never holds the batch back for long): the
batch lane then runs at most 1 / (1 + ratio) of the time, so it does not hold the cores, the GIL
and the engine all the time, and a live job's whole path (the API, Redis, the intake, the engine
thread, the publisher) finds them free when it arrives. A live arrival ends the pause at once.
With no live traffic the batch runs flat out; `ratio` 0 turns pacing off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackgroundPacing:
    ratio: float = 3.0  # pause after a background-only step, as a multiple of that step's length
    window_s: float = 2.0  # live traffic is present this long after a live job last ran or arrived
    max_pause_s: float = 0.1  # longest single pause


class Pacer:
    """The state pacing decides by: when live work was last seen, how long the last step took.
    Used by the engine thread only."""

    def __init__(self, pacing: BackgroundPacing) -> None:
        self.pacing = pacing
        self._live_at = float("-inf")  # monotonic time a live job last ran or was admitted
        self._last_step_s = 0.0

    def live_seen(self) -> None:
        self._live_at = time.monotonic()

    def step_took(self, seconds: float) -> None:
        self._last_step_s = seconds

    @property
    def active(self) -> bool:
        """Whether background work is paced now: on, and live traffic present."""
        return self.pacing.ratio > 0 and time.monotonic() - self._live_at <= self.pacing.window_s

    def pause_s(self, live_running: bool) -> float:
        """How long to hold background work back before the next step: 0 while a live job runs
        (its steps carry the batch's decodes along) or while pacing is not active."""
        if live_running:
            self.live_seen()
            return 0.0
        if not self.active:
            return 0.0
        return min(self.pacing.ratio * self._last_step_s, self.pacing.max_pause_s)
