"""Webhooks through the stack: the relay and a real Celery worker deliver signed job events."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from ferry.api.main import create_app
from ferry.api.settings import ApiSettings
from ferry.worker.webhooks.signing import new_secret, verify
from tests.api.conftest import MODEL, REDIS_URL, Proc, delete_prefix, new_prefix, stack_env

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


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
        # No worker serves MODEL on this prefix: the job stays queued until it is cancelled. The API
        # is allowed private URLs here (it refuses them at submission otherwise: test_hardening) so
        # that the webhook worker's own check, made again at delivery, is what is tested.
        app = create_app(ApiSettings(redis_url=REDIS_URL, key_prefix=prefix, models=MODEL, webhook_allow_private=True))
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
    done = subprocess.run([sys.executable, "-m", "ferry.worker.cli", "webhooks"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "FERRY_WEBHOOK_SECRET" in done.stderr
