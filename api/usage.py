"""Per-tenant usage as the API shows it: `GET /v1/usage` for the caller, and Prometheus counters.

The counters are written where jobs end (`worker.protocol.usage`): requests, prompt tokens and
completion tokens per tenant, in total and per UTC day. Prometheus gets them with a `tenant`
label of bounded cardinality: the first `usage_metrics_tenants` tenants by name keep their name,
the rest are summed as `other`. The values are read from Redis on each scrape, so every API
replica reports the same totals (aggregate with `max`, not `sum`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from ferry.worker.protocol import Keys
from ferry.worker.protocol.usage import day_of

COUNTERS = ("requests", "prompt_tokens", "completion_tokens")
OTHER_TENANTS = "other"


@dataclass(frozen=True, slots=True)
class UsageCounts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, raw: dict) -> UsageCounts:
        return cls(**{name: int(raw.get(name, 0)) for name in COUNTERS})

    def __add__(self, other: UsageCounts) -> UsageCounts:
        return UsageCounts(*(getattr(self, n) + getattr(other, n) for n in COUNTERS))

    def as_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS} | {
            "total_tokens": self.prompt_tokens + self.completion_tokens}


async def read_usage(redis, keys: Keys, tenant: str, days: int,
                     now: float) -> tuple[UsageCounts, list[tuple[str, UsageCounts]]]:
    """The tenant's totals, and its counts for each of the last `days` UTC days (oldest first)."""
    dates = [day_of(now - 86400 * back) for back in range(days - 1, -1, -1)]
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(keys.usage(tenant))
    for date in dates:
        pipe.hgetall(keys.usage_day(tenant, date))
    total, *per_day = await pipe.execute()
    return UsageCounts.of(total), [(date, UsageCounts.of(raw)) for date, raw in zip(dates, per_day, strict=True)]


@dataclass(slots=True, eq=False)  # a collector is registered by identity
class TenantUsageMetrics:
    """A Prometheus collector of the last usage read (`refresh` before each scrape)."""

    tenants: list[str]  # every configured tenant, by name
    labelled: int  # how many of them keep their own label
    counts: dict[str, UsageCounts] = field(default_factory=dict)  # label -> counts, as last read

    async def refresh(self, redis, keys: Keys) -> None:
        pipe = redis.pipeline(transaction=False)
        for tenant in self.tenants:
            pipe.hgetall(keys.usage(tenant))
        counts: dict[str, UsageCounts] = {}
        for i, (tenant, raw) in enumerate(zip(self.tenants, await pipe.execute(), strict=True)):
            label = tenant if i < self.labelled else OTHER_TENANTS
            counts[label] = counts.get(label, UsageCounts()) + UsageCounts.of(raw)
        self.counts = counts

    def collect(self):
        for name, doc in (("requests", "Jobs that ended"), ("prompt_tokens", "Prompt tokens of jobs that ended"),
                          ("completion_tokens", "Completion tokens of jobs that ended")):
            family = CounterMetricFamily(f"ferry_tenant_{name}", f"{doc}, per tenant", labels=["tenant"])
            for label, counts in self.counts.items():
                family.add_metric([label], getattr(counts, name))
            yield family
