"""Backlog-per-worker scaling policy: pure, clock-free, replayable.

One `Autoscaler` per served model. Each tick it gets an `Observation` (queue lag, pending
entries, live workers) and returns a `Decision` (the desired worker count). Rules, in order:

1. Backlog = lag + pending (jobs waiting in the stream + jobs delivered but not acked).
   The pool should hold at most `target_backlog_per_worker` per worker: the scale-up
   recommendation is ceil(backlog / target), at least 1 while any job exists, so the first
   job wakes a pool at zero.
2. Scale-up is immediate but adds at most `max_step_up` workers per decision.
3. Scale-down has a dead band and a memory. Its recommendation assumes each remaining
   worker is only `scale_down_utilization` of the target full (so a backlog hovering around
   a boundary does not add and remove the same worker every tick), the pool goes only as low
   as the highest such recommendation of the last `scale_down_window_s` (Kubernetes HPA's
   stabilisation window), and at most `max_step_down_frac` of the workers go per decision.
4. With no backlog one warm worker stays until the idle window has passed since the last job
   was seen; then the pool drops to `min_workers` (0 by default) in one step. The window
   starts at `idle_to_zero_s` and doubles (up to `max_idle_to_zero_s`) each time a job wakes
   the pool sooner after it went to zero than the window itself lasted: that drop cost a
   cold start and saved less than it would have cost to stay warm. A pool that stays at zero
   for `max_idle_to_zero_s` gets the short window back.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class ScalePolicy:
    target_backlog_per_worker: float = 8.0  # lag + pending jobs one worker should hold
    min_workers: int = 0  # floor after the idle window (0 = scale to zero)
    max_workers: int = 8  # ceiling: the GPU quota of the pool
    max_step_up: int = 4  # workers added per decision at most
    max_step_down_frac: float = 0.5  # share of the workers removed per decision at most (>= 1 worker)
    scale_down_utilization: float = 0.5  # scale in only if the rest would be this full of the target
    scale_down_window_s: float = 300.0  # scale down only to the highest recommendation seen in it
    idle_to_zero_s: float = 300.0  # no backlog for this long: drop to min_workers
    max_idle_to_zero_s: float = 1800.0  # the idle window's ceiling after repeated quick re-wakes

    def __post_init__(self) -> None:
        if self.target_backlog_per_worker <= 0:
            raise ValueError("target_backlog_per_worker must be > 0")
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError("need 0 <= min_workers <= max_workers")
        if self.max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if self.max_step_up < 1:
            raise ValueError("max_step_up must be >= 1")
        if not 0 < self.max_step_down_frac <= 1 or not 0 < self.scale_down_utilization <= 1:
            raise ValueError("max_step_down_frac and scale_down_utilization must be in (0, 1]")
        if self.scale_down_window_s < 0 or not 0 <= self.idle_to_zero_s <= self.max_idle_to_zero_s:
            raise ValueError("need scale_down_window_s >= 0 and 0 <= idle_to_zero_s <= max_idle_to_zero_s")


@dataclass(slots=True, frozen=True)
class Observation:
    t: float  # seconds, any monotonic origin
    lag: int  # entries in the model's streams not yet delivered to the group
    pending: int  # entries delivered to a worker and not yet acked (running jobs)
    live_workers: int  # workers whose heartbeat for this model has not expired

    @property
    def backlog(self) -> int:
        return self.lag + self.pending


@dataclass(slots=True, frozen=True)
class Decision:
    t: float
    desired: int  # workers the pool should have now
    recommended: int  # what the backlog alone asks for at the target, before windows and steps
    reason: str  # one word for logs and the replay CSV: up | down | idle | hold


@dataclass
class Autoscaler:
    """Stateful wrapper around `ScalePolicy`; feed it observations in time order."""

    policy: ScalePolicy
    desired: int = 0  # last decision; start from the live count when (re)starting
    last_busy_t: float | None = None  # last time any backlog was seen
    idle_window_s: float | None = None  # idle window in force; None: the policy's idle_to_zero_s
    zeroed_at: float | None = None  # when the pool last dropped to zero workers
    _recent: deque[tuple[float, int]] = field(default_factory=deque)  # (t, scale-down recommendation)

    def decide(self, obs: Observation) -> Decision:
        p = self.policy
        if obs.backlog > 0:
            self.last_busy_t = obs.t
        if self.idle_window_s is None:
            self.idle_window_s = p.idle_to_zero_s
        up = self._recommend(obs.backlog, p.target_backlog_per_worker, obs.t)
        down = self._recommend(obs.backlog, p.target_backlog_per_worker * p.scale_down_utilization, obs.t)
        if not self._recent:  # (re)started: what runs now counts as recommended once
            self._recent.append((obs.t, self.desired))
        self._recent.append((obs.t, down))
        while self._recent[0][0] < obs.t - p.scale_down_window_s:
            self._recent.popleft()

        if up > self.desired:
            new, reason = min(up, self.desired + p.max_step_up), "up"
        elif obs.backlog == 0 and self._idle_for(obs.t) >= self.idle_window_s:
            new, reason = p.min_workers, "idle"
        else:
            step = max(1, int(self.desired * p.max_step_down_frac))
            floor = max(r for _, r in self._recent)
            new = min(self.desired, max(floor, self.desired - step))
            reason = "down"
        new = max(p.min_workers, min(p.max_workers, new))
        if new == self.desired:
            reason = "hold"
        self._adapt_idle_window(obs.t, new)
        self.desired = new
        return Decision(t=obs.t, desired=new, recommended=up, reason=reason)

    def _recommend(self, backlog: int, per_worker: float, t: float) -> int:
        p = self.policy
        if backlog > 0:
            return max(1, math.ceil(backlog / per_worker))
        if self._idle_for(t) < self.idle_window_s:
            return max(1, p.min_workers)
        return p.min_workers

    def _adapt_idle_window(self, t: float, new: int) -> None:
        p = self.policy
        if self.desired > 0 and new == 0:
            self.zeroed_at = t
        elif self.desired == 0 and new > 0 and self.zeroed_at is not None:
            slept = t - self.zeroed_at
            if slept < self.idle_window_s:
                self.idle_window_s = min(p.max_idle_to_zero_s, 2 * self.idle_window_s)
            elif slept >= p.max_idle_to_zero_s:
                self.idle_window_s = p.idle_to_zero_s

    def _idle_for(self, t: float) -> float:
        return math.inf if self.last_busy_t is None else t - self.last_busy_t
