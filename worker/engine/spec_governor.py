"""Speculate only where it pays, measured: decode-step throughput with and without proposals.

Whether verifying k+1 tokens per request, plus the proposer's own work, beats one token per
request depends on the device, the two models, the batch size and the acceptance of the moment;
no fixed threshold gets all of them right. So for each batch size (rounded to a power of two)
the governor keeps the emitted tokens per second of recent decode-only steps that verified
proposals and of recent ones that did not, measures a few of each first, then lets requests
propose while the median of the first has been the higher, and now and then measures the
slower side again: soon after a change, then at doubling intervals while it stays slower, so
that probing a loss costs little and a change in load or acceptance still shows.

Measurements describe the requests they were taken on (their acceptance, their lengths), so
when the running requests have turned over (fewer than half of them were running when the
governor last started measuring) every bucket starts afresh: a server that moves from free text
to code edits re-measures in a few steps instead of waiting out a long probe interval.

A probe costs more than its step's own time, and the governor keeps it to `probe_budget` (5%)
of the time, in two parts:
- per batch size, what the last probe's timed steps took beyond what the faster side would
  have for the same tokens: the next probe waits until the faster side has run for 1 /
  `probe_budget` times that;
- for the whole engine, the catch-up: a draft model that proposed nothing for a while first
  feeds on every token since (at batch 8, 25 plain steps' tokens took 36 ms against 1.8 ms a
  plain step here). The governor keeps the last catch-up's seconds per token and counts the
  tokens decided plain since speculation last ran; it lets speculation run again (a probe, or a
  batch size's first measurement) only while catching up would cost at most `probe_budget` of
  the plain steps' time since. Where catching up costs more than that share of every step, the
  draft stays idle until the running requests turn over, which also clears these counts.

A probe must come back with a measurement: a step that cannot be timed (the draft first caught
up on the tokens of a long plain stretch, or a prefill chunk shared the step) would otherwise
cost a probe and teach nothing, so such a probe is repeated on the next decision (at most
`_PROBE_RETRIES` times).

Only throughput changes with the decision: greedy tokens are the same either way, sampled ones
follow the same distribution, and seeded ones are the same tokens (see spec_decode.verify).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

_RECENT = 8  # steps per side whose median is the side's speed
_PROBE_RETRIES = 2  # untimed probe steps repeated before the probe is given up until the next interval


@dataclass(slots=True)
class _Side:
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))  # emitted tokens/s of recent steps
    samples: int = 0  # steps measured in all

    @property
    def rate(self) -> float:
        """The median of the recent steps: one step stalled by another process moves it little."""
        return statistics.median(self.recent)


@dataclass(slots=True)
class _Bucket:
    speculating: _Side = field(default_factory=_Side)  # decode steps that verified proposals
    plain: _Side = field(default_factory=_Side)  # decode steps that did not
    faster: bool | None = None  # the side chosen since the last change (None: still measuring)
    since_probe: int = 0  # decisions since the slower side was last measured
    interval: int = 0  # decisions between probes: doubles while probes confirm the choice
    probing: bool = False  # the last decision measured the slower side
    retry: bool = False  # that probe went untimed: the next decision probes again
    retries: int = 0  # untimed steps of the current probe so far
    probe_cost: float = 0.0  # seconds the last probe's timed steps took beyond the faster side's time for their tokens
    banked: float = 0.0  # seconds of steps on the faster side since that probe began


@dataclass(slots=True)
class SpecGovernor:
    min_samples: int = 3  # steps each side is measured before the faster one is chosen
    probe_every: int = 16  # decisions before the slower side is measured again, after a change ...
    max_probe_every: int = 128  # ... doubling up to this while it stays slower (a probe can cost a few steps)
    probe_budget: float = 0.05  # probes may cost at most this share of the time spent on the faster side
    _buckets: dict[int, _Bucket] = field(default_factory=dict)  # by the batch size's bit length
    _measured_on: frozenset[str] = frozenset()  # ids of the requests running when the measurements began
    _catch_up_per_token: float = 0.0  # seconds the proposer's last catch-up took per token it fed
    _missed_tokens: int = 0  # tokens decided plain since speculation last ran (one per running request a step)
    _plain_seconds: float = 0.0  # time of plain decode steps since speculation last ran
    resets: int = 0  # times the measurements started afresh (for tests and stats)

    def note_running(self, request_ids: list[str]) -> None:
        """The requests running this step; starts afresh once most of them are new."""
        current = frozenset(request_ids)
        if not current:
            return
        if len(current & self._measured_on) * 2 < len(current):
            if self._buckets:
                self.resets += 1
            self._buckets.clear()
            self._measured_on = current
            self._missed_tokens, self._plain_seconds = 0, 0.0

    def choose(self, batch_size: int) -> bool:
        """Whether requests may propose in a step of `batch_size` running requests."""
        speculate = self._choose_for(batch_size) and not self._catch_up_too_dear()
        if speculate:
            self._missed_tokens, self._plain_seconds = 0, 0.0
        else:
            self._missed_tokens += batch_size
        return speculate

    def _catch_up_too_dear(self) -> bool:
        return self._catch_up_per_token * self._missed_tokens > self.probe_budget * self._plain_seconds

    def _choose_for(self, batch_size: int) -> bool:
        """The batch size's own choice: measure both sides, then the faster, probing the slower."""
        bucket = self._buckets.setdefault(batch_size.bit_length(), _Bucket())
        for side, speculate in ((bucket.speculating, True), (bucket.plain, False)):
            if side.samples < self.min_samples:
                return speculate
        faster = bucket.speculating.rate >= bucket.plain.rate
        if bucket.retry:
            bucket.retry = False
            return not faster
        if faster != bucket.faster:
            bucket.faster, bucket.interval, bucket.since_probe = faster, self.probe_every, 0
            bucket.probe_cost = bucket.banked = 0.0
        bucket.since_probe += 1
        if bucket.since_probe < bucket.interval or bucket.banked * self.probe_budget < bucket.probe_cost:
            bucket.probing = False
            return faster
        bucket.since_probe, bucket.interval = 0, min(2 * bucket.interval, self.max_probe_every)
        bucket.probing, bucket.retries = True, 0
        bucket.probe_cost = bucket.banked = 0.0
        return not faster

    def unmeasured(self, batch_size: int) -> None:
        """The step just decided could not be timed; if it was a probe, the next decision repeats it."""
        bucket = self._buckets.get(batch_size.bit_length())
        if bucket is not None and bucket.probing and bucket.retries < _PROBE_RETRIES:
            bucket.retries += 1
            bucket.retry = True

    def observe(
        self, batch_size: int, speculated: bool, tokens: int, seconds: float, caught_up_tokens: int = 0
    ) -> None:
        """One decode-only step: `tokens` emitted in `seconds`, proposals verified or not.
        `caught_up_tokens`: the proposer first fed this many tokens it had missed (a prompt, a
        plain stretch); such a step is no measure of speculation's speed, only of catching up."""
        if seconds <= 0:
            return
        if not speculated:
            self._plain_seconds += seconds
        if caught_up_tokens:
            self._catch_up_per_token = seconds / caught_up_tokens
            return
        bucket = self._buckets.setdefault(batch_size.bit_length(), _Bucket())
        side = bucket.speculating if speculated else bucket.plain
        if bucket.faster is not None:
            if speculated == bucket.faster:
                bucket.banked += seconds
            else:
                faster_side = bucket.speculating if bucket.faster else bucket.plain
                bucket.probe_cost += max(0.0, seconds - tokens / faster_side.rate)
        side.recent.append(tokens / seconds)
        side.samples += 1
