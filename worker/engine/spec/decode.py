"""Speculative decoding: who proposes, how the target's verification accepts, and what it cost.

A step with speculation: `SpecDecoder.propose` gives each decoding request up to k proposed
tokens (`request.spec.token_ids`); the scheduler schedules them as extra query tokens after the
request's last known token (counted in the token budget, slots allocated but never cached); the
model runner computes the target's logits at all k+1 rows and calls `verify`; the engine core
rolls `num_computed_tokens` back over the rejected ones, whose KV is simply overwritten later
(`KVCacheManager.trim` returns blocks that held only rejected positions), and the output
processor appends the accepted tokens one by one (stop conditions apply to each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from ferry.worker.engine.config import SpeculativeConfig
from ferry.worker.engine.outputs import PositionLogprobs
from ferry.worker.engine.request import Request
from ferry.worker.engine.sampler import SamplingRow, adjust_logits, draw, sampling_probs, top_logprobs
from ferry.worker.engine.spec.governor import SpecGovernor

_ACCEPTANCE_WEIGHT = 0.3  # weight of the newest verification in a request's running acceptance


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters since the engine started (vLLM's names)."""

    num_drafts: int = 0  # verifications of at least one proposed token
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose (i+1)-th proposal was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: the accepted proposals plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> SpecDecodeStats:
        return replace(self, accepted_per_position=list(self.accepted_per_position))


class Proposer(Protocol):
    catch_up_tokens: int  # the most tokens one request fed the proposer's model this step before proposing
    catch_up_total: int  # the tokens all requests fed it this step before proposing

    def propose(self, requests: list[Request], num_tokens: list[int]) -> None:
        """Set up to num_tokens[i] proposals on requests[i].spec (token_ids, and draft_probs
        where they were drawn from a distribution)."""

    def pending_catch_up(self, requests: list[Request]) -> int:
        """Tokens proposing for `requests` now would first feed the proposer's model, beyond the
        one each request feeds every time (a new prompt, tokens decided while it was idle)."""


class SpecDecoder:
    """Decides who proposes and how many, keeps the statistics, pauses what does not pay."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.governor = SpecGovernor() if config.measure_speedup else None
        self._step_start = 0.0  # perf_counter at this step's propose(): the governor times whole steps
        self._batch_size = 0  # running requests when this step's proposals were decided
        self._quiet_left = 0  # plain steps still to run undecided and untimed (governor.quiet_steps)
        self._quiet_taken = 0  # ... and taken so far in this stretch, since perf_counter _quiet_since
        self._quiet_since = 0.0

    def propose(self, running: list[Request]) -> None:
        """Proposals for this step, for every running request that decodes (all its known tokens
        but the last have KV) and whose speculation pays."""
        if self._quiet_left and len(running) == self._batch_size:
            # A plain stretch the governor granted. Nothing has been proposed since it began
            # (preemption clears a request's proposals), so there is nothing to clear either.
            if not self._quiet_taken:
                self._quiet_since = time.perf_counter()
            self._quiet_left -= 1
            self._quiet_taken += 1
            return
        now = time.perf_counter()
        if self._quiet_taken:  # the stretch ran out, or the batch changed size
            self.governor.note_quiet(self._batch_size, self._quiet_taken, now - self._quiet_since)
        self._quiet_left = self._quiet_taken = 0
        self._step_start, self._batch_size = now, len(running)
        for request in running:
            request.spec.clear()
        cfg = self.config
        # A large batch makes the step compute-bound: verifying k+1 tokens per request costs ~k+1 times.
        if cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size:
            return
        if self.governor is not None:
            self.governor.note_running([r.request_id for r in running])
            if not self.governor.choose(len(running), self.proposer.pending_catch_up(running)):
                # Plain steps ahead may go undecided and untimed, unless a prompt is still being
                # prefilled (its chunks would count as plain decode time).
                if all(r.is_decoding for r in running):
                    self._quiet_left = self.governor.quiet_steps(len(running))
                return
        chosen, counts = [], []
        for request in running:
            if not request.is_decoding:
                continue  # prefilling
            spec = request.spec
            if spec.paused_steps:
                spec.paused_steps -= 1
                if not spec.paused_steps:
                    spec.acceptance = cfg.min_acceptance_rate  # on probation: one more poor verification pauses again
                continue
            # No use proposing what max_tokens or max_model_len would cut: a verification emits up to k+1 tokens.
            room = min(
                request.params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens
            ) - 1
            k = min(cfg.num_speculative_tokens, room)
            if k > 0:
                chosen.append(request)
                counts.append(k)
        if chosen:
            self.proposer.propose(chosen, counts)
        for request in chosen:  # a constrained request verifies only what its grammar allows next
            if request.grammar is not None and request.spec.token_ids:
                request.spec.keep(request.grammar.valid_prefix(request.spec.token_ids))

    def observe(self, requests: list[Request], sampled: dict[str, list[int]]) -> None:
        """Time this step for the governor, if it only decoded (called before the core rolls it back)."""
        if self.governor is None or self._quiet_taken:
            return
        speculated = any(r.spec.token_ids for r in requests)
        # A prefill chunk in the step would make both sides look slow: not the decision's doing.
        if not all(r.is_decoding for r in requests):
            self.governor.unmeasured(self._batch_size)
            return
        # A draft that first caught up on many tokens (a prompt, a long plain stretch) paid a
        # one-off cost: no measure of speculation's speed, but what catching up costs.
        caught_up = speculated and self.proposer.catch_up_tokens > self.config.num_speculative_tokens + 1
        tokens = sum(len(t) for t in sampled.values())
        seconds = time.perf_counter() - self._step_start
        self.governor.observe(
            self._batch_size, speculated, tokens, seconds, self.proposer.catch_up_total if caught_up else 0
        )
        if caught_up:
            self.governor.unmeasured(self._batch_size)

    def record(self, request: Request, num_accepted: int) -> None:
        """Count one verification of `request.spec.token_ids` and update the request's acceptance."""
        num_proposed = len(request.spec.token_ids)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_position[i] += 1
        request.metrics.num_draft_tokens += num_proposed
        request.metrics.num_accepted_tokens += num_accepted
        spec = request.spec
        spec.acceptance += _ACCEPTANCE_WEIGHT * (num_accepted / num_proposed - spec.acceptance)
        if spec.acceptance < self.config.min_acceptance_rate and self.config.pause_steps:
            spec.paused_steps = self.config.pause_steps
        spec.clear()


