"""Block manager: exact block ids through allocation, growth, freeing and eviction order; the
CPU pool the blocks live in."""

from __future__ import annotations

from ferry.worker.engine.kv_cache import FREED_BLOCK, KVCacheManager
from tests.engine.helpers import make_request


def test_blocks_are_allocated_only_when_a_token_needs_one():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = make_request("a", 5)
    assert kv.allocate(r, 5) == [0, 1]  # 5 tokens -> 2 blocks
    r.num_computed_tokens = 5
    assert kv.allocate(r, 1) == []  # token 6 fits block 1
    r.num_computed_tokens = 6
    assert kv.allocate(r, 2) == []  # tokens 7-8 still fit block 1
    assert kv.allocate(r, 3) == [2]  # token 9 opens block 2
    assert r.block_ids == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_allocation_is_all_or_nothing_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = make_request("a", 8), make_request("b", 12)
    assert kv.allocate(a, 8) == [0, 1]
    assert kv.allocate(b, 12) is None  # needs 3, only 2 free: nothing taken
    assert b.block_ids == [] and kv.num_free_blocks == 2
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 4
    assert kv.allocate(b, 12) is not None
    assert sorted(b.block_ids) == [0, 1, 2]


def test_reserve_keeps_a_watermark_free():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    assert kv.allocate(make_request("a", 12), 12, reserve=2) is None
    assert kv.allocate(make_request("b", 8), 8, reserve=2) == [0, 1]


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", 10)  # blocks: [0..3] [4..7] [8, 9]
    assert kv.lookup_prefix(a).block_ids == []
    assert kv.allocate(a, 10, kv.lookup_prefix(a)) == [0, 1, 2]
    a.num_computed_tokens = 10
    b = make_request("b", 9)  # same first 9 tokens: two full blocks can hit
    hit = kv.lookup_prefix(b)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    assert kv.allocate(b, 1, hit) == [0, 1, 3]
    assert kv.ref_counts[:4] == [2, 2, 1, 1]
    assert kv.prefix_hits == 8 and kv.prefix_queries == 10 + 9


def test_last_prompt_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", 8)
    kv.allocate(a, 8, kv.lookup_prefix(a))
    b = make_request("b", 8)  # identical 8 tokens = 2 full blocks, but only 1 may hit
    assert kv.lookup_prefix(b).block_ids == [0]


def test_partial_hit_stops_at_first_divergent_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", 12)
    kv.allocate(a, 12, kv.lookup_prefix(a))
    b = make_request("b", 12)
    b.all_token_ids[5] = 999  # second block differs, so the third (chained) cannot hit either
    assert kv.lookup_prefix(b).block_ids == [0]


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", 9)
    a.cache_extra = b"tenant-a"
    kv.allocate(a, 9, kv.lookup_prefix(a))
    b = make_request("b", 9)
    b.cache_extra = b"tenant-b"
    assert kv.lookup_prefix(b).block_ids == []
    c = make_request("c", 9)
    c.cache_extra = b"tenant-a"
    assert kv.lookup_prefix(c).block_ids == [0, 1]


def test_freed_blocks_stay_cached_and_evict_in_lru_order():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", 9, first_token=0)  # full blocks 0, 1 cached; block 2 partial
    kv.allocate(a, 9, kv.lookup_prefix(a))
    a.num_computed_tokens = 9
    kv.free(a)
    # Uncached partial block 2 is reused first; cached chain tail (1) goes before its head (0).
    assert list(kv.free_queue)[:1] == [2]
    assert list(kv.free_queue)[-2:] == [1, 0]
    assert set(kv.cached.values()) == {0, 1}
    b = make_request("b", 17, first_token=100)  # 5 blocks: takes 2, 3, 4, 5, then evicts 1
    assert kv.allocate(b, 17, kv.lookup_prefix(b)) == [2, 3, 4, 5, 1]
    assert 1 not in kv.cached.values() and 0 in kv.cached.values()
    c = make_request("c", 9, first_token=0)
    assert kv.lookup_prefix(c).block_ids == [0]  # head of a's chain survived the eviction


def test_blocks_in_use_are_never_evicted():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", 9)
    kv.allocate(a, 9, kv.lookup_prefix(a))  # uses all 3 blocks
    b = make_request("b", 4, first_token=50)
    assert kv.allocate(b, 4, kv.lookup_prefix(b)) is None
    assert a.block_ids == [0, 1, 2] and set(kv.cached.values()) == {0, 1}


