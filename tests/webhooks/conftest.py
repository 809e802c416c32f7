"""Webhook test fixtures."""

from tests.webhooks.receiver import receiver  # noqa: F401 (a fixture)
