"""Webhook delivery as Celery tasks, one per (job, event), on a broker of their own keys.

One tenant cannot take every delivery thread. An attempt holds its thread for at most one
deadline (`delivery`), but a tenant with enough slow receivers could still keep all of a process's
threads busy, one deadline after another. So each `ferry webhooks` process runs at most
FERRY_WEBHOOK_TENANT_CONCURRENCY attempts of one tenant at once (`TenantSlots`). A task whose
tenant is at its limit is not attempted: it is deferred, re-queued through the broker with its
attempt number unchanged, so waiting is never a failed attempt and never uses up the retries, and
its thread goes back to the queue at once. A deferred task comes back after the retry backoff
(FERRY_WEBHOOK_RETRY_BASE_S, doubling with each deferral, at most FERRY_WEBHOOK_RETRY_MAX_S): a
tenant with a deep backlog costs the broker a few re-queues a second, not one per task per deadline.

The limit is per process rather than one count across the fleet because what must hold, that no
tenant fills a process's threads, holds in every process on its own as long as the limit is below
FERRY_WEBHOOK_CONCURRENCY, and a local count cannot go wrong: no shared counter, no lease to expire
when a process dies mid-attempt, no Redis round trip per attempt, the same on Redis and on SQS.
A tenant may so run (processes x limit) attempts in all: its share grows with the fleet, as
everyone's does. Deferred tasks still pass through the one queue in order with the others (it is
not a fair queue), each taking a thread only for the moment it takes to defer it again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict

from celery import Celery
from kombu.transport.SQS import CHARS_REPLACE_TABLE

from ferry.worker.common.key_source import KeySource
from ferry.worker.common.tracing import Tracing
from ferry.worker.protocol import Keys
from ferry.worker.webhooks.delivery import WebhookMessage, attempt_delivery, backoff_s
from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.tracing import delivery_span, set_answer

log = logging.getLogger("ferry.webhooks")

TASK_NAME = "ferry.webhooks.deliver"


SQS_MAX_VISIBILITY_TIMEOUT_S = 43200  # SQS refuses a longer visibility timeout (12 hours)


def visibility_timeout_s(settings: WebhookSettings) -> int:
    """How long the broker keeps a taken task invisible before it hands it out again. A retry waits
    in the worker as an ETA task, unacknowledged, so this must outlast the longest backoff."""
    return max(3600, int(2 * settings.webhook_retry_max_s + settings.webhook_timeout_s))


def broker_transport_options(settings: WebhookSettings) -> dict:
    """Kombu's transport options for the broker `FERRY_CELERY_BROKER_URL` names (Redis or SQS)."""
    broker = settings.celery_broker_url or settings.redis_url
    keys = Keys(settings.key_prefix)
    visibility = visibility_timeout_s(settings)
    if not broker.startswith("sqs://"):
        return {
            "global_keyprefix": keys.celery_prefix,
            "visibility_timeout": visibility,
            "socket_connect_timeout": 2.0,
            "socket_timeout": 5.0,
        }
    if visibility > SQS_MAX_VISIBILITY_TIMEOUT_S:
        raise ValueError(
            f"FERRY_WEBHOOK_RETRY_MAX_S={settings.webhook_retry_max_s} needs a visibility timeout of {visibility} s; "
            f"SQS allows at most {SQS_MAX_VISIBILITY_TIMEOUT_S} s"
        )
    options: dict = {
        "visibility_timeout": visibility,  # set on queues kombu creates; a provisioned queue brings its own
        "queue_name_prefix": settings.celery_sqs_queue_name_prefix,
        "wait_time_seconds": 10,  # long polling: one ReceiveMessage per 10 s on an idle queue
        "polling_interval": 0,
        "client-config": {"connect_timeout": 2, "read_timeout": 15, "retries": {"max_attempts": 2}},
    }
    if settings.celery_sqs_region:
        options["region"] = settings.celery_sqs_region
    if settings.celery_sqs_queue_url:
        # A predefined queue: kombu neither lists nor creates queues, so the IAM role needs only
        # send/receive/delete/change-visibility on this one queue. Kombu names it as SQS spells it.
        sqs_name = (settings.celery_sqs_queue_name_prefix + keys.webhook_queue).translate(CHARS_REPLACE_TABLE)
        options["predefined_queues"] = {sqs_name: {"url": settings.celery_sqs_queue_url}}
    return options


