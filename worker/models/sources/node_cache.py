"""The node's model cache: each remote model downloaded once per node, whole or not at all.

Layout under the cache directory (`FERRY_MODEL_CACHE`, default `.ferry/models/`, shared with the
GGUF conversions, see gguf_cache.py):

    downloads/<key>/                 an entry: complete once it holds source.json (written last)
    downloads/<key>/.incoming        while downloading: the names of every file the entry will hold
    downloads/.tmp-<key>-<pid>-<id>/ the files still being written (never read)
    downloads/.locks/<key>.lock      flock'ed by the one process downloading <key>

One download per node: a process takes the key's lock (fcntl.flock) before it looks; the others
block on it and then find the entry complete. Atomic: each file is written in the temporary
directory, checked against the source (its size; the sha256 where the source gives one) and only
then renamed into the entry, and source.json is renamed in last, so a crash leaves no entry that
looks complete; the next holder of the lock removes the leftovers (the temporary directory, an
entry without source.json). Small files first: the configs and tokenizer arrive before the
weights, and `on_entry` is told then, so a worker builds its engine while the weights arrive and
`wait_for_file` holds its loader back until each weight file is there; a loader in the
downloading process reads each tensor as its bytes arrive instead (sources/arriving.py). Size cap: after a
download, least recently used entries (source.json's mtime, touched on every use) are removed
until the cache fits, never the entry just fetched; an entry is renamed away before it is deleted.
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
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.sources.arriving import ArrivingFile, register, unregister
from ferry.worker.models.sources.listing import Listing, RemoteFile
from ferry.worker.models.sources.progress import TransferProgress

log = logging.getLogger("ferry.worker.models")

DOWNLOADS = "downloads"
SOURCE_FILE = "source.json"  # in each entry: the reference, its version and files, when and how fast it came
INCOMING = ".incoming"  # in an entry being downloaded: JSON list of the names of all its files
WEIGHTS_SUFFIXES = (".safetensors", ".gguf")  # what arrives after the small files
_FREE_MARGIN = 64 << 20  # bytes left free on the disk beyond the download
_POLL_S = 0.05  # how often wait_for_file looks

# Writes the listing's files under the directory, in the listing's order, and calls `arrived`
# (from any thread) with each file once all its bytes are written; a download that writes files
# in place by ranges also calls `written(file, start, end)` for each piece (sources/arriving.py).
Arrived = Callable[[RemoteFile], None]
Written = Callable[[RemoteFile, int, int], None]
Download = Callable[..., None]  # (listing, directory, progress, arrived, written)


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

    def fetch(self, listing: Listing, download: Download, bar: bool = False,
              on_entry: Callable[[Path], None] | None = None, cancelled: threading.Event | None = None) -> Path:
        """The entry of `listing`, downloading it first unless the node already has it. A download
        calls `on_entry` with the entry's directory once every file but the weights is in it (not
        at all for a listing of weights alone); setting `cancelled` stops it (ModelSourceError)."""
        target = self.root / listing.key
        with self._locked(listing.key):
            if (target / SOURCE_FILE).is_file():
                os.utime(target / SOURCE_FILE)
                return target
            self._download(listing, download, target, bar, on_entry, cancelled)
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

    def _download(self, listing: Listing, download: Download, target: Path, bar: bool,
                  on_entry: Callable[[Path], None] | None, cancelled: threading.Event | None) -> None:
        ref = listing.ref.text
        # A crashed download's leftovers (we hold the lock): its temporary directory, its entry without source.json.
        for stale in [*self.root.glob(f".tmp-{listing.key}-*"), target]:
            shutil.rmtree(stale, ignore_errors=True)
        free = shutil.disk_usage(self.root).free
        if free < listing.total_bytes + _FREE_MARGIN:
            raise ModelSourceError(f"{ref}: not enough disk space in {self.root}: the model needs "
                                   f"{listing.total_bytes / 1e9:.2f} GB, {free / 1e9:.2f} GB free")
        building = self.root / f".tmp-{listing.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        progress = TransferProgress(ref, listing.total_bytes, bar, cancelled)
        ordered = sorted(listing.files, key=lambda f: f.name.endswith(WEIGHTS_SUFFIXES))  # small files first
        small = {f.name for f in ordered if not f.name.endswith(WEIGHTS_SUFFIXES)}
        streamed = {f.name: ArrivingFile(building / f.name, target / f.name, f.size)
                    for f in ordered if f.name.endswith(".safetensors")}
        lock = threading.Lock()

        def written(file: RemoteFile, start: int, end: int) -> None:
            if file.name in streamed:
                streamed[file.name].written(start, end)

        def arrived(file: RemoteFile) -> None:
            _verify(listing, file, building / file.name)
            os.replace(building / file.name, target / file.name)
            if file.name in streamed:
                streamed[file.name].complete()
            with lock:
                announce = file.name in small and len(small) == 1
                small.discard(file.name)
            if announce and on_entry is not None:
                on_entry(target)

        for file in streamed.values():
            register(file)
        try:
            building.mkdir()
            target.mkdir()
            (target / INCOMING).write_text(json.dumps([f.name for f in ordered]))
            download(replace(listing, files=tuple(ordered)), building, progress, arrived, written)
            rate = progress.close()
            for file in listing.files:
                if not (target / file.name).is_file():  # not reported by the download: checked here
                    arrived(file)
            source = {"ref": ref, "source": listing.ref.source, "scheme": listing.ref.scheme,
                      "revision": listing.ref.revision, "version": listing.version,
                      "files": [{"name": f.name, "size": f.size} for f in listing.files],
                      "downloaded_at": time.time(), "seconds": round(time.monotonic() - progress.started, 3),
                      "bytes_per_s": round(rate)}
            (building / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
            (target / INCOMING).unlink()
            os.replace(building / SOURCE_FILE, target / SOURCE_FILE)  # the entry is complete from here on
            shutil.rmtree(building, ignore_errors=True)
        except OSError as exc:
            cause = "the disk is full" if exc.errno == errno.ENOSPC else f"cannot write the model cache: {exc}"
            error = ModelSourceError(f"{ref}: {cause}")
            _fail(streamed.values(), error)  # before the files go: a reader gets the cause, not a missing file
            _remove(building, target)
            raise error from None
        except BaseException as exc:
            _fail(streamed.values(), exc)
            _remove(building, target)
            raise
        finally:
            for file in streamed.values():
                unregister(file)


def wait_for_file(path: Path) -> None:
    """Return once `path` exists, at once for any file but one of a node cache entry not yet
    complete (no source.json): that one is waited for while the entry's download holds its lock.
    ModelSourceError when the download ends without it (failed, cancelled, its process gone)."""
    entry = path.parent
    lock = entry.parent / ".locks" / f"{entry.name}.lock"
    if entry.parent.name != DOWNLOADS or not lock.is_file():
        return  # not in a node cache: the caller's open says what is missing
    while not path.exists() and not (entry / SOURCE_FILE).exists():
        if not _locked_by_another(lock) and not path.exists():
            raise ModelSourceError(f"the download of {entry.name} ended before {path.name} arrived")
        time.sleep(_POLL_S)


def incoming_files(directory: Path) -> list[str]:
    """The names of every file a download in progress into `directory` brings; [] for anything else."""
    try:
        return json.loads((directory / INCOMING).read_text())
    except (OSError, ValueError):
        return []


def _locked_by_another(lock: Path) -> bool:
    """Whether a download holds `lock` (flock: another process, or another open file in this one)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's own lock
    return False


def _fail(files, error: BaseException) -> None:
    """Wake the loaders reading `files` with the download's own error."""
    for file in files:
        file.fail(error)


def _remove(*directories: Path) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _verify(listing: Listing, file: RemoteFile, path: Path) -> None:
    """`file` downloaded whole at `path`: the source's size, and its sha256 where the source gave one."""
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
