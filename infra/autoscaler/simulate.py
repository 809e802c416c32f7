"""Replay a job trace against a simulated GPU pool driven by the autoscaler.

The pool model is deliberately small: a worker becomes ready `boot_s` after it is asked for
(node start, image pull, model load, snapshot restore), runs up to `concurrency` jobs at once,
and when scaled in it drains (takes no new job, leaves once its running jobs finish). Every
second a worker exists (booting, serving or draining) is paid for. The autoscaler only sees
what it would see in Redis: lag, pending and live workers, every `tick_s`.

Used by the tests to judge a policy on a burst, a diurnal curve and a trickle, and by
`ferry autoscale --simulate` to tune one before deploying it.
"""

from __future__ import annotations

import csv
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ferry.autoscaler.policy import Autoscaler, Decision, Observation, ScalePolicy


@dataclass(slots=True, frozen=True)
class Job:
    arrival_s: float  # seconds from the start of the trace
    service_s: float  # seconds one worker slot is busy with it


@dataclass(slots=True)
class PoolModel:
    boot_s: float = 120.0  # asked-for → /readyz: GPU node, image, weights, snapshot restore
    concurrency: int = 8  # jobs one worker runs at once (its engine's batch)
    tick_s: float = 15.0  # autoscaler interval
    flap_window_s: float = 600.0  # a scale-up this soon after a scale-down is a flap

    def __post_init__(self) -> None:
        if self.boot_s < 0 or self.tick_s <= 0 or self.concurrency < 1:
            raise ValueError("boot_s >= 0, tick_s > 0 and concurrency >= 1 are required")


@dataclass(slots=True, frozen=True)
class SimResult:
    worker_minutes: float  # every minute a worker existed (booting, serving, draining)
    idle_worker_minutes: float  # minutes a ready worker ran no job: the price of warmth
    ideal_worker_minutes: float  # total service time / concurrency: no policy can pay less
    first_worker_s: tuple[float, ...]  # per cold start: first waiting job → first ready worker
    flaps: int  # scale-ups within flap_window_s of a scale-down: a released GPU booted again
    scale_changes: int  # decisions that changed the desired count
    jobs_done: int
    jobs_total: int
    wait_p50_s: float  # queue wait: arrival → a worker slot
    wait_p95_s: float
    wait_max_s: float
    peak_workers: int
    ends_at_zero: bool  # the pool was empty when the trace ended
    decisions: tuple[Decision, ...] = field(repr=False)

    def summary(self) -> str:
        ttfw = max(self.first_worker_s, default=0.0)
        return (
            f"worker-min {self.worker_minutes:.1f} (idle {self.idle_worker_minutes:.1f}, "
            f"ideal {self.ideal_worker_minutes:.1f}), first worker <= {ttfw:.0f}s over "
            f"{len(self.first_worker_s)} cold starts, flaps {self.flaps}, changes {self.scale_changes}, "
            f"jobs {self.jobs_done}/{self.jobs_total}, wait p50/p95/max "
            f"{self.wait_p50_s:.0f}/{self.wait_p95_s:.0f}/{self.wait_max_s:.0f}s, peak {self.peak_workers}"
        )


@dataclass(slots=True)
class _Worker:
    ready_at: float
    draining: bool = False
    finishes: list[float] = field(default_factory=list)  # heap of running jobs' end times

    def ready(self, t: float) -> bool:
        return self.ready_at <= t and not self.draining


