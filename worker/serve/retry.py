"""Retry a Redis call with capped, jittered exponential backoff while Redis is unreachable."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import TypeVar

from ferry.worker.common.connect import UNAVAILABLE

log = logging.getLogger("ferry.worker.redis")

T = TypeVar("T")


class RetryAbandoned(Exception):
    """The stop event fired while a Redis call waited for Redis to come back: the caller gives up on it."""


def call_with_backoff(fn: Callable[[], T], *, what: str, stop: threading.Event, max_delay_s: float) -> T:
    """Call `fn` until it does not raise an UNAVAILABLE error; raise RetryAbandoned if `stop` is set meanwhile."""
    delay = 0.05
    failures = 0
    while True:
        try:
            result = fn()
        except UNAVAILABLE as exc:
            failures += 1
            if failures == 1 or failures % 20 == 0:
                log.warning("redis unavailable, retrying", extra={"op": what, "error": str(exc), "failures": failures})
            if stop.wait(delay * random.uniform(0.5, 1.0)):
                raise RetryAbandoned(what) from exc
            delay = min(max_delay_s, delay * 2)
            continue
        if failures:
            log.info("redis reachable again", extra={"op": what, "failures": failures})
        return result
