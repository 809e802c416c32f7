"""The sampling fields a request may carry and the values each allows: declared once, here.

Three schemas read this table: the engine's `SamplingParams` (which checks values in
`validate`), the job request of the wire (`JobRequest`, pydantic) and the OpenAI-compatible
request bodies of the API. A test walks the table against each of them, so a limit changed
here changes everywhere, and a field added to one schema but not to the table fails the suite.
The rules across fields (min_tokens against max_tokens and structured_outputs) are stated once
too, in `combination_problem`.

This module imports nothing but the standard library: the engine, the API and the wire all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKENS_LIMIT = 1 << 20  # far beyond any context window; keeps every count a small integer
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more ids than any vocabulary has
MAX_BAD_WORDS = 64
TOKEN_ID_MAX = 2**31 - 1  # a token id or count the API accepts before it knows the model's vocabulary
# logit_bias (OpenAI's): token id -> a bias added to its logit before sampling; -100 all but bans
# the token, 100 all but forces it. Not a Limit: a map, checked by `logit_bias_problem` and by the
# wire's `LogitBias` type (worker.protocol.jobs), both from these two numbers.
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_MAX = 100.0


def logit_bias_problem(value: object) -> str | None:
    """Why `value` is not a logit_bias map (token id -> bias), or None when it is (None: no bias)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must be a map of token id to bias"
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        return f"must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries"
    for token, bias in value.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= TOKEN_ID_MAX:
            return f"token ids must be integers >= 0 ({token!r} is not)"
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            return f"biases must be numbers in [-{_num(LOGIT_BIAS_MAX)}, {_num(LOGIT_BIAS_MAX)}] ({bias!r} is not)"
    return None


def combination_problem(min_tokens: int, max_tokens: int | None, structured: bool) -> str | None:
    """Why these values are not allowed together (the rules across fields, which no `Limit` can
    state), or None when they are. `structured`: the request has structured_outputs."""
    if max_tokens is not None and min_tokens > max_tokens:
        return f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})"
    if structured and min_tokens:
        return "min_tokens cannot be combined with structured_outputs (the grammar decides the end)"
    return None


