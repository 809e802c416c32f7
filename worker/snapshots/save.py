"""Save an engine's hottest cached prefixes to a store, and keep the store tidy."""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import secrets
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from ferry.worker.common.objectstore import ObjectStore, StoreError, open_store
from ferry.worker.engine import Engine
from ferry.worker.engine.kv_cache import CachedBlock
from ferry.worker.snapshots.fingerprint import fingerprint
from ferry.worker.snapshots.format import (
    FORMAT_VERSION,
    POINTER,
    SNAPSHOTS,
    STAMP,
    BlockRecord,
    Manifest,
    ShardRecord,
    SnapshotError,
    SnapshotInfo,
)
from ferry.worker.snapshots.policy import keys_digest, select_blocks
from ferry.worker.snapshots.stats import SnapshotStats

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 256 << 20
_ABANDONED_AFTER_S = 3600  # an incomplete snapshot dir this old is a crashed save, not one in flight


def save_snapshot(
    engine: Engine,
    url: str | ObjectStore,
    *,
    max_bytes: int = 1 << 30,
    keep: int = 3,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    only_if_changed: bool = False,
    progress: bool = False,
    stats: SnapshotStats | None = None,
) -> SnapshotInfo | None:
    """Write the engine's hottest cached prefixes (at most `max_bytes` of KV) and keep the last `keep`.

    Returns None when there is nothing to write: an empty cache (an idle worker must not
    replace a useful snapshot with an empty one), or with `only_if_changed` the same cached
    set as the last save or restore counted in `stats`. Raises SnapshotError when the store
    fails; the previous snapshot is then untouched. Call it between engine steps."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    stats = stats if stats is not None else SnapshotStats()
    store = open_store(url) if isinstance(url, str) else url
    started = time.monotonic()
    layout = engine.prefix_blocks.layout
    chosen = select_blocks(engine.prefix_blocks.cached(), max_bytes // layout.bytes_per_block)
    digest = keys_digest(meta.key for meta in chosen)
    if not chosen or (only_if_changed and digest == stats.last_keys_digest):
        return None
    # Names sort by creation time (microseconds: several saves a second still order correctly).
    key = f"{SNAPSHOTS}/{datetime.now(UTC).strftime(STAMP)}-{secrets.token_hex(4)}"
    try:
        manifest = _write_snapshot(engine, store, key, chosen, shard_bytes, progress)
    except (StoreError, OSError) as exc:
        stats.saves["failed"] += 1
        _delete_quietly(store, key)
        raise SnapshotError(
            "unreachable", f"saving a snapshot to {store.url} failed ({exc}); the previous one is intact"
        ) from exc
    _prune(store, keep, current=key)
    info = SnapshotInfo(
        url=store.url,
        key=key,
        blocks=len(chosen),
        tokens=len(chosen) * engine.block_size,
        bytes=manifest.num_bytes,
        seconds=time.monotonic() - started,
    )
    stats.saves["ok"] += 1
    stats.saved_blocks += info.blocks
    stats.saved_bytes += info.bytes
    stats.last_save_seconds = info.seconds
    stats.last_save_time = time.time()
    stats.last_keys_digest = digest
    log.info("saved prefix-cache snapshot %s/%s: %d blocks, %d tokens, %.1f MiB in %.2f s",
             info.url, key, info.blocks, info.tokens, info.bytes / 2**20, info.seconds)
    return info


def _write_snapshot(engine: Engine, store: ObjectStore, key: str, chosen: list[CachedBlock], shard_bytes: int,
                    progress: bool) -> Manifest:
    """Shards, then the manifest, then the pointer."""
    layout = engine.prefix_blocks.layout
    per_shard = max(1, shard_bytes // layout.bytes_per_block)
    blocks: list[BlockRecord] = []
    shards: list[ShardRecord] = []
    total = len(chosen) * layout.bytes_per_block
    with (
        tempfile.TemporaryDirectory(prefix="ferry-snapshot-") as tmp,
        tqdm(total=total, desc="uploading snapshot", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for shard_index, start in enumerate(range(0, len(chosen), per_shard)):
            group = chosen[start : start + per_shard]
            name = f"shard-{shard_index:05d}.safetensors"
            path = Path(tmp) / name
            kv = engine.prefix_blocks.read([meta.key for meta in group])  # [layers, 2, n, kv heads, slot, head dim]
            save_file({"kv": kv.contiguous()}, str(path))
            shards.append(ShardRecord(name, path.stat().st_size, sha256_file(path), len(group)))
            bar.total += shards[-1].size - len(group) * layout.bytes_per_block  # + the safetensors header
            bar.refresh()
            blocks.extend(
                BlockRecord(m.key.hex(), m.parent_key.hex(), list(m.token_ids), m.hits, m.last_used, shard_index, i)
                for i, m in enumerate(group)
            )
            store.upload(f"{key}/{name}", path, bar.update)
            path.unlink()
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        fingerprint=fingerprint(engine),
        created_at=time.time(),
        model={
            "name": engine.model_dir.name,
            "architecture": engine.arch.architecture,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "block_size": engine.block_size,
        },
        kv_block_shape=list(layout.block_shape),
        blocks=blocks,
        shards=shards,
    )
    data = manifest.to_json()
    store.write_bytes(f"{key}/manifest.json", data)
    pointer = {"snapshot": key, "manifest_sha256": hashlib.sha256(data).hexdigest(), "created_at": manifest.created_at}
    store.write_bytes(POINTER, json.dumps(pointer).encode())
    return manifest


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def list_snapshots(store: ObjectStore) -> dict[str, list[str]]:
    """Snapshot dir -> its object names, oldest dir first (dir names start with the UTC time)."""
    dirs: dict[str, list[str]] = collections.defaultdict(list)
    for name in store.list(SNAPSHOTS + "/"):
        parts = name.split("/")
        if len(parts) == 3:
            dirs["/".join(parts[:2])].append(name)
    return dict(sorted(dirs.items()))


def _prune(store: ObjectStore, keep: int, current: str) -> None:
    """Delete complete snapshots older than the newest `keep`, and abandoned partial ones.

    An incomplete dir younger than an hour may be another worker's save in flight: left alone."""
    try:
        dirs = list_snapshots(store)
        complete = [d for d, names in dirs.items() if f"{d}/manifest.json" in names]
        kept = set(complete[-keep:]) | {current}
        now = time.time()
        doomed = []
        for d, names in dirs.items():
            if d in kept:
                continue
            if d in complete or now - _dir_time(d) > _ABANDONED_AFTER_S:
                doomed.extend(names)
        if doomed:
            store.delete(doomed)
    except StoreError as exc:  # the new snapshot is published; old ones linger until the next save
        log.warning("could not delete old snapshots in %s: %s", store.url, exc)


def _dir_time(snapshot_dir: str) -> float:
    stamp = snapshot_dir.rsplit("/", 1)[-1].split("-", 1)[0]
    try:
        return datetime.strptime(stamp, STAMP).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0  # not ours: treat as old


def _delete_quietly(store: ObjectStore, key: str) -> None:
    """Remove a failed save's objects, unless the pointer write failed only on the way back."""
    try:
        pointer = store.read_bytes(POINTER)
        if pointer is not None and json.loads(pointer).get("snapshot") == key:
            return
        store.delete(store.list(key + "/"))
    except (StoreError, ValueError):
        pass  # a later save's prune removes it once it is old
