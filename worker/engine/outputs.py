"""What the engine hands back: per-step deltas (`RequestOutput`) and whole results (`CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a request ended. A StrEnum: `out.finish_reason == "stop"` holds, and it prints as its value."""

    STOP = "stop"  # EOS, a stop token id, a stop string, or the end of its grammar
    LENGTH = "length"  # max_tokens generated, or the context (max_model_len) full
    ABORT = "abort"  # `Engine.abort`
    ERROR = "error"  # its own processing failed: the exception is in `RequestOutput.error`


@dataclass(slots=True)
class Logprob:
    logprob: float  # natural log of the model's probability (raw logits, before sampling transforms)
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None  # the token's text, when a tokenizer is loaded


# One generated position: token id -> Logprob, holding the top-n tokens and the sampled one.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None = None  # when the scheduler first gave it tokens to compute
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each generated token
    num_preemptions: int = 0  # times its KV was freed for another request's (it recomputed)
    num_draft_tokens: int = 0  # speculative proposals verified for it
    num_accepted_tokens: int = 0  # of those, the ones accepted

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first being scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta)."""

    request_id: str
    new_token_ids: list[int]  # tokens generated in this step
    new_text: str  # text released in this step (stop strings held back until they cannot match)
    new_logprobs: list[PositionLogprobs] | None  # one entry per new token when logprobs were asked for
    finished: bool
    finish_reason: FinishReason | None  # why it ended, once finished
    stop_reason: str | int | None  # the stop string (str) or stop token id (int) that ended it, if one did
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at admission
    num_output_tokens: int  # generated so far, this step included
    metrics: RequestMetrics
    # What ended it, exactly when finish_reason is ERROR: a RequestFailedError (its processing raised
    # in a step) or an InvalidStructuredOutputError (its grammar did not compile); see worker.engine.errors
    error: Exception | None = None
    # params.prompt_logprobs, on the request's first output only: one entry per prompt token, None for
    # the first (nothing precedes it), each holding the prompt token's logprob and the top-n at its position
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[PositionLogprobs] | None
    metrics: RequestMetrics
    error: Exception | None = None  # what ended it, when finish_reason is ERROR (as in RequestOutput)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # as in RequestOutput