@dataclass(slots=True)
class VerifyOutput:
    token_ids: list[list[int]]  # per request: its accepted proposals, then one token of the target's
    logprobs: list[list[PositionLogprobs] | None]  # per request: one entry per token, where asked for
    failed: dict[int, str] = field(default_factory=dict)  # request index -> why its rows could not be adjusted


def verify(logits: torch.Tensor, requests: list[Request]) -> VerifyOutput:
    """Accept or reject every request's proposals so that its tokens follow the target exactly.

    logits: [sum of (k_r + 1), vocab] float32, the target's rows request by request: row i of a
    request scores the position after its first i proposals (`request.spec.token_ids`), row k_r
    the position after all of them. Modified in place. A request without proposals has one row
    and is sampled as the plain sampler would.

    With p the target's distribution at a position (after the request's penalties, temperature,
    top-k, top-p and min-p, applied as if the earlier proposals were accepted) and q the
    proposer's (the same transforms applied to the draft's logits; a point mass for n-gram):
      - accept proposal d with probability min(1, p(d) / q(d));
      - on the first rejection, emit a token drawn from normalize(max(0, p - q)) and stop;
      - when all k_r are accepted, emit a bonus token drawn from p at the last row.
    Then P(accept x) = q(x) min(1, p(x)/q(x)) = min(p(x), q(x)), P(reject) = sum_y max(0, p(y) - q(y)),
    so P(reject, then x) = max(0, p(x) - q(x)) and P(emit x) = p(x): exactly the target's
    distribution (Leviathan et al.; Chen et al., 2023). For a point mass at d: accept with
    probability p(d), else draw from p with d removed. Greedy requests are the limit: accept
    while d is the argmax, then emit the argmax, which reproduces non-speculative greedy decoding
    token for token.

    Seeded requests are verified by coupling instead: row i draws the target's token by the
    sampler's own exponential race on the request's next noise vector, and proposal i+1 is
    accepted if it is that token. Each emitted token is then exactly p's draw, and the
    generator advances one vector per emitted token, as without speculation: a seed gives the
    same tokens whether or not, and however much, the request speculated. (The draft proposed by
    racing q on the same noise, `peek_noise`; an n-gram proposal is accepted with probability
    p(d), as above.)
    """
    rows = [SamplingRow(r, r.spec.token_ids[:i]) for r in requests for i in range(len(r.spec.token_ids) + 1)]
    raw = logits.clone() if any(r.params.logprobs is not None for r in requests) else None
    failed_rows = adjust_logits(logits, rows)
    # A request's rows are all greedy or all random; each kind is worked on in one batch.
    greedy_rows = [i for i, row in enumerate(rows) if row.params.greedy]
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    argmax = _take(logits, greedy_rows).argmax(dim=-1).tolist() if greedy_rows else []
    probs = sampling_probs(_take(logits, random_rows), [rows[i] for i in random_rows]) if random_rows else None
    out = VerifyOutput([], [])
    first = 0  # this request's first row in `rows`
    first_greedy = first_random = 0  # ... in `argmax`, in `probs`
    for index, request in enumerate(requests):
        k = len(request.spec.token_ids)
        failure = next((failed_rows[r] for r in range(first, first + k + 1) if r in failed_rows), None)
        if failure is not None:  # its rows are void: no tokens, and the request fails alone
            out.failed[index] = failure
            out.token_ids.append([])
            out.logprobs.append(None)
            first += k + 1
            first_greedy += k + 1 if request.params.greedy else 0
            first_random += 0 if request.params.greedy else k + 1
            continue
        if request.params.greedy:
            tokens = _accept_greedy(request.spec.token_ids, argmax[first_greedy : first_greedy + k + 1])
            first_greedy += k + 1
        else:
            accept = _accept_sampled if request.generator is None else _accept_coupled
            tokens = accept(request, rows[first : first + k + 1], probs[first_random : first_random + k + 1])
            first_random += k + 1
        n = request.params.logprobs
        out.token_ids.append(tokens)
        out.logprobs.append(None if n is None else [top_logprobs(raw, first + j, t, n) for j, t in enumerate(tokens)])
        first += k + 1
    return out


