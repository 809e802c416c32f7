"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names).

Defaults and allowed values come from the one table of sampling fields
(`worker.protocol.sampling`), which the API's request schemas read too. A few fields may stay
unset (None) until the engine admits the request: `max_tokens` (then the rest of the context
window) and the fields of `MODEL_DEFAULTS` (then the model's generation_config.json);
`Engine.add_request` resolves them with `resolved` (in its input processor), so the sampler
only ever sees values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ferry.worker.engine.errors import InvalidSamplingParams
from ferry.worker.engine.structured.params import StructuredOutputs
from ferry.worker.protocol.sampling import (
    LIMITS,
    MAX_TOKENS_LIMIT,
    MODEL_DEFAULTS,
    SAMPLING_LIMITS,
    combination_problem,
    logit_bias_problem,
)

__all__ = ["InvalidSamplingParams", "SamplingParams"]

def _default(name: str):
    return LIMITS[name].default


@dataclass
class SamplingParams:
    max_tokens: int | None = _default("max_tokens")  # tokens to generate at most; None: the rest of the context
    temperature: float | None = _default("temperature")  # 0 = greedy; None: the model's default
    top_p: float | None = _default("top_p")  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int | None = _default("top_k")  # keep the k most likely tokens; 0 (or -1) = all
    min_p: float = _default("min_p")  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float | None = _default("repetition_penalty")  # >1 discourages tokens of prompt and output
    presence_penalty: float = _default("presence_penalty")  # subtracted once from tokens present in the output
    frequency_penalty: float = _default("frequency_penalty")  # subtracted per occurrence in the output
    seed: int | None = _default("seed")  # per-request RNG: same seed, same tokens, whatever the batch
    stop: list[str] | str | None = _default("stop")  # strings that end generation; never part of the text
    stop_token_ids: list[int] | None = _default("stop_token_ids")  # token ids that end generation (kept in token_ids)
    ignore_eos: bool = _default("ignore_eos")  # keep generating past the model's EOS token
    min_tokens: int = _default("min_tokens")  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = _default("logprobs")  # return the top-n logprobs (plus the sampled token's) per token
    allowed_token_ids: list[int] | None = _default("allowed_token_ids")  # only these may be sampled; None: all
    bad_words: list[str] | None = _default("bad_words")  # words never generated (tokenized by the input processor)
    include_stop_str_in_output: bool = _default("include_stop_str_in_output")  # the stop string / token's text kept
    skip_special_tokens: bool = _default("skip_special_tokens")  # special tokens left out of the text
    spaces_between_special_tokens: bool = _default("spaces_between_special_tokens")  # without skipping: spaced
    truncate_prompt_tokens: int | None = _default("truncate_prompt_tokens")  # keep the last k prompt tokens
    # The logprob of each prompt token given the ones before it, with the top-n at its position; such a
    # prompt skips the prefix cache (a cached block has KV but no logits).
    prompt_logprobs: int | None = _default("prompt_logprobs")
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    cache_salt: str | None = None  # prefix-cache namespace: requests share cached KV only with equal salts
    # A grammar the output must match (JSON schema, regex, choice, EBNF); a dict of its fields is accepted too.
    structured_outputs: StructuredOutputs | None = None
    # A reasoning model's grammar applies to its answer only (worker.engine.structured.reasoning): from
    # the token after the output has generated these in a row (the model's `</think>`); None: from the first.
    reasoning_end_token_ids: list[int] | None = None
    # With reasoning_end_token_ids: only an output whose first token is this one (`<think>`'s) thinks; the
    # first token may be it or one the grammar allows. None: every output thinks first.
    reasoning_start_token_id: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):  # a bare string is a list of one
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])
        for name in ("stop", "stop_token_ids", "bad_words", "allowed_token_ids", "reasoning_end_token_ids"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        self.validate()
        self.stop_strings = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if self.top_k == -1:  # None stays None: unset until `resolved`
            self.top_k = 0

    def validate(self) -> None:
        """Raise InvalidSamplingParams naming the field, the value and what is allowed."""
        for limit in SAMPLING_LIMITS:
            value = getattr(self, limit.name)
            problem = limit.check(value)
            if problem is not None:
                raise InvalidSamplingParams(f"invalid {limit.name}={_short(value)}: {problem}")
        problem = logit_bias_problem(self.logit_bias)
        if problem is not None:
            raise InvalidSamplingParams(f"invalid logit_bias={_short(self.logit_bias)}: {problem}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidSamplingParams(f"invalid cache_salt={_short(self.cache_salt)}: must be a string or None")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs | dict):
            raise InvalidSamplingParams(f"invalid structured_outputs={_short(so)}: must be a StructuredOutputs")
        problem = _reasoning_problem(self.reasoning_end_token_ids, self.reasoning_start_token_id)
        if problem is not None:
            raise InvalidSamplingParams(problem)
        problem = combination_problem(self.min_tokens, self.max_tokens, so is not None)
        if problem is not None:
            raise InvalidSamplingParams(problem)

    def resolved(self, model_defaults: dict[str, float | int], remaining: int) -> SamplingParams:
        """A copy with every unset field given its value: `max_tokens` the `remaining` context
        (max_model_len minus the prompt), the others the model's `model_defaults` (from its
        generation_config.json), else `MODEL_DEFAULTS`. Raises InvalidSamplingParams as the
        constructor does (min_tokens beyond the remaining context, say)."""
        unset = {name: model_defaults.get(name, value) for name, value in MODEL_DEFAULTS.items()
                 if getattr(self, name) is None}
        if self.max_tokens is None:
            unset["max_tokens"] = max(1, min(remaining, MAX_TOKENS_LIMIT))
        return replace(self, **unset) if unset else self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _reasoning_problem(end: list[int] | None, start: int | None) -> str | None:
    def token_id(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if end is not None and not (isinstance(end, list) and end and all(token_id(t) for t in end)):
        return f"invalid reasoning_end_token_ids={_short(end)}: must be a non-empty list of token ids"
    if start is not None and not token_id(start):
        return f"invalid reasoning_start_token_id={_short(start)}: must be a token id"
    if start is not None and end is None:
        return "reasoning_start_token_id needs reasoning_end_token_ids"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
