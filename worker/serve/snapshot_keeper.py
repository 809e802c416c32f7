"""The worker's prefix-cache snapshots: restored before it turns ready, saved every so often while
idle and on drain (`worker.snapshots` does the work; this decides when)."""

from __future__ import annotations

import logging
import time

from ferry.worker.common.objectstore import open_store
from ferry.worker.engine import Engine
from ferry.worker.snapshots import SnapshotStats, restore_snapshot, save_snapshot

log = logging.getLogger("ferry.worker.snapshots")


class SnapshotKeeper:
    def __init__(self, engine: Engine, url: str, interval_s: float, max_bytes: int, keep: int, stats: SnapshotStats,
                 s3_endpoint_url: str | None = None) -> None:
        self.engine = engine
        self.store = open_store(url, s3_endpoint_url)
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.keep = keep
        self.stats = stats
        self._saved_at = time.monotonic()

    def restore(self) -> None:
        """Before the worker is ready; never raises (a failed restore is a cold start)."""
        restore_snapshot(self.engine, self.store, self.stats)

    def save_if_due(self) -> None:
        """Between jobs, on the engine thread: save when the interval passed and the cache changed."""
        if time.monotonic() - self._saved_at < self.interval_s:
            return
        self._saved_at = time.monotonic()
        try:
            info = save_snapshot(self.engine, self.store, max_bytes=self.max_bytes, keep=self.keep,
                                 only_if_changed=True, stats=self.stats)
        except Exception:
            log.exception("periodic snapshot failed")
            return
        if info is not None:
            log.info("snapshot saved", extra={"blocks": info.blocks, "key": info.key})

    def save_now(self) -> None:
        """On the way out (the engine thread has stopped: safe to touch the engine); never raises."""
        started = time.monotonic()
        try:
            info = save_snapshot(self.engine, self.store, max_bytes=self.max_bytes, keep=self.keep, stats=self.stats)
        except Exception:
            log.exception("snapshot failed", extra={"url": self.store.url})
            return
        log.info("snapshot saved", extra={"url": self.store.url, "blocks": info.blocks if info else 0,
                                          "seconds": round(time.monotonic() - started, 2)})
