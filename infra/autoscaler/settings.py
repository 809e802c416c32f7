"""`ferry autoscale` settings: environment variables `FERRY_*` (pydantic-settings).

Redis is reached as every process does (`FerrySettings`); everything the autoscaler alone needs
is spelled `FERRY_AUTOSCALE_*`.
"""

from __future__ import annotations

from pydantic import Field

from ferry.autoscaler.policy import ScalePolicy
from ferry.worker.common.settings import FerrySettings


class AutoscalerSettings(FerrySettings):
    # Which pools: comma-separated served model names (FERRY_MODEL_NAME of their workers).
    autoscale_models: str = "smollm2-135m-instruct"
    autoscale_interval_s: float = Field(default=15.0, gt=0)

    # Policy (see infra/autoscaler/policy.py for what each knob does)
    autoscale_target_backlog: float = 8.0
    autoscale_min_workers: int = 0
    autoscale_max_workers: int = 8
    autoscale_max_step_up: int = 4
    autoscale_max_step_down_frac: float = 0.5
    autoscale_scale_down_utilization: float = 0.5
    autoscale_scale_down_window_s: float = 300.0
    autoscale_idle_to_zero_s: float = 300.0
    autoscale_max_idle_to_zero_s: float = 1800.0

    # Outputs: Prometheus /metrics (port 0 turns it off), CloudWatch, optional actuators.
    autoscale_metrics_host: str = "127.0.0.1"  # unauthenticated: bind to the pod network deliberately
    autoscale_metrics_port: int = 9310
    autoscale_cloudwatch_namespace: str | None = "Ferry"  # empty: do not publish to CloudWatch
    autoscale_aws_region: str | None = None  # default: boto3's own resolution
    autoscale_aws_endpoint_url: str | None = None  # a local CloudWatch/ECS API (tests, LocalStack)
    # "model=asg-name,..." : set each Auto Scaling group's desired capacity to the decision
    autoscale_asg_names: str | None = None
    # "model=cluster/service,..." : set each ECS service's desired count to the decision
    autoscale_ecs_services: str | None = None

    def models(self) -> list[str]:
        return [m.strip() for m in self.autoscale_models.split(",") if m.strip()]

    def policy(self) -> ScalePolicy:
        return ScalePolicy(
            target_backlog_per_worker=self.autoscale_target_backlog,
            min_workers=self.autoscale_min_workers,
            max_workers=self.autoscale_max_workers,
            max_step_up=self.autoscale_max_step_up,
            max_step_down_frac=self.autoscale_max_step_down_frac,
            scale_down_utilization=self.autoscale_scale_down_utilization,
            scale_down_window_s=self.autoscale_scale_down_window_s,
            idle_to_zero_s=self.autoscale_idle_to_zero_s,
            max_idle_to_zero_s=self.autoscale_max_idle_to_zero_s,
        )


def parse_pairs(spec: str | None) -> dict[str, str]:
    """'a=x,b=y' → {'a': 'x', 'b': 'y'}; None or '' → {}."""
    out: dict[str, str] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        model, sep, target = item.partition("=")
        if not sep or not model.strip() or not target.strip():
            raise ValueError(f"expected model=target, got {item!r}")
        out[model.strip()] = target.strip()
    return out
