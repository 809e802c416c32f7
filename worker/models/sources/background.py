"""A model's download on a thread of its own, so a worker builds its engine while the weights arrive.

    fetch = BackgroundFetch(ref, cache_dir)  # listing and download start now
    model_dir = fetch.entry()                # the node cache's entry once its configs and tokenizer are in
    engine = Engine(model_dir)               # the loader waits for each weight file (wait_for_file)
    fetch.result()                           # the complete entry; the download's error if it failed

A GGUF reference, or a copy the node already has, is complete when `entry` returns.

`ferry worker` starts its model's download before it imports torch and the engine (`start_early`,
from its entry point: about 4 s of imports to hide the download behind); the loading then takes
that fetch over (`take`) when it asks for the same model into the same cache.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

from ferry.worker.models.sources import fetch_model
from ferry.worker.models.sources.progress import DownloadCancelled
from ferry.worker.models.sources.refs import BadReferenceError, ModelRef, parse_ref

_EARLY: dict[tuple[str, Path], BackgroundFetch] = {}  # (reference, cache) -> the fetch `start_early` began


class BackgroundFetch:
    """One `fetch_model` call on its own thread; its outcome read from the caller's."""

    def __init__(self, ref: ModelRef, cache_dir: Path, max_bytes: int | None = None) -> None:
        self.ref = ref
        self.started = time.monotonic()
        self.finished: float | None = None  # monotonic time the fetch ended, done or failed
        self._entry: Future[Path] = Future()  # resolved once the engine can start on the entry
        self._done: Future[Path] = Future()  # resolved once the entry is complete
        self._lock = threading.Lock()  # _entry is resolved from a downloading thread or this one's
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cache_dir, max_bytes), name="model-fetch",
                                        daemon=True)
        self._thread.start()

    def entry(self) -> Path:
        """The served path once an engine can start loading it: a checkpoint directory holding
        all but its weight files, which are still arriving. Raises the fetch's error."""
        return self._entry.result()

    def result(self) -> Path:
        """The served path once the whole entry is in the node cache. Raises the fetch's error."""
        return self._done.result()

    def failure(self) -> BaseException | None:
        """The fetch's error if it has failed by now, else None."""
        return self._done.exception() if self._done.done() else None

    def cancel(self, timeout_s: float = 10.0) -> BaseException | None:
        """Stop the download (nothing of it stays in the cache) and wait up to `timeout_s` for its
        thread. Returns the error the download had failed with on its own, else None."""
        self._cancelled.set()
        self._thread.join(timeout_s)
        error = self.failure()
        return None if isinstance(error, DownloadCancelled) else error

    def _run(self, cache_dir: Path, max_bytes: int | None) -> None:
        try:
            path = fetch_model(self.ref, cache_dir, max_bytes, on_entry=self._announce, cancelled=self._cancelled)
        except BaseException as exc:  # handed over to the caller's thread
            self.finished = time.monotonic()
            with self._lock:
                if not self._entry.done():
                    self._entry.set_exception(exc)
            self._done.set_exception(exc)
        else:
            self.finished = time.monotonic()
            self._announce(path)
            self._done.set_result(path)

    def _announce(self, path: Path) -> None:
        with self._lock:
            if not self._entry.done():
                self._entry.set_result(path)


def start_early(model: str | None, cache_dir: str, max_bytes: int | None) -> BackgroundFetch | None:
    """Start the download of `model` now if it is an hf:// or s3:// reference (None otherwise, or for
    one that does not parse: the settings report that). `take` hands it over."""
    try:
        ref = parse_ref(model) if model else None
    except BadReferenceError:
        return None
    if ref is None:
        return None
    directory = Path(cache_dir).expanduser()
    fetch = BackgroundFetch(ref, directory, max_bytes)
    _EARLY[(ref.text, directory.resolve())] = fetch
    return fetch


def take(ref: ModelRef, cache_dir: Path, max_bytes: int | None) -> BackgroundFetch:
    """The fetch `start_early` began for `ref` into `cache_dir`, else one started now. An early fetch
    of anything else (the settings named another model or cache) is cancelled."""
    early = _EARLY.pop((ref.text, Path(cache_dir).expanduser().resolve()), None)
    for other in list(_EARLY.values()):
        other.cancel(timeout_s=0)  # it stops at its next read and removes what it wrote
    _EARLY.clear()
    return early if early is not None else BackgroundFetch(ref, cache_dir, max_bytes)
