"""Paged KV block manager with a hash-chained prefix cache.

The pool holds `num_blocks` fixed-size blocks; each request owns a block table
(`request.block_ids`). A full block whose tokens are known gets a key

    key = sha256(parent_key ‖ uint32 count ‖ token ids as uint32 LE ‖ extra)

with the 32-byte parent key all zeros for a request's first block and `extra` carrying the
per-model salt and the request's `cache_salt`. Keys are the same in every process and across
restarts (snapshots rely on it). Freed blocks keep their key and sit in an LRU queue; they are
evicted only when their slot is needed, and a block with a reference is never evicted.

Verbs, all that the scheduler needs: `lookup_prefix`, `allocate` (None = preempt something),
`free`; and `trim`, which drops rejected speculative positions' blocks after a verification.

A model whose every layer attends over a sliding window (`window`) never reads a block again once
all its positions are before the window of the next token: `allocate` releases such blocks
(cached ones stay in the prefix cache as free blocks) and leaves FREED_BLOCK in their place in
the block table, so a sequence holds about window / block_size + 1 blocks however long it grows.
A model with both kinds of layers keeps its windowed layers' KV in a pool of their own, with a
manager of this class over `Request.window_table` (`hybrid_kv.HybridKVCacheManager`).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ferry.worker.engine.request import BlockTable, Request

ROOT_KEY = bytes(32)  # parent key of every chain's first block
FREED_BLOCK = -1  # a block-table place whose block left every layer's window and was released


def block_key(parent_key: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    """Stable prefix-cache key of one full block (never Python's hash())."""
    digest = hashlib.sha256(parent_key)
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    digest.update(extra)
    return digest.digest()


def cache_extra(model_salt: str, cache_salt: str | None) -> bytes:
    """Namespace bytes: requests share cached blocks only with the same model and cache_salt."""
    salt = (cache_salt or "").encode()
    return struct.pack("<I", len(model_salt.encode())) + model_salt.encode() + salt


@dataclass(slots=True)
class PrefixHit:
    # cached blocks holding the request's leading full blocks, in order; a windowed pool's hit
    # starts with FREED_BLOCK for the blocks before the window of the first token to compute
    block_ids: list[int]
    num_tokens: int  # = len(block_ids) * block_size
    window: PrefixHit | None = None  # a hybrid model's: the windowed layers' blocks of the same tokens


@dataclass(slots=True)
class CachedBlock:
    """What the prefix cache knows of a full block (exported in snapshots)."""

    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    hits: int = 0  # times a request reused this block
    last_used: float = field(default_factory=time.time)  # wall clock, comparable across restarts


@dataclass(slots=True)
class KVUsage:
    num_blocks: int
    num_used_blocks: int  # blocks referenced by running requests
    num_cached_free_blocks: int  # free blocks still holding a cached prefix
    num_used_tokens: int  # token slots holding KV of running requests

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


def own_table(request: Request) -> BlockTable:
    """The request's block table over the pool of every layer (or a hybrid model's full-attention
    layers): the fields live on the request itself."""
    return request


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None,
        table: Callable[[Request], BlockTable] = own_table,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's sliding window (the widest): blocks before it are released
        self._table = table  # the request's block table in this pool
        self.ref_counts = [0] * num_blocks
        self.block_meta: list[CachedBlock | None] = [None] * num_blocks  # set while a block is cached
        self.cached: dict[bytes, int] = {}  # key -> block id
        # Free blocks in eviction order (front = next to reuse). Uncached blocks go to the front,
        # cached ones to the back, so a cached prefix survives as long as possible.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_cached_free = (
            0  # free blocks that still hold a cached prefix (kept as they change: usage() is per step)
        )
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of those, tokens found cached

    # --- verbs -------------------------------------------------------------------------------

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """The longest run of the request's leading full blocks already cached (with a window:
        the longest whose blocks inside the window of the token after it are, `window_hit`).

        The last token is never covered (its logits must be computed), so at most
        (num_tokens - 1) // block_size blocks can hit."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return PrefixHit([], 0)  # prompt logprobs need every prompt position's logits computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.window is not None:  # the blocks before the next token's window need not be cached
            return self.window_hit(request, max_blocks)
        self._extend_keys(request, max_blocks)
        hits = []
        for key in request.block_keys[:max_blocks]:
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return PrefixHit(hits, len(hits) * self.block_size)

    def window_hit(self, request: Request, num_blocks: int) -> PrefixHit:
        """A windowed pool's share of a hit of the request's leading `num_blocks` blocks: the longest
        hit of at most that many whose blocks inside the window of the first token after it are
        all cached (those before that window are FREED_BLOCK: no query reads them again)."""
        self._extend_keys(request, num_blocks)
        held = [self.cached.get(key) for key in request.block_keys[:num_blocks]]
        missing = [i for i, block in enumerate(held) if block is None]
        for n in range(num_blocks, -1, -1):
            while missing and missing[-1] >= n:
                missing.pop()
            dead = min(self.blocks_before_window(n * self.block_size), n)
            if not missing or missing[-1] < dead:
                return PrefixHit([FREED_BLOCK] * dead + held[dead:n], n * self.block_size)
        raise AssertionError("a hit of no blocks always holds")

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: PrefixHit | None = None,
        reserve: int = 0,
        lookahead: int = 0,
    ) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool is short.

        `prefix` (at admission only) attaches cached blocks first; `reserve` keeps that many
        blocks free after the allocation (a watermark for admitting new requests); `lookahead`
        adds slots for that many speculative tokens past them, which never enter the prefix
        cache (they are not final)."""
        table = self._table(request)
        hit_blocks = prefix.block_ids if prefix else []
        if hit_blocks and table.block_ids:
            raise ValueError("a prefix hit is attached only to a request without blocks")
        if not self.fits(request, num_new_tokens, prefix, reserve, lookahead):
            return None
        num_computed = prefix.num_tokens if prefix else request.num_computed_tokens
        if prefix is not None:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += prefix.num_tokens
        now = time.time()
        for block in hit_blocks:
            if block == FREED_BLOCK:  # before the window of the first token to compute: never read
                continue
            self._touch(block)
            meta = self.block_meta[block]
            meta.hits += 1
            meta.last_used = now
        num_needed = -(-(num_computed + num_new_tokens + lookahead) // self.block_size) - len(table.block_ids)
        new_blocks = [self._pop_free() for _ in range(max(num_needed - len(hit_blocks), 0))]
        table.block_ids.extend(hit_blocks)
        table.block_ids.extend(new_blocks)
        if hit_blocks:
            table.num_registered_blocks = len(hit_blocks)
            table.num_window_freed_blocks = next((i for i, b in enumerate(hit_blocks) if b != FREED_BLOCK),
                                                 len(hit_blocks))
        # Blocks fully covered once this step's tokens are computed join the cache now: a request
        # scheduled in the same step reads them after this step's KV writes, layer by layer.
        self._register_full_blocks(request, (num_computed + num_new_tokens) // self.block_size)
        return hit_blocks + new_blocks

    def fits(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None, reserve: int = 0,
             lookahead: int = 0) -> bool:
        """Whether `allocate` with these arguments finds its blocks (the scheduler preempts
        lower-priority requests until a waiting one fits). Blocks that left the window are
        released first: they are dead either way."""
        table = self._table(request)
        if self.window is not None and table.block_ids:
            self._release_out_of_window(request)
        hit_blocks = prefix.block_ids if prefix else []
        num_tokens = (prefix.num_tokens if prefix else request.num_computed_tokens) + num_new_tokens + lookahead
        num_needed = -(-num_tokens // self.block_size) - len(table.block_ids) - len(hit_blocks)
        # Hit blocks that sit in the free queue stop being free once attached.
        reclaimed = sum(1 for b in hit_blocks if b != FREED_BLOCK and self.ref_counts[b] == 0)
        return num_needed + reserve <= len(self.free_queue) - reclaimed

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted)."""
        # Blocks registered for tokens not computed yet (a request preempted inside the very
        # schedule() call that allocated them) hold no KV: they leave the cache before release.
        table = self._table(request)
        first_uncomputed = request.num_computed_tokens // self.block_size
        for i in range(first_uncomputed, min(table.num_registered_blocks, len(table.block_ids))):
            block = table.block_ids[i]
            meta = None if block == FREED_BLOCK else self.block_meta[block]
            if meta is not None and self.ref_counts[block] == 1 and meta.key == request.block_keys[i]:
                del self.cached[meta.key]
                self.block_meta[block] = None
        self._release(table.block_ids)
        table.block_ids.clear()
        table.num_registered_blocks = 0
        table.num_window_freed_blocks = 0

    def trim(self, request: Request) -> None:
        """Release the blocks past the request's computed tokens: after a verification they hold
        only rejected speculative KV (never cached: lookahead slots are not registered)."""
        table = self._table(request)
        keep = -(-request.num_computed_tokens // self.block_size)
        self._release(table.block_ids[keep:])
        del table.block_ids[keep:]

    # --- figures -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self, running: Sequence[Request]) -> KVUsage:
        return KVUsage(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_blocks - len(self.free_queue),
            num_cached_free_blocks=self.num_cached_free,
            num_used_tokens=sum(r.num_computed_tokens for r in running),
        )

    def cached_blocks(self) -> list[tuple[int, CachedBlock]]:
        """(block id, metadata) of every cached block, used or free (snapshot export)."""
        return [(b, meta) for b, meta in enumerate(self.block_meta) if meta is not None]

    def adopt_cached_block(self, meta: CachedBlock) -> int | None:
        """Reserve a free block for an imported cached block (snapshot restore) and register it.

        Returns the block id whose KV the caller must fill, or None when the key is already
        cached or no uncached free block is left (imports never evict)."""
        if meta.key in self.cached:
            return None
        block = next((b for b in self.free_queue if self.block_meta[b] is None), None)
        if block is None:
            return None
        self.block_meta[block] = meta
        self.cached[meta.key] = block
        self.num_cached_free += 1
        self.free_queue.move_to_end(block)
        return block

    # --- internals ---------------------------------------------------------------------------

    def _extend_keys(self, request: Request, num_blocks: int) -> None:
        keys = request.block_keys
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            parent = keys[-1] if keys else ROOT_KEY
            keys.append(block_key(parent, request.all_token_ids[i * bs : (i + 1) * bs], request.cache_extra))

    def _release_out_of_window(self, request: Request) -> None:
        """Release the leading blocks no query from the next token on can see: a query at p reads
        positions above p - window, so block i is done once (i + 1) * block_size <= p - window + 1."""
        table = self._table(request)
        dead = min(self.blocks_before_window(request.num_computed_tokens), len(table.block_ids))
        if dead <= table.num_window_freed_blocks:
            return
        first = table.num_window_freed_blocks
        self._release(table.block_ids[first:dead])
        table.block_ids[first:dead] = [FREED_BLOCK] * (dead - first)
        table.num_window_freed_blocks = dead

    def blocks_before_window(self, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on reads (0 without a window)."""
        return 0 if self.window is None else max(num_computed - self.window + 1, 0) // self.block_size

    def _release(self, blocks: list[int]) -> None:
        # Reverse order: a chain's tail is evicted before its head, which more requests share.
        for block in reversed(blocks):
            if block == FREED_BLOCK:
                continue
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_meta[block] is None:
                    self.free_queue.move_to_end(block, last=False)
                else:
                    self.num_cached_free += 1

    def _touch(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
            if self.block_meta[block] is not None:
                self.num_cached_free -= 1
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        meta = self.block_meta[block]
        if meta is not None:  # evict the least recently freed cached block
            del self.cached[meta.key]
            self.block_meta[block] = None
            self.num_cached_free -= 1
        self.ref_counts[block] = 1
        return block

    def _register_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        table = self._table(request)
        if not self.enable_prefix_caching or num_full_blocks <= table.num_registered_blocks:
            return
        self._extend_keys(request, num_full_blocks)
        bs = self.block_size
        now = time.time()
        for i in range(table.num_registered_blocks, num_full_blocks):
            key = request.block_keys[i]
            block = table.block_ids[i]
            if block == FREED_BLOCK or key in self.cached or self.block_meta[block] is not None:
                continue  # same content computed twice concurrently: keep the first copy cached
            parent = request.block_keys[i - 1] if i else ROOT_KEY
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.block_meta[block] = CachedBlock(key, parent, tokens, last_used=now)
            self.cached[key] = block
        table.num_registered_blocks = num_full_blocks
