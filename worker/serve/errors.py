"""The wire error code of each engine exception: one table, most specific type first.

The engine raises typed exceptions (`ferry.worker.engine.errors`) and knows nothing of the wire;
the worker turns them into a failed job's stable `ErrorCode` here and nowhere else.
"""

from __future__ import annotations

from ferry.worker.engine import (
    InvalidPromptError,
    InvalidResumeError,
    InvalidSamplingParams,
    InvalidStructuredOutputError,
    PromptTooLongError,
)
from ferry.worker.engine.errors import LoraAdapterError
from ferry.worker.protocol import ErrorCode

ERROR_CODES: dict[type[BaseException], str] = {
    PromptTooLongError: ErrorCode.PROMPT_TOO_LONG,
    InvalidPromptError: ErrorCode.INVALID_PROMPT,
    InvalidResumeError: ErrorCode.INVALID_PROMPT,  # what the client already has cannot be continued
    InvalidSamplingParams: ErrorCode.INVALID_SAMPLING_PARAMS,
    InvalidStructuredOutputError: ErrorCode.INVALID_STRUCTURED_OUTPUT,
    LoraAdapterError: ErrorCode.LORA_LOAD_FAILED,  # corrupt, rank over max_lora_rank, another base's shapes
}


def error_code(exc: BaseException) -> str:
    """The code of `exc`'s most specific type in the table; `engine_error` for anything else."""
    for cls in type(exc).__mro__:
        if cls in ERROR_CODES:
            return ERROR_CODES[cls]
    return ErrorCode.ENGINE_ERROR
