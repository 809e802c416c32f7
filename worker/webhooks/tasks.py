"""Webhook delivery as Celery tasks, one per (job, event), on a broker of their own keys."""

from __future__ import annotations

import logging
from dataclasses import asdict

from celery import Celery

from worker.protocol import Keys
from worker.webhooks.delivery import WebhookMessage, attempt_delivery, backoff_s
from worker.webhooks.settings import WebhookSettings

log = logging.getLogger("ferry.webhooks")

TASK_NAME = "ferry.webhooks.deliver"


def make_celery(settings: WebhookSettings, on_final=None) -> Celery:
    """A Celery app on its broker (`FERRY_CELERY_BROKER_URL`, default the job Redis); on Redis its keys
    live under `<prefix>:celery:`. A hand-off to a broker that does not answer fails within seconds
    (the relay retries it) instead of hanging the relay.

    `on_final(message, attempt, attempts)` is called once per message when it is settled
    (delivered, refused, rejected, gone, or out of attempts).
    """
    keys = Keys(settings.key_prefix)
    app = Celery("ferry", broker=settings.celery_broker_url or settings.redis_url, set_as_current=False)
    app.conf.update(
        # A retry waits in the worker as an ETA task; Redis re-delivers an unacked task after the
        # visibility timeout, so it must outlast the longest backoff.
        broker_transport_options={
            "global_keyprefix": keys.celery_prefix,
            "visibility_timeout": max(3600, int(2 * settings.webhook_retry_max_s + settings.webhook_timeout_s)),
            "socket_connect_timeout": 2.0,
            "socket_timeout": 5.0,
        },
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0},
        broker_connection_retry_on_startup=True,
        task_default_queue=keys.webhook_queue,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        task_serializer="json",
        accept_content=["json"],
    )

    @app.task(name=TASK_NAME, bind=True, max_retries=None)
    def deliver(task, delivery: dict) -> str:
        d = WebhookMessage(**delivery)
        number = task.request.retries + 1
        if not settings.webhook_secret:
            raise RuntimeError("FERRY_WEBHOOK_SECRET is not set")
        attempt = attempt_delivery(
            d,
            settings.webhook_secret,
            allow_private=settings.webhook_allow_private,
            timeout_s=settings.webhook_timeout_s,
        )
        log.info("webhook %s %s -> %s attempt %d: %s", d.event, d.job_id, d.url, number, attempt.detail)
        if attempt.outcome == "retry" and number < settings.webhook_max_attempts:
            raise task.retry(countdown=backoff_s(number, settings.webhook_retry_base_s, settings.webhook_retry_max_s))
        if on_final is not None:
            on_final(d, attempt, number)
        return attempt.outcome

    return app


def enqueue(app: Celery, message: WebhookMessage) -> None:
    app.send_task(TASK_NAME, kwargs={"delivery": asdict(message)})
