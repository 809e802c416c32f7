"""Weight files still downloading, read by byte range as their ranges arrive.

The S3 download writes each weight file in place, range by range, in parallel (s3.py). While it
does, the node cache registers the file here under the path it will have in the entry, and the
download reports every range it has written. A loader in the same process then reads a tensor
as soon as its bytes are in (safetensors_stream.py), instead of waiting for the whole file: the
load runs beside the download, and a multi-GB shard is in the weights moments after its last
byte. Another process (a second worker on the node, a tensor-parallel rank) waits for the whole
file instead (node_cache.wait_for_file).

    arriving = ArrivingFile(building / name, entry / name, size)   # the node cache, per weight file
    arriving.written(start, end)                                   # the download, per range
    arriving.complete() / arriving.fail(error)                     # the node cache, at the end
    arriving.read(start, end)                                      # a loader: waits for the bytes
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from pathlib import Path

from ferry.worker.models.errors import ModelSourceError

_ARRIVING: dict[Path, ArrivingFile] = {}  # the file's path in its entry (resolved) -> the file while it downloads
_REGISTRY_LOCK = threading.Lock()


class ArrivingFile:
    """One file being written in place by ranges, readable by range as soon as the range is in."""

    def __init__(self, building: Path, final: Path, size: int) -> None:
        self.building = building  # where the download writes it
        self.final = final  # where it is renamed once whole (same inode: an open descriptor stays valid)
        self.size = size
        self._starts: list[int] = []  # written ranges, merged and sorted: [starts[i], ends[i])
        self._ends: list[int] = []
        self._error: BaseException | None = None
        self._whole = size == 0
        self._fd: int | None = None
        self._changed = threading.Condition()

    def written(self, start: int, end: int) -> None:
        """Bytes [start, end) are in the file (called by the download after writing them)."""
        with self._changed:
            self._merge(start, end)
            self._changed.notify_all()

    def complete(self) -> None:
        """The file is whole (and may have been renamed to `final`)."""
        with self._changed:
            self._whole = True
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """The download failed (this file, or another of the model: the entry is removed either way):
        every reader waiting, and every later one, gets `error`."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def read(self, start: int, end: int) -> bytearray:
        """Bytes [start, end) of the file, once they are in. Raises the download's error if it fails first."""
        if not 0 <= start <= end <= self.size:
            raise ModelSourceError(f"{self.final.name}: bytes {start}-{end} lie outside its {self.size} bytes")
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or self._covered(start, end))
            if self._error is not None:
                raise self._error
            fd = self._open()
        out = bytearray(end - start)
        view, offset = memoryview(out), start
        while offset < end:  # pread may return less than asked
            got = os.preadv(fd, [view[offset - start:]], offset)
            if got <= 0:
                raise ModelSourceError(f"{self.final.name}: bytes from {offset} are missing on disk")
            offset += got
        return out

    def _covered(self, start: int, end: int) -> bool:
        if self._whole or start == end:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def _merge(self, start: int, end: int) -> None:
        """Add [start, end) to the written ranges, joining any it touches (called under the lock)."""
        i = bisect.bisect_left(self._ends, start)  # the first range ending at or after `start`
        j = bisect.bisect_right(self._starts, end)  # past the last range starting at or before `end`
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [start], [end]

    def _open(self) -> int:
        """The file's descriptor, opened once (called under the lock): at `building` while it is
        being written, at `final` once it has been renamed there."""
        if self._fd is None:
            try:
                self._fd = os.open(self.building, os.O_RDONLY)
            except FileNotFoundError:
                self._fd = os.open(self.final, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
        return self._fd


def register(file: ArrivingFile) -> None:
    with _REGISTRY_LOCK:
        _ARRIVING[file.final.resolve()] = file


def unregister(file: ArrivingFile) -> None:
    with _REGISTRY_LOCK:
        if _ARRIVING.get(file.final.resolve()) is file:
            del _ARRIVING[file.final.resolve()]


def arriving_file(path: Path) -> ArrivingFile | None:
    """The file a download in this process is writing to `path` now, else None."""
    with _REGISTRY_LOCK:
        return _ARRIVING.get(Path(path).resolve())
