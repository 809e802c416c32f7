"""The queue's scripts on a real Redis Cluster: each touches one slot, whichever shard a job is in."""

from __future__ import annotations

import time

import pytest
from redis.crc import key_slot

from tests.serve.conftest import greedy
from worker.protocol import JobState, cancel_job, enqueue_job, enqueue_jobs, lua
from worker.tools.local_cluster import LocalCluster

pytestmark = pytest.mark.redis


def test_the_local_cluster_has_three_primaries_each_with_a_synced_replica(cluster: LocalCluster):
    primaries = {cluster.primary_for_slot(slot) for slot in (0, 8000, 16000)}
    assert len(primaries) == 3
    assert all(len(cluster.replicas_of(port)) == 1 for port in primaries)


def test_three_shards_land_on_three_primaries(cluster, ckeys):
    assert len({cluster.primary_for_slot(ckeys.shard_slot(n)) for n in range(3)}) == 3


def test_enqueue_spreads_jobs_over_the_shards_each_atomically_in_its_slot(cclient, ckeys):
    ids = [enqueue_job(cclient, ckeys, greedy(prompt=[1, 2])).job_id for _ in range(30)]
    assert {ckeys.shard_of(j) for j in ids} == {0, 1, 2}
    for job_id in ids:
        assert cclient.hget(ckeys.job(job_id), "state") == "queued"
    waiting = sum(cclient.xlen(q) for q in ckeys.queues("tiny"))
    assert waiting == 30
    more = enqueue_jobs(cclient, ckeys, [greedy(prompt=[3]) for _ in range(9)])  # one pipeline over three nodes
    assert all(r.created for r in more) and sum(cclient.xlen(q) for q in ckeys.queues("tiny")) == 39


def test_an_idempotency_key_lands_with_its_job_and_answers_the_same_job(cclient, ckeys):
    request = greedy(prompt=[1, 2], tenant="t")
    first = enqueue_job(cclient, ckeys, request, idempotency_key="k-1")
    again = enqueue_job(cclient, ckeys, request, idempotency_key="k-1")
    assert first.created and not again.created and again.job_id == first.job_id
    assert key_slot(ckeys.idempotency("t", "k-1").encode()) == key_slot(ckeys.job(first.job_id).encode())


def test_cancel_of_a_queued_job_is_spublished_on_the_jobs_shard_channel(cclient, ckeys):
    job_id = enqueue_job(cclient, ckeys, greedy(prompt=[1])).job_id
    pubsub = cclient.pubsub()
    pubsub.ssubscribe(ckeys.channel(job_id))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pubsub.get_sharded_message(timeout=0.1) is None:
        pass  # the ssubscribe confirmation
    assert cancel_job(cclient, ckeys, job_id) is JobState.cancelled
    message = None
    while time.monotonic() < deadline and message is None:
        message = pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=0.1)
    pubsub.close()
    assert message is not None and message["type"] == "smessage" and '"cancelled"' in message["data"]


def test_scripts_publish_on_shard_channels_only_on_a_cluster(cclient):
    import redis

    assert "SPUBLISH" in lua.register(cclient, lua.EMIT).script
    assert "'PUBLISH'" in lua.register(redis.Redis(), lua.EMIT).script


def test_a_worker_reads_high_before_normal_before_low_across_shards(cclient, ckeys):
    from worker.serve.intake import Consumer
    from worker.serve.settings import WorkerSettings

    consumer = Consumer(cclient, ckeys, WorkerSettings(model_name="tiny"), "w-1")
    consumer.ensure_groups()
    for shard, priority in ((0, "low"), (1, "normal"), (2, "high"), (0, "high"), (2, "low")):
        cclient.xadd(ckeys.queue("tiny", priority, shard), {"job_id": f"j-{priority}-s{shard}", "attempt": "1"})
    taken = [d.fields["job_id"] for d in consumer.read(room=3, block_ms=0)]
    assert sorted(taken[:2]) == ["j-high-s0", "j-high-s2"] and taken[2] == "j-normal-s1"
    rest = [d.fields["job_id"] for d in consumer.read(room=5, block_ms=0)]
    assert sorted(rest) == ["j-low-s0", "j-low-s2"]
    assert consumer.read(room=5, block_ms=300) == []  # blocks on the shards in turn, then gives up
    cclient.xadd(ckeys.queue("tiny", "normal", 1), {"job_id": "late-s1", "attempt": "1"})
    assert [d.fields["job_id"] for d in consumer.read(room=1, block_ms=300)] == ["late-s1"]
