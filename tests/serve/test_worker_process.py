"""The worker as real subprocesses on a private redis-server, with a tiny model.

Three workers serve model "tiny" for the whole module (starting a worker costs seconds of
imports on two cores). Tests that kill or stop a worker run last, in file order: kill -9 takes
one spare, SIGTERM the other, and the Redis restart runs under the survivor.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import redis

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.engine.structured import StructuredOutputs
from ferry.worker.protocol import (
    ErrorCode,
    JobRecord,
    JobState,
    Keys,
    cancel_job,
    decode_event,
    enqueue_job,
    new_job_id,
)
from tests.serve.conftest import (
    RedisServer,
    WorkerProc,
    assert_seq,
    enqueue,
    events,
    greedy,
    record,
    start_worker,
    streamed_text,
    streamed_tokens,
    wait_for,
    wait_ready,
    wait_terminal,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

PREFIX = "ferrytest-worker"


@dataclass
class Stack:
    server: RedisServer
    client: redis.Redis
    keys: Keys
    main: WorkerProc  # survives every test
    spares: list[WorkerProc]  # taken by the kill -9 and SIGTERM tests
    llm: LLM

    def reference(self, prompts: list[str], max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    directory = tmp_path_factory.mktemp("worker-stack")
    server = RedisServer(directory)
    server.start()
    workers = [start_worker(llama_dir, server.url, PREFIX, directory) for _ in range(3)]
    client = redis.Redis.from_url(server.url, decode_responses=True)
    keys = Keys(PREFIX)
    llm = LLM(str(llama_dir), kv_cache_bytes=16 << 20)  # loads while the workers start
    try:
        wait_ready(client, keys, workers)
        yield Stack(server, client, keys, workers[0], workers[1:], llm)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(10)
        client.close()
        server.stop()


def test_job_runs_to_success_and_streams_every_event(stack):
    c, k = stack.client, stack.keys
    job_id = new_job_id()
    pubsub = c.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(k.channel(job_id))
    live = []

    def listen():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.2)
            if message:
                live.append(decode_event(message["data"]))
                if live[-1].type == "completed":
                    return

    listener = threading.Thread(target=listen)
    listener.start()
    request = greedy(prompt="Ferry serves language models", max_tokens=24)
    assert enqueue_job(c, k, request, job_id=job_id).created
    [rec] = wait_terminal(c, k, [job_id])
    listener.join(10)
    pubsub.close()

    stored = events(c, k, job_id)
    assert_seq(stored)
    assert [e.type for e in stored] == ["started"] + ["token"] * 24 + ["completed"]
    assert [e.seq for e in live] == [e.seq for e in stored] and [e.type for e in live] == [e.type for e in stored]
    [ref] = stack.reference(["Ferry serves language models"], 24)
    assert streamed_tokens(stored) == ref.token_ids and streamed_text(stored) == ref.text
    assert rec.state is JobState.succeeded and rec.text == ref.text and rec.token_ids == ref.token_ids
    assert rec.finish_reason == "length" and rec.attempts == 1 and rec.worker_id.startswith("w-")
    assert rec.usage.prompt_tokens == len(ref.prompt_token_ids) and rec.usage.completion_tokens == 24
    assert 0 <= rec.timings.queue_s <= rec.timings.ttft_s <= rec.timings.total_s and rec.timings.tbt_s > 0
    done = stored[-1]
    assert done.usage == rec.usage and done.finish_reason == "length"
    assert 0 < c.ttl(k.job(job_id)) <= 86400 and 0 < c.ttl(k.events(job_id)) <= 86400
    assert c.xlen(k.queue("tiny", "normal")) == 0  # ACKed and deleted
    assert c.xpending(k.queue("tiny", "normal"), k.group)["pending"] == 0


def test_chat_and_logprobs_jobs(stack):
    c, k = stack.client, stack.keys
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    chat_id = enqueue(c, k, messages=messages, max_tokens=8)
    lp_id = enqueue(c, k, prompt=[5, 6, 7, 8], max_tokens=4, logprobs=True, top_logprobs=3)
    chat, lp = wait_terminal(c, k, [chat_id, lp_id])
    template = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    [ref] = stack.llm.chat([template], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert chat.state is JobState.succeeded and chat.token_ids == ref.token_ids and chat.text == ref.text
    tokens = [e for e in events(c, k, lp_id) if e.type == "token"]
    assert lp.state is JobState.succeeded and len(tokens) == 4
    for e in tokens:
        [entry] = e.logprobs
        assert entry.token_id == e.token_ids[0] and len(entry.top) == 3
        assert entry.top[0].logprob >= entry.top[-1].logprob and entry.logprob == entry.top[0].logprob  # greedy: rank 1


def test_cancel_running_and_queued(stack):
    c, k = stack.client, stack.keys
    # 1000 tokens take the tiny model about 0.23 s on a fast CPU: cancel as soon as tokens flow.
    running = enqueue(c, k, prompt="a long one", max_tokens=1000)
    wait_for(lambda: len(events(c, k, running)) >= 4, 30, "tokens of the running job", interval=0.005)
    asked = time.monotonic()
    assert cancel_job(c, k, running) is JobState.running
    [rec] = wait_terminal(c, k, [running], timeout=10)
    assert time.monotonic() - asked < 3
    evs = events(c, k, running)
    assert_seq(evs)
    assert rec.state is JobState.cancelled and evs[-1].type == "cancelled"
    assert rec.token_ids == streamed_tokens(evs) and 0 < len(rec.token_ids) < 1000

    # Flag set but never settled by the API (say it died in between): the worker skips it when pulled.
    queued = new_job_id()
    fields = JobRecord.new(queued, greedy(prompt="never run", max_tokens=4)).to_redis() | {"cancel": "1"}
    c.hset(k.job(queued), mapping=fields)
    c.xadd(k.queue("tiny", "low"), {"job_id": queued, "attempt": "1"})
    [rec] = wait_terminal(c, k, [queued])
    assert rec.state is JobState.cancelled and [e.type for e in events(c, k, queued)] == ["cancelled"]
    wait_for(lambda: c.xlen(k.queue("tiny", "low")) == 0, 5, "the cancelled entry to be ACKed")


def test_ttl_expired_job_is_timed_out_without_running(stack):
    c, k = stack.client, stack.keys
    job_id = enqueue(c, k, prompt="too late", max_tokens=4, ttl_s=5, created_at=time.time() - 60)
    [rec] = wait_terminal(c, k, [job_id])
    assert rec.state is JobState.timed_out and rec.error_code == ErrorCode.TTL_EXPIRED
    assert rec.attempts == 0 and rec.started_at is None
    [only] = events(c, k, job_id)
    assert only.type == "timed_out" and only.seq == 0 and only.code == ErrorCode.TTL_EXPIRED


def test_execution_timeout_aborts_the_job(stack):
    c, k = stack.client, stack.keys
    # 1000 tokens take the tiny model 0.23 s on this project's fastest CPU so far (0.2 ms a token
    # with the native decoder stack; it was a second before): a 0.1 s timeout always fires first,
    # and leaves time for the first tokens even on a loaded machine.
    job_id = enqueue(c, k, prompt="runs too long", max_tokens=1000, timeout_s=0.1)
    [rec] = wait_terminal(c, k, [job_id], timeout=30)
    assert rec.state is JobState.timed_out and rec.error_code == ErrorCode.EXECUTION_TIMEOUT
    evs = events(c, k, job_id)
    assert_seq(evs)
    assert evs[0].type == "started" and evs[-1].type == "timed_out" and 0 < len(rec.token_ids) < 1000
    assert 0.1 <= rec.finished_at - rec.started_at < 3.1


def test_dead_letter_after_max_attempts(stack):
    c, k = stack.client, stack.keys
    job_id = new_job_id()
    request = greedy(prompt="poison", max_tokens=4)
    # Three workers already died running it (each delivery that started counts one attempt).
    c.hset(k.job(job_id), mapping=JobRecord.new(job_id, request).to_redis() | {"attempts": "3", "state": "running"})
    c.xadd(k.queue("tiny", "normal"), {"job_id": job_id, "attempt": "1"})
    [rec] = wait_terminal(c, k, [job_id])
    assert rec.state is JobState.failed and rec.error_code == ErrorCode.MAX_ATTEMPTS_EXCEEDED
    parked = [fields for _, fields in c.xrange(k.dlq) if fields["job_id"] == job_id]
    assert len(parked) == 1 and parked[0]["code"] == ErrorCode.MAX_ATTEMPTS_EXCEEDED


def test_bad_input_fails_only_that_job(stack):
    c, k = stack.client, stack.keys
    q = k.queue("tiny", "normal")

    def raw_job(request_json: str) -> str:
        job_id = new_job_id()
        base = JobRecord.new(job_id, greedy(prompt="x", max_tokens=2)).to_redis()
        c.hset(k.job(job_id), mapping=base | {"request": request_json})
        c.xadd(q, {"job_id": job_id, "attempt": "1"})
        return job_id

    good = greedy(prompt="fine", max_tokens=3).model_dump(mode="json")
    unknown_field = raw_job(json.dumps(good | {"best_of": 4}))
    bad_sampling = raw_job(json.dumps(good | {"temperature": -1}))
    not_json = raw_job("{oops")
    too_long = enqueue(c, k, prompt=[7] * 1100, max_tokens=2)
    bad_ids = enqueue(c, k, prompt=[1, 2, 999999], max_tokens=2)
    c.xadd(q, {"nonsense": "1"})  # no job id at all
    c.xadd(q, {"job_id": "does-not-exist", "attempt": "1"})
    bad_attempt = new_job_id()
    c.hset(k.job(bad_attempt), mapping=JobRecord.new(bad_attempt, greedy(prompt="x", max_tokens=2)).to_redis())
    c.xadd(q, {"job_id": bad_attempt, "attempt": "zero"})
    fine = enqueue(c, k, prompt="still serving", max_tokens=3)

    ids = [unknown_field, bad_sampling, not_json, too_long, bad_ids, bad_attempt, fine]
    recs = dict(zip(ids, wait_terminal(c, k, ids), strict=True))
    assert recs[fine].state is JobState.succeeded
    expected = {
        unknown_field: ErrorCode.INVALID_REQUEST,
        bad_sampling: ErrorCode.INVALID_REQUEST,
        not_json: ErrorCode.INVALID_REQUEST,
        too_long: ErrorCode.PROMPT_TOO_LONG,
        bad_ids: ErrorCode.INVALID_PROMPT,
        bad_attempt: ErrorCode.MALFORMED_ENVELOPE,
    }
    for job_id, code in expected.items():
        assert (recs[job_id].state, recs[job_id].error_code) == (JobState.failed, code), recs[job_id]
        assert events(c, k, job_id)[-1].code == code
    assert "best_of" in recs[unknown_field].error_message
    wait_for(lambda: c.xlen(q) == 0, 5, "every entry to be ACKed")
    codes = [fields["code"] for _, fields in c.xrange(k.dlq)]
    assert codes.count(ErrorCode.MALFORMED_ENVELOPE) == 2 and codes.count(ErrorCode.JOB_NOT_FOUND) == 1
    assert all(w.proc.poll() is None for w in [stack.main, *stack.spares])


@contextlib.contextmanager
def _frozen(workers: list[WorkerProc]):
    """Every worker stopped (SIGSTOP) until the block ends: none reads the queue meanwhile."""
    try:
        for w in workers:
            w.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: all(_state(w) == "T" for w in workers), 10, "the workers to stop")
        yield
    finally:
        for w in workers:
            w.proc.send_signal(signal.SIGCONT)


def _state(w: WorkerProc) -> str:
    return Path(f"/proc/{w.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_priority_high_before_low(stack):
    """A low job queued before a high one: the high one starts first. Both are queued while no
    worker can read, in one transaction (a worker that read between two separate enqueues took the
    low one alone and started it first), so the first read sees both and takes them by priority."""
    c, k = stack.client, stack.keys
    workers = [stack.main, *stack.spares]
    jobs = {lane: new_job_id() for lane in ("low", "high")}
    for lane, job_id in jobs.items():
        request = greedy(prompt=lane, max_tokens=2, priority=lane)
        c.hset(k.job(job_id), mapping=JobRecord.new(job_id, request).to_redis())
    with _frozen(workers):
        # A worker stopped inside a blocked read is handed whatever is written next, and Redis 7.0
        # answers it from the one stream that woke it: a normal-lane filler per worker, written
        # first, takes those reads.
        fillers = [enqueue(c, k, prompt=f"filler {i}", max_tokens=2) for i in range(len(workers))]
        pipe = c.pipeline(transaction=True)
        for lane, job_id in jobs.items():  # low first
            pipe.xadd(k.queue("tiny", lane), {"job_id": job_id, "attempt": "1"})
        pipe.execute()
    low, high = wait_terminal(c, k, [jobs["low"], jobs["high"], *fillers], timeout=90)[:2]
    assert (low.state, high.state) == (JobState.succeeded, JobState.succeeded)
    assert high.started_at <= low.started_at


def test_a_live_job_takes_a_batch_jobs_place_in_a_full_worker(stack):
    c, k = stack.client, stack.keys
    # Every slot of every worker holds a low-lane job with a long way to go.
    batch = [enqueue(c, k, prompt=f"batch {i}", max_tokens=1000, priority="low") for i in range(12)]
    wait_for(lambda: all(record(c, k, j).state is JobState.running for j in batch), 30, "all slots busy",
             interval=0.005)
    live = enqueue(c, k, prompt="live", max_tokens=4, priority="normal")
    (rec,) = wait_terminal(c, k, [live], timeout=30)
    assert rec.state is JobState.succeeded
    for j in batch:
        cancel_job(c, k, j)
    ended = wait_terminal(c, k, batch, timeout=60)
    # It did not wait for a batch job to end: it started before any of them ended (one that ran
    # its 1000 tokens out while the live one ran is no failure).
    assert rec.started_at < min(r.finished_at for r in ended)
    assert all(r.state is JobState.cancelled or r.finish_reason == "length" for r in ended)


def test_http_health_ready_metrics(stack):
    port = stack.main.http_port
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{base}/readyz", timeout=5) as r:
        assert r.status == 200 and json.load(r)["status"] == "ready"
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        text = r.read().decode()
    for name in ("ferry_time_to_first_token_seconds_bucket", "ferry_jobs_total{status=\"succeeded\"}",
                 "ferry_kv_cache_usage_perc", "ferry_prefix_cache_queries_total", "ferry_queue_lag",
                 "ferry_inter_token_latency_seconds_count", "ferry_snapshot_saves_total"):
        assert name in text, name
    beat = stack.client.hgetall(stack.keys.worker(stack.main.worker_id))
    assert beat["model"] == "tiny" and len(beat["fingerprint"]) == 64
    assert 0 < stack.client.ttl(stack.keys.worker(stack.main.worker_id)) <= 10
    assert stack.client.zscore(stack.keys.models, "tiny") > time.time() - 10


def _running_mid_generation(stack, job_id: str, candidates: list[WorkerProc]) -> WorkerProc | None:
    """The candidate worker running `job_id`, once the job has streamed a few tokens; None otherwise."""
    rec = record(stack.client, stack.keys, job_id)
    if rec.state is not JobState.running or len(events(stack.client, stack.keys, job_id)) < 4:
        return None
    return next((w for w in candidates if w.worker_id == rec.worker_id), None)


def _holder_mid_generation(stack, job_ids: list[str], candidates: list[WorkerProc]) -> tuple[WorkerProc, list[str]]:
    """A candidate worker running at least one of `job_ids` that has streamed a few tokens already."""
    c, k = stack.client, stack.keys

    def find():
        for j in job_ids:
            worker = _running_mid_generation(stack, j, candidates)
            if worker is not None:
                return worker, [i for i in job_ids if record(c, k, i).worker_id == worker.worker_id]
        return None

    return wait_for(find, 60, "a spare worker mid-generation", interval=0.02)


def _frozen_mid_generation(stack, job_ids: list[str], candidates: list[WorkerProc]) -> WorkerProc:
    """A candidate worker stopped (SIGSTOP) while it runs at least one of `job_ids` that has streamed a
    few tokens: the job was still running once the worker could no longer end it."""
    c, k = stack.client, stack.keys

    def find():
        for j in job_ids:
            worker = _running_mid_generation(stack, j, candidates)
            if worker is not None:
                worker.proc.send_signal(signal.SIGSTOP)
                if record(c, k, j).state is JobState.running:
                    return worker
                worker.proc.send_signal(signal.SIGCONT)  # it ended the job just before it stopped
        return None

    return wait_for(find, 60, "a spare worker mid-generation", interval=0.02)


def _prompts(tag: str) -> list[str]:
    return [f"{tag} {i}: the quick brown fox" for i in range(8)]


# Half the kill -9 test's jobs are held to a schema: a resumed job's matcher is advanced over the
# tokens already streamed, so its output goes on as one valid JSON text, token for token the same.
_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 6, "maxItems": 6}


def test_kill9_mid_generation_resumes_without_gap(stack):
    c, k = stack.client, stack.keys
    prompts = _prompts("kill")
    constrained = {i for i in range(len(prompts)) if i % 2}
    schema = {"structured_outputs": {"json": _SCHEMA}}
    ids = [
        enqueue(c, k, prompt=p, max_tokens=120, **(schema if i in constrained else {})) for i, p in enumerate(prompts)
    ]
    # The victim is a worker frozen (SIGSTOP) mid-generation on a constrained job, so that nothing it
    # runs can end between the look at its jobs and the kill: a constrained job can finish early (its
    # JSON complete), and one the victim finished is not resumed.
    victim = _frozen_mid_generation(stack, [ids[i] for i in sorted(constrained)], stack.spares)
    held = [j for j in ids if (rec := record(c, k, j)).worker_id == victim.worker_id and rec.state is JobState.running]
    victim.kill9()
    stack.spares.remove(victim)
    recs = wait_terminal(c, k, ids, timeout=120)
    greedy_params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True,
                       structured_outputs=StructuredOutputs(json=_SCHEMA)) if i in constrained else greedy_params
        for i in range(len(prompts))
    ]
    refs = stack.llm.generate(prompts, params, use_tqdm=False)
    for i, (job_id, rec, ref) in enumerate(zip(ids, recs, refs, strict=True)):
        evs = events(c, k, job_id)
        assert_seq(evs)
        assert rec.state is JobState.succeeded
        assert streamed_tokens(evs) == ref.token_ids and streamed_text(evs) == ref.text
        assert rec.text == ref.text and rec.token_ids == ref.token_ids
        if i in constrained:
            jsonschema.validate(json.loads(rec.text), _SCHEMA)
    assert any(ids.index(j) in constrained for j in held)
    for job_id in held:
        rec = record(c, k, job_id)
        assert rec.attempts == 2 and rec.worker_id != victim.worker_id
        assert sum(e.type == "started" for e in events(c, k, job_id)) == 1


# Half the SIGTERM test's jobs sample with a seed and penalties: a resumed job must continue on the
# seed's next draws and count its earlier tokens in the penalties, as an uninterrupted run does.
_SEEDED = {
    "temperature": 0.9,
    "top_p": 0.95,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.4,
    "repetition_penalty": 1.2,
}


def test_sigterm_hands_jobs_back_without_waiting_for_the_lease(stack):
    c, k = stack.client, stack.keys
    prompts = _prompts("term")
    sampling = [{} if i % 2 == 0 else {**_SEEDED, "seed": 100 + i} for i in range(len(prompts))]
    ids = [enqueue(c, k, prompt=p, max_tokens=120, **extra) for p, extra in zip(prompts, sampling, strict=True)]
    [victim] = stack.spares
    victim, held = _holder_mid_generation(stack, ids, [victim])
    lease_s = 4.0
    victim.sigterm()
    # drain_timeout_s is 0: the jobs go back at once and another worker takes them well before
    # their lease (4 s) would have let the reaper do it (a job may still end in a last step).
    wait_for(lambda: all(r.worker_id != victim.worker_id or r.terminal for r in (record(c, k, j) for j in held)),
             lease_s - 1, "handed-back jobs to run on another worker")
    assert victim.proc.wait(30) == 0
    recs = wait_terminal(c, k, ids, timeout=120)
    params = [SamplingParams(max_tokens=120, ignore_eos=True, **({"temperature": 0.0} | extra)) for extra in sampling]
    refs = stack.llm.generate(prompts, params, use_tqdm=False)
    for job_id, rec, ref in zip(ids, recs, refs, strict=True):
        evs = events(c, k, job_id)
        assert_seq(evs)
        assert rec.state is JobState.succeeded and streamed_text(evs) == ref.text and rec.token_ids == ref.token_ids
    for job_id in held:
        assert record(c, k, job_id).attempts == 1  # a hand-back is not a failed attempt
    assert any(sampling[ids.index(j)] for j in held) or len(held) < 2  # a seeded job was among those resumed
    log = victim.log()
    assert '"drain started"' in log and '"job handed back"' in log and '"drain finished"' in log
    assert c.exists(k.worker(victim.worker_id)) == 0


def test_redis_restart_under_a_running_worker(stack):
    c, k = stack.client, stack.keys
    stack.server.stop()
    time.sleep(1.5)  # the worker's reads and heartbeats fail meanwhile
    stack.server.start()  # empty: no streams, no group
    job_id = enqueue(c, k, prompt="after the restart", max_tokens=5)
    [rec] = wait_terminal(c, k, [job_id], timeout=30)
    assert rec.state is JobState.succeeded
    assert stack.main.proc.poll() is None
    assert '"redis unavailable, retrying"' in stack.main.log()
    wait_for(lambda: c.exists(k.worker(stack.main.worker_id)), 5, "the heartbeat to come back")

