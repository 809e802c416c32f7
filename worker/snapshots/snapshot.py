"""Prefix-cache snapshots: save the hot part of the KV cache to a store, restore it at start-up.

A snapshot is a directory in a store (`worker.snapshots.store`):

    snapshots/<utc time>-<random>/shard-00000.safetensors   one tensor "kv": [layers, 2, n, kv heads, block size, head dim]
    snapshots/<utc time>-<random>/manifest.json             fingerprint, blocks (key, parent key, tokens, hits,
                                                            last use, shard, index), shards (name, size, sha256)
    latest.json                                             pointer: snapshot dir + manifest sha256, written last

Shards go up first, then the manifest, then the pointer, so a reader never sees half a
snapshot and a failed save leaves the previous one in place. A snapshot restores only into an
engine with the same fingerprint (model config, weight files, dtype, block size, KV layout,
model salt); block keys are the prefix cache's stable sha256 chain, so restored blocks are hit
by exactly the requests that would have computed them.

Restoring never fails an engine: a missing, foreign, corrupt or unreachable snapshot means a
cold start, one warning and a count in `SnapshotStats`.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from worker.engine.kv_cache import ROOT_KEY, CachedBlock
from worker.models.loader import weight_files
from worker.snapshots.store import SnapshotStore, StoreError, open_store

if TYPE_CHECKING:
    from worker.engine.engine import Engine

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Shards hold blocks in the pool's own layout; bump when ModelRunner.kv_cache changes layout.
KV_LAYOUT = "layer,kv,block,kv_head,slot,head_dim"
POINTER = "latest.json"
SNAPSHOTS = "snapshots"
DEFAULT_SHARD_BYTES = 256 << 20
_STAMP = "%Y%m%dT%H%M%S%fZ"  # snapshot dir names start with the UTC creation time
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10  # weight data hashed per file for the fingerprint
_ABANDONED_AFTER_S = 3600  # an incomplete snapshot dir this old is a crashed save, not one in flight


class SnapshotError(RuntimeError):
    """A snapshot could not be saved or used. `reason`: missing | foreign | corrupt | unreachable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --- the format --------------------------------------------------------------------------------


@dataclass(slots=True)
class BlockRecord:
    key: str  # hex of the block's prefix-cache key
    parent_key: str  # hex; all zeros for a chain's first block
    token_ids: list[int]
    hits: int  # prefix-cache reuses so far (carried across restores, so ranking persists)
    last_used: float  # unix time of the last use
    shard: int  # index into Manifest.shards
    index: int  # position along the shard tensor's block dimension


@dataclass(slots=True)
class ShardRecord:
    name: str  # file name inside the snapshot dir
    size: int  # bytes
    sha256: str
    num_blocks: int


@dataclass(slots=True)
class Manifest:
    format_version: int
    fingerprint: str
    created_at: float  # unix time
    model: dict  # readable summary for `ferry snapshot inspect`: name, architecture, dtype, block size
    kv_block_shape: list[int]  # one block's KV: [layers, 2, kv heads, block size, head dim]
    blocks: list[BlockRecord]  # parents before children
    shards: list[ShardRecord]

    @property
    def num_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        raw["blocks"] = [BlockRecord(**b) for b in raw["blocks"]]
        raw["shards"] = [ShardRecord(**s) for s in raw["shards"]]
        return cls(**raw)


@dataclass(slots=True)
class SnapshotInfo:
    """What a save wrote."""

    url: str
    key: str  # the snapshot dir inside the store
    blocks: int
    tokens: int
    bytes: int  # shard bytes
    seconds: float


@dataclass(slots=True)
class RestoreResult:
    """What a restore put into the engine."""

    url: str
    key: str
    blocks: int  # blocks now cached from the snapshot
    tokens: int
    bytes: int  # shard bytes downloaded
    skipped: int  # already cached, parent missing, or no free block left
    seconds: float
    age_s: float  # how old the snapshot was