@dataclass(frozen=True, slots=True)
class Limit:
    """One sampling field: its type, default and allowed range (None: no bound on that side)."""

    name: str
    kind: type  # int | float | bool | str ("str" fields are the stop strings); lists are `items` of this kind
    default: object
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    nullable: bool = False  # None is a valid value (e.g. seed: no seed)
    items: bool = False  # a list of `kind` values (each within the bounds), `min_items` to `max_items` long
    max_items: int | None = None
    min_items: int = 0
    doc: str = ""

    def check(self, value: object) -> str | None:
        """Why `value` is not allowed (a phrase naming what is), or None when it is."""
        if value is None:
            return None if self.nullable else f"must be {self.allowed()}"
        if self.items:
            if not isinstance(value, list | tuple):
                return f"must be a list of {self._range('values')}"
            if self.max_items is not None and len(value) > self.max_items:
                return f"must hold at most {self.max_items} values"
            if len(value) < self.min_items:
                return f"must hold at least {self.min_items} value{'s' if self.min_items > 1 else ''}"
            bad = next((v for v in value if self._scalar_problem(v)), None)
            return None if bad is None else f"must be a list of {self._range('values')} ({bad!r} is not)"
        return f"must be {self.allowed()}" if self._scalar_problem(value) else None

    def _scalar_problem(self, value: object) -> bool:
        if self.kind is bool:
            return not isinstance(value, bool)
        if self.kind is str:
            return not isinstance(value, str) or not value  # an empty stop string would end every output at once
        if isinstance(value, bool) or not isinstance(value, int | float):
            return True
        if self.kind is int and not isinstance(value, int):
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return True
        return not (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def allowed(self) -> str:
        """The allowed values in words, for error messages."""
        text = self._range("a boolean" if self.kind is bool else "a non-empty string" if self.kind is str else None)
        if self.items:
            text = f"a list of {self._range('values')}"
        return f"{text} or null" if self.nullable else text

    def _range(self, noun: str | None) -> str:
        if noun is not None and self.kind in (bool, str):
            return noun if not self.items else ("non-empty strings" if self.kind is str else "booleans")
        kind = "integer" if self.kind is int else "finite number"
        parts = []
        if self.ge is not None:
            parts.append(f">= {_num(self.ge)}")
        if self.gt is not None:
            parts.append(f"> {_num(self.gt)}")
        if self.le is not None:
            parts.append(f"<= {_num(self.le)}")
        if self.lt is not None:
            parts.append(f"< {_num(self.lt)}")
        noun = f"{kind}s" if self.items else f"an {kind}" if kind == "integer" else f"a {kind}"
        return f"{noun} {' and '.join(parts)}" if parts else noun


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# The fields whose unset value (None) takes the model's `generation_config.json` value, and the
# value each takes when the model's file says nothing (vLLM's rule: a client that sets none of them
# gets the sampling the model's authors recommend, not a flat temperature 1).
MODEL_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
_FROM_MODEL = "; unset: the model's generation_config.json, else "

# Every sampling field, in vLLM's names. Defaults are the engine's; the API leaves a field unset
# (None) where the client did not send it and the engine default applies. An unset `max_tokens` is
# the rest of the context window (max_model_len minus the prompt), which only the engine knows.
SAMPLING_LIMITS: tuple[Limit, ...] = (
    Limit(
        "max_tokens", int, None, ge=1, le=MAX_TOKENS_LIMIT, nullable=True,
        doc="tokens to generate at most; unset: the rest of the context window",
    ),
    Limit("temperature", float, None, ge=0.0, le=100.0, nullable=True, doc="0 = greedy" + _FROM_MODEL + "1"),
    Limit(
        "top_p", float, None, gt=0.0, le=1.0, nullable=True,
        doc="nucleus: the smallest set of tokens whose probability reaches top_p" + _FROM_MODEL + "1",
    ),
    Limit(
        "top_k", int, None, ge=-1, le=TOKEN_ID_MAX, nullable=True,
        doc="the k most likely tokens; 0 or -1 = all" + _FROM_MODEL + "0",
    ),
    Limit("min_p", float, 0.0, ge=0.0, le=1.0, doc="drop tokens less likely than min_p x the most likely one"),
    Limit(
        "repetition_penalty", float, None, gt=0.0, le=100.0, nullable=True,
        doc="> 1 discourages tokens of the prompt and output" + _FROM_MODEL + "1",
    ),
    Limit("presence_penalty", float, 0.0, ge=-2.0, le=2.0, doc="subtracted once from tokens present in the output"),
    Limit("frequency_penalty", float, 0.0, ge=-2.0, le=2.0, doc="subtracted per occurrence in the output"),
    Limit("seed", int, None, ge=INT64_MIN, le=INT64_MAX, nullable=True, doc="same seed, same tokens"),
    Limit(
        "stop",
        str,
        None,
        nullable=True,
        items=True,
        max_items=MAX_STOP_STRINGS,
        doc="strings that end generation (a single string is a list of one)",
    ),
    Limit(
        "stop_token_ids",
        int,
        None,
        ge=0,
        le=TOKEN_ID_MAX,
        nullable=True,
        items=True,
        max_items=MAX_STOP_TOKEN_IDS,
        doc="token ids that end generation",
    ),
    Limit("ignore_eos", bool, False, doc="keep generating past the model's EOS token"),
    Limit("min_tokens", int, 0, ge=0, le=MAX_TOKENS_LIMIT, doc="EOS and stop_token_ids are masked until this many"),
    Limit(
        "logprobs",
        int,
        None,
        ge=0,
        le=MAX_LOGPROBS,
        nullable=True,
        doc="the top-n logprobs (plus the sampled token's) per token",
    ),
    # vLLM's extras: what may be sampled, how the text is decoded, how much of the prompt is kept.
    Limit("allowed_token_ids", int, None, ge=0, le=TOKEN_ID_MAX, nullable=True, items=True, min_items=1,
          max_items=MAX_ALLOWED_TOKEN_IDS, doc="only these token ids may be sampled"),
    Limit("bad_words", str, None, nullable=True, items=True, max_items=MAX_BAD_WORDS,
          doc="words never generated (each tokenized as it starts the text and after a space: the last "
          "token of a word is masked while the output ends with the tokens before it)"),
    Limit("include_stop_str_in_output", bool, False,
          doc="keep the matched stop string (or the stop token's text) at the end of the output"),
    Limit("skip_special_tokens", bool, True, doc="leave special tokens (EOS, ...) out of the text"),
    Limit("spaces_between_special_tokens", bool, True,
          doc="with skip_special_tokens false: a space between a special token and the text around it "
          "(Hugging Face's slow-tokenizer decode)"),
    Limit("truncate_prompt_tokens", int, None, ge=1, le=MAX_TOKENS_LIMIT, nullable=True,
          doc="keep only the last k prompt tokens"),
    Limit("prompt_logprobs", int, None, ge=0, le=MAX_LOGPROBS, nullable=True,
          doc="the logprob of each prompt token and the top-n at its position (the prompt is computed whole: "
          "it skips the prefix cache)"),
)
LIMITS = {limit.name: limit for limit in SAMPLING_LIMITS}
