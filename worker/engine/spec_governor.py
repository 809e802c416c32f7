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

A probe costs more than its own step: a draft model that proposed nothing for a while first
catches up on every token since (at batch 8, 25 plain steps' tokens took 36 ms against 1.8 ms a
plain step here). So the governor keeps what the last probe cost, its steps' time beyond what
the faster side would have taken for the same tokens, in two parts: the catch-up, which grows
with the decisions since the probe before (so it is kept per decision), and the rest. The next
probe starts only once the faster side's time since the last one, times `probe_budget`, covers
what a probe would cost then: probing costs at most that share of the time. Where catching up
alone costs more than that share of each step, there is no further probe until the running
requests turn over.

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
    # What the last probe cost: seconds its steps took beyond the faster side's time for their tokens.
    probe_cost: float = 0.0  # its timed steps
    catch_up_cost: float = 0.0  # its catch-up steps (the draft feeding on what it had missed) ...
    absent: int = 0  # ... after this many decisions since the probe before
    banked: float = 0.0  # seconds of steps on the faster side since that probe began


@dataclass(slots=True)
class SpecGovernor:
    min_samples: int = 3  # steps each side is measured before the faster one is chosen
    probe_every: int = 16  # decisions before the slower side is measured again, after a change ...
    max_probe_every: int = 128  # ... doubling up to this while it stays slower (a probe can cost a few steps)
    probe_budget: float = 0.05  # probes may cost at most this share of the time spent on the faster side
    _buckets: dict[int, _Bucket] = field(default_factory=dict)  # by the batch size's bit length
    _measured_on: frozenset[str] = frozenset()  # ids of the requests running when the measurements began
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

    def choose(self, batch_size: int) -> bool:
        """Whether requests may propose in a step of `batch_size` running requests."""
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
            bucket.probe_cost = bucket.catch_up_cost = bucket.banked = 0.0
        bucket.since_probe += 1
        if bucket.since_probe < bucket.interval or bucket.banked * self.probe_budget < self._next_probe_cost(bucket):
            bucket.probing = False
            return faster
        bucket.absent, bucket.since_probe = bucket.since_probe, 0
        bucket.interval = min(2 * bucket.interval, self.max_probe_every)
        bucket.probing, bucket.retries = True, 0
        bucket.probe_cost = bucket.catch_up_cost = bucket.banked = 0.0
        return not faster

    @staticmethod
    def _next_probe_cost(bucket: _Bucket) -> float:
        """What a probe now would cost, from the last one: its catch-up scaled to the decisions since."""
        catch_up_per_decision = bucket.catch_up_cost / bucket.absent if bucket.absent else 0.0
        return bucket.probe_cost + catch_up_per_decision * bucket.since_probe

    def unmeasured(self, batch_size: int) -> None:
        """The step just decided could not be timed; if it was a probe, the next decision repeats it."""
        bucket = self._buckets.get(batch_size.bit_length())
        if bucket is not None and bucket.probing and bucket.retries < _PROBE_RETRIES:
            bucket.retries += 1
            bucket.retry = True

    def observe(self, batch_size: int, speculated: bool, tokens: int, seconds: float, timed: bool = True) -> None:
        """One decode-only step: `tokens` emitted in `seconds`, proposals verified or not. An
        untimed step (`timed=False`: the draft caught up first) counts toward what a probe
        costs, not toward either side's speed."""
        if seconds <= 0:
            return
        bucket = self._buckets.setdefault(batch_size.bit_length(), _Bucket())
        side = bucket.speculating if speculated else bucket.plain
        if bucket.faster is not None:
            if speculated == bucket.faster:
                bucket.banked += seconds
            else:
                faster_side = bucket.speculating if bucket.faster else bucket.plain
                extra = max(0.0, seconds - tokens / faster_side.rate)
                if timed:
                    bucket.probe_cost += extra
                else:
                    bucket.catch_up_cost += extra
        if not timed:
            return
        side.recent.append(tokens / seconds)
        side.samples += 1
