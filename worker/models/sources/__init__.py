"""Weights from where users keep them: `hf://` (the Hugging Face Hub) and `s3://` references,
downloaded once per node into the model cache (node_cache.py) and served from there.

    fetch_model(parse_ref("s3://bucket/llama/"), Path(".ferry/models"))  -> the cached directory
    fetch_model(parse_ref("hf://org/name/x.Q4_K_M.gguf"), ...)          -> the cached .gguf file
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from ferry.worker.models.errors import SourceUnreachableError
from ferry.worker.models.sources import hub, s3
from ferry.worker.models.sources.node_cache import CacheEntry, NodeCache, incoming_files, wait_for_file
from ferry.worker.models.sources.refs import BadReferenceError, ModelRef, parse_ref

log = logging.getLogger("ferry.worker.models")

DEFAULT_CACHE_DIR = ".ferry/models"  # the node's model cache unless FERRY_MODEL_CACHE says otherwise
SOURCES = {"hf": hub, "s3": s3}  # scheme -> module with list_files(ref) and download (node_cache.Download)


def fetch_model(ref: ModelRef, cache_dir: Path, max_bytes: int | None = None, bar: bool = False,
                on_entry: Callable[[Path], None] | None = None, cancelled: threading.Event | None = None) -> Path:
    """The local copy of `ref`: its checkpoint directory, or the .gguf file for a GGUF reference.
    Downloads it unless the node's cache has it (`max_bytes`: the cache's cap, LRU eviction).
    ModelSourceError names the reference and the cause. When the source is unreachable, a copy of
    the same reference (and revision) already cached is served, with a warning. A checkpoint's
    download calls `on_entry` with its directory once all but its weight files are there (the
    weights follow: node_cache.wait_for_file); setting `cancelled` stops the download."""
    source = SOURCES[ref.scheme]
    cache = NodeCache(cache_dir, max_bytes)
    if ref.revision is not None and re.fullmatch(r"[0-9a-f]{40}", ref.revision):
        pinned = cached_entries(cache, ref)  # a commit never changes: no need to ask the Hub
        if pinned:
            cache.touch(pinned[0])
            return _served_path(ref, pinned[0].path)
    try:
        listing = source.list_files(ref)
    except SourceUnreachableError as exc:
        cached = cached_entries(cache, ref)
        if not cached:
            raise
        log.warning("%s; serving the copy the node has (%s)", exc, cached[0].path.name,
                    extra={"model": ref.text, "revision": cached[0].source["version"]})
        cache.touch(cached[0])
        return _served_path(ref, cached[0].path)
    entry = cache.fetch(listing, source.download, bar, None if ref.gguf else on_entry, cancelled)
    return _served_path(ref, entry)


def cache_dir_from_env(env: Mapping[str, str]) -> str | None:
    """The node cache an environment names: FERRY_MODEL_CACHE_DIR (the engine field's name), else
    FERRY_MODEL_CACHE (the documented one); an empty variable is an unset one. None: neither. The
    worker's settings and its early download (worker/serve/early_start.py) both read it here."""
    return env.get("FERRY_MODEL_CACHE_DIR") or env.get("FERRY_MODEL_CACHE") or None


def cached_entries(cache: NodeCache, ref: ModelRef) -> list[CacheEntry]:
    """The cache's copies of `ref` (any version of it; of its revision when it names one), newest use first."""
    return [e for e in cache.entries() if e.source["source"] == ref.source
            and (ref.revision is None or ref.revision in (e.source["revision"], e.source["version"]))]


def _served_path(ref: ModelRef, entry: Path) -> Path:
    return entry / ref.path.rsplit("/", 1)[-1] if ref.gguf else entry


__all__ = ["DEFAULT_CACHE_DIR", "BadReferenceError", "CacheEntry", "ModelRef", "NodeCache", "cache_dir_from_env",
           "cached_entries", "fetch_model", "incoming_files", "parse_ref", "wait_for_file"]
