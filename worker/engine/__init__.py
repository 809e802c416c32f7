"""Ferry's inference engine: `LLM` for offline batches, `Engine` for the step API."""

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, EngineStats
from worker.engine.llm import LLM
from worker.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from worker.engine.parallel.group import RankFailedError
from worker.engine.resume import Resume
from worker.engine.sampling_params import InvalidSamplingParams, SamplingParams
from worker.engine.structured import InvalidStructuredOutputError, StructuredOutputs
from worker.models.sharding import TensorParallelError

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "InvalidSamplingParams",
    "InvalidStructuredOutputError",
    "Logprob",
    "RankFailedError",
    "RequestMetrics",
    "RequestOutput",
    "Resume",
    "SamplingParams",
    "StructuredOutputs",
    "TensorParallelError",
]
