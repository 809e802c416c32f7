"""`ferry snapshot save|load|inspect URL`: prefix-cache snapshots from the command line.

- save URL --model DIR [--prompt TEXT | --prompt-file FILE | --system TEXT] [--from URL]:
  warm an engine's prefix cache (prompts computed once, or another snapshot restored) and
  write a snapshot to URL; e.g. pre-warm a shared system prompt before workers scale up.
- load URL --model DIR: restore the snapshot into a fresh engine and report what it brought
  (the check a worker does at start, with a clear error instead of a cold start).
- inspect URL [--json]: fingerprint, blocks, tokens, bytes and age of the latest snapshot, and
  the snapshots kept; reads only the pointer and manifests.

URLs: file:///dir, a local path, or s3://bucket/prefix (endpoint from FERRY_S3_ENDPOINT_URL or
the standard AWS environment).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ferry snapshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def engine_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", required=True, help="model directory or cached hub id")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV pool size (default: the engine's)")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--device", default=None)

    save = commands.add_parser("save", help="warm a prefix cache and write a snapshot")
    save.add_argument("url")
    engine_options(save)
    save.add_argument("--prompt", action="append", default=[], help="a prompt to cache (repeatable)")
    save.add_argument("--prompt-file", action="append", default=[], type=Path, help="a file whose text is one prompt")
    save.add_argument("--system", action="append", default=[],
                      help="a system prompt, rendered with the model's chat template (repeatable)")
    save.add_argument("--from", dest="source", help="restore this snapshot first (copy or merge between stores)")
    save.add_argument("--max-bytes", type=int, default=1 << 30, help="KV bytes the snapshot keeps at most")
    save.add_argument("--keep", type=int, default=3, help="snapshots kept in the store")

    load = commands.add_parser("load", help="restore a snapshot into a fresh engine and report it")
    load.add_argument("url")
    engine_options(load)

    inspect = commands.add_parser("inspect", help="describe the latest snapshot at URL")
    inspect.add_argument("url")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from ferry.worker.snapshots import SnapshotError

    try:
        return {"save": _save, "load": _load, "inspect": _inspect}[args.command](args)
    except SnapshotError as exc:
        print(f"ferry snapshot {args.command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad URL, bad engine option, unknown model
        print(f"ferry snapshot {args.command}: {exc}", file=sys.stderr)
        return 2


def _engine(args: argparse.Namespace):
    from ferry.worker.engine import Engine

    return Engine(
        args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=args.max_model_len, device=args.device,
    )


def _save(args: argparse.Namespace) -> int:
    from ferry.worker.engine import SamplingParams
    from ferry.worker.snapshots import load_snapshot, save_snapshot

    engine = _engine(args)
    if args.source:
        restored = load_snapshot(engine, args.source, progress=True)
        print(f"restored {restored.blocks} blocks from {restored.url}/{restored.key}")
    prompts = [engine.encode(p) for p in args.prompt + [f.read_text() for f in args.prompt_file]]
    prompts += [engine.apply_chat_template([{"role": "system", "content": s}], add_generation_prompt=False)
                for s in args.system]
    if not prompts and not args.source:
        print(
            "ferry snapshot save: nothing to cache: give --prompt, --prompt-file, --system or --from", file=sys.stderr
        )
        return 2
    # One generated token per prompt: computing the prompt is what fills the cache.
    for i, tokens in enumerate(prompts):
        engine.add_request(f"warm-{i}", tokens, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    info = save_snapshot(engine, args.url, max_bytes=args.max_bytes, keep=args.keep, progress=True)
    if info is None:
        print("ferry snapshot save: no full block cached (prompts shorter than one block?): nothing written",
              file=sys.stderr)
        return 1
    print(f"saved {info.url}/{info.key}: {info.blocks} blocks, {info.tokens} tokens, "
          f"{_size(info.bytes)} in {info.seconds:.2f} s")
    return 0


def _load(args: argparse.Namespace) -> int:
    from ferry.worker.snapshots import load_snapshot

    engine = _engine(args)
    result = load_snapshot(engine, args.url, progress=True)
    print(f"restored {result.url}/{result.key}: {result.blocks} blocks, {result.tokens} tokens, "
          f"{_size(result.bytes)} in {result.seconds:.2f} s ({result.skipped} skipped, {_age(result.age_s)} old)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ferry.worker.common.objectstore import StoreError, open_store
    from ferry.worker.snapshots import list_snapshots, read_manifest

    store = open_store(args.url)
    key, manifest = read_manifest(store)
    try:
        kept = list(list_snapshots(store))
    except StoreError:
        kept = [key]  # listing may be denied where reading is allowed
    summary = {
        "url": store.url,
        "snapshot": key,
        "fingerprint": manifest.fingerprint,
        "format_version": manifest.format_version,
        "model": manifest.model,
        "created_at": manifest.created_at,
        "age_s": round(max(time.time() - manifest.created_at, 0.0), 1),
        "blocks": len(manifest.blocks),
        "tokens": len(manifest.blocks) * manifest.model.get("block_size", 0),
        "bytes": manifest.num_bytes,
        "shards": len(manifest.shards),
        "chains": sum(1 for b in manifest.blocks if b.parent_key == "0" * 64),
        "kept": kept,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(manifest.created_at))
    model = manifest.model
    print(f"snapshot     {store.url}/{key}")
    print(f"created      {created} ({_age(summary['age_s'])} ago)")
    print(f"fingerprint  {manifest.fingerprint}")
    print(f"model        {model.get('name')} ({model.get('architecture')}), {model.get('dtype')}, "
          f"block size {model.get('block_size')}")
    chains = summary["chains"]
    print(f"blocks       {summary['blocks']} in {chains} chain{'s' * (chains != 1)}, {summary['tokens']} tokens")
    print(f"bytes        {_size(summary['bytes'])} in {summary['shards']} shards")
    print(f"kept         {len(kept)}: {', '.join(k.rsplit('/', 1)[-1] for k in kept)}")
    return 0


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