class TenantSlots:
    """Attempts in flight per tenant in this process, at most `limit` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: dict[str, int] = {}  # tenant -> attempts running; a tenant with none is absent
        self._lock = threading.Lock()  # delivery threads take and give back slots

    def take(self, tenant: str) -> bool:
        """A slot for one attempt of `tenant`; False when it has `limit` attempts in flight already."""
        with self._lock:
            held = self._in_flight.get(tenant, 0)
            if held >= self.limit:
                return False
            self._in_flight[tenant] = held + 1
            return True

    def give_back(self, tenant: str) -> None:
        with self._lock:
            held = self._in_flight.pop(tenant) - 1
            if held:
                self._in_flight[tenant] = held


def make_celery(settings: WebhookSettings, on_final=None, tracing: Tracing | None = None) -> Celery:
    """A Celery app on its broker (`FERRY_CELERY_BROKER_URL`, default the job Redis): on Redis its keys
    live under `<prefix>:celery:`; on SQS (`sqs://`) its one queue is `FERRY_CELERY_SQS_QUEUE_URL`.
    A hand-off to a broker that does not answer fails within seconds (the relay retries it) instead
    of hanging the relay.

    `on_final(message, attempt, attempts)` is called once per message when it is settled
    (delivered, refused, rejected, gone, or out of attempts). Attempts of one tenant are limited
    per process (the module's docstring). With `tracing`, each attempt is a span of the job's
    trace (`worker.webhooks.tracing`).
    """
    keys = Keys(settings.key_prefix)
    tenants = KeySource(settings.api_keys, settings.api_keys_file)  # re-read when the key file changes
    app = Celery("ferry", broker=settings.celery_broker_url or settings.redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options=broker_transport_options(settings),
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

    slots = TenantSlots(settings.webhook_tenant_concurrency)

    @app.task(name=TASK_NAME, bind=True, max_retries=None)
    def deliver(task, delivery: dict, attempt: int | None = None, deferrals: int = 0) -> str:
        d = WebhookMessage(**delivery)
        # A deferral re-queues the task too, so Celery's retry count is not the attempt number. A
        # fresh task carries none (its retry count is 0), nor does one queued before this was passed.
        number = attempt or task.request.retries + 1
        if not settings.webhook_secret:
            raise RuntimeError("FERRY_WEBHOOK_SECRET is not set")
        if not slots.take(d.tenant):
            log.info("webhook %s %s deferred: tenant %r has %d attempts in flight", d.event, d.job_id, d.tenant,
                     slots.limit)
            raise task.retry(
                kwargs={"delivery": delivery, "attempt": number, "deferrals": deferrals + 1},
                countdown=backoff_s(deferrals + 1, settings.webhook_retry_base_s, settings.webhook_retry_max_s),
            )
        try:
            with delivery_span(tracing, d.traceparent, d.url, d.job_id, d.event, number) as (span, traceparent):
                result = attempt_delivery(
                    d,
                    tenants.current().tenant(d.tenant).webhook_secrets or [settings.webhook_secret],
                    allow_private=settings.webhook_allow_private,
                    timeout_s=settings.webhook_timeout_s,
                    traceparent=traceparent,
                )
                set_answer(span, result.status_code, result.outcome, result.detail)
                log.info("webhook %s %s -> %s attempt %d: %s", d.event, d.job_id, d.url, number, result.detail)
        finally:
            slots.give_back(d.tenant)
        if result.outcome == "retry" and number < settings.webhook_max_attempts:
            raise task.retry(kwargs={"delivery": delivery, "attempt": number + 1},
                             countdown=backoff_s(number, settings.webhook_retry_base_s, settings.webhook_retry_max_s))
        if on_final is not None:
            on_final(d, result, number)
        return result.outcome

    return app


def enqueue(app: Celery, message: WebhookMessage) -> None:
    app.send_task(TASK_NAME, kwargs={"delivery": asdict(message)})
