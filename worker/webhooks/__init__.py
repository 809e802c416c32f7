"""Signed webhook delivery (Standard Webhooks) through Celery, fed by a relay that follows job events."""
