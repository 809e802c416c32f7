"""A small, pure, batched sampler: logits in, one token per row out.

Order per row: the grammar mask (structured outputs) -> penalties -> logit_bias -> allowed_token_ids ->
bad_words -> min_tokens mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.
Draws use the exponential race (argmax p/E, E ~ Exp(1)), so a seeded request consumes exactly one
vector of its own generator per token: same seed, same tokens, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ferry.worker.engine.outputs import Logprob, PositionLogprobs
from ferry.worker.engine.request import Request
from ferry.worker.engine.sampling_params import SamplingParams
from ferry.worker.engine.structured import GrammarState, apply_grammars


@dataclass(slots=True)
class SamplingRow:
    """A request as one logits row sees it: with `extra` tokens assumed already generated.

    Speculative verification scores a request's proposals in one pass; the row after the i-th
    proposal must be penalised and min_tokens-masked as if the first i had been accepted. Every
    sampler function takes Requests or SamplingRows alike (they share these attributes)."""

    request: Request
    extra: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.request.eos_token_ids

    @property
    def grammar(self) -> GrammarState | None:
        return self.request.grammar

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self.request.bad_words_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)


Row = Request | SamplingRow


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[PositionLogprobs | None]  # one per row; None where not requested
    failed: dict[int, str] = field(default_factory=dict)  # row -> why its own adjustments raised (its token is void)


def _penalise(logits: torch.Tensor, row: int, request: Row) -> None:
    """Repetition (prompt + output, transformers' rule), presence and frequency (output only)."""
    vocab = logits.shape[-1]
    p = request.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(request.all_token_ids, dtype=torch.int64).clamp_(0, vocab - 1).unique()
        values = logits[row, seen]
        logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, dtype=torch.int64).clamp_(0, vocab - 1)
        counts = torch.zeros(vocab, dtype=logits.dtype).scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_min_tokens(logits: torch.Tensor, row: int, request: Row) -> None:
    p = request.params
    if request.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
        if banned:
            logits[row, banned] = float("-inf")


def _mask_disallowed(logits: torch.Tensor, row: int, allowed: list[int]) -> None:
    """Only `allowed` token ids keep their logits (vLLM's allowed_token_ids)."""
    ids = torch.tensor(allowed, dtype=torch.long)
    kept = logits[row, ids]
    logits[row] = float("-inf")
    logits[row, ids] = kept


