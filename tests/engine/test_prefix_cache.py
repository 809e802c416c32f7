"""Prefix cache: exact block ids and ref counts, LRU eviction order, hash stability, exact outputs."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ferry.worker.engine import Engine, SamplingParams
from ferry.worker.engine.kv_cache import ROOT_KEY, KVCacheManager, block_key, cache_extra
from ferry.worker.engine.outputs import RequestMetrics
from ferry.worker.engine.request import Request

BS = 4  # tokens per block in every test here
REPO = Path(__file__).resolve().parents[2]


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(cache_salt=cache_salt).resolved({}, remaining=16),
        priority=0,
        arrival_seq=0,
        metrics=RequestMetrics(arrival_time=0.0),
        cache_extra=cache_extra("test-model", cache_salt),
    )


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does at admission: look up the prefix, allocate the rest, compute it."""
    prefix = kv.lookup_prefix(request)
    blocks = kv.allocate(request, request.num_tokens - prefix.num_tokens, prefix)
    if blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return blocks


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv.free_queue)


# --- the block manager ---------------------------------------------------------------------------


def test_miss_hit_and_partial_hit_share_exact_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == [0, 1, 2]
    assert kv.ref_counts == [1, 1, 1, 0, 0, 0, 0, 0]
    assert sorted(kv.cached.values()) == [0, 1]  # only full blocks are cached

    b = make_request("b", list(range(8)) + [100, 101, 102])  # same first 2 blocks
    hit = kv.lookup_prefix(b)
    assert (hit.block_ids, hit.num_tokens) == ([0, 1], 8)
    assert admit(kv, b) == [0, 1, 3]
    assert b.block_ids == [0, 1, 3]
    assert kv.ref_counts == [2, 2, 1, 1, 0, 0, 0, 0]

    c = make_request("c", list(range(4)) + list(range(50, 58)))  # shares only the first block
    assert kv.lookup_prefix(c).block_ids == [0]
    assert admit(kv, c) == [0, 4, 5]
    assert kv.ref_counts == [3, 2, 1, 1, 1, 1, 0, 0]
    assert sorted(kv.cached.values()) == [0, 1, 4, 5]

    d = make_request("d", list(range(8)), cache_salt="tenant-2")  # same tokens, other tenant
    assert kv.lookup_prefix(d).block_ids == []
    assert admit(kv, d) == [6, 7]
    assert kv.prefix_queries == 10 + 11 + 12 + 8
    assert kv.prefix_hits == 0 + 8 + 4 + 0


def test_last_prompt_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))  # exactly 2 full blocks: the 2nd must be recomputed
    assert kv.lookup_prefix(again).num_tokens == BS


def test_freed_blocks_stay_cached_and_evict_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(9)))  # blocks 0, 1 full (cached), block 2 partial
    admit(kv, a)
    kv.free(a)
    # The uncached partial block is reused first; cached ones wait at the back, tail before head.
    assert free_order(kv) == [2, 3, 4, 5, 1, 0]
    assert kv.ref_counts == [0] * 6
    assert kv.usage([]).num_cached_free_blocks == 2

    b = make_request("b", list(range(100, 108)))
    assert admit(kv, b) == [2, 3]  # uncached free blocks go first: nothing evicted
    c = make_request("c", list(range(200, 208)))
    assert admit(kv, c) == [4, 5]
    assert sorted(kv.cached.values()) == [0, 1, 2, 3, 4, 5]  # every computed full block
    assert free_order(kv) == [1, 0]

    d = make_request("d", list(range(300, 304)))  # one block: evicts a's tail, keeps its head
    assert admit(kv, d) == [1]
    head, tail = a.block_keys
    assert tail not in kv.cached and kv.cached[head] == 0
    again = make_request("a2", list(range(9)))
    assert kv.lookup_prefix(again).block_ids == [0]


def test_blocks_in_use_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(16)))
    assert admit(kv, a) == [0, 1, 2, 3]
    b = make_request("b", list(range(50, 54)))
    assert admit(kv, b) is None  # the pool is short: the caller preempts, nothing is evicted
    assert b.block_ids == [] and kv.ref_counts == [1, 1, 1, 1]
    assert len(kv.cached) == 4


def test_hit_on_a_free_cached_block_reclaims_it_from_the_lru():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == [0, 1, 2]
    assert free_order(kv) == [3]
    assert kv.ref_counts == [1, 1, 1, 0]
    assert kv.block_meta[0].hits == 1 and kv.block_meta[1].hits == 1


