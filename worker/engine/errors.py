"""The engine's exceptions, by what went wrong (the worker maps each type to its wire error code).

`Engine.add_request` refuses a request with an `EngineInputError`, one subclass per kind of bad
input; nothing of the request is left behind. A request the engine took and then could not go
on with ends alone with `FinishReason.ERROR`, its exception in `RequestOutput.error`: a
`RequestFailedError` when its own processing raised in a step, an `InvalidStructuredOutputError`
when its grammar did not compile.

This module imports nothing, so every part of the engine (and `structured.params`) can use it.
"""

from __future__ import annotations


class EngineInputError(ValueError):
    """A request the engine refuses as given; the message says what is wrong and with what."""


class InvalidPromptError(EngineInputError):
    """No prompt tokens, token ids outside the vocabulary, or text (a chat) given to a model
    that has no tokenizer (no chat template) to turn it into tokens."""


class PromptTooLongError(InvalidPromptError):
    """The prompt reaches max_model_len: no room is left to generate a token."""


class InvalidSamplingParams(EngineInputError):
    """A sampling value outside what is allowed; the message names the field."""


class InvalidStructuredOutputError(EngineInputError):
    """A structured-output spec that is malformed or that the grammar compiler refuses; the
    message names the field and, for a compile failure, carries the compiler's words."""


class InvalidResumeError(EngineInputError):
    """Resumed tokens the engine cannot continue from: ids outside the vocabulary, or tokens
    whose text already ends the request with a stop string."""


class LoraAdapterError(EngineInputError):
    """A LoRA adapter the engine cannot serve: LoRA is off, its files are missing or corrupt, its
    rank is over max_lora_rank, it targets modules Ferry does not adapt, or its shapes are another
    base model's. The message names the adapter and the cause. Raised by `Engine.add_lora` and
    `add_request`; a request whose adapter fails to load in the background ends alone with it."""


class RequestFailedError(RuntimeError):
    """One request's own processing raised during a step (its detokenizer, its grammar, its
    sampling adjustments): it ended with `FinishReason.ERROR`, the rest of the batch went on.
    The message names the original exception, which is also its `__cause__` where there was one."""
