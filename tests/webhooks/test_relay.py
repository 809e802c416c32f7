"""The relay against a Celery broker that refuses hand-offs (real redis-servers: the jobs' and the
broker's): it survives, counts the failures, marks nothing sent, and hands the event over once
the broker is back. A relay that stops anyway takes its process down."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict

import pytest
import redis

from ferry.worker.protocol import (
    CompletedEvent,
    JobRequest,
    Keys,
    StartedEvent,
    Timings,
    Usage,
    Webhook,
    enqueue_job,
    event_to_fields,
)
from ferry.worker.protocol.keys import watch_value
from ferry.worker.webhooks.delivery import WebhookMessage
from ferry.worker.webhooks.relay import Relay
from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.tasks import make_celery
from tests.api.conftest import REDIS_URL, delete_prefix, new_prefix
from tests.serve.conftest import REPO, RedisServer, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def servers(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "broker").mkdir()
    jobs, broker = RedisServer(tmp_path / "jobs"), RedisServer(tmp_path / "broker")
    jobs.start()
    yield jobs, broker
    jobs.kill9()
    broker.kill9()


def _finished_job_with_a_webhook(client: redis.Redis, keys: Keys) -> str:
    webhook = Webhook(url="https://example.com/hook", events=["job.completed"])
    request = JobRequest(model="m", prompt="x", webhook=webhook)
    job_id = enqueue_job(client, keys, request).job_id
    client.xadd(keys.events(job_id), event_to_fields(StartedEvent(seq=0, worker_id="w", attempt=1)), id="0-1")
    done = CompletedEvent(seq=1, finish_reason="length", usage=Usage(completion_tokens=1), timings=Timings())
    client.hset(keys.job(job_id), mapping={"state": "succeeded", "text": "y", "finished_at": repr(time.time())})
    client.xadd(keys.events(job_id), event_to_fields(done), id="1-1")
    client.hset(keys.webhook_watch, job_id, watch_value("0-0", time.time()))
    return job_id


def test_a_refused_hand_off_is_retried_until_the_broker_takes_it(servers):
    jobs, broker = servers
    prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
    settings = WebhookSettings(redis_url=jobs.url, key_prefix=prefix, celery_broker_url=broker.url,
                               webhook_secret=SECRET)
    relay = Relay(settings, make_celery(settings))
    client = redis.Redis.from_url(jobs.url, decode_responses=True)
    keys = Keys(prefix)
    job_id = _finished_job_with_a_webhook(client, keys)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: relay.handoff_failures >= 2, 60, "failed hand-offs to the stopped broker")
        assert thread.is_alive()
        assert not client.exists(keys.webhook_sent(job_id, "job.completed"))  # never marked sent before it was taken
        assert client.hexists(keys.webhook_watch, job_id)
        broker.start()
        wait_for(lambda: client.exists(keys.webhook_sent(job_id, "job.completed")), 60, "the hand-off to succeed")
        assert not client.hexists(keys.webhook_watch, job_id)
        broker_client = redis.Redis.from_url(broker.url, decode_responses=True)
        queued = [k for k in broker_client.scan_iter(f"{keys.celery_prefix}*") if broker_client.type(k) == "list"]
        assert sum(broker_client.llen(k) for k in queued) == 1  # handed over exactly once
    finally:
        stop.set()
        thread.join(10)


def test_a_relay_that_stops_takes_its_process_down():
    code = (
        "import threading\n"
        "from worker.webhooks.cli import _relay_or_exit\n"
        "from worker.webhooks.relay import Relay\n"
        "from worker.webhooks.settings import WebhookSettings\n"
        "relay = Relay(WebhookSettings(redis_url='redis://127.0.0.1:1/0'))\n"
        "relay.run = lambda stop: None  # a relay whose loop ended for any reason\n"
        "_relay_or_exit(relay, threading.Event())\n"
        "import time; time.sleep(5)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stderr


def _handed_over(raw: str) -> dict:
    """The webhook message in a Celery task as kombu keeps it in a Redis list."""
    envelope = json.loads(raw)
    _, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
    return kwargs["delivery"]


@pytest.mark.redis
def test_an_event_or_outbox_entry_the_relay_cannot_read_stops_no_other_webhook():
    prefix = new_prefix()
    keys = Keys(prefix)
    settings = WebhookSettings(redis_url=REDIS_URL, key_prefix=prefix, webhook_secret=SECRET)
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    relay = Relay(settings, make_celery(settings))
    try:
        plain = _finished_job_with_a_webhook(client, keys)
        # A newer worker's events, with a field this relay's event models do not know; and an entry
        # that is no event at all before a job's terminal event.
        started = json.loads(StartedEvent(seq=0, worker_id="w", attempt=1).model_dump_json()) | {"gpu": "h100"}
        done = json.loads(CompletedEvent(seq=1, finish_reason="length", usage=Usage(), timings=Timings())
                          .model_dump_json())
        newer = _finished_job_with_a_webhook(client, keys)
        garbled = _finished_job_with_a_webhook(client, keys)
        for job_id, entries in ((newer, [started, done | {"reasoning_tokens": 3}]), (garbled, [{"junk": 1}, done])):
            client.delete(keys.events(job_id))
            for seq, event in enumerate(entries):
                fields = {"seq": seq, "type": event["type"], "data": json.dumps(event)} if "type" in event else event
                client.xadd(keys.events(job_id), fields, id=f"{seq}-1")
        client.xadd(keys.webhook_outbox, {"webhook_id": "msg_half", "job_id": "batch_1"})  # not a whole message
        whole = WebhookMessage("msg_batch_2", "batch_2", "batch.completed", "https://example.com/b", "{}", "t")
        client.xadd(keys.webhook_outbox, asdict(whole))

        relay.step(block_ms=100)

        for job_id in (plain, newer, garbled):
            assert client.exists(keys.webhook_sent(job_id, "job.completed")), job_id
        assert client.hlen(keys.webhook_watch) == 0 and client.xlen(keys.webhook_outbox) == 0
        queued = [k for k in client.scan_iter(f"{keys.celery_prefix}*") if client.type(k) == "list"]
        handed = [_handed_over(raw)["webhook_id"] for key in queued for raw in client.lrange(key, 0, -1)]
        assert sorted(handed) == sorted([f"msg_{job}_completed" for job in (plain, newer, garbled)] + ["msg_batch_2"])
    finally:
        client.close()
        delete_prefix(prefix)
