"""Worker process settings: environment variables `FERRY_*` (pydantic-settings).

Only the process edge reads the environment; the engine takes the `EngineConfig` dataclass
built from these settings by `engine_kwargs()`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The code model trained by models/train.py and shipped in the repository (models/README.md).
SHIPPED_DEMO_MODEL = str(Path(__file__).resolve().parents[2] / "models" / "demo")


def _env(field: str, engine_key: str) -> AliasChoices:
    """The field's own name (code), its FERRY_ variable, and FERRY_SPECULATIVE_<the engine key>."""
    return AliasChoices(field, f"FERRY_{field.upper()}", f"FERRY_SPECULATIVE_{engine_key.upper()}")


class WorkerSettings(BaseSettings):
    # populate_by_name: fields with alternative environment names still take their own name in code.
    model_config = SettingsConfigDict(env_prefix="FERRY_", extra="ignore", populate_by_name=True)

    # Redis and naming
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ferry"  # every Redis key and channel lives under this prefix
    worker_id: str | None = None  # default: hostname-pid

    # Model and engine
    model: str = SHIPPED_DEMO_MODEL  # local directory or a hub id already in the local cache
    model_name: str | None = None  # served name; default: the model directory's name
    dtype: str = "float32"
    device: str | None = None  # default: cuda when available, else cpu
    block_size: int = 16
    kv_cache_bytes: int | None = None  # default: a share of free device memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Speculative decoding (worker.engine.config.SpeculativeConfig). The engine config's own key
    # names are accepted too: FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS, _PROMPT_LOOKUP_MAX/_MIN.
    speculative_method: str | None = None  # "ngram" | "draft"; unset: no speculation
    speculative_num_tokens: int = Field(4, validation_alias=_env("speculative_num_tokens", "num_speculative_tokens"))
    speculative_ngram_max: int = Field(4, validation_alias=_env("speculative_ngram_max", "prompt_lookup_max"))
    speculative_ngram_min: int = Field(1, validation_alias=_env("speculative_ngram_min", "prompt_lookup_min"))
    speculative_draft_model: str | None = None
    speculative_measure_speedup: bool = True  # the governor: propose only while it measurably pays
    speculative_disable_by_batch_size: int | None = None  # no proposals while this many requests run

    # Snapshots of the prefix cache
    snapshot_url: str | None = None  # file:///dir or s3://bucket/prefix
    snapshot_interval_s: float = 600.0
    snapshot_keep: int = 3
    snapshot_max_bytes: int = 1 << 30
    s3_endpoint_url: str | None = None

    # Process behaviour
    metrics_port: int = 9300
    metrics_host: str = "0.0.0.0"
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
    job_ttl_s: float = 3600.0  # a queued job older than this is timed out without running
    job_timeout_s: float = 600.0  # default execution timeout per job
    result_ttl_s: int = 86400  # how long a finished job's hash and event stream are kept
    queue_maxlen: int = 100_000

    @property
    def served_model_name(self) -> str:
        return self.model_name or Path(self.model.rstrip("/")).name

    @property
    def lease_renew_interval_s(self) -> float:
        return self.lease_renew_s or self.lease_s / 3

    def engine_kwargs(self) -> dict:
        """Keyword arguments for `Engine(self.model, **kwargs)`."""
        return {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.enable_prefix_caching,
            "device": self.device,
            "snapshot_url": self.snapshot_url,
            "snapshot_max_bytes": self.snapshot_max_bytes,
            "snapshot_keep": self.snapshot_keep,
            "speculative": self.speculative(),
        }

    def speculative(self) -> dict | None:
        """`Engine(speculative=...)` from FERRY_SPECULATIVE_*; None leaves speculation off."""
        if not self.speculative_method:
            return None
        spec = {
            "method": self.speculative_method,
            "num_speculative_tokens": self.speculative_num_tokens,
            "measure_speedup": self.speculative_measure_speedup,
            "disable_by_batch_size": self.speculative_disable_by_batch_size,
        }
        if self.speculative_method == "ngram":
            spec |= {"prompt_lookup_max": self.speculative_ngram_max, "prompt_lookup_min": self.speculative_ngram_min}
        else:
            spec["draft_model"] = self.speculative_draft_model
        return spec