def _mask_bad_words(logits: torch.Tensor, row: int, request: Row) -> None:
    """vLLM's bad_words: a word's last token is masked while the output ends with the tokens
    before it (a one-token word is always masked). Only the output counts, not the prompt."""
    output = request.output_token_ids
    banned = [
        word[-1] for word in request.bad_words_token_ids
        if len(word) == 1 or (len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1])
    ]
    if banned:
        logits[row, banned] = float("-inf")


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p drop. logits: [n, vocab], already tempered;
    top_k: [n] int (0 = off), top_p: [n] float (1 = off), min_p: [n] float (0 = off)."""
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).expand_as(sorted_logits)
        drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first token always stays).
        before = probs.cumsum(dim=-1) - probs
        drop = before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def draw(probs: torch.Tensor, requests: Sequence[Row]) -> torch.Tensor:
    """One token per row by the exponential race, each seeded row on its own generator."""
    noise = torch.empty_like(probs).exponential_()
    for row, request in enumerate(requests):
        if request.generator is not None:
            noise[row] = torch.empty(probs.shape[-1], dtype=probs.dtype).exponential_(generator=request.generator)
    return (probs / noise).argmax(dim=-1)


def advance_generator(generator: torch.Generator, n: int, vocab: int) -> None:
    """Consume the noise of n tokens, as draw() would have: a resumed seeded request continues
    on the vectors its uninterrupted run would have used next."""
    for _ in range(n):
        torch.empty(vocab).exponential_(generator=generator)


def peek_noise(request: Row, n: int, vocab: int) -> torch.Tensor:
    """The noise draw() will use for a seeded request's next n tokens, without consuming it:
    [n, vocab]. A draft that races its own distribution on the same noise agrees with the
    target as often as the two distributions allow, and the target's tokens stay the ones the
    seed gives without speculation."""
    state = request.generator.get_state()
    noise = torch.stack([torch.empty(vocab).exponential_(generator=request.generator) for _ in range(n)])
    request.generator.set_state(state)
    return noise


def top_logprobs(raw_logits: torch.Tensor, row: int, token: int, n: int) -> PositionLogprobs:
    logprobs = raw_logits[row].log_softmax(dim=-1)
    result: PositionLogprobs = {}
    if n > 0:
        values, ids = logprobs.topk(n)
        for rank, (tid, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
            result[tid] = Logprob(value, rank)
    if token not in result:
        value = logprobs[token]
        result[token] = Logprob(float(value), int((logprobs > value).sum()) + 1)
    return result


def _bias(logits: torch.Tensor, row: int, logit_bias: dict[int, float]) -> None:
    ids = torch.tensor(list(logit_bias), dtype=torch.long)
    logits[row, ids] += torch.tensor(list(logit_bias.values()), dtype=logits.dtype)


def adjust_logits(logits: torch.Tensor, rows: Sequence[Row]) -> dict[int, str]:
    """The grammar mask, penalties, logit_bias, allowed_token_ids, bad_words, then the min_tokens mask,
    in place: what greedy argmax and sampling both see. Rows without a grammar cost one attribute check for the mask.

    These are the only steps that read one request's own data row by row, so they are where one
    request's bad data could raise: such a row is reported (row -> error) and left as it is, and
    every other row is adjusted as usual. The batch-wide steps after it take validated numbers."""
    constrained = [
        (i, r.grammar, r.extra if isinstance(r, SamplingRow) else ())
        for i, r in enumerate(rows)
        if r.grammar is not None
    ]
    failed: dict[int, str] = apply_grammars(logits, constrained) if constrained else {}
    penalised = any(
        r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty for r in rows
    )
    for row, request in enumerate(rows):
        if row in failed:
            continue
        try:
            if penalised:
                _penalise(logits, row, request)
            if request.params.logit_bias:
                _bias(logits, row, request.params.logit_bias)
            if request.params.allowed_token_ids:
                _mask_disallowed(logits, row, request.params.allowed_token_ids)
            if request.bad_words_token_ids:
                _mask_bad_words(logits, row, request)
            _mask_min_tokens(logits, row, request)
        except Exception as exc:  # any error of one request's data: that request fails alone
            failed[row] = f"{type(exc).__name__}: {exc}"
    return failed


def sampling_probs(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """The distribution each (non-greedy) row draws from: temperature -> top-k -> top-p -> min-p.
    logits: [n, vocab] after adjust_logits; returns [n, vocab] probabilities."""
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    filtered = filter_logits(
        logits / temperature[:, None],
        torch.tensor([r.params.top_k for r in rows]),
        torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype),
        torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype),
    )
    return filtered.softmax(dim=-1)


def sample(logits: torch.Tensor, requests: Sequence[Row]) -> SamplerOutput:
    """logits: [n, vocab] float32, row i for requests[i]. Rows are modified in place."""
    raw = logits.clone() if any(r.params.logprobs is not None for r in requests) else None
    failed = adjust_logits(logits, requests)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        sub = [requests[i] for i in random_rows]
        tokens[rows] = draw(sampling_probs(logits.index_select(0, rows), sub), sub)
    token_list = tokens.tolist()
    logprobs: list[PositionLogprobs | None] = [
        None if r.params.logprobs is None or i in failed else top_logprobs(raw, i, token_list[i], r.params.logprobs)
        for i, r in enumerate(requests)
    ]
    return SamplerOutput(token_list, logprobs, failed)
