"""The scaling rules one at a time, on hand-made observations (no Redis, no clock)."""

import pytest

from ferry.autoscaler.policy import Autoscaler, Observation, ScalePolicy


def obs(t: float, lag: int = 0, pending: int = 0, live: int = 0) -> Observation:
    return Observation(t=t, lag=lag, pending=pending, live_workers=live)


def run(scaler: Autoscaler, steps: list[Observation]) -> list[int]:
    return [scaler.decide(o).desired for o in steps]


def test_first_job_wakes_a_pool_at_zero():
    scaler = Autoscaler(ScalePolicy())
    assert run(scaler, [obs(0), obs(15), obs(30, lag=1)]) == [0, 0, 1]


def test_scale_up_is_bounded_per_decision_and_by_max_workers():
    scaler = Autoscaler(ScalePolicy(target_backlog_per_worker=4, max_workers=10, max_step_up=3))
    assert run(scaler, [obs(15 * i, lag=400) for i in range(5)]) == [3, 6, 9, 10, 10]


def test_pending_jobs_count_as_backlog():
    scaler = Autoscaler(ScalePolicy(target_backlog_per_worker=4), desired=1)
    assert scaler.decide(obs(0, lag=0, pending=12, live=1)).desired == 3


def test_no_scale_down_inside_the_stabilisation_window():
    policy = ScalePolicy(target_backlog_per_worker=4, scale_down_window_s=300, max_step_down_frac=1.0)
    scaler = Autoscaler(policy, desired=4)
    scaler.decide(obs(0, lag=16, live=4))
    # The backlog drops to one worker's worth: the window still remembers 16 jobs.
    desired = run(scaler, [obs(t, lag=2, live=4) for t in range(15, 300, 15)])
    assert set(desired) == {4}
    assert scaler.decide(obs(330, lag=2, live=4)).desired == 1


def test_dead_band_keeps_a_worker_while_backlog_hovers_at_the_boundary():
    # Backlog between 1x and 2x the target: up to 2 workers, and no way back to 1 at 50% utilisation.
    scaler = Autoscaler(ScalePolicy(target_backlog_per_worker=8, scale_down_window_s=60), desired=1)
    desired = run(scaler, [obs(15 * i, pending=9 if i % 2 else 6, live=2) for i in range(40)])
    assert desired[1:] == [2] * 39


def test_scale_down_removes_at_most_the_step_fraction():
    policy = ScalePolicy(
        target_backlog_per_worker=1, scale_down_window_s=0, max_step_down_frac=0.5, scale_down_utilization=1
    )
    scaler = Autoscaler(policy, desired=8)
    assert run(scaler, [obs(0, pending=8, live=8)] + [obs(t, pending=1, live=8) for t in (15, 30, 45, 60)]) == [
        8,
        4,
        2,
        1,
        1,
    ]


def test_idle_window_then_zero_and_min_workers_respected():
    scaler = Autoscaler(ScalePolicy(idle_to_zero_s=300, scale_down_window_s=60))
    scaler.decide(obs(0, lag=1))
    desired = run(scaler, [obs(t) for t in range(15, 331, 15)])
    assert desired[:19] == [1] * 19  # t = 15 .. 285: one warm worker
    assert desired[-2:] == [0, 0]  # t >= 300 since the last job: zero
    floor = Autoscaler(ScalePolicy(min_workers=2, idle_to_zero_s=0))
    assert run(floor, [obs(0), obs(15, lag=1), obs(30)]) == [2, 2, 2]


def test_idle_window_doubles_after_a_quick_rewake_and_resets_after_a_long_sleep():
    policy = ScalePolicy(idle_to_zero_s=300, max_idle_to_zero_s=1200, scale_down_window_s=0)
    scaler = Autoscaler(policy)
    scaler.decide(obs(0, lag=1))
    assert scaler.decide(obs(300)).desired == 0
    assert scaler.decide(obs(400, lag=1)).desired == 1  # woke 100 s after dropping: 300 s was too short
    assert scaler.idle_window_s == 600
    assert scaler.decide(obs(900)).desired == 1  # 500 s idle < 600 s
    assert scaler.decide(obs(1000)).desired == 0
    assert scaler.decide(obs(3000, lag=1)).desired == 1  # slept 2000 s >= max: back to the short window
    assert scaler.idle_window_s == 300


def test_restart_with_live_workers_does_not_empty_the_pool_at_once():
    scaler = Autoscaler(ScalePolicy(scale_down_window_s=300), desired=3, last_busy_t=0)
    assert run(scaler, [obs(t, live=3) for t in (15, 30, 285)]) == [3, 3, 3]
    assert scaler.decide(obs(330, live=3)).desired == 0  # idle window over: the pool empties


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_backlog_per_worker": 0},
        {"min_workers": 3, "max_workers": 2},
        {"max_workers": 0},
        {"max_step_up": 0},
        {"max_step_down_frac": 0},
        {"scale_down_utilization": 1.5},
        {"idle_to_zero_s": 900, "max_idle_to_zero_s": 600},
    ],
)
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        ScalePolicy(**kwargs)
