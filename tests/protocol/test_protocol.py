"""The wire contract: encodings, the job record, atomic enqueue and cancel (real Redis, own prefix)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from ferry.worker.protocol import (
    CompletedEvent,
    Envelope,
    FailedEvent,
    JobRecord,
    JobRequest,
    JobState,
    Keys,
    StartedEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    cancel_job,
    cancel_job_async,
    decode_event,
    encode_event,
    enqueue_job,
    enqueue_job_async,
    enqueue_jobs,
    event_from_fields,
    event_stream_id,
    event_to_fields,
    job_id_created_at,
    new_job_id,
    seq_of_stream_id,
)

pytestmark = pytest.mark.redis


@pytest.fixture
def keys():
    prefix = f"ferrytest-{uuid.uuid4().hex}"
    yield Keys(prefix)
    client = redis.Redis()
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def client():
    c = redis.Redis(decode_responses=True)
    yield c
    c.close()


def test_protocol_and_keys_import_no_torch():
    code = "import sys, worker.protocol.jobs, worker.protocol.keys; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_key_names():
    k = Keys("ferry")
    assert k.queues("m") == ["ferry:q:{s0}:m:high", "ferry:q:{s0}:m:normal", "ferry:q:{s0}:m:low"]
    assert (k.job("j"), k.events("j"), k.channel("j")) == (
        "ferry:job:{s0}:j", "ferry:job:{s0}:j:events", "ferry:job:{s0}:j")
    assert (k.cancel, k.dlq, k.worker("w"), k.model_limits("m")) == (
        "ferry:cancel",
        "ferry:dlq",
        "ferry:worker:w",
        "ferry:model:m",
    )
    with pytest.raises(ValueError):
        k.queue("m", "urgent")


def test_idempotency_names_are_one_per_tenant_and_key_whatever_they_hold():
    k = Keys("ferry")
    assert k.idempotency("t", "x") == k.idempotency("t", "x") and k.idempotency("t", "x").startswith("ferry:idem:")
    pairs = [("acme", "x:K"), ("acme:x", "K"), ("acme", "xK"), ("acmex", "K"), ("", "acme:x:K"), ("acme:x:K", "")]
    assert len({k.idempotency(t, key) for t, key in pairs}) == len(pairs)


def test_every_key_of_a_job_shares_its_shards_slot_with_the_shards_queues():
    k = Keys("ferry", shards=3)
    for shard in range(3):
        job_id = new_job_id(shard=shard)
        assert Keys.shard_of(job_id) == shard and job_id_created_at(job_id) is not None
        slots = {key_slot(name.encode()) for name in
                 [k.job(job_id), k.events(job_id), k.channel(job_id), *k.shard_queues("m", shard)]}
        assert slots == {k.shard_slot(shard)}
    assert Keys.shard_of("an-id-without-a-shard") == 0


def test_shards_spread_over_an_evenly_split_cluster_one_per_primary():
    for shards in (2, 3, 6, 16):
        k = Keys("ferry", shards=shards)
        owners = [k.shard_slot(n) * shards // 16384 for n in range(shards)]
        assert owners == list(range(shards))


def test_an_idempotency_key_is_in_the_shard_of_the_job_it_names():
    k = Keys("ferry", shards=4)
    shards = {k.idempotency_shard("t", f"key-{i}") for i in range(64)}
    assert shards == {0, 1, 2, 3}
    for i in range(16):
        assert key_slot(k.idempotency("t", f"key-{i}").encode()) == k.shard_slot(k.idempotency_shard("t", f"key-{i}"))


def test_events_round_trip_through_json_and_stream_fields():
    top = [TopLogprob(token_id=3, token="a", logprob=-0.1)]
    evs = [
        StartedEvent(seq=0, worker_id="w", attempt=1),
        TokenEvent(
            seq=1, text="hé", token_ids=[3, 4], logprobs=[TokenLogprob(token_id=3, token="a", logprob=-0.1, top=top)]
        ),
        CompletedEvent(
            seq=2,
            finish_reason="stop",
            stop_reason="\n",
            usage=Usage(prompt_tokens=2, completion_tokens=2, total_tokens=4, cached_tokens=0),
            timings=Timings(queue_s=0.1, ttft_s=0.2, tbt_s=0.01, total_s=0.3),
        ),
        FailedEvent(seq=3, code="engine_error", message="boom"),
    ]
    for e in evs:
        assert decode_event(encode_event(e)) == e
        fields = event_to_fields(e)
        assert fields["seq"] == str(e.seq) and fields["type"] == e.type
        assert event_from_fields({k.encode(): v.encode() for k, v in fields.items()}) == e
        assert encode_event(e).startswith('{"seq":')
    assert event_stream_id(7) == "7-1" and seq_of_stream_id(b"7-1") == 7


def test_request_contract():
    with pytest.raises(ValueError):
        JobRequest(model="m")
    with pytest.raises(ValueError):
        JobRequest(model="m", prompt="x", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        JobRequest(model="m", prompt="x", min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError):
        JobRequest(model="m", prompt="x", best_of=2)
    r = JobRequest(model="m", prompt=[1, 2], logprobs=True, top_logprobs=2, stop="\n")
    assert (
        r.sampling_kwargs()["logprobs"] == 2 and JobRequest(model="m", prompt="x").sampling_kwargs()["logprobs"] is None
    )


def test_record_round_trip_with_results():
    request = JobRequest(model="m", prompt="hi", tenant="acme", webhook={"url": "https://example.com/hook"})
    rec = JobRecord.new("j1", request)
    rec = rec.model_copy(update={
        "state": JobState.succeeded, "text": "out", "token_ids": [1, 2], "finish_reason": "stop", "stop_reason": 7,
        "usage": Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3), "timings": Timings(total_s=1.5),
        "cancel": True, "attempts": 2,
    })
    fields = rec.to_redis()
    assert all(isinstance(v, str) for v in fields.values())
    assert JobRecord.from_redis(fields) == rec
    assert JobRecord.from_redis({k.encode(): v.encode() for k, v in fields.items()}) == rec
    assert JobRecord.from_redis({}) is None


def test_enqueue_is_atomic_and_idempotent(client, keys):
    request = JobRequest(model="m", prompt="hi", priority="high", tenant="acme")
    first = enqueue_job(client, keys, request, idempotency_key="k1")
    again = enqueue_job(client, keys, request, idempotency_key="k1")
    assert first.created and not again.created and again.job_id == first.job_id
    [(_, envelope)] = client.xrange(keys.queue("m", "high"))
    assert Envelope.from_fields(envelope) == Envelope(job_id=first.job_id, attempt=1)
    rec = JobRecord.from_redis(client.hgetall(keys.job(first.job_id)))
    assert rec.state is JobState.queued and rec.tenant == "acme" and rec.request == request
    assert client.get(keys.idempotency("acme", "k1")) == first.job_id


def test_enqueue_jobs_writes_a_batch_once_even_where_redis_forgot_the_script(tmp_path):
    from tests.serve.conftest import RedisServer

    server = RedisServer(tmp_path)  # a Redis of its own: SCRIPT FLUSH must not touch anyone else's
    server.start()
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        keys = Keys("ferrytest-batch")
        requests = [
            JobRequest(model="m", prompt=f"p{i}", priority=p) for i, p in enumerate(["high", "normal", "normal"])
        ]
        for attempt in range(2):
            client.script_flush()  # a restarted Redis: the bare EVALSHAs fail, the batch is sent again
            ids = [f"job-{attempt}-{i}" for i in range(3)]
            results = enqueue_jobs(client, keys, requests, job_ids=ids)
            assert [(r.job_id, r.created) for r in results] == [(i, True) for i in ids]
        assert client.xlen(keys.queue("m", "high")) == 2 and client.xlen(keys.queue("m", "normal")) == 4
        for i, request in enumerate(requests):
            assert JobRecord.from_redis(client.hgetall(keys.job(f"job-1-{i}"))).request == request
        client.close()
    finally:
        server.stop()


def test_cancel_settles_a_queued_job_at_once(client, keys):
    job_id = enqueue_job(client, keys, JobRequest(model="m", prompt="hi")).job_id
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.cancel, keys.channel(job_id))
    pubsub.get_message(timeout=1)
    assert cancel_job(client, keys, job_id) is JobState.cancelled
    assert cancel_job(client, keys, job_id) is JobState.cancelled  # terminal: unchanged
    assert cancel_job(client, keys, "nope") is None
    [(entry_id, fields)] = client.xrange(keys.events(job_id))
    assert entry_id == "0-1" and event_from_fields(fields).type == "cancelled"
    seen = [pubsub.get_message(timeout=1) for _ in range(3)]
    pubsub.close()
    assert {m["channel"] for m in seen if m} == {keys.cancel, keys.channel(job_id)}
    rec = JobRecord.from_redis(client.hgetall(keys.job(job_id)))
    assert rec.state is JobState.cancelled and rec.cancel and rec.finished_at
    assert client.ttl(keys.job(job_id)) > 0


def test_cancel_of_a_running_job_only_sets_the_flag(client, keys):
    job_id = enqueue_job(client, keys, JobRequest(model="m", prompt="hi")).job_id
    client.hset(keys.job(job_id), "state", "running")
    client.xadd(keys.events(job_id), event_to_fields(StartedEvent(seq=0, worker_id="w", attempt=1)), id="0-1")
    assert cancel_job(client, keys, job_id) is JobState.running
    assert client.hget(keys.job(job_id), "cancel") == "1" and client.xlen(keys.events(job_id)) == 1


def test_async_variants(keys):
    async def go():
        c = redis.asyncio.Redis()
        try:
            made = await enqueue_job_async(c, keys, JobRequest(model="m", prompt="hi"), idempotency_key="a")
            again = await enqueue_job_async(c, keys, JobRequest(model="m", prompt="hi"), idempotency_key="a")
            state = await cancel_job_async(c, keys, made.job_id)
            return made, again, state
        finally:
            await c.aclose()

    made, again, state = asyncio.run(go())
    assert made.created and again.job_id == made.job_id and state is JobState.cancelled
