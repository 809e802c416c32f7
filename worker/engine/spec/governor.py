"""Speculate only where it pays, measured: decode-step throughput with and without proposals.

Whether verifying k+1 tokens per request, plus the proposer's own work, beats one token per
request depends on the device, the two models, the batch size and the acceptance of the moment:
no fixed threshold gets all of them right (bench/README.md, "The speedup governor"). So for each
batch size (rounded to a power of two) the governor times recent decode-only steps with proposals
and without, measures a few of each first, then lets requests propose while that side's rate
(tokens over time) has been the higher, and probes the slower side now and then: soon after a
change, then at doubling intervals while it stays slower, so that a probe costs little and a
change in load or acceptance still shows. A probe's first timed step replaces the slower side's
stale samples; a switch takes two probe steps that agree. When most running requests are new,
each batch size keeps its measurements but probes again soon. Probes, and a draft model's
catch-up on tokens it missed, may cost at most `probe_budget` of the faster side's time.

Only throughput changes with the decision: greedy tokens are the same either way, sampled ones
follow the same distribution, and seeded ones are the same tokens (see spec/decode.py, `verify`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

_RECENT = 8  # steps per side whose tokens over their time are the side's speed
_PROBE_RETRIES = 2  # untimed probe steps repeated before the probe is given up until the next interval
_QUIET_MAX = 7  # plain steps at most that follow a plain decision without being decided and timed
_STALL = 3.0  # a step this many times its side's median took was stalled from outside: not counted


@dataclass(slots=True)
class _Side:
    # (tokens, seconds) of recent steps
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_RECENT))
    samples: int = 0  # steps measured in all
    rate: float = 0.0  # tokens per second of the recent steps (see add), kept: every step's decision reads it

    def add(self, tokens: int, seconds: float, replace: bool = False) -> None:
        """One measured step (`replace`: instead of the recent ones). The rate is the recent
        steps' tokens over their time, leaving out a step that took more than `_STALL` times the
        median: another process stalled it, and it says nothing of this side. Tokens are summed,
        not taken at the median: a verification emits anything from 1 to k + 1 tokens, and a
        step where more requests proposed takes longer and emits more."""
        if replace:
            self.recent.clear()
        self.recent.append((tokens, seconds))
        self.samples += 1
        times = sorted(s for _, s in self.recent)
        n = len(times)
        cutoff = _STALL * (times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2)
        kept = [(t, s) for t, s in self.recent if s <= cutoff]
        self.rate = sum(t for t, _ in kept) / sum(s for _, s in kept)


@dataclass(slots=True)
class _Bucket:
    speculating: _Side = field(default_factory=_Side)  # decode steps that verified proposals
    plain: _Side = field(default_factory=_Side)  # decode steps that did not
    faster: bool | None = None  # the side chosen since the last change (None: still measuring)
    since_probe: int = 0  # decisions since the slower side was last measured
    interval: int = 0  # decisions between probes: doubles while probes confirm the choice
    probing: bool = False  # the last decision measured the slower side
    stale: bool = False  # a probe began: its first timed step replaces the slower side's samples
    fresh: int = 0  # the slower side's timed steps since that replacement (one alone does not switch)
    retry: bool = False  # that probe went untimed: the next decision probes again
    retries: int = 0  # untimed steps of the current probe so far
    probe_cost: float = 0.0  # seconds the last probe's timed steps took beyond the faster side's time for their tokens
    banked: float = 0.0  # seconds of steps on the faster side since that probe began


@dataclass(slots=True)
class SpecGovernor:
    min_samples: int = 3  # steps each side is measured before the faster one is chosen
    probe_every: int = 16  # decisions before the slower side is measured again, after a change ...
    max_probe_every: int = 128  # ... doubling up to this while it stays slower (a probe can cost a few steps)
    probe_budget: float = 0.025  # probes may cost at most this share of the time spent on the faster side
    _buckets: dict[int, _Bucket] = field(default_factory=dict)  # by the batch size's bit length
    _measured_on: frozenset[str] = frozenset()  # ids of the requests running at the last turnover
    _catch_up_per_token: float = 0.0  # seconds the proposer's last catch-up took per token it fed
    _plain_seconds: float = 0.0  # time of plain decode steps since speculation last ran
    turnovers: int = 0  # times the running requests turned over (for tests and stats)

    def note_running(self, request_ids: list[str]) -> None:
        """The requests running this step; once most of them are new, every batch size's slower
        side is measured again within `probe_every` decisions (budget permitting)."""
        current = frozenset(request_ids)
        if not current:
            return
        if len(current & self._measured_on) * 2 < len(current):
            if self._measured_on:
                self.turnovers += 1
            self._measured_on = current
            for bucket in self._buckets.values():
                bucket.since_probe, bucket.interval = 0, self.probe_every

    def choose(self, batch_size: int, catch_up_tokens: int = 0) -> bool:
        """Whether requests may propose in a step of `batch_size` running requests.
        catch_up_tokens: what the proposer would first feed on, beyond one token per request
        (a new prompt, tokens decided while it was idle)."""
        speculate = self._choose_for(batch_size, self._catch_up_per_token * catch_up_tokens)
        if speculate:
            self._plain_seconds = 0.0
        return speculate

    def _affordable(self, catch_up_seconds: float) -> bool:
        """Whether trying speculation (not known to be faster) may first spend this on catching up."""
        return catch_up_seconds <= self.probe_budget * self._plain_seconds

    def _choose_for(self, batch_size: int, catch_up_seconds: float) -> bool:
        """The batch size's own choice: measure both sides, then the faster, probing the slower."""
        bucket = self._buckets.setdefault(batch_size.bit_length(), _Bucket())
        if bucket.speculating.samples < self.min_samples and self._affordable(catch_up_seconds):
            return True
        if bucket.plain.samples < self.min_samples or bucket.speculating.samples < self.min_samples:
            return False
        faster = bucket.speculating.rate >= bucket.plain.rate
        if bucket.retry:
            bucket.retry = False
            if bucket.faster or self._affordable(catch_up_seconds):
                return not bucket.faster
        if faster != bucket.faster and bucket.fresh == 1:
            # One probe step says the slower side is now the faster: measure it once more before
            # switching (bench/README.md: one verification's tokens vary widely).
            bucket.probing, bucket.retries = True, 0
            return faster
        if faster != bucket.faster:
            bucket.faster, bucket.interval, bucket.since_probe = faster, self.probe_every, 0
            bucket.probe_cost = bucket.banked = 0.0
        bucket.since_probe += 1
        if (bucket.since_probe < bucket.interval or bucket.banked * self.probe_budget < bucket.probe_cost
                or not (faster or self._affordable(catch_up_seconds))):
            bucket.probing = False
            return faster
        bucket.since_probe, bucket.interval = 0, min(2 * bucket.interval, self.max_probe_every)
        bucket.probing, bucket.retries, bucket.stale = True, 0, True
        bucket.probe_cost = bucket.banked = 0.0
        return not faster

    def quiet_steps(self, batch_size: int) -> int:
        """How many plain steps of `batch_size` may follow the decision just made without being
        decided or timed (then `note_quiet`): where plain was chosen, not as a probe, up to the
        next probe's turn (a probe held back by its budget may wait up to `_QUIET_MAX` steps more).
        A plain step of a tiny model takes a fraction of a millisecond: deciding and timing every
        one, right after the model's weights went through the caches, would be a visible share of it."""
        bucket = self._buckets.get(batch_size.bit_length())
        if bucket is None or bucket.faster or bucket.probing or bucket.retry:
            return 0
        if bucket.faster is None:  # still measuring: quiet only while speculation waits for an affordable catch-up
            return _QUIET_MAX if bucket.plain.samples >= self.min_samples else 0
        until_probe = bucket.interval - bucket.since_probe - 1
        return min(_QUIET_MAX, until_probe) if until_probe > 0 else _QUIET_MAX

    def note_quiet(self, batch_size: int, steps: int, seconds: float) -> None:
        """`steps` plain steps of `batch_size` ran undecided and untimed, `seconds` in all."""
        bucket = self._buckets.get(batch_size.bit_length())
        if bucket is None:
            return
        bucket.since_probe += steps
        bucket.banked += seconds
        self._plain_seconds += seconds

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
        replace = False
        if bucket.faster is not None:
            if speculated == bucket.faster:
                bucket.banked += seconds
            else:
                faster_side = bucket.speculating if bucket.faster else bucket.plain
                bucket.probe_cost += max(0.0, seconds - tokens / faster_side.rate)
                replace, bucket.stale = bucket.stale, False  # a probe's first step: its side's samples are stale
                bucket.fresh = 1 if replace else bucket.fresh + 1
        side.add(tokens, seconds, replace)
