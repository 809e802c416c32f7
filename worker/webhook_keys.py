"""Redis names of webhook delivery, on top of `worker.keys.Keys` (same prefix).

| name                                    | type          | written by     | use |
|-----------------------------------------|---------------|----------------|-----|
| `{p}:webhooks:watch`                    | hash          | api, relay     | job id -> "<last event stream id> <registered unix ts>" for jobs with a webhook whose terminal event is not relayed yet |
| `{p}:webhooks:sent:{job}:{event}`       | string NX EX  | relay          | an event was handed to Celery once (relay restarts never enqueue it twice) |
| `{p}:webhooks:deliveries:{job}`         | hash, EX      | webhook worker | event name -> JSON outcome (webhook id, outcome, status code, attempts) |
| `{p}:celery:*`                          | Celery's keys | Celery         | broker keys (`global_keyprefix`); the task queue is `{p}:webhooks` |

These belong in `worker.keys` and live here only until they are moved there.
"""

from __future__ import annotations

from worker.keys import Keys


class WebhookKeys(Keys):
    @property
    def webhook_watch(self) -> str:
        return f"{self.prefix}:webhooks:watch"

    def webhook_sent(self, job_id: str, event: str) -> str:
        return f"{self.prefix}:webhooks:sent:{job_id}:{event}"

    def webhook_deliveries(self, job_id: str) -> str:
        return f"{self.prefix}:webhooks:deliveries:{job_id}"

    @property
    def celery_prefix(self) -> str:
        return f"{self.prefix}:celery:"

    @property
    def webhook_queue(self) -> str:
        return f"{self.prefix}:webhooks"


def watch_value(last_id: str, registered_at: float) -> str:
    """A `webhook_watch` value: the last event stream id relayed, and when the job was registered."""
    return f"{last_id} {registered_at:.3f}"


def parse_watch_value(value: str) -> tuple[str, float]:
    last_id, _, registered = value.partition(" ")
    return last_id, float(registered or 0)
