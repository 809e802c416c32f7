"""The queue's scripts on a real Redis Cluster: each touches one slot, whichever shard a job is in."""

from __future__ import annotations

import time

import pytest
from redis.crc import key_slot

from ferry.worker.protocol import JobState, cancel_job, enqueue_job, enqueue_jobs, lua
from ferry.worker.tools.local_cluster import LocalCluster
from tests.serve.conftest import greedy

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
    from ferry.worker.serve.queue_reader import QueueReader

    consumer = QueueReader(cclient, ckeys, "tiny", "w-1", lease_s=30.0)
    consumer.ensure_groups()
    for shard, priority in ((0, "low"), (1, "normal"), (2, "high"), (0, "high"), (2, "low")):
        cclient.xadd(ckeys.queue("tiny", priority, shard), {"job_id": f"j-{priority}-s{shard}", "attempt": "1"})
    taken = [d.fields["job_id"] for d in consumer.read(room=3, block_ms=0)]
    assert sorted(taken[:2]) == ["j-high-s0", "j-high-s2"] and taken[2] == "j-normal-s1"
    rest = [d.fields["job_id"] for d in consumer.read(room=5, block_ms=0)]
    assert sorted(rest) == ["j-low-s0", "j-low-s2"]
    assert consumer.read(room=5, block_ms=300) == []  # blocks on every shard, then gives up
    deadline = time.monotonic() + 10
    while consumer.in_flight and time.monotonic() < deadline:  # the other blocked reads end too
        assert consumer.read(room=5, block_ms=0) == []
        time.sleep(0.05)
    cclient.xadd(ckeys.queue("tiny", "normal", 1), {"job_id": "late-s1", "attempt": "1"})
    assert [d.fields["job_id"] for d in consumer.read(room=1, block_ms=300)] == ["late-s1"]


def _job_ids(deliveries) -> list[str]:
    return [d.fields["job_id"] for d in deliveries]


def test_an_idle_worker_blocks_on_every_shard_at_once_and_keeps_room_for_its_reads(cclient, ckeys):
    """A job in any shard wakes an idle worker at once. One blocked read per shard cannot be done
    on one connection (a blocking read names one slot); blocking on the shards in turn would return
    nothing here: the job lands in a shard the first turn does not block on."""
    import threading

    from ferry.worker.serve.queue_reader import QueueReader

    consumer = QueueReader(cclient, ckeys, "tiny", "w-1", lease_s=30.0)
    consumer.ensure_groups()
    got: list = []
    reader = threading.Thread(target=lambda: got.append(consumer.read(room=8, block_ms=8000)))
    reader.start()
    time.sleep(0.5)  # the reads are blocked by now
    cclient.xadd(ckeys.queue("tiny", "normal", 2), {"job_id": "late-s2", "attempt": "1"})
    reader.join(20)
    assert _job_ids(got[0]) == ["late-s2"]
    # The other shards' reads are still blocked, and each may still claim an entry: with room for
    # two, both places are theirs, so nothing else is read.
    assert consumer.in_flight == 2
    cclient.xadd(ckeys.queue("tiny", "high", 2), {"job_id": "queued-s2", "attempt": "1"})
    assert consumer.read(room=2, block_ms=0) == []
    assert _job_ids(consumer.read(room=3, block_ms=0)) == ["queued-s2"]
    # Room for one more than the reads in flight: the shard without a read gets one, and wakes it.
    got.clear()
    reader = threading.Thread(target=lambda: got.append(consumer.read(room=3, block_ms=8000)))
    reader.start()
    time.sleep(0.5)
    cclient.xadd(ckeys.queue("tiny", "normal", 2), {"job_id": "again-s2", "attempt": "1"})
    reader.join(20)
    assert _job_ids(got[0]) == ["again-s2"] and consumer.in_flight == 2
    # An entry a read in flight claims comes with the next read, or from settle (a drain).
    cclient.xadd(ckeys.queue("tiny", "low", 0), {"job_id": "during-s0", "attempt": "1"})
    deadline = time.monotonic() + 10
    while consumer.in_flight == 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    cclient.xadd(ckeys.queue("tiny", "low", 1), {"job_id": "during-s1", "attempt": "1"})
    assert sorted(_job_ids(consumer.settle(5.0))) == ["during-s0", "during-s1"]
    assert consumer.in_flight == 0


