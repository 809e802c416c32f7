"""Convert each GGUF file once: `<cache dir>/<key prefix>/` is the HF checkpoint made from it.

The key is a sha256 over `CONVERTER_VERSION` and the file's every byte, so an edited file or a
changed converter never meets a stale conversion. Hashing the whole file rather than samples
costs about a second per GB, small next to loading the model, and cannot miss a change.

A conversion is built in a temporary directory beside its target and renamed into place, so a
directory under a key's name is always complete. Two processes converting one file at once both
finish: the rename of the slower one fails because the target exists, and it uses the winner's.
Anything that fails removes its temporary directory: the cache never holds half a conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from ferry.worker.models.gguf import read_gguf, write_checkpoint

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump whenever the conversion's output changes: every cached directory is rebuilt
_KEY_CHARS = 16  # hex digits of the key naming a cached directory


def gguf_cache_key(path: Path) -> str:
    """sha256 (hex) over the converter version and the whole file."""
    digest = hashlib.sha256(f"ferry-gguf-converter:{CONVERTER_VERSION}\n".encode())
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def converted_checkpoint(path: Path, cache_dir: Path) -> Path:
    """The HF checkpoint directory converted from the GGUF at `path`, converting it first unless
    `cache_dir` already holds it. Raises what `read_gguf` raises for a bad or unsupported file."""
    key = gguf_cache_key(path)
    target = cache_dir / key[:_KEY_CHARS]
    if target.is_dir():
        log.info("GGUF %s: using its conversion in %s", path, target)
        return target
    checkpoint = read_gguf(path)  # a bad file fails here, before anything is written
    start = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    building = cache_dir / f".{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    building.mkdir()
    try:
        write_checkpoint(checkpoint, building)
        source = {"gguf": str(path), "size": path.stat().st_size, "sha256": key, "converter_version": CONVERTER_VERSION}
        (building / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    try:
        building.rename(target)
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
        if not target.is_dir():
            raise
        log.info("GGUF %s: another process converted it first; using %s", path, target)
        return target
    log.info("GGUF %s: converted in %.1f s into %s", path, time.perf_counter() - start, target)
    return target
