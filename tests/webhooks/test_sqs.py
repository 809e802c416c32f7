"""Celery's broker on Amazon SQS (kombu's SQS transport) against moto's server over HTTP: a signed
webhook waits in the SQS queue, not in Redis, until `ferry webhooks` takes it and delivers it to a
real local receiver; the relay's hand-offs go the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import boto3
import pytest
import redis

from ferry.worker.protocol import (
    CompletedEvent,
    JobRequest,
    Keys,
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
from ferry.worker.webhooks.signing import verify
from ferry.worker.webhooks.tasks import broker_transport_options, enqueue, make_celery
from tests.api.conftest import REDIS_URL, Proc, delete_prefix, new_prefix
from tests.serve.conftest import free_port, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.s3, pytest.mark.timeout(180)]

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "ferrytest", "AWS_SECRET_ACCESS_KEY": "ferrytest", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def sqs_endpoint():
    """moto's server on a free port: (host:port, a boto3 SQS client on it)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    client = boto3.client("sqs", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="ferrytest", aws_secret_access_key="ferrytest")
    yield f"127.0.0.1:{port}", client
    server.stop()


def _queue_with_a_dead_letter_queue(client, name: str) -> str:
    """The queue as terraform/envs/dev provisions it: a redrive policy to a dead-letter queue."""
    dlq = client.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
    dlq_arn = client.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    redrive = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})
    return client.create_queue(QueueName=name, Attributes={"RedrivePolicy": redrive, "VisibilityTimeout": "7260"})[
        "QueueUrl"
    ]


def _messages(client, url: str) -> int:
    attrs = client.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])


def _finished_job(client: redis.Redis, keys: Keys, url: str) -> str:
    request = JobRequest(model="m", prompt="x", webhook=Webhook(url=url, events=["job.completed"]))
    job_id = enqueue_job(client, keys, request).job_id
    done = CompletedEvent(seq=0, finish_reason="length", usage=Usage(completion_tokens=1), timings=Timings())
    client.hset(keys.job(job_id), mapping={"state": "succeeded", "text": "y", "finished_at": repr(time.time())})
    client.xadd(keys.events(job_id), event_to_fields(done), id="1-1")
    client.hset(keys.webhook_watch, job_id, watch_value("0-0", time.time()))
    return job_id


def test_a_webhook_travels_through_sqs_to_the_receiver(sqs_endpoint, receiver, tmp_path, monkeypatch):
    endpoint, sqs = sqs_endpoint
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    prefix = new_prefix()
    keys = Keys(prefix)
    env = {
        "FERRY_REDIS_URL": REDIS_URL,
        "FERRY_KEY_PREFIX": prefix,
        "FERRY_CELERY_BROKER_URL": f"sqs://{endpoint}",
        "FERRY_CELERY_SQS_QUEUE_URL": _queue_with_a_dead_letter_queue(sqs, prefix.replace("-", "_") + "_webhooks"),
        "FERRY_CELERY_SQS_REGION": "us-east-1",
        "FERRY_WEBHOOK_SECRET": SECRET,
        "FERRY_WEBHOOK_ALLOW_PRIVATE": "1",
        "FERRY_WEBHOOK_METRICS_PORT": "0",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = WebhookSettings()
    assert "predefined_queues" in broker_transport_options(settings)
    queue_url = settings.celery_sqs_queue_url
    jobs = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    webhooks = None
    try:
        # Handed over before any webhook worker runs: the task waits in SQS, and nothing in Redis.
        enqueue(make_celery(settings), WebhookMessage("msg_direct", "job-direct", "job.completed",
                                                      receiver.base + "/direct", '{"type":"job.completed"}'))
        assert _messages(sqs, queue_url) == 1
        assert not list(jobs.scan_iter(f"{keys.celery_prefix}*"))

        job_id = _finished_job(jobs, keys, receiver.base + "/relayed")
        webhooks = Proc("webhooks", ["webhooks", "--loglevel", "WARNING"], dict(os.environ), tmp_path)
        received = receiver.wait_for(2, timeout=90)
        webhooks.check_alive()
        by_path = {r.path: r for r in received}
        assert set(by_path) == {"/direct", "/relayed"}
        for got in received:
            verify(SECRET, got.headers, got.body)
        assert by_path["/direct"].headers["webhook-id"] == "msg_direct"
        assert by_path["/relayed"].json()["data"]["id"] == job_id
        wait_for(lambda: jobs.hexists(keys.webhook_deliveries(job_id), "job.completed"), 30, "the outcome record")
        outcome = json.loads(jobs.hget(keys.webhook_deliveries(job_id), "job.completed"))
        assert (outcome["outcome"], outcome["attempts"]) == ("delivered", 1)
        wait_for(lambda: _messages(sqs, queue_url) == 0, 30, "SQS to forget the acknowledged tasks")
        assert not list(jobs.scan_iter(f"{keys.celery_prefix}*"))
    finally:
        if webhooks is not None:
            webhooks.stop()
        delete_prefix(prefix)


def test_a_retry_cap_beyond_what_sqs_can_hold_invisible_is_refused_at_start():
    settings = WebhookSettings(celery_broker_url="sqs://", webhook_retry_max_s=30000.0)
    with pytest.raises(ValueError, match="SQS allows at most 43200"):
        broker_transport_options(settings)
    env = dict(os.environ, **AWS_ENV, FERRY_CELERY_BROKER_URL="sqs://", FERRY_WEBHOOK_RETRY_MAX_S="30000",
               FERRY_WEBHOOK_SECRET=SECRET, FERRY_WEBHOOK_METRICS_PORT="0")
    done = subprocess.run([sys.executable, "-m", "ferry.worker.cli", "webhooks"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "SQS allows at most 43200" in done.stderr


def test_a_message_sqs_refuses_holds_back_only_its_own_job(sqs_endpoint, monkeypatch):
    endpoint, sqs = sqs_endpoint
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    prefix = new_prefix()
    keys = Keys(prefix)
    settings = WebhookSettings(redis_url=REDIS_URL, key_prefix=prefix, celery_broker_url=f"sqs://{endpoint}",
                               celery_sqs_queue_url=_queue_with_a_dead_letter_queue(sqs, prefix.replace("-", "_")),
                               celery_sqs_region="us-east-1", webhook_secret=SECRET)
    relay = Relay(settings, make_celery(settings))
    jobs = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        huge = _finished_job(jobs, keys, "https://example.com/huge")
        jobs.hset(keys.job(huge), "text", "x" * 1_100_000)  # its job.completed is over SQS's 1 MiB a message
        fine = _finished_job(jobs, keys, "https://example.com/fine")

        assert relay.step(block_ms=100)  # neither raises nor waits on the refused message

        assert jobs.exists(keys.webhook_sent(fine, "job.completed")) and not jobs.hexists(keys.webhook_watch, fine)
        assert _messages(sqs, settings.celery_sqs_queue_url) == 1
        assert relay.handoff_failures == 1
        assert not jobs.exists(keys.webhook_sent(huge, "job.completed"))  # not lost: still watched, tried later
        assert jobs.hexists(keys.webhook_watch, huge)
    finally:
        jobs.close()
        delete_prefix(prefix)
