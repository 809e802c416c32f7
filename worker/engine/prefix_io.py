"""The engine's prefix cache as an outside store sees it: which full blocks are cached, their KV
out, foreign KV in. Snapshots (`worker.snapshots`) use the engine only through this.

Blocks are named by their prefix-cache key (`kv_cache.block_key`), never by pool position, so
KV read from one engine is adopted by another with the same `KVLayout` and key salt.

A hybrid model (`hybrid_kv`) holds a block in two pools. A block is exported where both hold it
(its every layer's KV); an import fills each pool where the key is missing and there is room.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.worker.engine.executor import Executor
from ferry.worker.engine.hybrid_kv import HybridKVCacheManager
from ferry.worker.engine.kv_cache import FREED_BLOCK, CachedBlock, KVCacheManager

# The pool's axes; bump when ModelRunner.kv_cache changes layout (a stored block then no longer fits).
KV_LAYOUT = "layer,kv,block,kv_head,slot,head_dim"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one block of KV looks like: equal layouts can exchange blocks."""

    axes: str  # KV_LAYOUT
    block_shape: tuple[int, ...]  # one block's KV: [layers, 2, kv heads (all of them), block size, head dim]
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        return int(torch.Size(self.block_shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class PrefixBlocks:
    """Export and import of cached blocks. Not thread-safe: call from the engine's thread, between steps."""

    def __init__(self, kv: KVCacheManager | HybridKVCacheManager, executor: Executor, layout: KVLayout) -> None:
        self._kv = kv
        # The pools a block has a place in, in the order the executor takes their ids.
        self._pools = [kv.full, kv.windowed] if isinstance(kv, HybridKVCacheManager) else [kv]
        self._executor = executor  # reads and writes whole blocks (every kv head, every rank's)
        self.layout = layout

    @property
    def enabled(self) -> bool:
        return self._kv.enable_prefix_caching

    def cached(self) -> list[CachedBlock]:
        """Every cached full block (in use or free) whose KV every pool holds, parents not necessarily first."""
        first, *others = self._pools
        return [meta for _, meta in first.cached_blocks() if all(meta.key in pool.cached for pool in others)]

    def contains(self, key: bytes) -> bool:
        return all(key in pool.cached for pool in self._pools)

    def room(self) -> int:
        """Free blocks holding no cached prefix: how many blocks an import can fill (imports never evict)."""
        return min(pool.num_free_blocks - pool.num_cached_free for pool in self._pools)

    def read(self, keys: list[bytes]) -> torch.Tensor:
        """KV of the cached blocks `keys`, on the CPU: [layers, 2, len(keys), kv heads, block size, head dim]."""
        return self._executor.read_blocks(*([pool.cached[key] for key in keys] for pool in self._pools))

    def adopt(self, blocks: list[CachedBlock], kv: torch.Tensor) -> int:
        """Cache `blocks` (children before parents is best: adopted blocks join the back of the
        eviction queue) with their KV `kv[:, :, i]`; a block whose key is cached already or that
        finds no free uncached slot is skipped (per pool, for a hybrid model). Returns how many
        were adopted (in some pool)."""
        placed = [[pool.adopt_cached_block(meta) for pool in self._pools] for meta in blocks]
        sources = [i for i, ids in enumerate(placed) if any(b is not None for b in ids)]
        if sources:
            # Per pool, the adopted blocks' ids; FREED_BLOCK where that pool has the key already or no room.
            ids = [[FREED_BLOCK if placed[i][p] is None else placed[i][p] for i in sources]
                   for p in range(len(self._pools))]
            self._executor.write_blocks(ids[0], kv.index_select(2, torch.tensor(sources)), *ids[1:])
        return len(sources)
