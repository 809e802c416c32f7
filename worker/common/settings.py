"""The `FERRY_*` variables that more than one process reads, declared once.

Every process's settings class (`WorkerSettings`, `ApiSettings`, `WebhookSettings`,
`AutoscalerSettings`, `UpSettings`) derives from `FerrySettings` and adds only what that process
alone reads; a test checks that no variable is declared twice. The same values must be given to
every process of a deployment (one Redis, one key prefix, one shard count).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_QUEUE_SHARDS = 256  # queue shards per model: more than a cluster has primaries, with room to grow

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class FerrySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FERRY_", extra="ignore")

    # --- Redis: where the queue, the jobs and their events live ---
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ferry"  # every Redis key and channel lives under this prefix
    redis_cluster: bool = False  # FERRY_REDIS_URL is any node of a Redis Cluster
    # Queue shards per model: each shard's streams and jobs share one hash slot, so N shards spread
    # a model over up to N primaries.
    queue_shards: int = Field(1, ge=1, le=MAX_QUEUE_SHARDS)
    # An enqueue (the API's 202) and a job's terminal write wait until this many replicas have it
    # (WAIT); 0 = do not wait. Fewer in time: the API answers 503 + Retry-After, never a silent
    # 202; a worker logs it (its write is on the primary).
    redis_min_replicas: int = Field(0, ge=0)
    redis_replica_timeout_ms: int = Field(1000, ge=1)  # the WAIT's timeout

    # --- Jobs: the API stamps the defaults on new jobs, the worker enforces them ---
    job_ttl_s: float = 3600.0  # a queued job older than this is timed out without running
    job_timeout_s: float = 600.0  # default execution timeout per job
    result_ttl_s: int = 86400  # how long a finished job's hash, events and webhook outcomes are kept

    # --- Tenants and webhooks (the API authenticates with the keys; the webhook worker signs with
    # a tenant's own secrets from the same configuration) ---
    # Comma-separated "sha256hex:tenant[;option=value...]" entries, or a file of them, one per line
    # (re-read when it changes). With neither set the API runs open (and says so loudly at start-up).
    api_keys: str | None = None
    api_keys_file: str | None = None
    webhook_secret: str | None = None  # "whsec_<base64>": signs webhooks of tenants without their own
    webhook_allow_private: bool = False  # webhook URLs on private/loopback addresses (refused by default)

    # --- Object storage (snapshots, Batch API files) ---
    s3_endpoint_url: str | None = None  # MinIO, R2 or a local S3 server; default: AWS

    # --- The API's address (`ferry api`; `ferry up` starts it there) ---
    host: str = "0.0.0.0"
    port: int = 8000

    # The JSON log's level: INFO writes a few lines per job
    log_level: LogLevel = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_capitals(cls, value):
        return value.upper() if isinstance(value, str) else value

    @classmethod
    def variable_names(cls) -> set[str]:
        """Every environment variable these settings read."""
        return {f"FERRY_{name.upper()}" for name in cls.model_fields}

    @classmethod
    def own_variable_names(cls) -> set[str]:
        """The variables this class declares beyond `FerrySettings`'s."""
        return cls.variable_names() - FerrySettings.variable_names()
