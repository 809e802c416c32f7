"""bench.lora end to end on its quick workload, smaller still (2 layers, a few requests): the
adapters it writes load in the engine, unused slots change no token, a cold adapter comes from
moto's S3 server, and every request of the stream is accounted for."""

from __future__ import annotations

import json

import pytest

from bench import lora


@pytest.mark.s3
@pytest.mark.slow
def test_quick_run_writes_every_part_and_its_checks(tmp_path, capsys):
    lora.main(["--quick", "--tokens", "4", "--stream-requests", "12", "--stream-adapters", "10",
               "--in-flight", "6", "--stream-tokens", "2", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "lora-latest.json").read_text())["results"]

    throughput = result["throughput"]
    assert throughput["lora_unused_same_tokens_as_base"] == throughput["requests"] == 8
    assert all(changed > 0 for changed in throughput["adapters_changed_tokens"].values())
    assert set(throughput["systems"]) == {"base", "lora-unused", "qv", "all7"}
    assert throughput["lora_stats"]["qv"]["host_loads"] == 4 and throughput["lora_stats"]["qv"]["load_failures"] == 0

    cold = result["cold"]
    assert cold["lora_stats"]["host_loads"] == 1 and cold["lora_stats"]["load_failures"] == 0
    assert cold["ttft_median_s"]["cold_adapter_s"] > 0

    stream = result["stream"]
    assert len(stream["per_request"]) == 12
    assert stream["own_adapter_reads_waited"]["max"] >= 1  # every first turn of an adapter reads it
    assert stream["goal"]["met"] == (stream["own_adapter_reads_waited"]["max"] <= 1)
    assert stream["adapter_ready_s"]["max"] <= stream["wait_s"]["max"]
    assert "goal: no request waits for more than 1 load" in capsys.readouterr().out
