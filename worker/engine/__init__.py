"""Ferry's inference engine: `LLM` for offline batches, `Engine` for the step API."""

from ferry.worker.engine.config import EngineConfig
from ferry.worker.engine.engine import Engine, EngineStats
from ferry.worker.engine.errors import (
    EngineInputError,
    InvalidPromptError,
    InvalidResumeError,
    InvalidSamplingParams,
    InvalidStructuredOutputError,
    LoraAdapterError,
    PromptTooLongError,
    RequestFailedError,
)
from ferry.worker.engine.llm import LLM
from ferry.worker.engine.lora import LoRARequest
from ferry.worker.engine.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput
from ferry.worker.engine.parallel.group import RankFailedError
from ferry.worker.engine.resume import Resume
from ferry.worker.engine.sampling_params import SamplingParams
from ferry.worker.engine.structured import StructuredOutputs
from ferry.worker.models.sharding import TensorParallelError

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineInputError",
    "EngineStats",
    "FinishReason",
    "InvalidPromptError",
    "InvalidResumeError",
    "InvalidSamplingParams",
    "InvalidStructuredOutputError",
    "Logprob",
    "LoRARequest",
    "LoraAdapterError",
    "PromptTooLongError",
    "RankFailedError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "Resume",
    "SamplingParams",
    "StructuredOutputs",
    "TensorParallelError",
]
