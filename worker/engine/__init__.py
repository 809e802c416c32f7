"""Ferry's inference engine: `LLM` for offline batches, `Engine` for the step API."""

from ferry.worker.engine.config import EngineConfig
from ferry.worker.engine.engine import Engine, EngineStats
from ferry.worker.engine.llm import LLM
from ferry.worker.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ferry.worker.engine.parallel.group import RankFailedError
from ferry.worker.engine.resume import Resume
from ferry.worker.engine.sampling_params import InvalidSamplingParams, SamplingParams
from ferry.worker.engine.structured import InvalidStructuredOutputError, StructuredOutputs
from ferry.worker.models.sharding import TensorParallelError

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