def test_a_terminal_write_short_of_replicas_is_logged_without_holding_the_publisher(cclient, ckeys, caplog):
    """Each primary has one replica: a check for two times out (3 s) and is logged, while the
    publisher goes on at once (its WAIT runs on a thread of its own)."""
    from ferry.worker.protocol import CompletedEvent, Timings, Usage
    from ferry.worker.serve.job_starts import JobStarter
    from ferry.worker.serve.publisher import Publisher
    from ferry.worker.serve.queue_reader import QueueReader
    from ferry.worker.serve.render import PromptRenderer
    from ferry.worker.serve.settings import WorkerSettings
    from ferry.worker.serve.writes import finish

    reader = QueueReader(cclient, ckeys, "tiny", "w-1", lease_s=30.0)
    reader.ensure_groups()
    starter = JobStarter(cclient, ckeys, WorkerSettings(model_name="tiny"), "w-1", PromptRenderer(None, "hermes"))
    enqueue_job(cclient, ckeys, greedy(model="tiny", prompt=[1, 2, 3], max_tokens=2))
    [job], writes = starter.prepare(reader.read(room=4, block_ms=0))
    assert writes == []
    publisher = Publisher(cclient, ckeys, "tiny", "w-1", result_ttl_s=60, min_replicas=2, replica_timeout_ms=3000)
    done = CompletedEvent(seq=1, finish_reason="length", usage=Usage(completion_tokens=2), timings=Timings())
    started = time.monotonic()
    assert publisher.write([finish(job.job_id, job.delivery, done, "w-1", {"text": "ab"})]) == {}
    assert time.monotonic() - started < 2.0  # the 3 s WAIT is not on this thread
    assert cclient.hget(ckeys.job(job.job_id), "state") == "succeeded"
    deadline = time.monotonic() + 15
    while "not replicated in time" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "terminal write not replicated in time" in caplog.text


def test_lora_hand_offs_move_jobs_of_every_shard_in_its_slot(cclient, ckeys):
    """A job moved to the worker holding its adapter (`worker.serve.lora_affinity`): the move and
    the take each touch one slot, the job's shard's, whichever shard that is."""
    import json

    from ferry.worker.serve.lora_affinity import LoraAffinity
    from ferry.worker.serve.queue_reader import QueueReader

    cclient.hset(ckeys.worker("w-a"), mapping={"model": "tiny", "state": "ready", "loras": json.dumps(["sql"]),
                                               "jobs": "0", "max_num_seqs": "256", "ts": repr(time.time())})
    cclient.zadd(ckeys.workers, {"w-a": time.time()})
    holder, reader = (QueueReader(cclient, ckeys, "tiny", w, lease_s=30.0, handoffs=True) for w in ("w-a", "w-b"))
    holder.ensure_groups()
    reader.ensure_groups()
    jobs = {}
    while len({ckeys.shard_of(j) for j in jobs}) < ckeys.shards:  # a job in every shard
        job_id = enqueue_job(cclient, ckeys, greedy(prompt="hi", lora="sql")).job_id
        jobs[job_id] = None
    read = reader.read(room=len(jobs), block_ms=0)
    assert sorted(d.fields["job_id"] for d in read) == sorted(jobs)
    affinity = LoraAffinity(cclient, ckeys, "tiny", "w-b", list, refresh_s=0.0, max_age_s=5.0)
    chosen = affinity.choose([(d, d.fields["job_id"], "sql") for d in read])
    assert chosen == dict.fromkeys(jobs, "w-a")
    assert affinity.move([(d, d.fields["job_id"], "w-a") for d in read]) == set(jobs)
    taken = holder.handoffs()
    assert sorted(d.fields["job_id"] for d in taken) == sorted(jobs) and all(d.handed for d in taken)
    assert {(d.stream, d.entry_id) for d in taken} == {(d.stream, d.entry_id) for d in read}
