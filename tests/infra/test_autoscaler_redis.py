"""The autoscaler against the real Redis at 127.0.0.1:6379: key names, lag, pending, heartbeats.

A fake pool (no engine) consumes the streams the way workers do (XREADGROUP, XACK, heartbeat
hashes with a TTL) on a synthetic clock, the loop records what it sees, and the recording
replays to the same decisions.
"""

import heapq
import uuid
from dataclasses import dataclass, field

import pytest
import redis

from ferry.autoscaler import main
from ferry.autoscaler.loop import AutoscaleLoop, read_recording, replay
from ferry.autoscaler.policy import ScalePolicy
from ferry.autoscaler.publish import PrometheusGauges
from ferry.autoscaler.redis_source import RedisBacklog
from ferry.worker.protocol import GROUP, Keys

pytestmark = pytest.mark.redis

MODEL = "tiny-llama"


@pytest.fixture
def r():
    client = redis.Redis(host="127.0.0.1", port=6379, decode_responses=True)
    prefix = f"ferrytest-{uuid.uuid4().hex[:12]}"
    yield client, prefix
    keys = list(client.scan_iter(match=prefix + ":*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_lag_pending_and_live_workers_per_model(r):
    client, prefix = r
    high, normal, low = Keys(prefix).queues(MODEL)
    client.xgroup_create(high, GROUP, id="0", mkstream=True)
    for i in range(5):
        client.xadd(high, {"job_id": f"h{i}", "attempt": 1})
    client.xreadgroup(GROUP, "w1", {high: ">"}, count=2)  # two running on w1
    for i in range(3):  # queued before any worker made the group: all lag
        client.xadd(low, {"job_id": f"l{i}", "attempt": 1})
    _heartbeat(client, prefix, "w1", MODEL)
    _heartbeat(client, prefix, "w2", "other-model")
    client.zadd(f"{prefix}:workers", {"w3": client.time()[0]})  # listed, but its hash expired: dead

    got = RedisBacklog(client, prefix).observe([MODEL, "other-model", "absent"], t=1.0)
    assert (got[MODEL].lag, got[MODEL].pending, got[MODEL].live_workers) == (3 + 3, 2, 1)
    assert got["other-model"].live_workers == 1 and got["other-model"].backlog == 0
    assert got["absent"].backlog == 0 and got["absent"].live_workers == 0


def test_lag_is_counted_when_redis_cannot_report_it(r):
    client, prefix = r
    key = Keys(prefix).queues(MODEL)[1]
    client.xgroup_create(key, GROUP, id="0", mkstream=True)
    ids = [client.xadd(key, {"job_id": str(i)}) for i in range(4)]
    client.xreadgroup(GROUP, "w1", {key: ">"}, count=1)
    client.xdel(key, ids[2])  # a hole after the last delivered id: XINFO GROUPS lag is nil
    assert next(g for g in client.xinfo_groups(key) if g["name"] == GROUP)["lag"] is None
    assert RedisBacklog(client, prefix).queue_backlog(key) == (2, 1)


def _heartbeat(client, prefix: str, worker_id: str, model: str) -> None:
    """What a worker writes every heartbeat (worker/protocol/keys.py)."""
    keys = Keys(prefix)
    client.hset(keys.worker(worker_id), mapping={"model": model, "load": 0})
    client.expire(keys.worker(worker_id), 30)
    client.zadd(keys.workers, {worker_id: client.time()[0]})


@dataclass
class FakeWorker:
    name: str
    ready_at: float
    draining: bool = False
    running: list = field(default_factory=list)  # heap of (finish_t, stream, entry id)


def test_fake_pool_on_real_redis_scales_up_down_to_zero_and_replays(r, tmp_path):
    client, prefix = r
    keys = Keys(prefix).queues(MODEL)
    for key in keys:
        client.xgroup_create(key, GROUP, id="0", mkstream=True)
    policy = ScalePolicy(
        target_backlog_per_worker=4, max_workers=4, max_step_up=2, scale_down_window_s=60, idle_to_zero_s=120
    )
    record = tmp_path / "recording.csv"
    gauges = PrometheusGauges()
    with open(record, "w") as f:
        loop = AutoscaleLoop(RedisBacklog(client, prefix), policy, [MODEL], publishers=[gauges], record_to=f)
        workers: list[FakeWorker] = []
        desired_seen = []
        # Synthetic clock, 15 s ticks: a burst of 24 jobs at 30 s, a straggler at 600 s.
        arrivals = {30: 24, 600: 1}
        for step in range(80):
            t = step * 15.0
            for i in range(arrivals.get(int(t), 0)):
                client.xadd(keys[i % 3], {"job_id": f"j{t}-{i}", "attempt": 1})
            _run_workers(client, prefix, keys, workers, t, slots=4, service_s=60)
            desired = loop.tick(t)[MODEL].desired
            desired_seen.append(desired)
            _resize(client, prefix, workers, desired, t, boot_s=45)

    assert desired_seen[:2] == [0, 0]
    assert desired_seen[2] == 2 and max(desired_seen) == 4  # first job: up by the step, then the cap
    assert desired_seen[-1] == 0 and not workers
    assert all(client.xinfo_groups(k)[0]["pending"] == 0 for k in keys)  # every job acked
    assert gauges.registry.get_sample_value("ferry_autoscaler_desired_workers", {"model": MODEL}) == 0

    recorded = read_recording(record)[MODEL]
    assert [d.desired for _, d in recorded] == desired_seen
    replayed = replay([o for o, _ in recorded], policy)
    assert [(d.desired, d.reason) for d in replayed] == [(d.desired, d.reason) for _, d in recorded]


def _run_workers(client, prefix, keys, workers, t, *, slots, service_s):
    for w in workers:
        while w.running and w.running[0][0] <= t:
            _, key, entry = heapq.heappop(w.running)
            client.xack(key, GROUP, entry)
        if w.ready_at > t:
            continue
        _heartbeat(client, prefix, w.name, MODEL)
        free = 0 if w.draining else slots - len(w.running)
        for key in keys:  # highest priority first
            if free <= 0:
                break
            for stream, entries in client.xreadgroup(GROUP, w.name, {key: ">"}, count=free):
                for entry, _ in entries:
                    heapq.heappush(w.running, (t + service_s, stream, entry))
                    free -= 1
    for w in [w for w in workers if w.draining and not w.running]:
        client.delete(f"{prefix}:worker:{w.name}")
        workers.remove(w)


def _resize(client, prefix, workers, desired, t, *, boot_s):
    active = [w for w in workers if not w.draining]
    for i in range(desired - len(active)):
        workers.append(FakeWorker(name=f"w{t:.0f}-{i}", ready_at=t + boot_s))
    for w in sorted(active, key=lambda w: len(w.running))[: max(0, len(active) - desired)]:
        w.draining = True


def test_cli_once_dry_run_prints_decisions(r, monkeypatch, capsys):
    client, prefix = r
    client.xadd(Keys(prefix).queues(MODEL)[1], {"job_id": "x", "attempt": 1})
    monkeypatch.setenv("FERRY_KEY_PREFIX", prefix)
    monkeypatch.setenv("FERRY_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("FERRY_AUTOSCALE_MODELS", f"{MODEL},idle-model")
    assert main(["--once", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{MODEL}: desired=1" in out and "idle-model: desired=0" in out