def simulate(jobs: list[Job], policy: ScalePolicy, pool: PoolModel, horizon_s: float) -> SimResult:
    """Run `jobs` (any order) through the pool for `horizon_s` seconds, one-second steps."""
    arrivals = deque(sorted(jobs, key=lambda j: j.arrival_s))
    queue: deque[Job] = deque()
    workers: list[_Worker] = []
    scaler = Autoscaler(policy)
    decisions: list[Decision] = []
    waits: list[float] = []
    first_worker: list[float] = []
    cold_since: float | None = None
    worker_s = idle_s = 0.0
    done = peak = 0
    next_tick = 0.0

    for step in range(int(horizon_s)):
        t = float(step)
        while arrivals and arrivals[0].arrival_s <= t:
            queue.append(arrivals.popleft())
        for w in workers:
            while w.finishes and w.finishes[0] <= t:
                heapq.heappop(w.finishes)
                done += 1
        workers = [w for w in workers if not (w.draining and not w.finishes)]

        ready = [w for w in workers if w.ready(t)]
        if cold_since is not None and ready:
            first_worker.append(t - cold_since)
            cold_since = None
        if queue and not ready and cold_since is None:
            cold_since = queue[0].arrival_s
        while queue and ready:
            w = min(ready, key=lambda w: len(w.finishes))
            if len(w.finishes) >= pool.concurrency:
                break
            job = queue.popleft()
            waits.append(t - job.arrival_s)
            heapq.heappush(w.finishes, t + job.service_s)

        if t >= next_tick:
            next_tick += pool.tick_s
            obs = Observation(
                t=t, lag=len(queue), pending=sum(len(w.finishes) for w in workers), live_workers=len(ready)
            )
            decision = scaler.decide(obs)
            decisions.append(decision)
            workers = _resize(workers, decision.desired, t, pool)

        worker_s += len(workers)
        idle_s += sum(1 for w in workers if w.ready(t) and not w.finishes)
        peak = max(peak, len(workers))

    waits.sort()
    return SimResult(
        worker_minutes=worker_s / 60,
        idle_worker_minutes=idle_s / 60,
        ideal_worker_minutes=sum(j.service_s for j in jobs) / pool.concurrency / 60,
        first_worker_s=tuple(first_worker),
        flaps=count_flaps(decisions, pool.flap_window_s),
        scale_changes=sum(1 for a, b in zip(decisions, decisions[1:], strict=False) if a.desired != b.desired),
        jobs_done=done,
        jobs_total=len(jobs),
        wait_p50_s=_percentile(waits, 0.50),
        wait_p95_s=_percentile(waits, 0.95),
        wait_max_s=waits[-1] if waits else 0.0,
        peak_workers=peak,
        ends_at_zero=not workers,
        decisions=tuple(decisions),
    )


def _resize(workers: list[_Worker], desired: int, t: float, pool: PoolModel) -> list[_Worker]:
    active = [w for w in workers if not w.draining]
    if desired > len(active):
        return workers + [_Worker(ready_at=t + pool.boot_s) for _ in range(desired - len(active))]
    # Scale in: cancel the workers still booting first (latest first), then drain the least busy.
    for w in sorted(active, key=lambda w: (w.ready_at <= t, len(w.finishes), -w.ready_at))[: len(active) - desired]:
        w.draining = True
    return [w for w in workers if not (w.draining and (not w.finishes or w.ready_at > t))]


def count_flaps(decisions: list[Decision], window_s: float) -> int:
    """Scale-ups less than `window_s` after a scale-down.

    Each one re-boots capacity that was just released: a cold start paid for nothing. (A
    scale-down soon after a scale-up is not counted: that is a burst served and gone.)
    """
    flaps = 0
    last_down: float | None = None
    for prev, cur in zip(decisions, decisions[1:], strict=False):
        if cur.desired < prev.desired:
            last_down = cur.t
        elif cur.desired > prev.desired and last_down is not None and cur.t - last_down < window_s:
            flaps += 1
    return flaps


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


# --- traces -------------------------------------------------------------------------------


def burst_trace(start_s: float = 300.0, jobs: int = 400, over_s: float = 60.0, service_s: float = 20.0) -> list[Job]:
    """`jobs` jobs spread evenly over `over_s` seconds, then silence."""
    return [Job(start_s + i * over_s / jobs, service_s) for i in range(jobs)]


def trickle_trace(hours: int = 12, service_s: float = 30.0) -> list[Job]:
    """One job an hour, each at the half hour."""
    return [Job(1800.0 + 3600.0 * h, service_s) for h in range(hours)]


def diurnal_trace(
    seed: int = 7, hours: float = 24.0, peak_per_s: float = 0.5, mean_service_s: float = 20.0
) -> list[Job]:
    """Poisson arrivals whose rate follows a day: zero from 00:00 to 06:00, peak at 15:00.

    Inhomogeneous Poisson by thinning; service times exponential around `mean_service_s`
    (clipped to 2-120 s). Same seed, same trace.
    """
    rng = random.Random(seed)
    out: list[Job] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak_per_s)
        if t >= hours * 3600:
            return out
        if rng.random() < _day_rate(t):
            out.append(Job(t, min(120.0, max(2.0, rng.expovariate(1 / mean_service_s)))))


def _day_rate(t: float) -> float:
    """Fraction of the peak rate at second `t` of the day (0 at night, 1 at 15:00)."""
    hour = (t / 3600) % 24
    if hour < 6:
        return 0.0
    return math.sin(math.pi * (hour - 6) / 18) ** 2


def load_jobs_csv(path: str | Path) -> list[Job]:
    """A recorded trace: CSV with columns `arrival_s,service_s` ('#' lines are comments)."""
    with open(path, newline="") as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return [Job(float(r["arrival_s"]), float(r["service_s"])) for r in rows]