# --- hash stability ------------------------------------------------------------------------------

# The key of block [0..15] under model salt "ferry" and no cache_salt. Snapshots written by one
# release are read by the next: a change here orphans every stored snapshot.
GOLDEN_KEY = "47160db02beabf3461e330a6035bd69c451ead2b530f8a6c5d0536241d86cd1e"


def test_block_key_is_pinned_and_chained():
    first = block_key(ROOT_KEY, list(range(16)), cache_extra("ferry", None))
    assert first.hex() == GOLDEN_KEY
    # The documented construction, spelled out: parent ‖ u32 count ‖ u32 LE tokens ‖ extra.
    extra = struct.pack("<I", 5) + b"ferry"
    payload = bytes(32) + struct.pack("<I", 16) + struct.pack("<16I", *range(16)) + extra
    assert hashlib.sha256(payload).hexdigest() == GOLDEN_KEY
    second = block_key(first, list(range(16)), cache_extra("ferry", None))
    assert second != first  # same tokens, other position in the chain
    assert block_key(ROOT_KEY, list(range(16)), cache_extra("ferry", "t")) != first
    assert block_key(ROOT_KEY, list(range(16)), cache_extra("other", None)) != first


def test_keys_are_identical_in_another_process(llama_dir):
    prompt = list(range(5, 60))
    engine = Engine(llama_dir, block_size=BS, kv_cache_bytes=64 * 2048, max_model_len=128)
    here = _engine_keys(engine, prompt)
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from worker.engine import Engine\n"
        f"e = Engine({str(llama_dir)!r}, block_size={BS}, kv_cache_bytes=64 * 2048, max_model_len=128)\n"
        "e.add_request('r', list(range(5, 60)))\n"
        "r = e.scheduler.waiting[0]; e.kv.lookup_prefix(r)\n"
        "print(' '.join(k.hex() for k in r.block_keys))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    there = done.stdout.split()
    assert len(here) == (len(prompt) - 1) // BS
    assert there == here


def _engine_keys(engine: Engine, prompt: list[int]) -> list[str]:
    engine.add_request("r", prompt)
    request = engine.scheduler.waiting[0]
    engine.kv.lookup_prefix(request)
    keys = [k.hex() for k in request.block_keys]
    engine.abort("r")
    engine.step()
    return keys


