"""The input processor: what a caller gives `Engine.add_request`, checked and turned into a
`Request` the core can schedule, with the detokenizer its output will go through.

Every check that refuses a request runs here, before any part of the engine holds it, so a
refused request leaves nothing behind. Each raises its kind of `EngineInputError`
(worker.engine.errors): a bad prompt, a prompt too long, sampling values this model cannot take,
structured outputs without a tokenizer, a resume the engine cannot continue from.
"""

from __future__ import annotations

import itertools
import time

from jinja2 import TemplateError

from ferry.worker.engine.detokenizer import IncrementalDetokenizer
from ferry.worker.engine.errors import (
    InvalidPromptError,
    InvalidResumeError,
    InvalidSamplingParams,
    InvalidStructuredOutputError,
    LoraAdapterError,
    PromptTooLongError,
)
from ferry.worker.engine.kv_cache import cache_extra
from ferry.worker.engine.loading import LoadedModel
from ferry.worker.engine.lora import LoRARequest
from ferry.worker.engine.outputs import RequestMetrics
from ferry.worker.engine.request import Request
from ferry.worker.engine.resume import Resume
from ferry.worker.engine.sampler import advance_generator
from ferry.worker.engine.sampling_params import SamplingParams
from ferry.worker.engine.structured import GrammarState, StructuredOutputManager
from ferry.worker.engine.structured.reasoning import ReasoningGate


class InputProcessor:
    def __init__(self, model: LoadedModel, structured_outputs_cache_size: int, lora_enabled: bool = False) -> None:
        self.lora_enabled = lora_enabled  # requests may name an adapter
        self.tokenizer = model.tokenizer  # None: prompts must be token ids
        self.vocab_size = model.arch.vocab_size  # every token id must be below it
        self.max_model_len = model.max_model_len
        self.eos_token_ids = model.eos_token_ids
        self.sampling_defaults = model.sampling_defaults  # what unset sampling fields take (generation_config.json)
        self.model_salt = model.model_salt
        rope = model.arch.rope
        # LongRoPE: a sequence longer than this is rotated with the long factors throughout, and
        # its KV lives in a prefix-cache namespace of its own (config.rope_table_rows).
        self.long_rope_after = rope.original_max_positions if rope.long_inv_freq is not None else None
        # Compiles grammars (None without a tokenizer: a grammar is over the tokens' text).
        self.structured = None if model.tokenizer is None else StructuredOutputManager(
            model.tokenizer, self.vocab_size, model.eos_token_ids, structured_outputs_cache_size
        )
        self._arrivals = itertools.count()  # admission order: ties on priority go to the earlier request

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidPromptError("this model directory has no tokenizer: give prompts as token-id lists")
        return self.tokenizer.encode(prompt)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a chat, rendered with the model's own chat template (given `tools`, the
        functions the model may call, in OpenAI's shape). InvalidPromptError without a template,
        or for a chat the template refuses."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidPromptError("this model has no chat template; send a plain prompt instead")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except TemplateError as exc:  # the template's own raise_exception: roles out of order, say
            raise InvalidPromptError(f"the model's chat template refused the messages: {exc}") from exc
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the token ids must be this model's."""
        start = [] if params.reasoning_start_token_id is None else [params.reasoning_start_token_id]
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("reasoning_end_token_ids", params.reasoning_end_token_ids or []),
                          ("reasoning_start_token_id", start)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidSamplingParams(
                    f"invalid {name}: token id {bad} is beyond the vocabulary ({self.vocab_size} ids)"
                )

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int,
        arrival_time: float | None,
        resume: Resume | None,
        background: bool,
        lora_request: LoRARequest | None = None,
    ) -> tuple[Request, IncrementalDetokenizer | None]:
        """The request (its params resolved against the model's defaults, a resume's tokens
        already its output) and its detokenizer (None without a tokenizer)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if lora_request is not None and not self.lora_enabled:
            raise LoraAdapterError(f"LoRA adapter {lora_request.lora_name!r}: this engine runs without LoRA "
                                   "(enable_lora=False)")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError("lora_request must be a LoRARequest")
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self._check_prompt(token_ids)
        params = params.resolved(self.sampling_defaults, self.max_model_len - len(token_ids))
        self.check_params(params)
        resumed = list(resume.token_ids) if resume is not None else []
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in resumed):
            raise InvalidResumeError(f"resumed token ids must be integers in [0, {self.vocab_size})")
        if params.structured_outputs is not None and self.structured is None:
            raise InvalidStructuredOutputError("structured_outputs need a model with a tokenizer")
        request = Request(
            request_id=str(request_id),
            prompt_token_ids=token_ids,
            params=params,
            priority=int(priority),
            arrival_seq=next(self._arrivals),
            metrics=RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time),
            prompt=prompt if isinstance(prompt, str) else None,
            eos_token_ids=self.eos_token_ids,
            cache_extra=cache_extra(self.model_salt, params.cache_salt),
            background=bool(background),
            bad_words_token_ids=self.bad_words_token_ids(params.bad_words or []),
            lora=lora_request,
        )
        if resumed:
            request.output_token_ids = resumed
            request.all_token_ids += resumed
            if request.generator is not None:
                advance_generator(request.generator, len(resumed), self.vocab_size)
        if self.long_rope_after is not None:
            request.long_rope_after = self.long_rope_after
            request.long_rope_cache_extra = cache_extra(f"{self.model_salt}|longrope-long", params.cache_salt)
            if request.num_tokens > self.long_rope_after:  # long from its first token: nothing to recompute
                request.rope_long, request.cache_extra = True, request.long_rope_cache_extra
        # A resume whose tokens reach its end: the core finishes it at once, and its text is final.
        ended = request.length_reached(self.max_model_len)
        detokenizer = self._detokenizer(request, resume, ended)
        if params.structured_outputs is not None and not ended:  # its matcher advances over the resumed tokens
            gate = None if params.reasoning_end_token_ids is None else ReasoningGate(
                tuple(params.reasoning_end_token_ids), params.reasoning_start_token_id)
            request.grammar = GrammarState(self.structured.compile(params.structured_outputs), gate)
        return request, detokenizer

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, as vLLM tokenizes them: as it starts a text, and after a space
        when that spelling is a different first token of the same length (a word mid-sentence)."""
        if words and self.tokenizer is None:
            raise InvalidSamplingParams("bad_words need a model with a tokenizer")
        sequences: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:  # only spaces: no token to mask
                continue
            sequences.append(bare)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return sequences

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidPromptError("prompt is empty: give at least one token")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidPromptError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens leave room to generate"
            )

    def _detokenizer(self, request: Request, resume: Resume | None, ended: bool) -> IncrementalDetokenizer | None:
        """The request's detokenizer, having replayed a resume's tokens (see worker.engine.resume)."""
        if self.tokenizer is None:
            return None
        p = request.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, p.stop_strings, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
        )
        if request.output_token_ids:
            matched = detokenizer.replay(
                request.output_token_ids, request.params.min_tokens, resume.num_text_chars, final=ended
            )
            if matched is not None:
                raise InvalidResumeError(f"the resumed tokens already end the request with the stop string {matched!r}")
        return detokenizer
