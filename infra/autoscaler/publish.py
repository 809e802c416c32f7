"""Where a decision goes: Prometheus gauges, a CloudWatch metric, and optionally the pool itself.

CloudWatch (namespace `Ferry`, dimension `Model`) gets `DesiredWorkers`, `LiveWorkers`,
`Backlog` and `BacklogPerWorker`: alarms and dashboards read them, and a platform that sizes
its pool from a metric (an ECS service or an ASG with a step or target-tracking policy) can
use `DesiredWorkers` directly. Where the autoscaler should set the size itself, the two
actuators call the platform's API (`SetDesiredCapacity`, `UpdateService`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from ferry.autoscaler.policy import Decision, Observation


class PrometheusGauges:
    """`ferry_autoscaler_*` gauges on their own registry (served by `ferry autoscale`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model"]
        r = self.registry
        self.desired = Gauge("ferry_autoscaler_desired_workers", "Workers the pool should have", labels, registry=r)
        self.live = Gauge("ferry_autoscaler_live_workers", "Workers with a live heartbeat", labels, registry=r)
        self.lag = Gauge("ferry_autoscaler_queue_lag", "Jobs not yet delivered to a worker", labels, registry=r)
        self.pending = Gauge("ferry_autoscaler_queue_pending", "Jobs delivered and not acked", labels, registry=r)

    def publish(self, model: str, obs: Observation, decision: Decision) -> None:
        self.desired.labels(model).set(decision.desired)
        self.live.labels(model).set(obs.live_workers)
        self.lag.labels(model).set(obs.lag)
        self.pending.labels(model).set(obs.pending)


class CloudWatchPublisher:
    """One PutMetricData call per model per tick."""

    def __init__(self, client: Any, namespace: str) -> None:
        self.client = client  # boto3 CloudWatch client
        self.namespace = namespace

    def publish(self, model: str, obs: Observation, decision: Decision) -> None:
        dims = [{"Name": "Model", "Value": model}]
        values = {
            "DesiredWorkers": decision.desired,
            "LiveWorkers": obs.live_workers,
            "Backlog": obs.backlog,
            "BacklogPerWorker": obs.backlog / max(1, obs.live_workers),
        }
        self.client.put_metric_data(
            Namespace=self.namespace,
            MetricData=[
                {"MetricName": name, "Dimensions": dims, "Value": float(v), "Unit": "Count"}
                for name, v in values.items()
            ],
        )


class AsgActuator:
    """Sets an EC2 Auto Scaling group's desired capacity (within the group's own min/max)."""

    def __init__(self, client: Any, groups: dict[str, str]) -> None:
        self.client = client  # boto3 autoscaling client
        self.groups = groups  # model -> Auto Scaling group name

    def apply(self, model: str, desired: int) -> None:
        if model in self.groups:
            self.client.set_desired_capacity(
                AutoScalingGroupName=self.groups[model], DesiredCapacity=desired, HonorCooldown=False
            )


class EcsActuator:
    """Sets an ECS service's desired task count."""

    def __init__(self, client: Any, services: dict[str, str]) -> None:
        self.client = client  # boto3 ecs client
        self.services = services  # model -> "cluster/service"

    def apply(self, model: str, desired: int) -> None:
        if model in self.services:
            cluster, _, service = self.services[model].partition("/")
            self.client.update_service(cluster=cluster, service=service, desiredCount=desired)
