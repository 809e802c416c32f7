"""Logprobs on the wire: a generated token's (`TokenLogprob`, on token events when asked for), and
the prompt's (vLLM's `prompt_logprobs`: per prompt position, the prompt token's logprob and the top-n
at that position, each with its rank; the first position has none, nothing precedes the first
token; carried by a job's first token event and kept in its result)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TopLogprob(BaseModel):
    token_id: int
    token: str | None = None
    logprob: float


class TokenLogprob(BaseModel):
    """The sampled token's logprob and the most likely alternatives at its position."""

    token_id: int
    token: str | None = None
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class RankedLogprob(BaseModel):
    logprob: float
    rank: int  # 1 = the most likely token at its position
    token: str | None = None  # its text, when the worker has a tokenizer


# One entry per prompt token: token id -> its logprob (the prompt token's, and the top-n), None first.
PromptLogprobs = list[dict[int, RankedLogprob] | None]