@dataclass(slots=True)
class SnapshotStats:
    """Counters of one engine's snapshot activity; exported as `ferry_snapshot_*` by SnapshotCollector."""

    restores: collections.Counter = field(default_factory=collections.Counter)  # outcome -> count
    saves: collections.Counter = field(default_factory=collections.Counter)  # "ok" | "failed" -> count
    restored_blocks: int = 0
    restored_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    last_restore_seconds: float = 0.0
    last_save_seconds: float = 0.0
    last_save_time: float = 0.0  # unix time of the last successful save
    last_keys_digest: str | None = None  # the cached set last saved or restored (skip unchanged saves)


# --- fingerprint -------------------------------------------------------------------------------


def fingerprint(engine: Engine) -> str:
    """sha256 over everything that decides whether KV computed by one engine is valid in another."""
    config = json.loads((engine.model_dir / "config.json").read_text())
    config.pop("transformers_version", None)  # re-saving with another library release changes nothing
    parts = {
        "config": config,
        "weights": [
            {"name": p.name, "size": p.stat().st_size, "sha256": _safetensors_sample_sha256(p)}
            for p in weight_files(engine.model_dir)
        ],
        "dtype": str(engine.dtype),
        "block_size": engine.block_size,
        "kv_layout": KV_LAYOUT,
        "kv_block_shape": _block_shape(engine),
        "model_salt": engine.model_salt,  # block keys are salted with it
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _safetensors_sample_sha256(path: Path) -> str:
    """sha256 of a safetensors file's header plus samples of its tensor data.

    The header (u64 length + JSON) names every tensor with dtype, shape and offsets; fine-tunes
    of one base model share it, so a few spread-out slices of the data are hashed too: cheap
    (about 1 MiB read per file) and different for any two trained checkpoints."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little")
        digest.update(head + f.read(header_len))
        data_start = 8 + header_len
        span = max(size - data_start - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            f.seek(data_start + span * i // max(_SAMPLES - 1, 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _block_shape(engine: Engine) -> list[int]:
    shape = list(engine.runner.kv_cache.shape)  # [layers, 2, blocks, kv heads, block size, head dim]
    return shape[:2] + shape[3:]


def _bytes_per_block(engine: Engine) -> int:
    return engine.runner.kv_cache[:, :, 0].numel() * engine.runner.kv_cache.element_size()


# --- policy ------------------------------------------------------------------------------------


def select_blocks(cached: list[tuple[int, CachedBlock]], max_blocks: int) -> list[tuple[int, CachedBlock]]:
    """The cached blocks worth keeping: whole chains from the root, by hits then recency.

    Only blocks whose every ancestor is cached qualify (a block is useless without its prefix).
    Blocks are taken best first, each with its not-yet-taken ancestors, while the chain fits in
    `max_blocks`. Returns (block id, metadata) with parents before children."""
    by_key = {meta.key: (block, meta) for block, meta in cached}
    rooted = _rooted_keys(by_key)
    ranked = sorted(rooted, key=lambda k: (-by_key[k][1].hits, -by_key[k][1].last_used))
    chosen: dict[bytes, None] = {}  # insertion-ordered set
    for key in ranked:
        if len(chosen) >= max_blocks:
            break
        chain = []
        while key != ROOT_KEY and key not in chosen:
            chain.append(key)
            key = by_key[key][1].parent_key
        if len(chosen) + len(chain) <= max_blocks:
            chosen.update(dict.fromkeys(reversed(chain)))
    return [by_key[k] for k in chosen]


def _rooted_keys(by_key: dict[bytes, tuple[int, CachedBlock]]) -> set[bytes]:
    """Keys whose chain back to the root is entirely cached."""
    good: set[bytes] = set()
    bad: set[bytes] = set()
    for start in by_key:
        path, key = [], start
        while True:
            if key == ROOT_KEY or key in good:
                good.update(path)
                break
            if key in bad or key not in by_key:
                bad.update(path)
                break
            path.append(key)
            key = by_key[key][1].parent_key
    return good


def _keys_digest(keys) -> str:
    return hashlib.sha256(b"".join(sorted(keys))).hexdigest()


# --- save --------------------------------------------------------------------------------------


def save_snapshot(
    engine: Engine,
    url: str | SnapshotStore,
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
    set as the last save or restore. Raises SnapshotError when the store fails; the previous
    snapshot is then untouched."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    stats = stats if stats is not None else SnapshotStats()
    store = open_store(url) if isinstance(url, str) else url
    started = time.monotonic()
    bytes_per_block = _bytes_per_block(engine)
    chosen = select_blocks(engine.kv.cached_blocks(), max_bytes // bytes_per_block)
    digest = _keys_digest(meta.key for _, meta in chosen)
    if not chosen or (only_if_changed and digest == stats.last_keys_digest):
        return None
    # Names sort by creation time (microseconds: several saves a second still order correctly).
    key = f"{SNAPSHOTS}/{datetime.now(UTC).strftime(_STAMP)}-{secrets.token_hex(4)}"
    try:
        manifest = _write_snapshot(engine, store, key, chosen, shard_bytes, progress)
    except (StoreError, OSError) as exc:
        stats.saves["failed"] += 1
        _delete_quietly(store, key)
        raise SnapshotError("unreachable", f"saving a snapshot to {store.url} failed ({exc}); the previous one is intact") from exc
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


def _write_snapshot(
    engine: Engine, store: SnapshotStore, key: str, chosen: list[tuple[int, CachedBlock]], shard_bytes: int, progress: bool
) -> Manifest:
    """Shards, then the manifest, then the pointer."""
    kv = engine.runner.kv_cache  # [layers, 2, blocks, kv heads, block size, head dim]
    per_shard = max(1, shard_bytes // _bytes_per_block(engine))
    blocks: list[BlockRecord] = []
    shards: list[ShardRecord] = []
    total = len(chosen) * _bytes_per_block(engine)
    with (
        tempfile.TemporaryDirectory(prefix="ferry-snapshot-") as tmp,
        tqdm(total=total, desc="uploading snapshot", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for shard_index, start in enumerate(range(0, len(chosen), per_shard)):
            group = chosen[start : start + per_shard]
            ids = torch.tensor([block for block, _ in group], device=kv.device)
            name = f"shard-{shard_index:05d}.safetensors"
            path = Path(tmp) / name
            save_file({"kv": kv.index_select(2, ids).cpu().contiguous()}, str(path))
            shards.append(ShardRecord(name, path.stat().st_size, _sha256_file(path), len(group)))
            bar.total += shards[-1].size - len(group) * _bytes_per_block(engine)  # + the safetensors header
            bar.refresh()
            blocks.extend(
                BlockRecord(m.key.hex(), m.parent_key.hex(), list(m.token_ids), m.hits, m.last_used, shard_index, i)
                for i, (_, m) in enumerate(group)
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
        kv_block_shape=_block_shape(engine),
        blocks=blocks,
        shards=shards,
    )
    data = manifest.to_json()
    store.write_bytes(f"{key}/manifest.json", data)
    pointer = {"snapshot": key, "manifest_sha256": hashlib.sha256(data).hexdigest(), "created_at": manifest.created_at}
    store.write_bytes(POINTER, json.dumps(pointer).encode())
    return manifest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def list_snapshots(store: SnapshotStore) -> dict[str, list[str]]:
    """Snapshot dir -> its object names, oldest dir first (dir names start with the UTC time)."""
    dirs: dict[str, list[str]] = collections.defaultdict(list)
    for name in store.list(SNAPSHOTS + "/"):
        parts = name.split("/")
        if len(parts) == 3:
            dirs["/".join(parts[:2])].append(name)
    return dict(sorted(dirs.items()))


def _prune(store: SnapshotStore, keep: int, current: str) -> None:
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
        return datetime.strptime(stamp, _STAMP).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0  # not ours: treat as old


def _delete_quietly(store: SnapshotStore, key: str) -> None:
    """Remove a failed save's objects, unless the pointer write failed only on the way back."""
    try:
        pointer = store.read_bytes(POINTER)
        if pointer is not None and json.loads(pointer).get("snapshot") == key:
            return
        store.delete(store.list(key + "/"))
    except (StoreError, ValueError):
        pass  # a later save's prune removes it once it is old


# --- restore -----------------------------------------------------------------------------------


def read_manifest(store: SnapshotStore) -> tuple[str, Manifest]:
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
            raise SnapshotError("foreign", f"{store.url}/{key} has snapshot format {version}, this Ferry reads {FORMAT_VERSION}")
        return key, Manifest.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError("corrupt", f"manifest of {store.url}/{key} is malformed: {exc}") from exc


def load_snapshot(engine: Engine, url: str | SnapshotStore, progress: bool = False) -> RestoreResult:
    """Import the latest snapshot at `url` into the engine's prefix cache as cached free blocks.

    Everything is checked before the engine is touched: pointer, manifest sha256, format,
    fingerprint, every shard's size, sha256 and tensor shape. Imports never evict: blocks that
    find no free uncached slot are skipped, and so is a block whose parent is neither cached nor
    imported. Raises SnapshotError."""
    started = time.monotonic()
    store = open_store(url) if isinstance(url, str) else url
    key, manifest = read_manifest(store)
    if manifest.fingerprint != fingerprint(engine):
        raise SnapshotError(
            "foreign",
            f"{store.url}/{key} was made by another model or configuration ({manifest.model}); this engine runs "
            f"{engine.model_dir.name} {str(engine.dtype).removeprefix('torch.')} block size {engine.block_size}",
        )
    tensors = _fetch_shards(engine, store, key, manifest, progress)
    blocks, skipped = _import_blocks(engine, manifest, tensors)
    return RestoreResult(
        url=store.url,
        key=key,
        blocks=blocks,
        tokens=blocks * engine.block_size,
        bytes=manifest.num_bytes,
        skipped=skipped,
        seconds=time.monotonic() - started,
        age_s=max(time.time() - manifest.created_at, 0.0),
    )


def _fetch_shards(engine: Engine, store: SnapshotStore, key: str, manifest: Manifest, progress: bool) -> list[torch.Tensor]:
    """Download, verify and load every shard: [layers, 2, n, kv heads, block size, head dim] each."""
    tensors = []
    with (
        tempfile.TemporaryDirectory(prefix="ferry-snapshot-") as tmp,
        tqdm(total=manifest.num_bytes, desc="downloading snapshot", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for shard in manifest.shards:
            path = Path(tmp) / Path(shard.name).name
            try:
                store.download(f"{key}/{shard.name}", path, bar.update)
            except StoreError as exc:
                raise SnapshotError("unreachable", f"cannot fetch {store.url}/{key}/{shard.name}: {exc}") from exc
            size = path.stat().st_size
            if size != shard.size or _sha256_file(path) != shard.sha256:
                raise SnapshotError(
                    "corrupt", f"{store.url}/{key}/{shard.name}: {size} bytes, sha256 mismatch (truncated or corrupt)"
                )
            expected = manifest.kv_block_shape[:2] + [shard.num_blocks] + manifest.kv_block_shape[2:]
            try:
                with safe_open(str(path), framework="pt") as f:
                    tensor = f.get_tensor("kv")
            except Exception as exc:  # safetensors raises its own error types for malformed files
                raise SnapshotError("corrupt", f"{store.url}/{key}/{shard.name} is not a KV shard: {exc}") from exc
            if list(tensor.shape) != expected or tensor.dtype != engine.dtype:
                raise SnapshotError(
                    "corrupt", f"{shard.name} holds {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(expected)}"
                )
            tensors.append(tensor)
    return tensors


def _import_blocks(engine: Engine, manifest: Manifest, tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Adopt whole chains into free uncached blocks and copy their KV. Returns (imported, skipped)."""
    kv = engine.kv
    usage = engine.kv_usage()
    room = usage.num_blocks - usage.num_used_blocks - usage.num_cached_free_blocks
    plan: list[BlockRecord] = []
    planned: set[bytes] = set()
    for record in manifest.blocks:  # parents come first
        block_key, parent = bytes.fromhex(record.key), bytes.fromhex(record.parent_key)
        if block_key in kv.cached:
            continue  # already here; its children may still attach to it
        if len(plan) < room and (parent == ROOT_KEY or parent in planned or parent in kv.cached):
            plan.append(record)
            planned.add(block_key)
    # Adopt the least valuable blocks, and children before parents, first: adopted blocks join
    # the back of the LRU queue, so tails and cold chains are the first to be evicted later.
    moves: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # shard -> (block id, index)
    for record in reversed(plan):
        meta = CachedBlock(
            bytes.fromhex(record.key), bytes.fromhex(record.parent_key), tuple(record.token_ids),
            hits=record.hits, last_used=record.last_used,
        )
        block = kv.adopt_cached_block(meta)
        if block is not None:
            moves[record.shard].append((block, record.index))
    pool = engine.runner.kv_cache  # [layers, 2, blocks, kv heads, block size, head dim]
    for shard, pairs in moves.items():
        dst = torch.tensor([b for b, _ in pairs], device=pool.device)
        src = torch.tensor([i for _, i in pairs])
        pool.index_copy_(2, dst, tensors[shard].index_select(2, src).to(pool.device))
    imported = sum(len(p) for p in moves.values())
    return imported, len(manifest.blocks) - imported


def restore_snapshot(engine: Engine, url: str, stats: SnapshotStats | None = None) -> RestoreResult | None:
    """`load_snapshot` for engine start-up: on any failure log one warning, count it, start cold."""
    stats = stats if stats is not None else SnapshotStats()
    if not engine.config.enable_prefix_caching:
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
    stats.last_keys_digest = _keys_digest(meta.key for _, meta in engine.kv.cached_blocks())
    log.info("restored prefix-cache snapshot %s/%s: %d blocks (%d tokens, %.1f MiB, %.0f s old) in %.2f s",
             result.url, result.key, result.blocks, result.tokens, result.bytes / 2**20, result.age_s, result.seconds)
    return result


# --- metrics -----------------------------------------------------------------------------------


class SnapshotCollector:
    """Prometheus collector over an engine's SnapshotStats: `registry.register(SnapshotCollector(lambda: stats))`."""

    def __init__(self, stats) -> None:
        self._stats = stats  # a callable returning the current SnapshotStats (the engine may be rebuilt)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats()
        restores = CounterMetricFamily("ferry_snapshot_restores", "Snapshot restores at start-up by outcome", labels=["outcome"])
        for outcome in ("ok", "missing", "foreign", "corrupt", "unreachable", "error"):
            restores.add_metric([outcome], s.restores[outcome])
        saves = CounterMetricFamily("ferry_snapshot_saves", "Snapshot saves by outcome", labels=["outcome"])
        for outcome in ("ok", "failed"):
            saves.add_metric([outcome], s.saves[outcome])
        yield restores
        yield saves
        yield CounterMetricFamily("ferry_snapshot_restored_blocks", "KV blocks restored from snapshots", value=s.restored_blocks)
        yield CounterMetricFamily("ferry_snapshot_restored_bytes", "Snapshot bytes downloaded and restored", value=s.restored_bytes)
        yield CounterMetricFamily("ferry_snapshot_saved_blocks", "KV blocks written to snapshots", value=s.saved_blocks)
        yield CounterMetricFamily("ferry_snapshot_saved_bytes", "Snapshot bytes written", value=s.saved_bytes)
        yield GaugeMetricFamily("ferry_snapshot_last_restore_duration_seconds", "Duration of the last restore",
                                value=s.last_restore_seconds)
        yield GaugeMetricFamily("ferry_snapshot_last_save_duration_seconds", "Duration of the last save",
                                value=s.last_save_seconds)
        yield GaugeMetricFamily("ferry_snapshot_last_save_timestamp_seconds", "Unix time of the last successful save",
                                value=s.last_save_time)
