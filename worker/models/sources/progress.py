"""Download progress: a tqdm bar for a terminal (`ferry models pull`), and for a worker's log a
line every few seconds with bytes done, bytes/s and the ETA."""

from __future__ import annotations

import logging
import threading
import time

from tqdm import tqdm

from ferry.worker.models.errors import ModelSourceError

log = logging.getLogger("ferry.worker.models")

_LOG_EVERY_S = 5.0


class DownloadCancelled(ModelSourceError):
    """The download was stopped by its caller (TransferProgress.cancelled), not by the source."""


class TransferProgress:
    """Thread-safe byte counter over one download (`advance` from any downloading thread)."""

    def __init__(self, what: str, total_bytes: int, bar: bool = False,
                 cancelled: threading.Event | None = None) -> None:
        self.what = what
        self.cancelled = cancelled  # once set, the next `advance` raises: the download stops
        self.total = total_bytes
        self.done = 0
        self.started = time.monotonic()
        self._logged_at = self.started
        self._lock = threading.Lock()
        self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                         disable=not bar, leave=False)

    def advance(self, n: int) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise DownloadCancelled(f"{self.what}: the download was cancelled")
        with self._lock:
            self.done += n
            self._bar.update(n)
            now = time.monotonic()
            if now - self._logged_at >= _LOG_EVERY_S:
                self._logged_at = now
                self._log("downloading")

    def close(self) -> float:
        """End the bar and log the total; returns the average bytes/s."""
        self._bar.close()
        self._log("downloaded")
        return self.rate

    @property
    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.started, 1e-6)

    def _log(self, verb: str) -> None:
        rate = self.rate
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        log.info("%s %s: %.1f / %.1f MB, %.1f MB/s, ETA %.0f s", verb, self.what, self.done / 1e6, self.total / 1e6,
                 rate / 1e6, eta, extra={"model": self.what, "bytes": self.done, "total_bytes": self.total,
                                         "bytes_per_s": round(rate), "eta_s": round(eta, 1)})
