"""The engine's prefix cache as an outside store sees it: which full blocks are cached, their KV
out, foreign KV in. Snapshots (`worker.snapshots`) use the engine only through this.

Blocks are named by their prefix-cache key (`kv_cache.block_key`), never by pool position, so
KV read from one engine is adopted by another with the same `KVLayout` and key salt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.kv_cache import CachedBlock, KVCacheManager

# The pool's axes; bump when ModelRunner.kv_cache changes layout (a stored block then no longer fits).
KV_LAYOUT = "layer,kv,block,kv_head,slot,head_dim"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one block of KV looks like: equal layouts can exchange blocks."""

    axes: str  # KV_LAYOUT
    block_shape: tuple[int, ...]  # one block's KV: [layers, 2, kv heads, block size, head dim]
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        return int(torch.Size(self.block_shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class PrefixBlocks:
    """Export and import of cached blocks. Not thread-safe: call from the engine's thread, between steps."""

    def __init__(self, kv: KVCacheManager, pool: torch.Tensor) -> None:
        self._kv = kv
        self._pool = pool  # [layers, 2, blocks, kv heads, block size, head dim]
        shape = tuple(pool.shape)
        self.layout = KVLayout(KV_LAYOUT, shape[:2] + shape[3:], pool.dtype, kv.block_size)

    @property
    def enabled(self) -> bool:
        return self._kv.enable_prefix_caching

    def cached(self) -> list[CachedBlock]:
        """Every cached full block (in use or free), parents not necessarily first."""
        return [meta for _, meta in self._kv.cached_blocks()]

    def contains(self, key: bytes) -> bool:
        return key in self._kv.cached

    def room(self) -> int:
        """Free blocks holding no cached prefix: how many blocks an import can fill (imports never evict)."""
        return self._kv.num_free_blocks - self._kv.num_cached_free

    def read(self, keys: list[bytes]) -> torch.Tensor:
        """KV of the cached blocks `keys`, on the CPU: [layers, 2, len(keys), kv heads, block size, head dim]."""
        ids = torch.tensor([self._kv.cached[key] for key in keys], device=self._pool.device)
        return self._pool.index_select(2, ids).cpu()

    def adopt(self, blocks: list[CachedBlock], kv: torch.Tensor) -> int:
        """Cache `blocks` (children before parents is best: adopted blocks join the back of the
        eviction queue) with their KV `kv[:, :, i]`; a block whose key is cached already or that
        finds no free uncached slot is skipped. Returns how many were adopted."""
        targets, sources = [], []
        for i, meta in enumerate(blocks):
            block = self._kv.adopt_cached_block(meta)
            if block is not None:
                targets.append(block)
                sources.append(i)
        if targets:
            dst = torch.tensor(targets, device=self._pool.device)
            self._pool.index_copy_(2, dst, kv.index_select(2, torch.tensor(sources)).to(self._pool.device))
        return len(targets)
