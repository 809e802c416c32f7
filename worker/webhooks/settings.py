"""The webhook process's settings: environment variables `FERRY_*` (pydantic-settings)."""

from __future__ import annotations

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from worker.protocol.connect import RedisTopology


class WebhookSettings(RedisTopology):
    model_config = SettingsConfigDict(env_prefix="FERRY_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ferry"
    # Celery's broker, default redis_url: a single Redis (redis://, rediss://) or Amazon SQS (sqs:// for
    # AWS with the pod's credentials, sqs://host:port for an SQS-compatible endpoint). Kombu cannot use
    # a Redis Cluster as a broker: with FERRY_REDIS_CLUSTER set this must name something else.
    celery_broker_url: str | None = None
    celery_sqs_queue_url: str | None = None  # the provisioned queue (Terraform output): no CreateQueue needed
    celery_sqs_region: str | None = None  # default: boto3's region chain (AWS_REGION, AWS_DEFAULT_REGION)
    celery_sqs_queue_name_prefix: str = ""  # kombu creates <prefix><queue> itself when no queue URL is given
    webhook_secret: str | None = None  # "whsec_<base64>"; required to deliver
    # The API's key configuration (worker.protocol.tenants): a tenant's `webhook_secret` options sign
    # its webhooks instead of webhook_secret. The file is re-read when it changes
    # (worker.protocol.key_source): a rotation needs no restart.
    api_keys: str | None = None
    api_keys_file: str | None = None
    webhook_retry_base_s: float = 2.0  # first retry after ~base, then doubling (with jitter)
    webhook_retry_max_s: float = 3600.0  # cap on one backoff
    webhook_max_attempts: int = 8
    webhook_timeout_s: float = 10.0
    webhook_allow_private: bool = False
    webhook_concurrency: int = 16  # delivery threads in the Celery worker
    webhook_metrics_port: int = 9301  # 0 disables the Prometheus endpoint (unauthenticated: keep it on the pod network)
    webhook_metrics_host: str = "127.0.0.1"  # the address it binds; the pod's IP in Kubernetes
    result_ttl_s: int = 86400  # how long delivery outcomes are kept (as long as the job)

    @model_validator(mode="after")
    def _broker_off_the_cluster(self) -> WebhookSettings:
        if self.redis_cluster and not self.celery_broker_url:
            raise ValueError("FERRY_CELERY_BROKER_URL must be set with FERRY_REDIS_CLUSTER=true: Celery's broker "
                             "cannot be a Redis Cluster (a single Redis, or sqs://)")
        return self
