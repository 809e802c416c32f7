"""The key configuration, kept current while the process runs.

FERRY_API_KEYS_FILE is re-read when it changes (its inode, size or modification time), checked
at most once every `check_interval_s`: a Kubernetes Secret mounted as a file is replaced in
place, and a key revoked or a webhook secret rotated there takes effect in the API and the
webhook worker within seconds, without a restart (a rotation lists both secrets for the overlap:
every listed secret signs, so no delivery in flight fails verification).

A change that does not parse, or a file that cannot be read, keeps the configuration in force and
is logged: a half-written file never takes the keys away. A change that would leave no key at
all while keys were configured is refused the same way: an emptied file must not turn the API
into open mode. FERRY_API_KEYS (an environment variable) cannot change under a running process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ferry.worker.common.tenants import KeyConfig

log = logging.getLogger("ferry.keys")

CHECK_INTERVAL_S = 1.0


class KeySource:
    """`current()` is the configuration parsed from `spec` and `file`, re-read when the file changes."""

    def __init__(self, spec: str | None = None, file: str | None = None, *,
                 check_interval_s: float = CHECK_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.file = file
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._config = KeyConfig.parse(spec, file)  # a bad configuration at start-up is an error, not a log line
        self._checked_at = clock()

    def current(self) -> KeyConfig:
        if self.file is None or self._clock() - self._checked_at < self.check_interval_s:
            return self._config
        with self._lock:
            if self._clock() - self._checked_at >= self.check_interval_s:
                self._checked_at = self._clock()
                self._reload_if_changed()
        return self._config

    def _reload_if_changed(self) -> None:
        try:
            stamp = self._file_stamp()
        except OSError as exc:
            log.error("API key file unreadable: keeping the configuration in force", extra={"error": str(exc)})
            return
        if stamp == self._stamp:
            return
        try:
            config = KeyConfig.parse(self.spec, self.file)
        except (OSError, ValueError) as exc:  # ValueError names the bad entry, never a secret
            log.error("API key file changed but does not parse: keeping the configuration in force",
                      extra={"error": str(exc)})
            return
        finally:
            self._stamp = stamp  # a bad version is reported once, not on every check
        if self._config.keys and not config.keys:
            log.error("API key file changed to no keys at all: refused (it would open the API to anyone)")
            return
        self._config = config
        log.info("API key file reloaded", extra={"keys": len(config.keys), "tenants": len(config.tenants)})

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self.file is None:
            return None
        st = os.stat(self.file)
        return st.st_ino, st.st_size, st.st_mtime_ns
