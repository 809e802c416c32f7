"""Prefix-cache snapshots: the hot part of an engine's KV cache saved to a store, restored at start-up.

A snapshot restores only into an engine with the same fingerprint (model config, weight files,
dtype, block size, KV layout, model salt); block keys are the prefix cache's stable sha256
chain, so restored blocks are hit by exactly the requests that would have computed them. The
engine is used only through `Engine.prefix_blocks` (`worker.engine.prefix_io`).

- `format`: shards, manifest, pointer (kept in a `worker.common.objectstore` store, `file://` or `s3://`);
- `policy`: which blocks to keep and to take back; `fingerprint`;
- `save` / `restore`; `stats`: counters and their Prometheus export; `cli`: `ferry snapshot`.
"""

from ferry.worker.common.objectstore import ObjectStore, StoreError, open_store
from ferry.worker.snapshots.fingerprint import fingerprint
from ferry.worker.snapshots.format import POINTER, Manifest, RestoreResult, SnapshotError, SnapshotInfo
from ferry.worker.snapshots.policy import select_blocks
from ferry.worker.snapshots.restore import load_snapshot, read_manifest, restore_snapshot
from ferry.worker.snapshots.save import list_snapshots, save_snapshot
from ferry.worker.snapshots.stats import SnapshotCollector, SnapshotStats

__all__ = [
    "POINTER",
    "Manifest",
    "RestoreResult",
    "SnapshotCollector",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotStats",
    "ObjectStore",
    "StoreError",
    "fingerprint",
    "list_snapshots",
    "load_snapshot",
    "open_store",
    "read_manifest",
    "restore_snapshot",
    "save_snapshot",
    "select_blocks",
]
