"""The webhook process's settings: environment variables `FERRY_*` (pydantic-settings)."""

from __future__ import annotations

from pydantic import Field, model_validator

from ferry.worker.common.settings import FerrySettings


class WebhookSettings(FerrySettings):
    """Shared with the other processes (`FerrySettings`): Redis, `webhook_secret` (required to
    deliver), `api_keys`/`api_keys_file` (a tenant's `webhook_secret` options sign its webhooks
    instead; the file is re-read when it changes, so a rotation needs no restart),
    `webhook_allow_private`, `result_ttl_s` (how long delivery outcomes are kept)."""

    # Celery's broker, default redis_url: a single Redis (redis://, rediss://) or Amazon SQS (sqs:// for
    # AWS with the pod's credentials, sqs://host:port for an SQS-compatible endpoint). Kombu cannot use
    # a Redis Cluster as a broker: with FERRY_REDIS_CLUSTER set this must name something else.
    celery_broker_url: str | None = None
    celery_sqs_queue_url: str | None = None  # the provisioned queue (Terraform output): no CreateQueue needed
    celery_sqs_region: str | None = None  # default: boto3's region chain (AWS_REGION, AWS_DEFAULT_REGION)
    celery_sqs_queue_name_prefix: str = ""  # kombu creates <prefix><queue> itself when no queue URL is given
    webhook_retry_base_s: float = 2.0  # first retry after ~base, then doubling (with jitter)
    webhook_retry_max_s: float = 3600.0  # cap on one backoff
    webhook_max_attempts: int = 8
    # Wall-clock limit on one attempt: resolving the host, connecting, TLS, sending, the answer's headers
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_concurrency: int = Field(16, ge=1)  # delivery threads in the Celery worker
    # Attempts of one tenant in flight at once in one `ferry webhooks` process; its others wait
    # (deferred, not counted as attempts), so one tenant's slow receivers leave the other threads free
    webhook_tenant_concurrency: int = Field(4, ge=1)
    webhook_metrics_port: int = 9301  # 0 disables the Prometheus endpoint (unauthenticated: keep it on the pod network)
    webhook_metrics_host: str = "127.0.0.1"  # the address it binds; the pod's IP in Kubernetes

    @model_validator(mode="after")
    def _broker_off_the_cluster(self) -> WebhookSettings:
        if self.redis_cluster and not self.celery_broker_url:
            raise ValueError("FERRY_CELERY_BROKER_URL must be set with FERRY_REDIS_CLUSTER=true: Celery's broker "
                             "cannot be a Redis Cluster (a single Redis, or sqs://)")
        return self
