"""Slow receivers hold their own tenant's deliveries only: a real `ferry webhooks` process (Celery,
its broker on the real Redis) delivers to real local receivers, one tenant's dripping forever."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import redis

from ferry.worker.protocol import Keys
from ferry.worker.webhooks.delivery import WebhookMessage
from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.tasks import TenantSlots, enqueue, make_celery
from tests.api.conftest import REDIS_URL, Proc, delete_prefix, new_prefix
from tests.serve.conftest import wait_for

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_tenant_slots_cap_each_tenant_apart():
    slots = TenantSlots(2)
    assert [slots.take("a"), slots.take("a"), slots.take("a")] == [True, True, False]
    assert slots.take("b")  # another tenant's attempts do not count against a's
    slots.give_back("a")
    assert slots.take("a") and not slots.take("a")
    for tenant in ("a", "a", "b"):
        slots.give_back(tenant)
    assert slots.take("b") and slots.take("b") and not slots.take("b")


def _webhooks(prefix: str, tmp_path, **settings: str) -> Proc:
    """`ferry webhooks` on the real Redis: two delivery threads, at most one attempt per tenant."""
    env = dict(os.environ, FERRY_REDIS_URL=REDIS_URL, FERRY_KEY_PREFIX=prefix, FERRY_WEBHOOK_SECRET=SECRET,
               FERRY_WEBHOOK_ALLOW_PRIVATE="1", FERRY_WEBHOOK_METRICS_PORT="0", FERRY_WEBHOOK_CONCURRENCY="2",
               FERRY_WEBHOOK_TENANT_CONCURRENCY="1", FERRY_WEBHOOK_RETRY_BASE_S="0.2", **settings)
    return Proc("webhooks", ["webhooks", "--loglevel", "INFO"], env, tmp_path)


def _messages(tenant: str, base: str, n: int) -> list[WebhookMessage]:
    return [WebhookMessage(f"msg_{tenant}{i}", f"job-{tenant}{i}", "job.completed", f"{base}/{tenant}{i}",
                           '{"type":"job.completed"}', f"tenant-{tenant}") for i in range(n)]


@pytest.mark.redis
@pytest.mark.timeout(240)
def test_a_tenant_of_slow_drip_receivers_does_not_stop_another_tenants_webhooks(slow_receiver, receiver, tmp_path):
    prefix = new_prefix()
    keys = Keys(prefix)
    app = make_celery(WebhookSettings(redis_url=REDIS_URL, key_prefix=prefix, webhook_secret=SECRET))
    slow_receiver.part, slow_receiver.pace_s = "headers", 0.1  # a byte every 0.1 s: never a status code
    slow = _messages("a", slow_receiver.base, 3)  # more than the delivery threads
    webhooks = _webhooks(prefix, tmp_path, FERRY_WEBHOOK_TIMEOUT_S="1", FERRY_WEBHOOK_MAX_ATTEMPTS="2")
    jobs = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        for message in slow:
            enqueue(app, message)
        slow_receiver.wait_for(1, timeout=60)  # tenant a's receivers hold delivery threads now
        (fine,) = _messages("b", receiver.base, 1)
        enqueue(app, fine)
        (got,) = receiver.wait_for(1, timeout=60)
        assert got.headers["webhook-id"] == fine.webhook_id

        for message in [*slow, fine]:
            key = keys.webhook_deliveries(message.job_id)
            wait_for(lambda key=key: jobs.hexists(key, "job.completed"), 120, f"{message.job_id} to settle")
        outcomes = {m.job_id: json.loads(jobs.hget(keys.webhook_deliveries(m.job_id), "job.completed"))
                    for m in [*slow, fine]}
        assert {job: (o["outcome"], o["attempts"], o["detail"]) for job, o in outcomes.items()} == {
            **{m.job_id: ("failed", 2, "timed out after 1 s while reading the answer") for m in slow},
            fine.job_id: ("delivered", 1, "ok"),
        }
        # Every attempt the policy allows, and no more: waiting for a slot was never counted as one.
        assert Counter(r.headers["webhook-id"] for r in slow_receiver.requests) == {m.webhook_id: 2 for m in slow}
        webhooks.check_alive()
    finally:
        webhooks.stop()
        jobs.close()
        delete_prefix(prefix)


@pytest.mark.redis
@pytest.mark.timeout(240)
def test_one_tenant_cannot_hold_every_delivery_thread(slow_receiver, receiver, tmp_path):
    prefix = new_prefix()
    app = make_celery(WebhookSettings(redis_url=REDIS_URL, key_prefix=prefix, webhook_secret=SECRET))
    slow_receiver.part, slow_receiver.pace_s = "headers", 0.1
    # A deadline longer than the test holds tenant a's receivers: only the per-tenant limit frees a thread.
    webhooks = _webhooks(prefix, tmp_path, FERRY_WEBHOOK_TIMEOUT_S="600")
    try:
        for message in _messages("a", slow_receiver.base, 3):
            enqueue(app, message)
        slow_receiver.wait_for(1, timeout=60)
        (fine,) = _messages("b", receiver.base, 1)
        enqueue(app, fine)
        (got,) = receiver.wait_for(1, timeout=60)
        assert got.headers["webhook-id"] == fine.webhook_id
        assert len(slow_receiver.requests) == 1  # tenant a's other webhooks wait, unattempted, for its one slot
        webhooks.check_alive()
    finally:
        slow_receiver.stop.set()  # the held attempt ends (the receiver hangs up), so the worker stops at once
        webhooks.stop()
        delete_prefix(prefix)
