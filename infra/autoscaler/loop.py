"""One autoscaler tick over every model, and a CSV recording of what it saw and decided.

A recording (`ferry autoscale --record FILE`) can be replayed through another policy with
`replay()` to see what it would have decided on the same traffic.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from ferry.autoscaler.policy import Autoscaler, Decision, Observation, ScalePolicy
from ferry.autoscaler.redis_source import RedisBacklog

log = logging.getLogger("ferry.autoscale")

RECORD_FIELDS = ["t", "model", "lag", "pending", "live_workers", "desired", "recommended", "reason"]


class DecisionReporter(Protocol):
    """Where each tick's observation and decision are reported (CloudWatch, Prometheus gauges)."""

    def publish(self, model: str, obs: Observation, decision: Decision) -> None: ...


class Actuator(Protocol):
    def apply(self, model: str, desired: int) -> None: ...


@dataclass
class AutoscaleLoop:
    source: RedisBacklog
    policy: ScalePolicy
    models: list[str]
    publishers: list[DecisionReporter] = field(default_factory=list)
    actuators: list[Actuator] = field(default_factory=list)
    record_to: TextIO | None = None  # CSV sink for --record
    scalers: dict[str, Autoscaler] = field(default_factory=dict)

    def tick(self, t: float) -> dict[str, Decision]:
        """Observe, decide, publish; actuators are called only when a count changes."""
        decisions = {}
        for model, obs in self.source.observe(self.models, t).items():
            scaler = self.scalers.get(model)
            if scaler is None:
                # (Re)start from what runs now, as if it had just been busy: a restart of
                # the autoscaler must not empty a pool that is still serving.
                scaler = Autoscaler(self.policy, desired=obs.live_workers)
                scaler.last_busy_t = t if obs.live_workers else None
                self.scalers[model] = scaler
                changed = True
            else:
                changed = False
            before = scaler.desired
            decision = scaler.decide(obs)
            changed = changed or decision.desired != before
            for publisher in self.publishers:
                publisher.publish(model, obs, decision)
            if changed:
                log.info(
                    "model=%s desired=%d (%s) lag=%d pending=%d live=%d",
                    model,
                    decision.desired,
                    decision.reason,
                    obs.lag,
                    obs.pending,
                    obs.live_workers,
                )
                for actuator in self.actuators:
                    actuator.apply(model, decision.desired)
            if self.record_to is not None:
                _write_row(self.record_to, model, obs, decision)
            decisions[model] = decision
        return decisions


def _write_row(f: TextIO, model: str, obs: Observation, d: Decision) -> None:
    if f.tell() == 0:
        f.write(",".join(RECORD_FIELDS) + "\n")
    f.write(f"{obs.t:.3f},{model},{obs.lag},{obs.pending},{obs.live_workers},{d.desired},{d.recommended},{d.reason}\n")
    f.flush()


def read_recording(path: str | Path) -> dict[str, list[tuple[Observation, Decision]]]:
    """A `--record` CSV, per model, in time order."""
    out: dict[str, list[tuple[Observation, Decision]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            t = float(row["t"])
            obs = Observation(t, int(row["lag"]), int(row["pending"]), int(row["live_workers"]))
            d = Decision(t, int(row["desired"]), int(row["recommended"]), row["reason"])
            out.setdefault(row["model"], []).append((obs, d))
    return out


def replay(observations: list[Observation], policy: ScalePolicy) -> list[Decision]:
    """Decisions `policy` would take on recorded observations (starting like the loop does)."""
    if not observations:
        return []
    first = observations[0]
    scaler = Autoscaler(policy, desired=first.live_workers)
    scaler.last_busy_t = first.t if first.live_workers else None
    return [scaler.decide(obs) for obs in observations]
