"""`ferry models`: the node's model cache by hand (worker/models/sources/).

    ferry models pull hf://org/name[@rev] | s3://bucket/prefix/   download (a progress bar), print the path
    ferry models ls                                                reference, version, size, last use of each
    ferry models rm <reference>                                    remove its copies (every version, or the one named)

The cache is FERRY_MODEL_CACHE (or --cache), as the worker uses it. Exit codes: 0 done, 1 nothing
cached to remove, 2 a bad reference or a failed download (one line naming the reference and the cause).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.sources import NodeCache, cached_entries, fetch_model, parse_ref
from ferry.worker.models.sources.refs import BadReferenceError

DEFAULT_CACHE = ".ferry/models"  # the engine's model_cache_dir default (worker/engine/config.py)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ferry models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=os.environ.get("FERRY_MODEL_CACHE") or os.environ.get("FERRY_MODEL_CACHE_DIR")
                   or DEFAULT_CACHE, help="the model cache directory (FERRY_MODEL_CACHE; default .ferry/models)")
    sub = p.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="download a model into the cache")
    pull.add_argument("ref", help="hf://org/name[@revision], hf://org/name/file.gguf, s3://bucket/prefix/ or s3://b/x.gguf")
    pull.add_argument("--max-gb", type=float, default=_env_float("FERRY_MODEL_CACHE_MAX_GB"),
                      help="cap the cache at this many GB, removing least recently used models "
                      "(FERRY_MODEL_CACHE_MAX_GB)")
    sub.add_parser("ls", help="list the cached models")
    rm = sub.add_parser("rm", help="remove a model's cached copies")
    rm.add_argument("ref")
    return p.parse_args(argv)


def _env_float(name: str) -> float | None:
    value = os.environ.get(name, "")
    return float(value) if value else None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cache_dir = Path(args.cache).expanduser()
    try:
        if args.command == "pull":
            max_bytes = None if args.max_gb is None else int(args.max_gb * 1e9)
            print(fetch_model(_ref(args.ref), cache_dir, max_bytes, bar=True))
            return 0
        if args.command == "ls":
            _list(NodeCache(cache_dir))
            return 0
        cache = NodeCache(cache_dir)
        doomed = cached_entries(cache, _ref(args.ref))
        for entry in doomed:
            cache.remove(entry)
            print(f"removed {entry.source['ref']} ({entry.source['version'][:12]}, {entry.size / 1e9:.2f} GB)")
        if not doomed:
            print(f"ferry models: nothing cached for {args.ref}", file=sys.stderr)
        return 0 if doomed else 1
    except (ModelSourceError, BadReferenceError) as exc:
        print(f"ferry models: {exc}", file=sys.stderr)
        return 2


def _ref(text: str):
    ref = parse_ref(text, bare_hub_ids=True)
    if ref is None:
        raise BadReferenceError(f"{text!r} is not a model reference: use hf://org/name[@revision] or s3://bucket/prefix/")
    return ref


def _list(cache: NodeCache) -> None:
    entries = cache.entries()
    if not entries:
        print(f"no models cached in {cache.root}")
        return
    print(f"{'REFERENCE':<48} {'VERSION':<12} {'SIZE':>9}  LAST USED")
    for e in entries:
        used = datetime.datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M")
        print(f"{e.source['ref']:<48} {e.source['version'][:12]:<12} {e.size / 1e9:>7.2f}GB  {used}")
    print(f"{len(entries)} models, {sum(e.size for e in entries) / 1e9:.2f} GB in {cache.root}")
