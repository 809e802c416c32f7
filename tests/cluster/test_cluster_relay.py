"""The webhook relay on a real Redis Cluster: watched jobs in every shard, one XREAD per shard;
Celery's broker is a single Redis (kombu cannot use a cluster)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from pydantic import ValidationError

from ferry.worker.protocol import (
    CompletedEvent,
    JobRequest,
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
from tests.cluster.conftest import SHARDS
from tests.serve.conftest import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

BROKER = "redis://127.0.0.1:6379/0"


def _finished_job_with_a_webhook(client, keys) -> str:
    request = JobRequest(model="m", prompt="x", webhook=Webhook(url="https://example.com/hook",
                                                                events=["job.completed"]))
    job_id = enqueue_job(client, keys, request).job_id
    client.xadd(keys.events(job_id), event_to_fields(StartedEvent(seq=0, worker_id="w", attempt=1)), id="0-1")
    done = CompletedEvent(seq=1, finish_reason="length", usage=Usage(completion_tokens=1), timings=Timings())
    client.hset(keys.job(job_id), mapping={"state": "succeeded", "text": "y", "finished_at": repr(time.time())})
    client.xadd(keys.events(job_id), event_to_fields(done), id="1-1")
    client.hset(keys.webhook_watch, job_id, watch_value("0-0", time.time()))
    return job_id


def test_the_relay_hands_off_watched_jobs_of_every_shard_once(cluster, cclient, ckeys):
    settings = WebhookSettings(redis_url=cluster.url, redis_cluster=True, queue_shards=SHARDS,
                               key_prefix=ckeys.prefix, celery_broker_url=BROKER,
                               webhook_secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    jobs = [_finished_job_with_a_webhook(cclient, ckeys) for _ in range(12)]
    assert len({ckeys.shard_of(j) for j in jobs}) > 1
    relay = Relay(settings, make_celery(settings))
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    broker = redis.Redis.from_url(BROKER, decode_responses=True)
    try:
        wait_for(lambda: all(cclient.exists(ckeys.webhook_sent(j, "job.completed")) for j in jobs), 60,
                 "every job's hand-off")
        assert cclient.hlen(ckeys.webhook_watch) == 0 and relay.handoff_failures == 0
        queued = [k for k in broker.scan_iter(f"{ckeys.celery_prefix}*") if broker.type(k) == "list"]
        assert sum(broker.llen(k) for k in queued) == len(jobs)  # once each
    finally:
        stop.set()
        thread.join(10)
        for key in broker.scan_iter(f"{ckeys.prefix}:*"):
            broker.delete(key)
        broker.close()


def test_the_webhook_worker_refuses_a_cluster_as_celerys_broker():
    with pytest.raises(ValidationError, match="FERRY_CELERY_BROKER_URL"):
        WebhookSettings(redis_url="redis://127.0.0.1:7000", redis_cluster=True)
