"""Webhook signing, the address guard, one delivery attempt, and delivery by a real Celery worker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import ApiSettings
from tests.api.conftest import MODEL, REDIS_URL, Proc, delete_prefix, new_prefix, stack_env
from worker.webhooks.delivery import (
    Delivery,
    InvalidSignature,
    RefusedUrl,
    attempt_delivery,
    backoff_s,
    new_secret,
    resolve_target,
    sign,
    verify,
)

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_signature_matches_the_standard_webhooks_reference_vector():
    # From the Standard Webhooks reference implementations' test suite.
    body = b'{"test": 2432232314}'
    assert sign(SECRET, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_verify_checks_body_secret_and_timestamp():
    now = int(time.time())
    body = b'{"type":"job.completed"}'
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(now), "webhook-signature": sign(SECRET, "msg_1", now, body)}
    verify(SECRET, headers, body)
    # Several signatures (secret rotation): one match is enough.
    verify(SECRET, headers | {"webhook-signature": "v1,AAAA " + headers["webhook-signature"]}, body)
    with pytest.raises(InvalidSignature):
        verify(SECRET, headers, body + b" ")
    with pytest.raises(InvalidSignature):
        verify(new_secret(), headers, body)
    with pytest.raises(InvalidSignature):
        verify(SECRET, headers, body, now=now + 301)
    with pytest.raises(InvalidSignature):
        verify(SECRET, {"webhook-id": "msg_1"}, body)


def test_backoff_doubles_with_jitter_and_is_capped():
    for attempt in range(1, 8):
        delays = [backoff_s(attempt, 2.0, 60.0) for _ in range(200)]
        nominal = min(60.0, 2.0 * 2 ** (attempt - 1))
        assert nominal * 0.5 <= min(delays) and max(delays) <= nominal * 1.5
        assert max(delays) - min(delays) > nominal * 0.2  # jittered, not a fixed schedule


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/hook", "http://localhost:9/hook", "http://[::1]:9/hook", "http://[::ffff:127.0.0.1]:9/",
     "https://127.0.0.2/"],
)
def test_loopback_urls_are_refused_without_the_allowance(url):
    with pytest.raises(RefusedUrl, match="non-public"):
        resolve_target(url, allow_private=False)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "http://", "not a url"])
def test_non_http_urls_are_refused(url):
    with pytest.raises(RefusedUrl):
        resolve_target(url, allow_private=True)


def test_allowed_target_is_pinned_to_the_checked_address():
    target = resolve_target("https://localhost:8443/hook?x=1", allow_private=True)
    assert target.url.split("//")[1].split(":")[0] in ("127.0.0.1", "[")
    assert target.url.endswith(":8443/hook?x=1")
    assert target.host_header == "localhost:8443"
    assert target.sni_hostname == "localhost"


def _delivery(url: str) -> Delivery:
    return Delivery("msg_job1_completed", "job1", "job.completed", url, '{"type":"job.completed"}')


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, "delivered"), (204, "delivered"), (500, "retry"), (503, "retry"), (429, "retry"), (410, "gone"),
     (400, "rejected"), (302, "rejected")],
)
def test_one_attempt_maps_the_receivers_answer(receiver, status, outcome):
    receiver.script.append(status)
    attempt = attempt_delivery(_delivery(receiver.base + "/hook"), SECRET, allow_private=True, timeout_s=5)
    assert (attempt.outcome, attempt.status_code) == (outcome, status)
    (got,) = receiver.wait_for(1)
    assert got.path == "/hook"  # a redirect is never followed
    assert got.headers["webhook-id"] == "msg_job1_completed"
    assert got.headers["content-type"] == "application/json"
    verify(SECRET, got.headers, got.body)


def test_unanswered_and_refused_connections_are_retried():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts into the backlog, never answers
        attempt = attempt_delivery(_delivery(f"http://127.0.0.1:{silent.getsockname()[1]}/"), SECRET,
                                   allow_private=True, timeout_s=0.3)
    assert attempt.outcome == "retry" and "Timeout" in attempt.detail
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    attempt = attempt_delivery(_delivery(f"http://127.0.0.1:{port}/"), SECRET, allow_private=True, timeout_s=1)
    assert attempt.outcome == "retry"


def test_refused_attempt_sends_nothing(receiver):
    attempt = attempt_delivery(_delivery(receiver.base + "/hook"), SECRET, allow_private=False, timeout_s=5)
    assert attempt.outcome == "refused"
    time.sleep(0.2)
    assert receiver.requests == []


# --- through the stack: relay + Celery worker process -----------------------------------------------


def _submit(api, url: str, events=None, **inp) -> str:
    webhook = {"url": url} if events is None else {"url": url, "events": events}
    body = {"input": {"prompt": "webhook test", "max_tokens": 4, "temperature": 0} | inp, "webhook": webhook,
            "metadata": {"order": 7}}
    r = api.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _deliveries(api, job_id: str, n: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if len(job["webhook_deliveries"]) >= n:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"deliveries of {job_id}: {job['webhook_deliveries']}")


@pytest.mark.redis
def test_job_events_are_delivered_signed_and_filtered(stack, api, receiver):
    job_id = _submit(api, receiver.base + "/all")
    started, completed = sorted(receiver.wait_for(2, path="/all"), key=lambda r: r.json()["type"] != "job.started")
    for got in (started, completed):
        verify(stack.secret, got.headers, got.body)
    assert started.json()["type"] == "job.started" and started.json()["data"]["status"] == "running"
    body = completed.json()
    job = _deliveries(api, job_id, 2)
    assert body["type"] == "job.completed"
    assert body["data"]["id"] == job_id and body["data"]["metadata"] == {"order": 7}
    assert body["data"]["output"]["text"] == job["output"]["text"]
    assert body["data"]["usage"]["completion_tokens"] == 4
    assert started.headers["webhook-id"] != completed.headers["webhook-id"]
    assert {k: v["outcome"] for k, v in job["webhook_deliveries"].items()} == {
        "job.started": "delivered", "job.completed": "delivered"}

    only_completed = _submit(api, receiver.base + "/filtered", events=["job.completed"])
    _deliveries(api, only_completed, 1)
    time.sleep(0.5)
    assert [r.json()["type"] for r in receiver.requests if r.path == "/filtered"] == ["job.completed"]


@pytest.mark.redis
def test_failing_receiver_gets_retries_with_the_same_webhook_id(stack, api, receiver):
    receiver.script.extend([500, 503])
    job_id = _submit(api, receiver.base + "/flaky", events=["job.completed"])
    attempts = receiver.wait_for(3)
    assert len({r.headers["webhook-id"] for r in attempts}) == 1
    assert len({r.body for r in attempts}) == 1
    for got in attempts:
        verify(stack.secret, got.headers, got.body)
    record = _deliveries(api, job_id, 1)["webhook_deliveries"]["job.completed"]
    assert (record["outcome"], record["attempts"], record["status_code"]) == ("delivered", 3, 200)
    time.sleep(0.5)
    assert len(receiver.requests) == 3


@pytest.mark.redis
def test_gone_stops_and_exhausted_attempts_are_recorded_as_failed(stack, api, receiver):
    receiver.script.append(410)
    gone = _submit(api, receiver.base + "/gone", events=["job.completed"])
    assert _deliveries(api, gone, 1)["webhook_deliveries"]["job.completed"]["outcome"] == "gone"
    receiver.script.extend([500] * 10)
    failing = _submit(api, receiver.base + "/down", events=["job.completed"])
    record = _deliveries(api, failing, 1)["webhook_deliveries"]["job.completed"]
    assert (record["outcome"], record["attempts"]) == ("failed", 4)  # FERRY_WEBHOOK_MAX_ATTEMPTS=4
    assert len([r for r in receiver.requests if r.path == "/gone"]) == 1
    assert len([r for r in receiver.requests if r.path == "/down"]) == 4


@pytest.mark.redis
def test_webhook_worker_without_the_allowance_refuses_loopback(tiny_model_factory, tmp_path, receiver):
    prefix = new_prefix()
    env = stack_env(prefix, tiny_model_factory("llama"), FERRY_WEBHOOK_SECRET=new_secret())
    env.pop("FERRY_WEBHOOK_ALLOW_PRIVATE", None)
    webhooks = Proc("webhooks", ["webhooks", "--loglevel", "WARNING"], env, tmp_path)
    try:
        # No worker serves MODEL on this prefix: the job stays queued until it is cancelled.
        app = create_app(ApiSettings(redis_url=REDIS_URL, key_prefix=prefix, models=MODEL))
        with TestClient(app) as api:
            job_id = _submit(api, receiver.base + "/private", events=["job.cancelled"])
            assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
            record = _deliveries(api, job_id, 1)["webhook_deliveries"]["job.cancelled"]
        assert record["outcome"] == "refused" and "non-public" in record["detail"]
        time.sleep(0.3)
        assert receiver.requests == []
        webhooks.check_alive()
    finally:
        webhooks.stop()
        delete_prefix(prefix)


def test_ferry_webhooks_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != "FERRY_WEBHOOK_SECRET"}
    done = subprocess.run([sys.executable, "-m", "worker.cli", "webhooks"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "FERRY_WEBHOOK_SECRET" in done.stderr
