"""Restore a snapshot into an engine's prefix cache, checking everything before touching the engine.

Restoring at start-up never fails an engine: a missing, foreign, corrupt or unreachable snapshot
means a cold start, one warning and a count in `SnapshotStats`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ferry.worker.common.objectstore import ObjectStore, StoreError, open_store
from ferry.worker.engine import Engine
from ferry.worker.engine.kv_cache import CachedBlock
from ferry.worker.snapshots.fingerprint import fingerprint
from ferry.worker.snapshots.format import FORMAT_VERSION, POINTER, Manifest, RestoreResult, SnapshotError
from ferry.worker.snapshots.policy import keys_digest, plan_import
from ferry.worker.snapshots.save import sha256_file
from ferry.worker.snapshots.stats import SnapshotStats

log = logging.getLogger(__name__)


def read_manifest(store: ObjectStore) -> tuple[str, Manifest]:
    """(snapshot dir, manifest) that `latest.json` points to, checked against the pointer's sha256."""
    try:
        pointer_data = store.read_bytes(POINTER)
        if pointer_data is None:
            raise SnapshotError("missing", f"no snapshot at {store.url} ({POINTER} not found)")
        key = json.loads(pointer_data)["snapshot"]
        data = store.read_bytes(f"{key}/manifest.json")
    except StoreError as exc:
        raise SnapshotError("unreachable", f"snapshot store {store.url} unreachable: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError("corrupt", f"{store.url}/{POINTER} is not a snapshot pointer: {exc}") from exc
    if data is None:
        raise SnapshotError("missing", f"{store.url}/{POINTER} points to {key}, which has no manifest")
    if hashlib.sha256(data).hexdigest() != json.loads(pointer_data).get("manifest_sha256"):
        raise SnapshotError("corrupt", f"manifest of {store.url}/{key} does not match the sha256 in {POINTER}")
    try:
        version = json.loads(data).get("format_version")
        if version != FORMAT_VERSION:
            raise SnapshotError(
                "foreign", f"{store.url}/{key} has snapshot format {version}, this Ferry reads {FORMAT_VERSION}"
            )
        return key, Manifest.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError("corrupt", f"manifest of {store.url}/{key} is malformed: {exc}") from exc


def load_snapshot(engine: Engine, url: str | ObjectStore, progress: bool = False) -> RestoreResult:
    """Import the latest snapshot at `url` into the engine's prefix cache as cached free blocks.

    Everything is checked before the engine is touched: pointer, manifest sha256, format,
    fingerprint, every shard's size, sha256 and tensor shape. Imports never evict: blocks that
    find no free uncached slot are skipped, and so is a block whose parent is neither cached nor
    imported. Raises SnapshotError. Call it between engine steps."""
    started = time.monotonic()
    store = open_store(url) if isinstance(url, str) else url
    key, manifest = read_manifest(store)
    if manifest.fingerprint != fingerprint(engine):
        raise SnapshotError(
            "foreign",
            f"{store.url}/{key} was made by another model or configuration ({manifest.model}); this engine runs "
            f"{engine.model_dir.name} {str(engine.dtype).removeprefix('torch.')} block size {engine.block_size} "
            f"tensor_parallel_size {engine.tensor_parallel_size}",
        )
    tensors = _fetch_shards(engine, store, key, manifest, progress)
    blocks = _import_blocks(engine, manifest, tensors)
    return RestoreResult(
        url=store.url,
        key=key,
        blocks=blocks,
        tokens=blocks * engine.block_size,
        bytes=manifest.num_bytes,
        skipped=len(manifest.blocks) - blocks,
        seconds=time.monotonic() - started,
        age_s=max(time.time() - manifest.created_at, 0.0),
    )


def _fetch_shards(
    engine: Engine, store: ObjectStore, key: str, manifest: Manifest, progress: bool
) -> list[torch.Tensor]:
    """Download, verify and load every shard: [layers, 2, n, kv heads, block size, head dim] each."""
    layout = engine.prefix_blocks.layout
    tensors = []
    with (
        tempfile.TemporaryDirectory(prefix="ferry-snapshot-") as tmp,
        tqdm(
            total=manifest.num_bytes, desc="downloading snapshot", unit="B", unit_scale=True, disable=not progress
        ) as bar,
    ):
        for shard in manifest.shards:
            path = Path(tmp) / Path(shard.name).name
            try:
                store.download(f"{key}/{shard.name}", path, bar.update)
            except StoreError as exc:
                raise SnapshotError("unreachable", f"cannot fetch {store.url}/{key}/{shard.name}: {exc}") from exc
            size = path.stat().st_size
            if size != shard.size or sha256_file(path) != shard.sha256:
                raise SnapshotError(
                    "corrupt", f"{store.url}/{key}/{shard.name}: {size} bytes, sha256 mismatch (truncated or corrupt)"
                )
            expected = manifest.kv_block_shape[:2] + [shard.num_blocks] + manifest.kv_block_shape[2:]
            try:
                with safe_open(str(path), framework="pt") as f:
                    tensor = f.get_tensor("kv")
            except Exception as exc:  # safetensors raises its own error types for malformed files
                raise SnapshotError("corrupt", f"{store.url}/{key}/{shard.name} is not a KV shard: {exc}") from exc
            if list(tensor.shape) != expected or tensor.dtype != layout.dtype:
                raise SnapshotError(
                    "corrupt", f"{shard.name} holds {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(expected)}"
                )
            tensors.append(tensor)
    return tensors


def _import_blocks(engine: Engine, manifest: Manifest, tensors: list[torch.Tensor]) -> int:
    """Adopt whole chains into free uncached blocks with their KV. Returns how many were imported."""
    prefix = engine.prefix_blocks
    plan = plan_import(manifest.blocks, prefix.room(), prefix.contains)
    # Least valuable first, children before parents: adopted blocks join the back of the eviction
    # queue, so tails and cold chains are the first to be evicted later.
    imported = 0
    for shard in reversed(range(len(tensors))):
        tensor = tensors[shard]
        records = [r for r in reversed(plan) if r.shard == shard]
        if not records:
            continue
        metas = [CachedBlock(bytes.fromhex(r.key), bytes.fromhex(r.parent_key), tuple(r.token_ids), hits=r.hits,
                             last_used=r.last_used) for r in records]
        imported += prefix.adopt(metas, tensor.index_select(2, torch.tensor([r.index for r in records])))
    return imported


def restore_snapshot(
    engine: Engine, url: str | ObjectStore, stats: SnapshotStats | None = None
) -> RestoreResult | None:
    """`load_snapshot` for start-up: on any failure log one warning, count it in `stats`, start cold."""
    stats = stats if stats is not None else SnapshotStats()
    if not engine.prefix_blocks.enabled:
        log.info("prefix caching is off: snapshot %s not restored", url)
        return None
    try:
        result = load_snapshot(engine, url)
    except SnapshotError as exc:
        stats.restores[exc.reason] += 1
        log.warning("starting with a cold prefix cache: %s", exc)
        return None
    except Exception as exc:  # a bad URL, a full disk...: still never worth failing start-up for
        stats.restores["error"] += 1
        log.warning("starting with a cold prefix cache: restoring %s failed: %s: %s", url, type(exc).__name__, exc)
        return None
    stats.restores["ok"] += 1
    stats.restored_blocks += result.blocks
    stats.restored_bytes += result.bytes
    stats.last_restore_seconds = result.seconds
    stats.last_keys_digest = keys_digest(meta.key for meta in engine.prefix_blocks.cached())
    log.info("restored prefix-cache snapshot %s/%s: %d blocks (%d tokens, %.1f MiB, %.0f s old) in %.2f s",
             result.url, result.key, result.blocks, result.tokens, result.bytes / 2**20, result.age_s, result.seconds)
    return result
