"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) = all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens present in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # per-request RNG: same seed, same tokens, whatever the batch
    stop: list[str] | str | None = None  # strings that end generation; never part of the text
    stop_token_ids: list[int] | None = None  # token ids that end generation (kept in token_ids)
    ignore_eos: bool = False  # keep generating past the model's EOS token
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # return the top-n logprobs (plus the sampled token's) per token
    cache_salt: str | None = None  # prefix-cache namespace: requests share cached KV only with equal salts
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and what is allowed."""
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (self.temperature >= 0.0, "temperature", ">= 0 (0 means greedy)"),
            (0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 or -1 = no limit)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "> 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "an integer >= 0"),
            (self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs", "None or an integer in [0, 20]"),
            (self.seed is None or isinstance(self.seed, int), "seed", "None or an integer"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative token ids"),
            (all(isinstance(s, str) for s in (self.stop or [])), "stop", "a string or a list of strings"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
