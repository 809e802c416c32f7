"""What the engine hands back: per-step deltas (`RequestOutput`) and whole results (`CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each generated token

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
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta)."""

    request_id: str
    new_token_ids: list[int]  # tokens generated in this step
    new_text: str  # text released in this step (stop strings held back until they cannot match)
    new_logprobs: list[PositionLogprobs] | None  # one entry per new token when logprobs were asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (its own processing raised) once finished
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at admission
    num_output_tokens: int  # generated so far, this step included
    metrics: RequestMetrics
    error: Exception | None = None  # what failed it, when finish_reason is "error" and the error is typed


@dataclass(slots=True)
class CompletionOutput:
    """One finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[PositionLogprobs] | None
    metrics: RequestMetrics