# --- through the engine --------------------------------------------------------------------------


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int = 6) -> dict[str, tuple[list[int], int]]:
    """Run requests to completion: id -> (generated tokens, num_cached_tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, tuple[list[int], int]] = {r: ([], 0) for r in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, out.num_cached_tokens)
    return results


@pytest.fixture
def small_engine(llama_dir):
    # 32 blocks of 4 tokens: block ids stay small enough to assert exactly.
    return Engine(llama_dir, block_size=BS, kv_cache_bytes=32 * 2048, max_model_len=64)


def test_abort_during_a_hit_releases_the_shared_blocks(small_engine):
    engine = small_engine
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks + 2
    assert run(engine, {"a": prompt}, max_tokens=1)["a"][1] == 0
    assert sorted(engine.kv.cached.values()) == [0, 1, 2]
    assert engine.kv.ref_counts[:4] == [0, 0, 0, 0]

    longer = prompt + list(range(40, 46))  # 20 tokens: shares a's 3 cached blocks
    engine.add_request("b", longer, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    (first,) = engine.step()
    assert first.num_cached_tokens == 12
    b = engine.scheduler.requests["b"]
    assert b.block_ids == [0, 1, 2, 3, 4]  # 3 hits, then a's freed partial block 3, then 4
    assert engine.kv.ref_counts[:6] == [1, 1, 1, 1, 1, 0]
    assert engine.stats().prefix_cache_hits == 12

    assert engine.abort("b")
    (aborted,) = engine.step()
    assert aborted.finish_reason == "abort"
    assert engine.kv.ref_counts[:6] == [0] * 6
    assert engine.kv_usage().num_used_blocks == 0
    # b's own full blocks 3 and 4 joined the cache; the head of the chain is evicted last.
    assert sorted(engine.kv.cached.values()) == [0, 1, 2, 3, 4]
    assert list(engine.kv.free_queue)[-5:] == [4, 3, 2, 1, 0]

    again = run(engine, {"c": longer}, max_tokens=1)
    assert again["c"][1] == 16  # 4 of 5 full blocks: the last prompt token is recomputed


def test_cache_salt_isolates_tenants(small_engine):
    prompt = list(range(10, 30))
    run(small_engine, {"a": prompt}, max_tokens=1)
    params = SamplingParams(max_tokens=1, cache_salt="tenant-b")
    small_engine.add_request("b", prompt, params)
    (out,) = small_engine.step()
    assert out.num_cached_tokens == 0
    small_engine.add_request("b2", prompt, params)
    (out,) = small_engine.step()
    assert out.num_cached_tokens == 16


def test_greedy_outputs_identical_with_and_without_prefix_caching(llama_dir):
    system = list(range(3, 40))
    prompts = {f"r{i}": system + [50 + i, 60 + i, 70 + i] * (i + 1) for i in range(4)}
    outputs = {}
    for caching in (True, False):
        engine = Engine(
            llama_dir, block_size=BS, kv_cache_bytes=96 * 2048, max_model_len=96, enable_prefix_caching=caching
        )
        first = run(engine, {"r0": prompts["r0"]}, max_tokens=8)
        rest = run(engine, {k: v for k, v in prompts.items() if k != "r0"}, max_tokens=8)
        outputs[caching] = {**first, **rest}
        if not caching:
            assert engine.stats().prefix_cache_hits == 0
    assert {k: v[0] for k, v in outputs[True].items()} == {k: v[0] for k, v in outputs[False].items()}
    assert all(outputs[True][f"r{i}"][1] == 36 for i in range(1, 4))  # the 9 full system blocks
    assert all(cached == 0 for _, cached in outputs[False].values())


def test_cached_free_count_follows_every_change_of_the_pool():
    """usage() reads a running count (it is asked every step); it must equal a count of the pool
    through hits on free cached blocks, evictions, releases and snapshot imports."""
    import random

    from ferry.worker.engine.kv_cache import CachedBlock

    def counted(kv: KVCacheManager) -> int:
        return sum(1 for b in kv.free_queue if kv.block_meta[b] is not None)

    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    live: list[Request] = []
    shrank = 0  # admissions after which fewer blocks were cached: something was evicted
    for step in range(300):
        if live and (rng.random() < 0.4 or kv.num_free_blocks < 4):
            kv.free(live.pop(rng.randrange(len(live))))  # finish: full blocks stay cached
        else:
            # Prompts from a few shared heads, so later ones hit the cache, evict, or both.
            head = rng.randrange(3)
            tokens = [1000 * head + i for i in range(rng.randrange(1, 4) * BS)] + [rng.randrange(10**6)]
            request = make_request(f"r{step}", tokens)
            cached_before = len(kv.cached)
            if admit(kv, request) is not None:
                live.append(request)
                shrank += len(kv.cached) < cached_before
        if step % 50 == 0:  # a snapshot import puts a cached block straight into the free queue
            kv.adopt_cached_block(CachedBlock(f"imported-{step}".encode(), ROOT_KEY, (1, 2, 3, 4), last_used=0.0))
        assert kv.usage(live).num_cached_free_blocks == counted(kv), step
    assert kv.prefix_hits > 0 and shrank > 0  # the walk did exercise hits and evictions
    for request in live:
        kv.free(request)
    assert kv.usage([]).num_cached_free_blocks == counted(kv) == len(kv.cached)


def test_a_prompt_shared_by_n_requests_is_prefilled_once_even_in_chunks(llama_dir):
    # n choices (or a batch's common prompt) arrive as n requests. The first one's chunks take the
    # step's whole budget until its prompt is done, and the blocks of each chunk enter the cache as
    # it is scheduled, so the others are admitted only onto a fully cached prompt: each computes
    # just the last partial block, never a chunk of its own.
    engine = Engine(llama_dir, block_size=BS, kv_cache_bytes=64 * 2048, max_model_len=64, max_num_batched_tokens=16)
    prompt = list(range(10, 50))  # 40 tokens: 3 chunks of at most 16, 10 full blocks
    outputs = run(engine, {f"choice-{i}": prompt for i in range(3)}, max_tokens=3)
    stats = engine.stats()
    assert stats.prefix_cache_queries == 3 * 40
    assert stats.prefix_cache_hits == 2 * 36  # 9 of 10 full blocks: the last prompt token is recomputed
    assert sorted(cached for _, cached in outputs.values()) == [0, 36, 36]
    assert len({tuple(tokens) for tokens, _ in outputs.values()}) == 1  # greedy: the same tokens each
