"""One mutable object per request: its tokens, how many have KV computed, its blocks, its state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ferry.worker.engine.outputs import FinishReason, PositionLogprobs, RequestMetrics
from ferry.worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferry.worker.engine.lora import LoRARequest
    from ferry.worker.engine.structured import GrammarState


@dataclass(slots=True)
class SpecState:
    """A request's speculative-decoding state: this step's proposals and what the proposer keeps."""

    token_ids: list[int] = field(default_factory=list)  # proposals to verify this step; not in all_token_ids
    draft_probs: torch.Tensor | None = (
        None  # [len(token_ids), vocab] the draft distribution each was drawn from; None = point masses
    )
    num_draft_computed: int = 0  # leading tokens whose KV the draft model holds (draft method)
    acceptance: float = 1.0  # running mean of accepted / proposed over recent verifications
    paused_steps: int = 0  # steps left without proposals after poor acceptance

    def keep(self, n: int) -> None:
        """Verify only the first n proposals (the budget or the pool is short)."""
        del self.token_ids[n:]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:n] if n else None

    def clear(self) -> None:
        self.token_ids = []
        self.draft_probs = None


@dataclass(slots=True)
class BlockTable:
    """A block table in a pool of its own (a hybrid model's windowed layers' `Request.window_table`);
    the request's table over the main pool is the same three fields on the Request itself."""

    block_ids: list[int] = field(default_factory=list)  # block i holds tokens [i*bs, (i+1)*bs); FREED_BLOCK: released
    num_registered_blocks: int = 0  # leading blocks already entered in this pool's prefix cache
    num_window_freed_blocks: int = 0  # leading blocks released once the window passed them


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds blocks and is scheduled each step it fits the budget
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # lower is served first and preempted last (vLLM's convention)
    arrival_seq: int  # monotonic admission order: ties on priority go to the earlier request
    metrics: RequestMetrics
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    cache_extra: bytes = b""  # prefix-cache namespace bytes (model salt + cache_salt)
    # LongRoPE: past this many tokens the sequence is rotated with the long factors (all of it,
    # recomputed at the switch: Scheduler._recompute_with_long_rope); None for every other rope
    long_rope_after: int | None = None
    long_rope_cache_extra: bytes = b""  # the namespace of its KV once long
    rope_long: bool = False  # its KV is rotated with the long factors
    background: bool = False  # background work (a batch's line): steps aside while foreground prompts prefill
    # params.bad_words as token sequences (the input processor tokenizes them): the sampler masks
    # a sequence's last token while the output ends with the tokens before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    all_token_ids: list[int] = field(init=False)  # prompt + output, the tokens KV is computed for
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # params.prompt_logprobs: one entry per prompt position (None at 0: nothing precedes the first
    # token), filled as its prompt chunks are computed
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    block_ids: list[int] = field(default_factory=list)  # block table: block i holds tokens [i*bs, (i+1)*bs)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, lazily extended
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    # leading blocks released since every layer's sliding window passed them (KVCacheManager.window);
    # their places in block_ids hold FREED_BLOCK
    num_window_freed_blocks: int = 0
    # a hybrid model's windowed layers' blocks, in their own pool (hybrid_kv); unused otherwise
    window_table: BlockTable = field(default_factory=BlockTable)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: Exception | None = None  # what ended it, when finish_reason is ERROR
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding (unused when it is off)
    grammar: GrammarState | None = None  # structured outputs: its compile, then its matcher; None = unconstrained
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    lora_ready: bool = False  # its adapter is in host memory and its cache namespace set (lora.manager)
    lora_slot: int = -1  # the device slot its adapter is in while it runs; -1: none

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def crossed_long_rope_switch(self) -> bool:
        """LongRoPE: the sequence just grew past the switch while its KV holds short-factor keys."""
        return self.long_rope_after is not None and not self.rope_long and self.num_tokens > self.long_rope_after

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Every known token but the newest has KV: the next step feeds one token (plus any
        proposals to verify), not a prompt chunk."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def awaiting_grammar(self) -> bool:
        """Its grammar is still compiling: the scheduler leaves it waiting."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def awaiting_lora(self) -> bool:
        """Its adapter is still loading: the scheduler leaves it waiting."""
        return self.lora is not None and not self.lora_ready

    @property
    def held_back(self) -> bool:
        """Something it needs is not ready yet (a grammar, an adapter): it waits, holding no one up."""
        return self.awaiting_grammar or self.awaiting_lora

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def length_reached(self, max_model_len: int) -> bool:
        """It may generate no more: max_tokens are out, or its context is full."""
        return self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len

    def append_output(self, token_id: int, logprobs: PositionLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def sort_key(self) -> tuple[int, int]:
        """Waiting order: priority, then arrival. The preemption victim is the max of this."""
        return (self.priority, self.arrival_seq)