def _take(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    """The rows in `index` (ascending); no copy when that is all of them."""
    return logits if len(index) == logits.shape[0] else logits[index]


def _accept_greedy(proposals: list[int], targets: list[int]) -> list[int]:
    """targets: the target's argmax at each of the k+1 rows."""
    for i, token in enumerate(proposals):
        if token != targets[i]:
            return proposals[:i] + [targets[i]]
    return proposals + [targets[len(proposals)]]


def _accept_coupled(request: Request, rows: list[SamplingRow], p: torch.Tensor) -> list[int]:
    """p: [k+1, vocab]. The target's own draw at each row, one noise vector each, until a proposal differs."""
    proposals = request.spec.token_ids
    tokens: list[int] = []
    for i in range(len(proposals) + 1):
        tokens.append(int(draw(p[i][None], rows[i : i + 1])[0]))
        if i == len(proposals) or tokens[i] != proposals[i]:
            break
    return tokens


def _accept_sampled(request: Request, rows: list[SamplingRow], p: torch.Tensor) -> list[int]:
    """p: [k+1, vocab] the target's distributions; request.spec.draft_probs: [k, vocab] or None (point masses)."""
    proposals, q = request.spec.token_ids, request.spec.draft_probs
    for i, token in enumerate(proposals):
        p_token = float(p[i, token])
        q_token = 1.0 if q is None else float(q[i, token])
        # u < p(d) / q(d), written without the division (q(d) > 0: d was drawn from q).
        if float(torch.rand((), generator=request.generator)) * q_token < p_token:
            continue
        residual = (
            p[i].clone().index_fill_(0, torch.tensor([token]), 0.0) if q is None else (p[i] - q[i]).clamp_(min=0.0)
        )
        if not float(residual.sum()) > 0.0:
            residual = p[i]  # p == q up to rounding: a rejection has probability ~0, any draw from p is right
        # draw() races unnormalised weights: normalising the residual would not change the winner.
        return proposals[:i] + [int(draw(residual[None], rows[i : i + 1])[0])]
    k = len(proposals)
    return proposals + [int(draw(p[k][None], rows[k : k + 1])[0])]
