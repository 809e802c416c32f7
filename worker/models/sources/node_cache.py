"""The node's model cache: each remote model downloaded once per node, whole or not at all.

Layout under the cache directory (`FERRY_MODEL_CACHE`, default `.ferry/models/`, shared with the
GGUF conversions, see gguf_cache.py):

    downloads/<key>/                 a complete copy: the serving files + source.json
    downloads/.tmp-<key>-<pid>-<id>/ a download in progress (never read)
    downloads/.locks/<key>.lock      flock'ed by the one process downloading <key>

One download per node: a process takes the key's lock (fcntl.flock) before it looks; the others
block on it and then find the entry complete. Atomic: files land in a temporary directory, are
checked against the source (every size; the sha256 where the source gives one), and only then
is the directory renamed to its key, so a crash leaves no directory that looks complete; the
next holder of the lock removes the leftovers. Size cap: after a download, least recently used
entries (source.json's mtime, touched on every use) are removed until the cache fits, never the
entry just fetched; an entry is renamed away before it is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.sources.listing import Listing
from ferry.worker.models.sources.progress import TransferProgress

log = logging.getLogger("ferry.worker.models")

DOWNLOADS = "downloads"
SOURCE_FILE = "source.json"  # in each entry: the reference, its version and files, when and how fast it came
_FREE_MARGIN = 64 << 20  # bytes left free on the disk beyond the download

Download = Callable[[Listing, Path, TransferProgress], None]  # writes the listing's files under the directory


@dataclass(frozen=True, slots=True)
class CacheEntry:
    path: Path  # downloads/<key>
    source: dict  # source.json

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.source["files"])

    @property
    def last_used(self) -> float:
        return (self.path / SOURCE_FILE).stat().st_mtime


class NodeCache:
    def __init__(self, cache_dir: Path, max_bytes: int | None = None) -> None:
        self.root = Path(cache_dir).expanduser() / DOWNLOADS
        self.max_bytes = max_bytes  # None: no cap

    def fetch(self, listing: Listing, download: Download, bar: bool = False) -> Path:
        """The entry of `listing`, downloading it first unless the node already has it."""
        target = self.root / listing.key
        with self._locked(listing.key):
            if (target / SOURCE_FILE).is_file():
                os.utime(target / SOURCE_FILE)
                return target
            self._download(listing, download, target, bar)
        self.evict(keep=target)
        return target

    def entries(self) -> list[CacheEntry]:
        """Every complete entry, most recently used first."""
        found = []
        for path in self.root.glob("*/" + SOURCE_FILE) if self.root.is_dir() else ():
            if not path.parent.name.startswith("."):
                with contextlib.suppress(OSError, ValueError):
                    found.append(CacheEntry(path.parent, json.loads(path.read_text())))
        return sorted(found, key=lambda e: -e.last_used)

    def touch(self, entry: CacheEntry) -> None:
        """Mark `entry` used now (LRU)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(entry.path / SOURCE_FILE)

    def remove(self, entry: CacheEntry) -> None:
        """Delete one entry: renamed out of place first, so it never looks half there."""
        doomed = self.root / f".tmp-removed-{entry.path.name}-{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(FileNotFoundError):
            entry.path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def evict(self, keep: Path | None = None) -> list[CacheEntry]:
        """Remove least recently used entries (never `keep`) until the cache is within its cap."""
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total, removed = sum(e.size for e in entries), []
        for entry in reversed(entries):
            if total <= self.max_bytes:
                break
            if entry.path != keep:
                self.remove(entry)
                total -= entry.size
                removed.append(entry)
                log.info("model cache over %.1f GB: removed %s", self.max_bytes / 1e9, entry.source["ref"])
        return removed

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        locks = self.root / ".locks"
        try:
            locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ModelSourceError(f"the model cache {self.root} is not writable: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _download(self, listing: Listing, download: Download, target: Path, bar: bool) -> None:
        ref = listing.ref.text
        for stale in self.root.glob(f".tmp-{listing.key}-*"):  # a crashed download's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        free = shutil.disk_usage(self.root).free
        if free < listing.total_bytes + _FREE_MARGIN:
            raise ModelSourceError(f"{ref}: not enough disk space in {self.root}: the model needs "
                                   f"{listing.total_bytes / 1e9:.2f} GB, {free / 1e9:.2f} GB free")
        building = self.root / f".tmp-{listing.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        progress = TransferProgress(ref, listing.total_bytes, bar)
        try:
            building.mkdir()
            download(listing, building, progress)
            rate = progress.close()
            _verify(listing, building)
            source = {"ref": ref, "source": listing.ref.source, "scheme": listing.ref.scheme,
                      "revision": listing.ref.revision, "version": listing.version,
                      "files": [{"name": f.name, "size": f.size} for f in listing.files],
                      "downloaded_at": time.time(), "seconds": round(time.monotonic() - progress.started, 3),
                      "bytes_per_s": round(rate)}
            (building / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
            building.rename(target)
        except OSError as exc:
            shutil.rmtree(building, ignore_errors=True)
            cause = "the disk is full" if exc.errno == errno.ENOSPC else f"cannot write the model cache: {exc}"
            raise ModelSourceError(f"{ref}: {cause}") from None
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise


def _verify(listing: Listing, directory: Path) -> None:
    """Every file present with the source's size, and its sha256 where the source gave one."""
    for file in listing.files:
        path = directory / file.name
        size = path.stat().st_size if path.is_file() else None
        if size != file.size:
            got = "missing" if size is None else f"{size} bytes"
            raise ModelSourceError(f"{listing.ref.text}: {file.name} is truncated or changed: the source has "
                                   f"{file.size} bytes, the download {got}")
        if file.sha256 is not None and _sha256(path) != file.sha256:
            raise ModelSourceError(f"{listing.ref.text}: {file.name} does not match the source's sha256")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
