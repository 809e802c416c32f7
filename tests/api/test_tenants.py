"""Job operations and tenants against the real stack: job listing, isolation, rate limits across two
API processes, usage, per-tenant webhook secrets, the admin DLQ routes."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from ferry.worker.protocol import Envelope, JobRecord, JobRequest, Keys, new_job_id
from ferry.worker.webhooks.signing import InvalidSignature, new_secret, verify
from tests.api.conftest import KEY_A, KEY_B, REDIS_URL, Proc, free_port, wait_until
from tests.api.test_batches import BatchStack, chat_line, upload, wait_final
from tests.webhooks.receiver import receiver  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

KEY_LIMITED, KEY_TOKENS, KEY_HOOKS, KEY_USAGE, KEY_ADMIN, KEY_SLOW, KEY_ONCE, KEY_FULL = (
    f"sk-ferrytest-{name}" for name in ("limited", "tokens", "hooks", "usage", "admin", "slow", "once", "full"))
HOOK_SECRETS = (new_secret(), new_secret())  # the old and the new secret during a rotation
KEY_ROTATE, KEY_ADDED = "sk-ferrytest-rotate", "sk-ferrytest-added"  # configured in the key file
ROTATE_SECRETS = (new_secret(), new_secret())
IDLE = "idle"  # a model accepted (FERRY_MODELS) that no worker serves: its jobs stay queued


def _entry(key: str, spec: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()}:{spec}"


KEYS_SETTING = ",".join([
    _entry(KEY_A, "tenant-a"),
    _entry(KEY_B, "tenant-b"),
    _entry(KEY_LIMITED, "tenant-limited;rpm=4"),
    _entry(KEY_TOKENS, "tenant-tokens;tpm=600;batch_tpm=100000"),
    _entry(KEY_HOOKS, f"tenant-hooks;webhook_secret={HOOK_SECRETS[0]};webhook_secret={HOOK_SECRETS[1]}"),
    _entry(KEY_USAGE, "tenant-usage"),
    _entry(KEY_ADMIN, "ops;admin=true"),
    _entry(KEY_SLOW, "tenant-slow;batch_rpm=30"),
    _entry(KEY_ONCE, "tenant-once;rpm=1"),
    _entry(KEY_FULL, "tenant-full;rpm=1;tpm=100"),
])


@pytest.fixture(scope="module")
def tstack(tiny_model_factory, tmp_path_factory):
    """Worker, webhook worker and two API processes on one Redis; /metrics labels the first 3 tenants."""
    directory = tmp_path_factory.mktemp("tenants")
    key_file = directory / "api-keys"  # rewritten by the rotation test: both processes re-read it
    key_file.write_text(_entry(KEY_ROTATE, f"tenant-rotate;webhook_secret={ROTATE_SECRETS[0]}") + "\n")
    stack = BatchStack(tiny_model_factory, directory, webhooks=True, FERRY_API_KEYS=KEYS_SETTING,
                       FERRY_API_KEYS_FILE=str(key_file), FERRY_USAGE_METRICS_TENANTS="3",
                       FERRY_MODELS=f"tiny,{IDLE}")
    port = free_port()
    stack.procs["api2"] = stack.start_api("api2", port)
    stack.url2 = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(stack.url2 + "/healthz").status_code == 200, 60, "api2", stack.procs.values())
        yield stack
    finally:
        stack.close()


def http(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def submit(client: httpx.Client, **inp) -> httpx.Response:
    return client.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4,
                                                   "temperature": 0} | inp})


def wait_done(client: httpx.Client, job_id: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise TimeoutError(job)


def test_jobs_list_newest_first_with_cursor_and_filters(tstack):
    with http(tstack.url, KEY_A) as api:
        ids = [submit(api).json()["id"] for _ in range(3)]
        for job_id in ids:
            wait_done(api, job_id)
        cancelled = submit(api, model=IDLE).json()["id"]
        assert api.post(f"/v1/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
        first = api.get("/v1/jobs", params={"limit": 2}).json()
        assert first["object"] == "list" and [j["id"] for j in first["data"]] == [cancelled, ids[2]]
        assert first["has_more"] and first["first_id"] == cancelled and first["last_id"] == ids[2]
        rest = api.get("/v1/jobs", params={"limit": 100, "after": first["last_id"]}).json()
        assert [j["id"] for j in rest["data"]][:2] == [ids[1], ids[0]]
        succeeded = api.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()["data"]
        assert cancelled not in {j["id"] for j in succeeded} and set(ids) <= {j["id"] for j in succeeded}
        assert {j["status"] for j in succeeded} == {"succeeded"}
        assert api.get("/v1/jobs", params={"status": "cancelled"}).json()["data"][0]["id"] == cancelled
        r = api.get("/v1/jobs", params={"status": "done"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "status"
        assert api.get("/v1/jobs", params={"limit": 101}).status_code == 422


def test_an_index_entry_without_a_job_hash_is_skipped_and_an_old_one_dropped(tstack):
    keys, rdb = Keys(tstack.prefix), redis.Redis.from_url(REDIS_URL, decode_responses=True)
    with http(tstack.url, KEY_A) as api:
        job_id = submit(api).json()["id"]
        now_ms = int(time.time() * 1000)
        fresh, old = f"{now_ms + 5:012x}" + "f" * 20, f"{now_ms - 3_600_000:012x}" + "e" * 20
        rdb.zadd(keys.tenant_jobs("tenant-a"), {fresh: 0, old: 0})  # as if an API died before the enqueue
        listed = [j["id"] for j in api.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        assert listed[0] == job_id and fresh not in listed and old not in listed
        assert rdb.zscore(keys.tenant_jobs("tenant-a"), fresh) is not None  # may still be enqueued: kept
        assert rdb.zscore(keys.tenant_jobs("tenant-a"), old) is None
    rdb.close()


def test_another_tenants_jobs_files_and_batches_are_404(tstack):
    with http(tstack.url, KEY_A) as a, http(tstack.url, KEY_B) as b, tstack.client(KEY_A) as client:
        job_id = submit(a).json()["id"]
        file = upload(client, [chat_line("one", "hi"), chat_line("two", "ho")])
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_final(client, batch.id).status == "completed"
        lines = a.get("/v1/jobs", params={"batch_id": batch.id}).json()["data"]
        assert len(lines) == 2 and {j["batch_id"] for j in lines} == {batch.id}
        for method, path in (("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/events"),
                             ("POST", f"/v1/jobs/{job_id}/cancel"), ("GET", f"/v1/files/{file.id}"),
                             ("GET", f"/v1/files/{file.id}/content"), ("DELETE", f"/v1/files/{file.id}"),
                             ("GET", f"/v1/batches/{batch.id}"), ("POST", f"/v1/batches/{batch.id}/cancel")):
            r = b.request(method, path)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] in ("job_not_found", "file_not_found", "batch_not_found")
        assert b.get("/v1/jobs", params={"batch_id": batch.id}).json()["data"] == []
        listed_by_b = {j["id"] for j in b.get("/v1/jobs", params={"limit": 100}).json()["data"]}
        assert job_id not in listed_by_b and not listed_by_b & {j["id"] for j in lines}
        assert a.get(f"/v1/files/{file.id}").status_code == 200  # B's DELETE did nothing


RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")


def test_requests_per_minute_hold_across_two_api_processes(tstack):
    """12 requests at once, alternating between the two processes: exactly the 4 the bucket holds pass."""
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        url = tstack.url if i % 2 else tstack.url2
        path, body = (("/v1/jobs", {"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2}}) if i % 3 else
                      ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        with http(url, KEY_LIMITED) as client:
            r = client.post(path, json=body)
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    passed = [r for r in answers if r.status_code in (200, 202)]
    refused = [r for r in answers if r.status_code == 429]
    assert len(passed) == 4 and len(refused) == 8, [r.status_code for r in answers]
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in passed) == [0, 1, 2, 3]
    for r in refused:
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert 1 <= int(r.headers["retry-after"]) <= 15
        assert all(name in r.headers for name in RATE_HEADERS)
        assert r.headers["x-ratelimit-limit-requests"] == "4" and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-limit-tokens" not in r.headers  # this tenant has no token limit
    with http(tstack.url, KEY_A) as unlimited:  # another tenant: no limits, no headers
        r = submit(unlimited)
        assert r.status_code == 202 and "x-ratelimit-limit-requests" not in r.headers


def test_reserved_tokens_are_given_back_when_the_job_ends_and_batches_have_their_own_budget(tstack):
    short = {"max_tokens": 500, "structured_outputs": {"choice": ["yes"]}}  # reserves ~500, uses a few
    with http(tstack.url, KEY_TOKENS) as one, http(tstack.url2, KEY_TOKENS) as two:
        first = submit(one, **short)
        started = time.monotonic()
        assert first.status_code == 202, first.text
        assert first.headers["x-ratelimit-limit-tokens"] == "600"
        assert int(first.headers["x-ratelimit-remaining-tokens"]) < 100
        second = submit(two, **short)
        assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(second.headers["retry-after"]) >= 30  # ~400 tokens at 10 per second
        too_big = submit(two, max_tokens=700)
        assert too_big.status_code == 429 and "more than the live budget" in too_big.json()["error"]["message"]
        with tstack.client(KEY_TOKENS) as client:  # the batch budget is separate: its lines run meanwhile
            lines = [chat_line(f"l{i}", "hi", max_tokens=300) for i in range(3)]
            batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            done = wait_final(client, batch.id)
            assert done.status == "completed" and done.request_counts.completed == 3
        job = wait_done(one, first.json()["id"])
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] < 10
        assert time.monotonic() - started < 35  # the refill alone would not have made room yet
        third = submit(two, **short)  # fits only because the first job's unused tokens came back
        assert third.status_code == 202, third.text


def test_batch_lines_over_the_batch_budget_wait_and_all_run_once(tstack):
    """30 lines pass at once, the last 2 wait for the refill (one per 2 s): none lost, none twice."""
    with tstack.client(KEY_SLOW) as client:
        lines = [chat_line(f"s{i}", "hi", max_tokens=2) for i in range(32)]
        started = time.monotonic()
        batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        done = wait_final(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 32
        assert time.monotonic() - started >= 3.5
        outputs = client.files.content(done.output_file_id).text.splitlines()
        assert sorted(json.loads(line)["custom_id"] for line in outputs) == sorted(f"s{i}" for i in range(32))


def test_an_idempotent_replay_takes_no_budget(tstack):
    with http(tstack.url, KEY_ONCE) as api:
        first = api.post("/v1/jobs", headers={"Idempotency-Key": "k1"},
                         json={"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2}})
        again = api.post("/v1/jobs", headers={"Idempotency-Key": "k1"},
                         json={"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2}})
        assert first.status_code == again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
        assert again.json()["id"] == first.json()["id"]
        other = api.post("/v1/jobs", headers={"Idempotency-Key": "k2"},
                         json={"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2}})
        assert other.status_code == 429 and other.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_full_queue_refuses_without_spending_the_budget(tstack):
    """A 429 queue_full takes nothing from the tenant's budget, on the job route and on the OpenAI
    routes (which admit a request before its jobs reach the queue): the one request a minute and
    the 100 tokens stay for a request that gets in."""
    port = free_port()
    full = Proc("api-full", ["api", "--host", "127.0.0.1", "--port", str(port)],
                tstack.env | {"FERRY_MAX_QUEUE_LEN": "1"}, tstack.logs)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/healthz").status_code == 200, 60, "api-full", [full])
        with http(url, KEY_A) as a, http(url, KEY_FULL) as limited:
            parked = a.post("/v1/jobs", json={"input": {"model": IDLE, "prompt": "hi", "max_tokens": 2}})
            assert parked.status_code in (202, 429)  # 429: an earlier test's job of IDLE waits already
            for _ in range(3):
                refused = [
                    limited.post("/v1/chat/completions", json={"model": IDLE, "max_tokens": 90,
                                                                "messages": [{"role": "user", "content": "hi"}]}),
                    limited.post("/v1/completions", json={"model": IDLE, "prompt": ["a", "b"], "max_tokens": 40}),
                    limited.post("/v1/jobs", json={"input": {"model": IDLE, "prompt": "hi", "max_tokens": 90}}),
                ]
                assert [r.json()["error"]["code"] for r in refused] == ["queue_full"] * 3, [r.text for r in refused]
        with http(tstack.url, KEY_FULL) as limited:
            r = limited.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 90})
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
        if parked.status_code == 202:
            with http(url, KEY_A) as a:
                a.post(f"/v1/jobs/{parked.json()['id']}/cancel")
    finally:
        full.stop()


def test_usage_counts_ended_jobs_for_the_caller_and_on_metrics(tstack):
    with http(tstack.url, KEY_USAGE) as api, http(tstack.url, KEY_A) as a:
        jobs = [wait_done(api, submit(api, max_tokens=3 + i).json()["id"]) for i in range(2)]
        cancelled = submit(api, model=IDLE).json()["id"]  # cancelled while queued: the API counts it
        assert api.post(f"/v1/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
        jobs.append(wait_done(api, cancelled))
        expected = {"requests": 3, "prompt_tokens": sum(j["usage"]["prompt_tokens"] for j in jobs if j["usage"]),
                    "completion_tokens": sum(j["usage"]["completion_tokens"] for j in jobs if j["usage"])}
        expected["total_tokens"] = expected["prompt_tokens"] + expected["completion_tokens"]
        wait_until(lambda: api.get("/v1/usage").json()["totals"] == expected, 10, "usage counted")
        body = api.get("/v1/usage", params={"days": 3}).json()
        assert body["tenant"] == "tenant-usage" and len(body["days"]) == 3
        assert {k: v for k, v in body["days"][-1].items() if k != "date"} == expected
        assert body["days"][0] == {"date": body["days"][0]["date"], "requests": 0, "prompt_tokens": 0,
                                   "completion_tokens": 0, "total_tokens": 0}
        a_requests = a.get("/v1/usage").json()["totals"]["requests"]
    text = httpx.get(tstack.url + "/metrics").text
    assert f'ferry_tenant_requests_total{{tenant="tenant-a"}} {float(a_requests)}' in text
    assert 'tenant="tenant-usage"' not in text and 'ferry_tenant_requests_total{tenant="other"}' in text


def test_a_tenants_own_secrets_both_sign_its_webhooks(tstack, receiver):  # noqa: F811
    with http(tstack.url, KEY_HOOKS) as api, http(tstack.url, KEY_A) as a:
        r = api.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                       "webhook": {"url": receiver.base + "/hooks", "events": ["job.completed"]}})
        r_a = a.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                       "webhook": {"url": receiver.base + "/plain", "events": ["job.completed"]}})
        assert r.status_code == r_a.status_code == 202
        [got] = receiver.wait_for(1, path="/hooks")
        [plain] = receiver.wait_for(1, path="/plain")
    assert len(got.headers["webhook-signature"].split()) == 2
    for secret in HOOK_SECRETS:  # a receiver holding either the old or the new secret accepts it
        verify(secret, got.headers, got.body)
    with pytest.raises(InvalidSignature):
        verify(tstack.env["FERRY_WEBHOOK_SECRET"], got.headers, got.body)
    verify(tstack.env["FERRY_WEBHOOK_SECRET"], plain.headers, plain.body)  # other tenants: the global secret
    assert len(plain.headers["webhook-signature"].split()) == 1


def test_a_secret_rotated_in_the_key_file_signs_without_a_restart(tstack, receiver):  # noqa: F811
    """Old secret alone, then old and new, then new alone, by rewriting FERRY_API_KEYS_FILE under the
    running API and webhook worker; a key added to the file works, a broken file changes nothing."""
    key_file = Path(tstack.env["FERRY_API_KEYS_FILE"])
    old, new = ROTATE_SECRETS

    def signed_with(phase: str) -> list[str]:
        with http(tstack.url, KEY_ROTATE) as api:
            r = api.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                           "webhook": {"url": f"{receiver.base}/{phase}", "events": ["job.completed"]}})
            assert r.status_code == 202, r.text
        [got] = receiver.wait_for(1, path=f"/{phase}")
        return [s for s in (old, new) if _verifies(s, got)]

    def rewrite(*secrets: str, extra: str = "") -> None:
        options = "".join(f";webhook_secret={s}" for s in secrets)
        key_file.write_text(_entry(KEY_ROTATE, f"tenant-rotate{options}") + "\n" + extra)

    def until(expected: list[str], phase: str) -> None:
        deadline, seen = time.monotonic() + 20, None
        for attempt in range(100):
            seen = signed_with(f"{phase}-{attempt}")
            if seen == expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert seen == expected, (phase, seen)

    assert signed_with("before") == [old]
    rewrite(old, new, extra=_entry(KEY_ADDED, "tenant-zadded") + "\n")
    until([old, new], "overlap")
    with http(tstack.url, KEY_ADDED) as added:
        wait_until(lambda: added.get("/v1/jobs").status_code == 200, 20, "the added key", tstack.procs.values())
    key_file.write_text("not a key entry\n")  # a broken file: the configuration in force stays
    time.sleep(2.5)
    assert signed_with("broken") == [old, new]
    rewrite(new)
    until([new], "after")
    with http(tstack.url, KEY_ADDED) as added:  # gone from the file: revoked
        wait_until(lambda: added.get("/v1/jobs").status_code == 401, 20, "the revoked key", tstack.procs.values())


def _verifies(secret: str, got) -> bool:
    try:
        verify(secret, got.headers, got.body)
    except InvalidSignature:
        return False
    return True


def test_admin_lists_and_requeues_dead_lettered_jobs_and_others_get_403(tstack):
    keys, rdb = Keys(tstack.prefix), redis.Redis.from_url(REDIS_URL, decode_responses=True)
    request = JobRequest(model="tiny", prompt="poison", max_tokens=3, tenant="tenant-a", metadata={"k": "v"})
    job_id = new_job_id()
    # Written as the enqueue script writes it, but delivered too often already: the worker dead-letters it.
    rdb.hset(keys.job(job_id), mapping=JobRecord.new(job_id, request).to_redis() | {"attempts": "1000"})
    rdb.xadd(keys.queue("tiny", "normal"), Envelope(job_id=job_id).to_fields())
    with http(tstack.url, KEY_ADMIN) as admin, http(tstack.url, KEY_A) as a:
        assert wait_done(a, job_id)["error"]["code"] == "max_attempts_exceeded"
        for method, path in (("GET", "/v1/admin/dlq"), ("POST", f"/v1/admin/dlq/{job_id}/requeue")):
            r = a.request(method, path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
            assert r.json()["error"]["type"] == "permission_error"
        listed = admin.get("/v1/admin/dlq").json()
        [entry] = [e for e in listed["data"] if e["job_id"] == job_id]
        assert entry["tenant"] == "tenant-a" and entry["code"] == "max_attempts_exceeded"
        r = admin.post(f"/v1/admin/dlq/{job_id}/requeue")
        assert r.status_code == 201 and r.json()["requeued_from"] == job_id
        new = wait_done(a, r.json()["id"])  # the new job is tenant-a's, with the request as it was
        assert new["status"] == "succeeded" and new["metadata"] == {"k": "v"}
        assert job_id not in [e["job_id"] for e in admin.get("/v1/admin/dlq").json()["data"]]
        again = admin.post(f"/v1/admin/dlq/{job_id}/requeue")
        assert again.status_code == 404 and again.json()["error"]["code"] == "dlq_entry_not_found"
    rdb.close()
