"""`ferry webhooks`: the Celery worker that delivers signed webhooks, and the relay that feeds it."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily

from ferry.worker.common.tracing import TracingConfigError, log_as_text, tracing_from_env
from ferry.worker.protocol import Keys
from ferry.worker.webhooks.delivery import Attempt, WebhookMessage
from ferry.worker.webhooks.relay import Relay
from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.signing import secret_key
from ferry.worker.webhooks.tasks import make_celery

log = logging.getLogger("ferry.webhooks")


def main(argv: list[str] | None = None) -> int:
    """`ferry webhooks`: the Celery delivery worker plus the job-event relay, in one process."""
    parser = argparse.ArgumentParser(prog="ferry webhooks", description=main.__doc__)
    parser.add_argument("--concurrency", type=int, default=None, help="delivery threads (FERRY_WEBHOOK_CONCURRENCY)")
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    log_as_text(args.loglevel)
    settings = WebhookSettings()
    if not settings.webhook_secret:
        log.error("FERRY_WEBHOOK_SECRET is not set (expected 'whsec_<base64>'): refusing to send unsigned webhooks")
        return 2
    secret_key(settings.webhook_secret)
    if settings.webhook_allow_private:
        log.warning("FERRY_WEBHOOK_ALLOW_PRIVATE is on: webhooks may reach private and loopback addresses")
    try:
        tracing = tracing_from_env("ferry-webhooks")  # None unless OTEL_* names an endpoint
    except TracingConfigError as exc:
        log.error("%s", exc)
        return 2
    registry = CollectorRegistry()
    outcomes = Counter("ferry_webhook_deliveries", "Settled webhook deliveries", ["outcome"], registry=registry)
    relay = Relay(settings, tracing=tracing)
    registry.register(_HandoffFailures(relay))
    if settings.webhook_metrics_port:
        start_http_server(settings.webhook_metrics_port, addr=settings.webhook_metrics_host, registry=registry)

    def on_final(message: WebhookMessage, attempt: Attempt, attempts: int) -> None:
        outcomes.labels("failed" if attempt.outcome == "retry" else attempt.outcome).inc()
        relay.record(message, attempt, attempts)

    try:
        app = make_celery(settings, on_final, tracing)
    except ValueError as exc:  # a broker setting the broker cannot honour
        log.error("%s", exc)
        return 2
    relay.app = app
    stop = threading.Event()
    threading.Thread(target=_relay_or_exit, args=(relay, stop), name="webhook-relay", daemon=True).start()
    concurrency = args.concurrency or settings.webhook_concurrency
    if settings.webhook_tenant_concurrency >= concurrency:
        log.warning("FERRY_WEBHOOK_TENANT_CONCURRENCY=%d is not below the %d delivery threads: one tenant's slow "
                    "receivers can hold them all", settings.webhook_tenant_concurrency, concurrency)
    try:
        app.worker_main(
            [
                "worker",
                "--pool=threads",
                f"--concurrency={concurrency}",
                f"--loglevel={args.loglevel}",
                "-Q",
                Keys(settings.key_prefix).webhook_queue,
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-n",
                f"ferry-webhooks-{os.getpid()}@{socket.gethostname()}",
            ]
        )
    finally:
        stop.set()
        if tracing is not None:
            tracing.shutdown()
    return 0


def _relay_or_exit(relay: Relay, stop: threading.Event) -> None:
    """The relay thread: should it ever end before the process stops, no job would get a webhook
    again while the process looked healthy, so the process exits (non-zero) to be restarted."""
    try:
        relay.run(stop)
    finally:
        if not stop.is_set():
            log.critical("webhook relay stopped: exiting")
            logging.shutdown()
            os._exit(70)


class _HandoffFailures:
    """`ferry_webhook_handoff_failures_total`: relay steps that failed (Redis or the broker refused)."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay

    def collect(self):
        yield CounterMetricFamily("ferry_webhook_handoff_failures", "Relay steps that failed and were retried",
                                  value=self._relay.handoff_failures)
