"""Publisher, queue reader and job starter against the real Redis, without an engine: fencing, ACK
order, hand-back, leases."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from ferry.worker.protocol import (
    CompletedEvent,
    JobRecord,
    JobRequest,
    Keys,
    Timings,
    TokenEvent,
    Usage,
    enqueue_job,
    event_from_fields,
)
from ferry.worker.serve.job_starts import JobStarter
from ferry.worker.serve.publisher import Publisher, PublisherThread
from ferry.worker.serve.queue_reader import QueueReader, Renewal
from ferry.worker.serve.render import PromptRenderer
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.writes import HandBack, Lost, Progress, finish

pytestmark = pytest.mark.redis


@pytest.fixture
def env(llama_dir):
    prefix = f"ferrytest-{uuid.uuid4().hex}"
    client = redis.Redis(decode_responses=True)
    keys = Keys(prefix)
    settings = WorkerSettings(key_prefix=prefix, model_name="m", lease_s=0.2, max_attempts=3)
    yield client, keys, settings, PromptRenderer.for_model(llama_dir, "hermes")
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def _reader(env, worker_id: str) -> QueueReader:
    client, keys, settings, _ = env
    reader = QueueReader(client, keys, "m", worker_id, settings.lease_s)
    reader.ensure_groups()
    return reader


def _starter(env, worker_id: str) -> JobStarter:
    client, keys, settings, renderer = env
    return JobStarter(client, keys, settings, worker_id, renderer)


def _take_one(env, worker_id: str = "w1"):
    client, keys, _, _ = env
    job_id = enqueue_job(client, keys, JobRequest(model="m", prompt="hi", max_tokens=3)).job_id
    reader = _reader(env, worker_id)
    starts, writes = _starter(env, worker_id).prepare(reader.read(room=4, block_ms=0))
    assert writes == [] and [s.job_id for s in starts] == [job_id] and starts[0].prompt_ids
    return reader, starts[0]


def test_read_takes_the_highest_priority_first_and_no_more_than_the_room(env):
    client, keys, _, _ = env
    reader = _reader(env, "w1")
    job_ids: dict[str, list[str]] = {"high": [], "normal": [], "low": []}
    for priority in ("low", "normal", "high", "normal", "low"):
        request = JobRequest(model="m", prompt=priority, max_tokens=2, priority=priority)
        job_ids[priority].append(enqueue_job(client, keys, request).job_id)

    first = reader.read(room=3, block_ms=0)
    assert [d.fields["job_id"] for d in first] == job_ids["high"] + job_ids["normal"]
    assert [d.stream for d in first] == [keys.queue("m", "high")] + [keys.queue("m", "normal")] * 2
    # The rest waited in Redis (visible to other workers), and comes with the next read.
    assert [d.fields["job_id"] for d in reader.read(room=8, block_ms=0)] == job_ids["low"]
    assert reader.read(room=8, block_ms=0) == []


def test_read_recreates_a_missing_consumer_group(env):
    client, keys, _, _ = env
    reader = _reader(env, "w1")
    for stream in keys.queues("m"):
        client.delete(stream)  # as after a Redis restart with nothing persisted
    assert reader.read(room=4, block_ms=0) == []
    job_id = enqueue_job(client, keys, JobRequest(model="m", prompt="hi", max_tokens=2)).job_id
    assert [d.fields["job_id"] for d in reader.read(room=4, block_ms=0)] == [job_id]


def test_read_keeps_what_it_took_when_a_later_stream_lost_its_group(env):
    client, keys, _, _ = env
    reader = _reader(env, "w1")
    high = enqueue_job(client, keys, JobRequest(model="m", prompt="hi", max_tokens=2, priority="high")).job_id
    client.delete(keys.queue("m", "low"))
    # The high entry is now pending under this consumer: it must come back, not wait out a lease.
    assert [d.fields["job_id"] for d in reader.read(room=4, block_ms=0)] == [high]
    low = enqueue_job(client, keys, JobRequest(model="m", prompt="lo", max_tokens=2, priority="low")).job_id
    assert [d.fields["job_id"] for d in reader.read(room=4, block_ms=0)] == [low]


def _done(seq: int) -> CompletedEvent:
    return CompletedEvent(seq=seq, finish_reason="length", usage=Usage(completion_tokens=2), timings=Timings())


def test_step_writes_then_terminal_write_acks_last(env):
    client, keys, _, _ = env
    _, job = _take_one(env)
    pub = Publisher(client, keys, "m", "w1", result_ttl_s=60)
    assert (
        pub.write([Progress(job.job_id, [TokenEvent(seq=1, text="a", token_ids=[5])], first_token_at=123.0)]) == {}
    )
    assert client.xpending(job.delivery.stream, keys.group)["pending"] == 1
    final = finish(job.job_id, job.delivery, _done(3), "w1", {"text": "ab"},
                      events_before=[TokenEvent(seq=2, text="b", token_ids=[6])])
    assert pub.write([final]) == {}
    assert [f["seq"] for _, f in client.xrange(keys.events(job.job_id))] == ["0", "1", "2", "3"]
    rec = JobRecord.from_redis(client.hgetall(keys.job(job.job_id)))
    assert (rec.state.value, rec.text, rec.first_token_at) == ("succeeded", "ab", 123.0)
    assert client.xlen(job.delivery.stream) == 0 and client.xpending(job.delivery.stream, keys.group)["pending"] == 0
    assert 0 < client.ttl(keys.events(job.job_id)) <= 60


def test_a_seq_written_by_another_worker_means_the_job_is_lost(env):
    client, keys, _, _ = env
    _, job = _take_one(env)
    pub = Publisher(client, keys, "m", "w1", result_ttl_s=60)
    mine = TokenEvent(seq=1, text="a", token_ids=[5])
    assert pub.write([Progress(job.job_id, [mine])]) == {}
    assert pub.write([Progress(job.job_id, [mine])]) == {}  # a retry of our own write
    theirs = TokenEvent(seq=2, text="x", token_ids=[9])
    client.xadd(keys.events(job.job_id), {"seq": "2", "type": "token", "data": theirs.model_dump_json()}, id="2-1")
    lost = pub.write(
        [finish(job.job_id, job.delivery, _done(3), "w1", events_before=[TokenEvent(seq=2, text="b", token_ids=[6])])]
    )
    assert lost == {job.job_id: Lost.TAKEN}
    assert client.hget(keys.job(job.job_id), "state") == "running"  # nothing after the refused event was written
    assert client.xpending(job.delivery.stream, keys.group)["pending"] == 1


def test_the_terminal_write_counts_the_tenants_usage_once_and_a_lost_job_not_at_all(env):
    client, keys, _, _ = env
    _, job = _take_one(env)
    _, other = _take_one(env, "w2")
    pub = Publisher(client, keys, "m", "w1", result_ttl_s=60)
    usage = {"usage": Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6)}
    final = finish(job.job_id, job.delivery, _done(1), "w1", usage)
    assert pub.write([final]) == {}
    assert pub.write([final]) == {}  # the same write again (a lost reply): counted once
    client.xadd(keys.events(other.job_id), {"seq": "1", "type": "token", "data": "{}"}, id="1-1")
    assert pub.write([finish(other.job_id, other.delivery, _done(1), "w1", usage)]) == {other.job_id: Lost.TAKEN}
    assert client.hgetall(keys.usage("default")) == {"requests": "1", "prompt_tokens": "4", "completion_tokens": "2"}


def test_hand_back_requeues_on_high_and_the_next_worker_resumes(env):
    client, keys, _, _ = env
    _, job = _take_one(env, "w1")
    pub = Publisher(client, keys, "m", "w1", result_ttl_s=60)
    pub.write([Progress(job.job_id, [TokenEvent(seq=1, text="ab", token_ids=[5, 6])])])
    pub.write([HandBack(job.job_id, job.delivery, attempts=0)])
    assert client.hget(keys.job(job.job_id), "state") == "queued"
    other = _reader(env, "w2")
    deliveries = other.read(room=4, block_ms=0)
    assert [d.stream for d in deliveries] == [keys.queue("m", "high")]
    [resumed], _ = _starter(env, "w2").prepare(deliveries)
    assert resumed.streamed.token_ids == [5, 6] and resumed.streamed.text == "ab" and resumed.streamed.next_seq == 2
    assert resumed.attempts == 1 and resumed.delivery.fields["attempt"] == "2"
    events = [event_from_fields(f) for _, f in client.xrange(keys.events(job.job_id))]
    assert [e.type for e in events] == ["started", "token"]  # no second `started`


def test_renew_keeps_the_lease_and_reports_a_reclaimed_entry(env):
    client, keys, _, _ = env
    reader, job = _take_one(env, "w1")
    time.sleep(0.3)
    assert reader.renew([(job.job_id, job.delivery)]) == Renewal(set(), set(), set())
    thief = _reader(env, "w2")
    assert thief.reap(room=4, held=set()) == []  # renewed: not idle long enough
    time.sleep(0.3)
    [taken] = thief.reap(room=4, held=set())
    assert taken.entry_id == job.delivery.entry_id and taken.reclaimed
    client.hset(keys.job(job.job_id), "cancel", "1")
    assert reader.renew([(job.job_id, job.delivery)]) == Renewal({job.job_id}, set(), {job.job_id})
    client.delete(keys.queue("m", "normal"))  # Redis lost the entry (a restart without persistence)
    client.xgroup_create(keys.queue("m", "normal"), keys.group, id="0", mkstream=True)
    assert thief.renew([(job.job_id, taken)]) == Renewal(set(), {job.job_id}, {job.job_id})


def test_the_publisher_writes_foreground_jobs_before_the_background_lane_of_the_same_round_trip(env):
    client, keys, _, _ = env
    _, live = _take_one(env)
    _, batch = _take_one(env, "w2")
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.psubscribe(f"{keys.prefix}:job:*")
    listener.get_message(timeout=1.0)
    thread = PublisherThread(Publisher(client, keys, "m", "w1", result_ttl_s=60), lambda *_: None,
                             threading.Event(), max_delay_s=1.0)
    token = TokenEvent(seq=1, text="a", token_ids=[5])
    # Submitted before the thread runs, so both go in one batch, the background job's first.
    thread.submit([Progress(batch.job_id, [token], background=True), Progress(live.job_id, [token])])
    thread.thread.start()
    assert thread.flush(10)
    order = []
    while (message := listener.get_message(timeout=2.0)) is not None:
        order.append(message["channel"].rsplit(":", 1)[1])
    thread.stop.set()
    listener.close()
    assert order == [live.job_id, batch.job_id]
