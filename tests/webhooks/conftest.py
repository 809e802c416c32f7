"""Webhook test fixtures."""

from tests.webhooks.receiver import receiver, slow_receiver  # noqa: F401 (fixtures)
