"""bench.redis_capacity's arithmetic: per-job and per-token costs out of two batches, and shards."""

from bench.redis_capacity import shards_needed, solve_costs


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
