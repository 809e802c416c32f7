"""Torch-free code every Ferry process shares that is not the wire itself: the Redis connection,
the object store, tenants and their key source, address checks, settings. `worker.protocol`, the
API, the worker and the webhook worker import it; it imports nothing else of Ferry's."""
