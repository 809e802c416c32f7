"""The relay against a Celery broker that refuses hand-offs (real redis-servers: the jobs' and the
broker's): it survives, counts the failures, marks nothing sent, and hands the event over once
the broker is back. A relay that stops anyway takes its process down."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

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
from ferry.worker.webhooks.relay import Relay
from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.tasks import make_celery
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
