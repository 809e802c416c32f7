"""KV blocks of a hybrid model: some layers attend over the whole context, others over a sliding window.

One pool for every layer would keep each windowed layer's KV for the whole context, since the
full-attention layers still read every block. So the two kinds get a pool each (the model
runner holds both, `worker.models.kv_split`), each with a `KVCacheManager`: the full layers'
over the request's own block table, the windowed layers' over `Request.window_table`, which
releases the blocks that left the window. A sequence then holds its full layers' KV for every
token and its windowed layers' KV for about window / block_size + 1 blocks, however long it grows.

The prefix cache keys are the same in both pools (the same tokens). A hit needs every block in
the full pool and, in the windowed pool, only the blocks inside the window of the first token
after it: `lookup_prefix` finds the longest such run (`KVCacheManager.window_hit`).

Same verbs as `KVCacheManager` (`lookup_prefix`, `fits`, `allocate`, `free`, `trim`, `usage`);
an allocation either finds its blocks in both pools or takes none.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferry.worker.engine.kv_cache import KVCacheManager, KVUsage, PrefixHit
from ferry.worker.engine.request import BlockTable, Request


def window_table(request: Request) -> BlockTable:
    return request.window_table


class HybridKVCacheManager:
    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, enable_prefix_caching: bool,
                 window: int) -> None:
        self.full = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.windowed = KVCacheManager(num_window_blocks, block_size, enable_prefix_caching, window, window_table)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # the windowed layers' (the widest of them)

    @property
    def num_blocks(self) -> int:
        """Both pools' blocks (a block of the windowed pool holds fewer layers)."""
        return self.full.num_blocks + self.windowed.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks + self.windowed.num_free_blocks

    @property
    def prefix_queries(self) -> int:
        return self.full.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.full.prefix_hits

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """The longest run of leading full blocks cached in the full pool whose blocks inside the
        window of the token after it are cached in the windowed pool (`hit.window`: those)."""
        full = self.full.lookup_prefix(request)
        window = self.windowed.window_hit(request, len(full.block_ids))
        return PrefixHit(full.block_ids[: len(window.block_ids)], window.num_tokens, window)

    def fits(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None, reserve: int = 0,
             lookahead: int = 0) -> bool:
        window = prefix.window if prefix is not None else None
        return (self.full.fits(request, num_new_tokens, prefix, reserve, lookahead)
                and self.windowed.fits(request, num_new_tokens, window, reserve, lookahead))

    def allocate(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None, reserve: int = 0,
                 lookahead: int = 0) -> list[int] | None:
        """`KVCacheManager.allocate` in both pools, or in neither (None: one of them is short).
        Returns the full pool's new blocks."""
        if not self.fits(request, num_new_tokens, prefix, reserve, lookahead):
            return None
        window = prefix.window if prefix is not None else None
        blocks = self.full.allocate(request, num_new_tokens, prefix, reserve, lookahead)
        taken = self.windowed.allocate(request, num_new_tokens, window, reserve, lookahead)
        if blocks is None or taken is None:  # fits() said both have room: a broken invariant, never a quiet leak
            raise AssertionError("a pool that fitted the allocation refused it")
        return blocks

    def free(self, request: Request) -> None:
        self.full.free(request)
        self.windowed.free(request)

    def trim(self, request: Request) -> None:
        self.full.trim(request)
        self.windowed.trim(request)

    def usage(self, running: Sequence[Request]) -> KVUsage:
        """The fuller pool's figures (the one that runs short first)."""
        return max(self.full.usage(running), self.windowed.usage(running), key=lambda u: u.usage)
