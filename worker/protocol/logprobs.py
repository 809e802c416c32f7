"""Prompt logprobs on the wire (vLLM's `prompt_logprobs`): per prompt position, the prompt token's
logprob and the top-n at that position, each with its rank. The first position has none (nothing
precedes the first token). Carried by a job's first token event and kept in its result."""

from __future__ import annotations

from pydantic import BaseModel


class RankedLogprob(BaseModel):
    logprob: float
    rank: int  # 1 = the most likely token at its position
    token: str | None = None  # its text, when the worker has a tokenizer


# One entry per prompt token: token id -> its logprob (the prompt token's, and the top-n), None first.
PromptLogprobs = list[dict[int, RankedLogprob] | None]