def test_hit_on_a_free_cached_block_reclaims_it():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", 9)
    kv.allocate(a, 9, kv.lookup_prefix(a))
    a.num_computed_tokens = 9
    kv.free(a)
    b = make_request("b", 9)
    hit = kv.lookup_prefix(b)
    assert hit.block_ids == [0, 1]
    assert kv.allocate(b, 1, hit) == [0, 1, 2]
    assert kv.num_free_blocks == 0 and kv.ref_counts == [1, 1, 1]


def test_abort_during_a_hit_releases_only_its_references():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", 9)
    kv.allocate(a, 9, kv.lookup_prefix(a))
    b = make_request("b", 9)
    kv.allocate(b, 1, kv.lookup_prefix(b))
    kv.free(b)  # aborted while sharing a's prefix
    assert kv.ref_counts[:3] == [1, 1, 1]
    assert kv.cached == {a.block_keys[0]: 0, a.block_keys[1]: 1}
    kv.free(a)
    assert kv.num_free_blocks == 6 and sum(kv.ref_counts) == 0


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", 9)
    kv.allocate(a, 9, kv.lookup_prefix(a))
    assert kv.cached == {}
    assert kv.lookup_prefix(make_request("b", 9)).block_ids == []


def test_blocks_registered_for_uncomputed_tokens_leave_the_cache_on_free():
    """A request preempted in the same schedule() call that allocated it never computed those
    blocks' KV: they must not stay behind as prefix-cache hits."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", 9)
    kv.allocate(a, 9, kv.lookup_prefix(a))  # registers blocks 0 and 1 for tokens this step would compute
    assert set(kv.cached.values()) == {0, 1}
    kv.free(a)  # preempted before the step ran: num_computed_tokens is still 0
    assert kv.cached == {} and kv.num_free_blocks == 8
    assert kv.lookup_prefix(make_request("b", 9)).block_ids == []


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_cpu_pool_is_zero_and_takes_memory_only_as_it_is_written():
    import torch

    from ferry.worker.engine.model_runner import zeroed_pool

    shape = (4, 2, 1024, 2, 16, 64)  # [layer, K/V, block, kv head, slot, head dim]: 512 MiB of float32
    before = _resident_bytes()
    pool = zeroed_pool(shape, torch.float32, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert _resident_bytes() - before < (64 << 20)  # torch.zeros would have written all 512 MiB
    pool[1, 0, 7] = 2.5
    assert float(pool[1, 0, 7].sum()) == 2.5 * 2 * 16 * 64 and float(pool.sum()) == 2.5 * 2 * 16 * 64
    half = zeroed_pool((3, 5), torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and torch.equal(half, torch.zeros(3, 5, dtype=torch.bfloat16))
    assert zeroed_pool((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_a_windowed_pool_hits_a_prefix_whose_blocks_before_the_window_were_evicted():
    """Every layer windowed: a prompt's blocks before the window of its next token are never read
    again, so a hit needs only the blocks inside it (the ones before stand as FREED_BLOCK)."""
    kv = KVCacheManager(num_blocks=12, block_size=4, window=8)
    a = make_request("a", 41)
    kv.allocate(a, 12, kv.lookup_prefix(a))
    a.num_computed_tokens = 12
    while a.num_computed_tokens < 41:  # one token a step: blocks behind the window are released as it goes
        assert kv.allocate(a, 1) is not None
        a.num_computed_tokens += 1
    assert a.block_ids[:8] == [FREED_BLOCK] * 8
    kv.free(a)  # blocks 0..9 cached; the free queue: 10 (uncached), 11, then 0..7 as released, then 9, 8
    assert kv.allocate(make_request("d", 24, first_token=1000), 24) == [10, 11, 0, 1, 2, 3]  # evicts 0..3
    b = make_request("b", 41)
    hit = kv.lookup_prefix(b)
    # the token at 40 reads 33..40: blocks 8 and 9, still cached
    assert hit.num_tokens == 40 and hit.block_ids == [FREED_BLOCK] * 8 + [8, 9]
    assert kv.allocate(b, 1, hit) == hit.block_ids + [4]
    assert b.num_window_freed_blocks == 8
