"""Iteration-level scheduler: a token budget per step, no prefill or decode phases.

Each request has `num_computed_tokens` and `num_tokens`; a step gives each scheduled request
up to `num_tokens - num_computed_tokens` tokens within `max_num_batched_tokens`. That one rule
covers decode (1 token), chunked prefill (a slice of the prompt), prefix-cache hits (computed
tokens start above 0), recompute after preemption and speculative verification (a decode plus
its `request.spec.token_ids` proposals, whose slots are allocated but never prefix-cached).

Priority is strict at admission too: a waiting request that finds every sequence slot (or the
pool) taken sends the lowest-priority running request of a lower priority back to waiting, so a
live request never waits behind a batch's. The victim's full blocks stay in the prefix cache, so
taking it back up recomputes little more than its last partial block.

Background work steps aside for foreground prompts: a step that prefills a request not marked
`background` (a live prompt arriving while a batch decodes) leaves out the running background
requests and admits none of the waiting ones. Those running keep their blocks and simply compute
nothing for one step, so the live prompt's first token costs its own prefill, not a step of 64
batch decodes.

A request with a LoRA adapter is admitted only once its adapter is in memory (until then it is
`held_back`, like one whose grammar compiles) and holds a device slot (`LoraManager.acquire`),
released when it finishes or is preempted. When an adapter finds every slot busy, later requests
for other adapters wait behind it, so the busy slots drain instead of being refilled for ever;
requests for the base model are admitted as usual.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from ferry.worker.engine.hybrid_kv import HybridKVCacheManager
from ferry.worker.engine.kv_cache import KVCacheManager
from ferry.worker.engine.lora.manager import LoraManager
from ferry.worker.engine.outputs import FinishReason
from ferry.worker.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request]  # scheduled this step, in batch order
    num_scheduled_tokens: list[
        int
    ]  # tokens each one computes this step, speculative ones included (aligned with requests)
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager | HybridKVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark_blocks: int = 0,
        lora: LoraManager | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks  # kept free when admitting, so decodes rarely preempt
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.lora = lora  # adapters' device slots: a request runs only with its adapter in one

    # --- queue management --------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a request and release its blocks. Idempotent."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        self._release_lora(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.metrics.finished_time = time.monotonic()
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def next_step_is_full(self) -> bool:
        """Whether the requests already here would fill the next step (token budget or sequence
        cap), so waiting for more arrivals could not add anything to it. A waiting prompt counts
        the tokens its prefix-cache hit leaves to compute (a burst of cached prompts is a small
        step, which later arrivals can still join); a short pool could shrink it further, so it
        may call a step full that is not, and the caller then merely steps without waiting.
        A step the background stands aside for is full too: what arrives meanwhile is most often
        background work (a batch's next lines), which could not join it, and waiting for it
        would hold the foreground prompt's first token back."""
        if len(self.requests) >= self.max_num_seqs or self._background_stands_aside():
            return True
        wanted = sum(max(1, r.num_tokens - r.num_computed_tokens) for r in self.running)
        for r in self.waiting:
            if r.held_back:
                continue
            wanted += r.num_tokens - self.kv.lookup_prefix(r).num_tokens
            if wanted >= self.max_num_batched_tokens:
                return True
        return wanted >= self.max_num_batched_tokens

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [])
        stands_aside = self._background_stands_aside()
        # 1) Running requests first, in admission order; the pool running short preempts the
        #    lowest-priority, latest-arrived running request (possibly this one).
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if stands_aside and request.background:
                index += 1
                continue
            if request.crossed_long_rope_switch:
                self._recompute_with_long_rope(request)
                continue  # back in waiting; the request now at `index` is the next one
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            # Speculative proposals (decode only) ride along as extra query tokens, as far as the
            # budget goes (and with LongRoPE not past the switch, which recomputes the sequence).
            room = budget - num_new
            if request.long_rope_after is not None and not request.rope_long:
                room = min(room, request.long_rope_after - request.num_tokens)
            request.spec.keep(min(len(request.spec.token_ids), room))
            while self.kv.allocate(request, num_new, lookahead=len(request.spec.token_ids)) is None:
                if request.spec.token_ids:
                    request.spec.keep(0)  # proposals are optional: verify none rather than preempt
                    continue
                victim = max(self.running, key=Request.sort_key)
                victim_index = self.running.index(victim)
                budget += self._preempt(victim, out)
                if victim_index < index:
                    index -= 1
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the request now at `index` is the next one
            num_new += len(request.spec.token_ids)
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            index += 1
        # 2) Waiting requests by priority then arrival, only if nothing had to be preempted; a
        #    request whose grammar is still compiling is passed over (it holds no one up).
        pool_was_short = bool(out.preempted)
        if not pool_was_short and budget > 0:
            budget += self._make_room_for_priority(out, budget)
        index = 0
        slots_full = False  # an adapter found no free slot: later adapters' requests wait behind it
        while not pool_was_short and index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[index]
            if request.held_back or (stands_aside and request.background):  # admitted in a later step
                index += 1
                continue
            if request.lora is not None and (slots_full or not self.lora.acquire(request)):
                # Every slot serves running requests of other adapters. Admitting more of those
                # would keep the slots busy for ever; they drain, and the first slot freed is this
                # one's. (An adapter dropped from memory meanwhile is read again: no slot shortage.)
                slots_full = slots_full or not request.awaiting_lora
                index += 1
                continue
            if request.crossed_long_rope_switch:  # preempted just as it grew past the switch: holds no KV
                self._go_long_rope(request)
            prefix = self.kv.lookup_prefix(request)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            if self.kv.allocate(request, num_new, prefix, reserve=self.watermark_blocks) is None:
                self._release_lora(request)
                break  # head of line waits: admitting lower-priority requests first would invert order
            self.waiting.pop(index)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = prefix.num_tokens
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
        return out

    def _background_stands_aside(self) -> bool:
        """Whether this step leaves the background requests out: there are some, and some
        foreground request has more than its next token to compute (a prompt, a resumed job's
        streamed tokens, a recompute after preemption), running or waiting to be admitted."""
        if not any(r.background for r in self.requests.values()):
            return False
        if any(not r.background and r.num_tokens - r.num_computed_tokens > 1 for r in self.running):
            return True
        return any(not r.background and not r.held_back for r in self.waiting)

    def _make_room_for_priority(self, out: SchedulerOutput, budget: int) -> int:
        """Preempt lower-priority running requests, lowest and latest first, until the
        highest-priority waiting request has a sequence slot and the blocks for this step's
        share of its prompt. Returns the budget given back."""
        head = next((r for r in self.waiting if not r.held_back), None)
        if head is None:
            return 0
        prefix = self.kv.lookup_prefix(head)
        num_new = min(head.num_tokens - prefix.num_tokens, budget)
        given_back = 0
        while len(self.running) >= self.max_num_seqs or not self.kv.fits(head, num_new, prefix, self.watermark_blocks):
            lower = [r for r in self.running if r.priority > head.priority]
            if not lower:
                break
            given_back += self._preempt(max(lower, key=Request.sort_key), out)
        return given_back

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Send a running request back to waiting (recompute later). Returns budget given back."""
        self.running.remove(victim)
        self.kv.free(victim)
        self._release_lora(victim)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.spec.clear()
        victim.spec.num_draft_computed = 0  # the draft's KV went with the blocks
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self._enqueue(victim)
        if victim in out.requests:  # already scheduled this step: unschedule it
            i = out.requests.index(victim)
            out.requests.pop(i)
            return out.num_scheduled_tokens.pop(i)
        return 0

    def _recompute_with_long_rope(self, request: Request) -> None:
        """A LongRoPE sequence just grew past the switch: like transformers, which then drops its
        cache, compute it again from its first token with the long factors. Its short-factor blocks
        stay cached in their own namespace; the request re-enters by priority, as after a preemption
        (not counted as one)."""
        self.running.remove(request)
        self.kv.free(request)
        self._release_lora(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec.clear()
        request.spec.num_draft_computed = 0
        self._go_long_rope(request)
        self._enqueue(request)

    @staticmethod
    def _go_long_rope(request: Request) -> None:
        """From now on the request's KV is rotated with the long factors, in their own namespace."""
        request.rope_long, request.cache_extra = True, request.long_rope_cache_extra
        request.block_keys.clear()

    def _release_lora(self, request: Request) -> None:
        if self.lora is not None:
            self.lora.release(request)

    def _enqueue(self, request: Request) -> None:
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.sort_key()), request)
