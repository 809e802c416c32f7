"""What a snapshot is in a store: shards of KV, a manifest describing them, and a pointer.

    snapshots/<utc time>-<random>/shard-00000.safetensors  one tensor "kv": [layers, 2, n, kv heads, slot, head dim]
    snapshots/<utc time>-<random>/manifest.json            fingerprint, blocks (key, parent key, tokens, hits,
                                                           last use, shard, index), shards (name, size, sha256)
    latest.json                                            pointer: snapshot dir + manifest sha256, written last

Shards go up first, then the manifest, then the pointer, so a reader never sees half a snapshot
and a failed save leaves the previous one in place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

FORMAT_VERSION = 1
POINTER = "latest.json"
SNAPSHOTS = "snapshots"
STAMP = "%Y%m%dT%H%M%S%fZ"  # snapshot dir names start with the UTC creation time


class SnapshotError(RuntimeError):
    """A snapshot could not be saved or used. `reason`: missing | foreign | corrupt | unreachable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
