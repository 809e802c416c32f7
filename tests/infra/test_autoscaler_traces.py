"""The default policy on synthetic traces: a burst, a diurnal curve, a trickle of one job an hour.

Numbers asserted here are the ones quoted in infra/README.md; the pool model is 120 s from
ask to ready (GPU node + image + weights), 8 jobs per worker, a 15 s tick.
"""

import pytest

from ferry.autoscaler.policy import ScalePolicy
from ferry.autoscaler.simulate import (
    Job,
    PoolModel,
    burst_trace,
    diurnal_trace,
    load_jobs_csv,
    simulate,
    trickle_trace,
)

POOL = PoolModel(boot_s=120, concurrency=8, tick_s=15)
COLD_START_BOUND_S = POOL.boot_s + POOL.tick_s  # a job waits at most one tick, then one boot


@pytest.fixture(scope="module")
def diurnal():
    return simulate(diurnal_trace(seed=7), ScalePolicy(), POOL, horizon_s=26 * 3600)


def test_burst_wakes_fast_serves_everything_and_returns_to_zero():
    r = simulate(burst_trace(start_s=300, jobs=400, over_s=60, service_s=20), ScalePolicy(), POOL, 3600)
    print("burst:", r.summary())
    assert r.jobs_done == r.jobs_total == 400
    assert r.first_worker_s and max(r.first_worker_s) <= COLD_START_BOUND_S
    assert r.peak_workers == ScalePolicy().max_workers
    assert r.flaps == 0
    assert r.ends_at_zero
    # Cost: the work itself (16.7) + 8 boots (16) + 8 workers held through the 300 s
    # stabilisation window after the last job (40); no worker survives past it.
    assert r.ideal_worker_minutes <= r.worker_minutes <= 80
    assert r.idle_worker_minutes <= 8 * 300 / 60 + 1


def test_diurnal_follows_the_day_without_flapping(diurnal):
    r = diurnal
    print("diurnal:", r.summary())
    assert r.jobs_done == r.jobs_total > 10_000
    assert r.flaps <= 2
    assert r.wait_p95_s <= 5
    assert max(r.first_worker_s) <= COLD_START_BOUND_S
    assert r.worker_minutes <= 3.5 * r.ideal_worker_minutes
    night = [d.desired for d in r.decisions if 3600 <= d.t < 6 * 3600]  # no traffic 00:00-06:00
    assert night and set(night) == {0}
    assert r.ends_at_zero


def test_adaptive_idle_window_halves_diurnal_flaps(diurnal):
    fixed = ScalePolicy(idle_to_zero_s=300, max_idle_to_zero_s=300)
    r = simulate(diurnal_trace(seed=7), fixed, POOL, horizon_s=26 * 3600)
    assert r.flaps >= 2 * max(1, diurnal.flaps)


def test_trickle_pays_one_cold_start_and_one_idle_window_per_job():
    r = simulate(trickle_trace(hours=12, service_s=30), ScalePolicy(), POOL, 13 * 3600)
    print("trickle:", r.summary())
    assert r.jobs_done == 12
    assert len(r.first_worker_s) == 12 and max(r.first_worker_s) <= COLD_START_BOUND_S
    assert r.flaps == 0
    per_job_s = POOL.boot_s + 30 + ScalePolicy().idle_to_zero_s + POOL.tick_s
    assert r.worker_minutes <= 12 * per_job_s / 60
    assert r.ends_at_zero


def test_min_workers_trades_idle_cost_for_no_cold_start():
    r = simulate(trickle_trace(hours=12, service_s=30), ScalePolicy(min_workers=1), POOL, 13 * 3600)
    assert r.first_worker_s == () and r.wait_max_s == 0
    assert r.worker_minutes == pytest.approx(13 * 60, abs=1)


def test_recorded_job_trace_loads_and_replays(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("# arrival_s,service_s of a recorded hour\narrival_s,service_s\n0,12.5\n30,4\n3000,8\n")
    jobs = load_jobs_csv(path)
    assert jobs == [Job(0, 12.5), Job(30, 4), Job(3000, 8)]
    r = simulate(jobs, ScalePolicy(), POOL, 4000)
    assert r.jobs_done == 3 and len(r.first_worker_s) == 2 and r.flaps == 0
