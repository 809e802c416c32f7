"""The engine's prefix cache as an outside store sees it: which full blocks are cached, their KV
out, foreign KV in. Snapshots (`worker.snapshots`) use the engine only through this.

Blocks are named by their prefix-cache key (`kv_cache.block_key`), never by pool position, so
KV read from one engine is adopted by another with the same `KVLayout` and key salt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.worker.engine.executor import Executor
from ferry.worker.engine.kv_cache import CachedBlock, KVCacheManager

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

    def __init__(self, kv: KVCacheManager, executor: Executor, layout: KVLayout) -> None:
        self._kv = kv
        self._executor = executor  # reads and writes whole blocks (every kv head, every rank's)
        self.layout = layout

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
        return self._executor.read_blocks([self._kv.cached[key] for key in keys])

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
            self._executor.write_blocks(targets, kv.index_select(2, torch.tensor(sources)))
        return len(targets)
