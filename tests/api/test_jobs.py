"""The jobs API against the real stack: submit, wait, SSE replay/resume/follow, cancel, idempotency, auth."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ferry.worker.protocol import JobRequest, Keys, enqueue_job
from tests.api.conftest import KEY_B, wait_until

pytestmark = pytest.mark.redis


def sse_events(response: httpx.Response, limit: int | None = None) -> list[dict]:
    """Parse an SSE body into [{id, event, data}] (keep-alive comments skipped)."""
    events, current = [], {}
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if not line:
            if current:
                events.append(current)
                current = {}
                if limit is not None and len(events) >= limit:
                    break
            continue
        name, _, value = line.partition(": ")
        current[name] = json.loads(value) if name == "data" else value
    return events


def submit(api, **inp) -> dict:
    r = api.post("/v1/jobs", json={"input": {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0} | inp})
    assert r.status_code == 202, r.text
    return r.json()


def wait_done(api, job_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise TimeoutError(job)


def all_events(api, job_id: str, last_event_id: int | None = None) -> list[dict]:
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    with api.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def test_submit_then_poll_gives_output_usage_and_timings(api):
    created = submit(api)
    assert created["status"] in ("queued", "running", "succeeded")
    assert created["urls"] == {"self": f"/v1/jobs/{created['id']}", "events": f"/v1/jobs/{created['id']}/events",
                               "cancel": f"/v1/jobs/{created['id']}/cancel"}
    job = wait_done(api, created["id"])
    assert job["status"] == "succeeded" and job["model"] == "tiny"
    assert job["usage"]["completion_tokens"] == 8 == len(job["output"]["token_ids"])
    assert job["output"]["finish_reason"] == "length"
    timings = job["timings"]
    assert 0 <= timings["queue_s"] <= timings["ttft_s"] <= timings["total_s"] and timings["tbt_s"] > 0


def test_prefer_wait_blocks_for_the_result(api):
    r = api.post("/v1/jobs", json={"input": {"prompt": "hi", "max_tokens": 4}}, headers={"Prefer": "wait=20"})
    assert r.status_code == 200 and r.json()["status"] == "succeeded"
    assert r.headers["preference-applied"] == "wait=20"
    assert r.headers["location"] == r.json()["urls"]["self"]


def test_chat_input_uses_the_models_template(api):
    job = wait_done(api, submit(api, prompt=None, messages=[{"role": "user", "content": "hello"}])["id"])
    # "<|user|>hello</s><|assistant|>" is more tokens than "hello" alone.
    assert job["status"] == "succeeded" and job["usage"]["prompt_tokens"] > 5


def test_events_after_completion_replay_the_whole_stream(api):
    job = wait_done(api, submit(api, max_tokens=12)["id"])
    events = all_events(api, job["id"])
    assert [int(e["id"]) for e in events] == list(range(len(events)))
    assert [e["data"]["seq"] for e in events] == list(range(len(events)))
    assert events[0]["event"] == "started" and events[-1]["event"] == "completed"
    assert "".join(e["data"]["text"] for e in events if e["event"] == "token") == job["output"]["text"]
    assert sum(len(e["data"]["token_ids"]) for e in events if e["event"] == "token") == 12


def test_last_event_id_resumes_with_exactly_the_remaining_events(api):
    job = wait_done(api, submit(api, max_tokens=10)["id"])
    full = all_events(api, job["id"])
    for last in (0, 3, len(full) - 2, len(full) - 1):
        assert all_events(api, job["id"], last) == full[last + 1:]


def test_resume_mid_run_loses_and_repeats_nothing(api):
    job_id = submit(api, max_tokens=150, ignore_eos=True)["id"]
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        first = sse_events(r, limit=5)
    rest = all_events(api, job_id, int(first[-1]["id"]))
    assert [e["data"]["seq"] for e in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1]["event"] == "completed"
    assert first + rest == all_events(api, job_id)


def test_follower_connected_while_queued_sees_the_live_cancel(stack, api, rdb):
    # A job for a model no worker serves stays queued; follow it, then cancel it.
    keys = Keys(stack.prefix)
    request = JobRequest(model="nobody-serves-this", prompt="x", tenant="tenant-a")
    job_id = enqueue_job(rdb, keys, request).job_id
    got: list = []
    follower = threading.Thread(target=lambda: got.extend(all_events(api, job_id)))
    follower.start()
    # The cancel must come while the follower listens (not before: it would only replay it).
    wait_until(lambda: rdb.pubsub_numsub(keys.channel(job_id))[0][1] == 1, 30, "the follower to subscribe")
    assert got == [] and follower.is_alive()
    r = api.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    follower.join(10)
    assert [e["event"] for e in got] == ["cancelled"]
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200  # cancelling again is harmless


def test_cancel_a_running_job(api):
    job_id = submit(api, max_tokens=1000, ignore_eos=True)["id"]
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        sse_events(r, limit=3)  # started + tokens: it is running
    r = api.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code in (200, 202)
    events = all_events(api, job_id)
    assert events[-1]["event"] == "cancelled"
    job = wait_done(api, job_id)
    assert job["status"] == "cancelled" and job["output"] is None
    r = api.post(f"/v1/jobs/{wait_done(api, submit(api)['id'])['id']}/cancel")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_finished"


def test_idempotency_key(stack, api):
    body = {"input": {"prompt": "once", "max_tokens": 2}}
    first = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "order-1"})
    again = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "order-1"})
    assert first.status_code == 202 and again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    other = api.post(
        "/v1/jobs", json={"input": {"prompt": "twice", "max_tokens": 2}}, headers={"Idempotency-Key": "order-1"}
    )
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    with stack.client(KEY_B) as tenant_b:  # keys are per tenant
        theirs = tenant_b.post("/v1/jobs", json=body, headers={"Idempotency-Key": "order-1"})
    assert theirs.status_code == 202 and theirs.json()["id"] != first.json()["id"]


def test_auth_no_key_bad_key_and_other_tenants_job(stack, api):
    job_id = submit(api)["id"]
    with stack.client(None) as anonymous, stack.client("sk-wrong") as wrong, stack.client(KEY_B) as tenant_b:
        for client in (anonymous, wrong):
            r = client.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
            assert client.post("/v1/jobs", json={"input": {"prompt": "x"}}).status_code == 401
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
            r = tenant_b.request(method, f"/v1/jobs/{job_id}{path}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    assert wait_done(api, job_id)["status"] == "succeeded"  # B's cancel did nothing


def test_health_readiness_and_metrics(stack):
    assert httpx.get(stack.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(stack.url + "/readyz").json() == {"status": "ready", "models": ["tiny"]}
    text = httpx.get(stack.url + "/metrics").text
    assert 'ferry_api_requests_total{method="GET",route="/readyz",status="200"}' in text
    assert "ferry_api_open_streams" in text
