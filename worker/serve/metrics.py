"""The worker's Prometheus metrics (names after vLLM's, prefix `ferry_`), on a registry of its own.

Latencies are per job as a client sees them (from `created_at`, when the API accepted the job);
engine gauges and counters are read from the latest `EngineStats` the engine thread handed over,
so a scrape never touches the engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: latencies of whole jobs (TTFT, e2e, queue) and of single tokens.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    """Exports the last `EngineStats` snapshot (set by the engine thread) at scrape time."""

    def __init__(self) -> None:
        self.stats = None  # worker.engine.EngineStats | None; replaced whole, never mutated

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        yield GaugeMetricFamily(
            "ferry_num_requests_running", "Requests in the engine's running batch", value=stats.num_running
        )
        yield GaugeMetricFamily(
            "ferry_num_requests_waiting", "Requests admitted but waiting for KV blocks", value=stats.num_waiting
        )
        yield GaugeMetricFamily("ferry_kv_cache_usage_perc", "Share of KV blocks in use (0..1)", value=stats.kv.usage)
        yield CounterMetricFamily(
            "ferry_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "ferry_prefix_cache_hits", "Prompt tokens served from the prefix cache", value=stats.prefix_cache_hits
        )
        yield CounterMetricFamily(
            "ferry_num_preemptions", "Requests preempted for KV space", value=stats.num_preemptions
        )
        if stats.spec_decode is not None:
            yield from _spec_decode_metrics(stats.spec_decode)


def _spec_decode_metrics(spec):
    """Speculative decoding since the engine started (vLLM's counters, and the two figures a
    dashboard wants without PromQL); only where the worker speculates."""
    yield CounterMetricFamily("ferry_spec_decode_num_drafts", "Verifications of proposed tokens", value=spec.num_drafts)
    yield CounterMetricFamily(
        "ferry_spec_decode_num_draft_tokens", "Proposed tokens verified", value=spec.num_draft_tokens
    )
    yield CounterMetricFamily(
        "ferry_spec_decode_num_accepted_tokens", "Proposed tokens accepted", value=spec.num_accepted_tokens
    )
    per_position = CounterMetricFamily(
        "ferry_spec_decode_num_accepted_tokens_per_pos", "Verifications whose proposal at this position was accepted",
        labels=["position"],
    )
    for position, accepted in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(position)], accepted)
    yield per_position
    yield GaugeMetricFamily(
        "ferry_spec_decode_acceptance_rate", "Accepted / proposed tokens", value=spec.acceptance_rate
    )
    yield GaugeMetricFamily("ferry_spec_decode_mean_accepted_length",
                            "Tokens a verification yields on average: accepted proposals + the target's own",
                            value=spec.mean_accepted_length)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ferry_time_to_first_token_seconds", "Job accepted -> first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ferry_inter_token_latency_seconds",
            "Time between a job's consecutive tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ferry_e2e_request_latency_seconds", "Job accepted -> terminal", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "ferry_request_queue_time_seconds",
            "Job accepted -> started on a worker",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.jobs = Counter("ferry_jobs", "Jobs this worker finished, by terminal status", ["status"], registry=r)
        self.reclaimed = Counter("ferry_jobs_reclaimed", "Jobs taken over from dead workers", registry=r)
        self.lora_handoffs = Counter(
            "ferry_lora_handoffs", "Jobs moved between workers to the one holding their LoRA adapter, by direction "
            "(sent: read here, served there; received)", ["direction"], registry=r,
        )
        self.handed_back = Counter("ferry_jobs_handed_back", "Jobs handed back to the queue on drain", registry=r)
        self.background_paused = Counter(
            "ferry_worker_background_paused_seconds", "Seconds the engine held batch work back for live traffic",
            registry=r,
        )
        self.records_lost = Counter(
            "ferry_job_records_lost", "Jobs stopped: Redis no longer had their record (nothing written)", registry=r
        )
        self.queue_lag = Gauge(
            "ferry_queue_lag", "Jobs in this model's queues not yet delivered to a worker", registry=r
        )
        self.ready = Gauge("ferry_worker_ready", "1 once the model (and snapshot) are loaded", registry=r)
        self.model_load = Gauge(
            "ferry_model_load_seconds", "Start-up, by phase: download (weights into the node's model cache; 0 when "
            "cached or local), load (weights into the engine), warmup (snapshot restore and the rest until ready)",
            ["phase"], registry=r,
        )
        self._engine = _EngineCollector()
        r.register(self._engine)

    def set_engine_stats(self, stats) -> None:
        self._engine.stats = stats
