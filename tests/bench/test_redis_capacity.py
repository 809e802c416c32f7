"""bench.redis_capacity's arithmetic: per-job and per-token costs out of two batches, and shards;
bench.redis_cluster's: shard scaling ratios, the servers' proof that the work ran, the enqueue
command it sends, and the added TTFT."""

import pytest
from redis.crc import key_slot

from bench.redis_capacity import shards_needed, solve_costs
from bench.redis_cluster import _jobs_workload, check_counts, scaling_ratios, ttft_summary
from bench.redis_server import PIPELINE
from ferry.worker.protocol import Keys


def _batch(jobs: int, tokens: int, seconds: float, per_job: float, per_token: float, idle: float) -> dict:
    commands = jobs * per_job + tokens * per_token + idle * seconds
    return {"jobs": jobs, "tokens": tokens, "seconds": seconds, "commands": {"evalsha": commands},
            "bytes": 10 * commands}


def test_two_batches_recover_the_per_job_and_per_token_costs_without_the_idle_rate():
    short, long = _batch(32, 256, 2.0, 23.0, 4.0, 12.0), _batch(32, 1280, 5.0, 23.0, 4.0, 12.0)
    costs = solve_costs(short, long, {"commands_per_s": 12.0, "bytes_per_s": 120.0})
    assert abs(costs["commands_per_job"] - 23.0) < 1e-9 and abs(costs["commands_per_token"] - 4.0) < 1e-9
    assert abs(costs["bytes_per_job"] - 230.0) < 1e-9 and abs(costs["bytes_per_token"] - 40.0) < 1e-9


def test_shards_cover_the_fleet_at_the_headroom():
    costs = {"events_per_token": 1.0, "commands_per_job": 20.0, "commands_per_token": 4.0, "bytes_per_token": 600.0,
             "bytes_per_job": 4000.0}
    node = {"token_events_per_s": 100_000.0, "commands_per_s": 1_000_000.0}
    # 100 GPUs x 1000 tok/s = 100k events/s = one node's ceiling; 400 jobs/s x 20 = 8k plain commands/s.
    row = shards_needed(costs, node, 100, 1000.0, 250, headroom=0.5)
    assert row["shards"] == 3  # busy 1.008 nodes at half a node each
    assert shards_needed(costs, node, 1, 1000.0, 250, headroom=0.5)["shards"] == 1


def _run(shards: int, ops_per_s: float, ops_per_server_cpu_s: float) -> dict:
    return {"shards": shards, "ops_per_s": ops_per_s, "ops_per_server_cpu_s": ops_per_server_cpu_s}


def test_scaling_per_core_is_what_three_primaries_give_with_a_core_each():
    # 3 primaries on 2 cores: 1.5x the ops/s, but each op cost 10% more CPU than on one primary.
    ratios = scaling_ratios(_run(1, 100_000.0, 120_000.0), _run(3, 150_000.0, 108_000.0))
    assert abs(ratios["scaling_measured"] - 1.5) < 1e-9
    assert abs(ratios["scaling_per_core"] - 2.7) < 1e-9


def test_the_server_counts_must_show_every_request_run_to_the_end():
    ok = {"evalsha": {"calls": 32, "failed_calls": 0, "rejected_calls": 0},
          "xadd": {"calls": 32, "failed_calls": 0, "rejected_calls": 0}}
    check_counts(ok, {"evalsha": 32, "xadd": 32})
    with pytest.raises(RuntimeError, match="expected"):
        check_counts(ok, {"evalsha": 32, "spublish": 32})  # the script returned before publishing
    with pytest.raises(RuntimeError, match="rejected"):
        check_counts({**ok, "hset": {"calls": 0, "failed_calls": 0, "rejected_calls": 5}}, {"evalsha": 32})


def test_every_enqueue_names_its_own_job_in_its_shards_slot():
    keys = Keys("bench", 3)
    workload = _jobs_workload(keys, "0" * 40, requests=1000)
    assert workload.requests % PIPELINE == 0 and workload.requests >= 1000
    for shard, command in enumerate(workload.commands):
        numkeys = int(command[2])
        named = command[3:3 + numkeys]
        assert {key_slot(k.encode()) for k in named} == {keys.shard_slot(shard)}
        job_id = command[3 + numkeys]  # ENQUEUE's ARGV[1]
        assert job_id.startswith("__rand_int__") and job_id.endswith(f"-s{shard}")
        suffix = job_id.removeprefix("__rand_int__")  # every mention of the id is the varied one
        assert all(x.count(suffix) == x.count(job_id) for x in command) and named[0].endswith(job_id)


def _round(setting: str, ttft: list[float], shard: list[int]) -> dict:
    return {"setting": setting, "ttft_ms": ttft, "intake_ms": [1.0] * len(ttft), "shard": shard}


def test_added_ttft_is_the_cluster_p50_over_the_node_p50_pooled_and_per_round_pair():
    rounds = [_round("node", [2.0, 3.0, 4.0], [0, 0, 0]), _round("cluster", [3.0, 5.0, 200.0], [0, 1, 2]),
              _round("node", [2.0, 2.0, 6.0], [0, 0, 0]), _round("cluster", [4.0, 4.0, 190.0], [0, 1, 2])]
    summary = ttft_summary(rounds)
    assert summary["node"]["rounds_p50"] == [3.0, 2.0] and summary["cluster"]["rounds_p50"] == [5.0, 4.0]
    assert summary["node"]["p50"] == 2.0 and summary["cluster"]["p50"] == 4.0  # nearest rank of 6
    assert summary["added_p50_ms"] == 2.0 and summary["added_p50_ms_by_round"] == [2.0, 2.0]
    assert summary["cluster"]["by_shard_p50"] == {"0": 3.0, "1": 4.0, "2": 190.0}
