"""The worker's /metrics text carries the engine's figures, speculative decoding included."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ferry.worker.engine import Engine, SamplingParams
from ferry.worker.serve.metrics import WorkerMetrics


def _samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _run(engine: Engine) -> None:
    engine.add_request("r", [5, 6, 7, 8] * 6, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_speculative_decoding_counters_and_rates_reach_the_metrics(llama_dir):
    # The target as its own draft: greedy proposals are all accepted, so every figure is non-trivial.
    spec = {"method": "draft", "draft_model": str(llama_dir), "num_speculative_tokens": 3, "measure_speedup": False}
    engine = Engine(str(llama_dir), speculative=spec)
    _run(engine)
    stats = engine.stats()
    spec = stats.spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    metrics = WorkerMetrics()
    metrics.set_engine_stats(stats)
    got = _samples(metrics)
    assert got[("ferry_spec_decode_num_drafts_total", ())] == spec.num_drafts
    assert got[("ferry_spec_decode_num_draft_tokens_total", ())] == spec.num_draft_tokens
    assert got[("ferry_spec_decode_num_accepted_tokens_total", ())] == spec.num_accepted_tokens
    per_position = [
        got[("ferry_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] for i in range(3)
    ]
    assert per_position == spec.accepted_per_position and sum(per_position) == spec.num_accepted_tokens
    assert got[("ferry_spec_decode_acceptance_rate", ())] == spec.acceptance_rate
    assert got[("ferry_spec_decode_mean_accepted_length", ())] == spec.mean_accepted_length > 1.0


def test_a_worker_that_does_not_speculate_exports_no_speculation_figures(llama_dir):
    engine = Engine(str(llama_dir))
    _run(engine)
    metrics = WorkerMetrics()
    metrics.set_engine_stats(engine.stats())
    names = {name for name, _ in _samples(metrics)}
    assert "ferry_num_requests_running" in names
    assert not any(name.startswith("ferry_spec_decode") for name in names)
