"""Signed webhook delivery (Standard Webhooks) through Celery, fed by a relay that follows job events.

- `signing`: secrets, signatures and their check (what a receiver runs);
- `delivery`: one attempt, and the guard on where an attempt may go;
- `tasks`: the Celery app and its delivery task, with backoff; `relay`: job events -> tasks;
- `settings`, `cli` (`ferry webhooks`).
"""
