"""A hybrid model's KV (full-attention layers beside sliding-window ones): two pools, the windowed
one releasing blocks that left the window, so a sequence's KV is its full layers' for every token
and its windowed layers' for about its window, with transformers' tokens and a correct prefix cache."""

from __future__ import annotations

import pytest
import torch

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.engine.hybrid_kv import HybridKVCacheManager
from ferry.worker.engine.kv_budget import split_pool
from ferry.worker.engine.kv_cache import FREED_BLOCK
from ferry.worker.models.kv_split import KVSplit
from tests.engine.helpers import make_request
from tests.engine.test_hf_parity import _assert_all_free, _prompts, _reference

# --- the manager ---------------------------------------------------------------------------------


def _grow(kv: HybridKVCacheManager, request, upto: int) -> None:
    """Compute the request's tokens one at a time up to `upto` (as decode steps would)."""
    while request.num_computed_tokens < upto:
        assert kv.allocate(request, 1) is not None
        request.num_computed_tokens += 1


def test_the_windowed_pool_releases_blocks_the_window_left_and_the_full_pool_keeps_them():
    kv = HybridKVCacheManager(num_blocks=16, num_window_blocks=8, block_size=4, enable_prefix_caching=True,
                              window=8)
    r = make_request("a", 40)
    assert kv.allocate(r, 4) is not None
    r.num_computed_tokens = 4
    _grow(kv, r, 40)
    assert len(r.block_ids) == 10 and FREED_BLOCK not in r.block_ids  # every token's, for the full layers
    # The next token (40) sees 33..40: blocks 0..7 hold nothing it reads; 8 and 9 stay.
    kv.allocate(r, 1)
    table = r.window_table.block_ids
    assert table[:8] == [FREED_BLOCK] * 8 and FREED_BLOCK not in table[8:]
    assert kv.windowed.num_blocks - kv.windowed.num_free_blocks == len(table) - 8 <= 8 // 4 + 1
    kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_an_allocation_takes_blocks_in_both_pools_or_in_neither():
    kv = HybridKVCacheManager(num_blocks=16, num_window_blocks=3, block_size=4, enable_prefix_caching=False,
                              window=8)
    a, b = make_request("a", 12), make_request("b", 8)
    assert kv.allocate(a, 12) is not None  # 3 blocks in each pool
    assert not kv.fits(b, 8)
    assert kv.allocate(b, 8) is None  # the full pool has room, the windowed one none: nothing taken
    assert b.block_ids == [] and b.window_table.block_ids == [] and kv.full.num_free_blocks == 13
    kv.free(a)
    assert kv.allocate(b, 8) is not None


def _computed_prompt(num_window_blocks: int):
    """A manager (block 4, window 8) in which request `a`'s 41 tokens are computed: blocks 0..9 cached."""
    kv = HybridKVCacheManager(num_blocks=32, num_window_blocks=num_window_blocks, block_size=4,
                              enable_prefix_caching=True, window=8)
    a = make_request("a", 41)
    kv.allocate(a, 41, kv.lookup_prefix(a))
    a.num_computed_tokens = 41
    return kv, a


def test_a_prefix_hit_needs_only_the_windowed_blocks_inside_the_window():
    kv, a = _computed_prompt(num_window_blocks=12)
    kv.free(a)  # blocks 0..9 cached in both pools; the windowed pool's free queue: 10 (uncached), 11, then 9..0
    b = make_request("b", 41)  # the same tokens: 10 full blocks can hit
    assert kv.lookup_prefix(b).num_tokens == 40
    # Another prompt takes 4 windowed blocks: the free ones, then the least recent cached: 9 and 8.
    assert kv.allocate(make_request("d", 16, first_token=1000), 16) is not None
    hit = kv.lookup_prefix(b)
    # 10 or 9 blocks would need block 9 or 8 for the next token's window; after 8 blocks, the
    # token at 32 reads 25..32: blocks 6 and 7, still cached.
    assert hit.num_tokens == 32 and hit.block_ids == [kv.full.cached[k] for k in b.block_keys[:8]]
    assert hit.window.block_ids == [FREED_BLOCK] * 6 + [kv.windowed.cached[k] for k in b.block_keys[6:8]]
    # More pressure evicts 7..2: the longest hit left is 2 blocks (the token at 8 reads 1..8: blocks 0, 1).
    assert kv.allocate(make_request("e", 24, first_token=2000), 24) is not None
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 8 and hit.window.block_ids == [kv.windowed.cached[k] for k in b.block_keys[:2]]


def test_a_hit_attaches_the_window_and_marks_the_blocks_before_it_freed():
    kv, a = _computed_prompt(num_window_blocks=32)
    b = make_request("b", 41)
    hit = kv.lookup_prefix(b)
    assert kv.allocate(b, 1, hit) is not None
    table = b.window_table
    assert table.block_ids[:8] == [FREED_BLOCK] * 8 and table.block_ids[8:10] == a.window_table.block_ids[8:10]
    assert table.num_window_freed_blocks == 8 and b.block_ids[:10] == a.block_ids[:10]
    assert kv.windowed.ref_counts[a.window_table.block_ids[0]] == 1  # only a holds the blocks b skipped
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


def test_the_windowed_pool_gets_what_the_windows_need_and_the_rest_goes_to_the_full_layers():
    split = KVSplit(full_layers=(1, 3), window_layers=(0, 2, 4, 5), window=64)
    full, windowed = split_pool(1000, split, block_size=16, max_num_seqs=8, step_tokens=512)
    assert windowed == 8 * (64 // 16 + 2) + 512 // 16  # 80
    assert full * 2 + windowed * 4 == 1000 * 6  # the same bytes as 1000 blocks of every layer
    assert split_pool(40, split, 16, 8, 512) == (40, 40)  # a pool smaller than the need: as one pool
    assert split_pool(1000, None, 16, 8, 512) == (1000, 0)


# --- the engine ----------------------------------------------------------------------------------

HYBRID_CASES = {
    # Gemma 2: every other layer a sliding window
    "gemma2": ("gemma2", {"head_dim": 16, "num_layers": 4, "attn_logit_softcapping": 5.0}),
    # Qwen2: layers from max_window_layers on slide
    "qwen2": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1, "num_layers": 3}),
}


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_a_sequence_4x_past_its_window_holds_its_window_of_the_windowed_layers_kv(tiny_model_factory, case):
    """KV bytes per sequence at 4x the window: every token's of the full layers, and at most 1.1x
    the window's worth of the windowed layers'; greedy tokens are transformers', also for a second
    request that takes the prompt from the prefix cache."""
    window, block = 64, 4
    arch, config = HYBRID_CASES[case]
    model_dir = tiny_model_factory(arch, sliding_window=window, **config)
    llm = LLM(str(model_dir), block_size=block, max_num_batched_tokens=16)
    kv, runner = llm.engine.core.kv, llm.engine.runner
    assert isinstance(kv, HybridKVCacheManager) and kv.window == window
    full_layers, window_layers = runner.kv_cache.shape[0], runner.window_kv_cache.shape[0]
    assert full_layers + window_layers == llm.engine.arch.num_layers and full_layers and window_layers
    prompt = _prompts(llm.engine.arch.vocab_size)[-1]  # 50 tokens
    new_tokens = 4 * window
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("a", prompt, params)
    tokens, held = [], []
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            tokens += output.new_token_ids
        request = llm.engine.scheduler.requests.get("a")
        if request is not None:
            held.append((request.num_computed_tokens, kv.full.num_blocks - kv.full.num_free_blocks,
                         kv.windowed.num_blocks - kv.windowed.num_free_blocks))
    assert tokens == _reference(model_dir, [prompt], new_tokens=new_tokens)[0]
    computed, full_held, window_held = held[-1]
    assert computed >= 4 * window
    assert full_held == -(-computed // block)  # every computed token's
    # Bytes: one token of one layer is 2 (K and V) x kv heads x head dim elements.
    token_layer_bytes = 2 * llm.engine.arch.num_kv_heads * llm.engine.arch.head_dim * 4
    window_bytes = max(w for _, _, w in held[-window:]) * block * window_layers * token_layer_bytes
    assert window_bytes <= 1.1 * window * window_layers * token_layer_bytes
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == tokens
    _assert_all_free(llm)


def test_a_snapshot_of_a_hybrid_model_carries_both_pools_kv(tiny_model_factory, monkeypatch):
    """Blocks read from one engine's two pools, in layer order as one pool holds them (so snapshots
    move between the two), and adopted by another engine: a prompt whose prefix came that way
    decodes as it did."""
    model_dir = tiny_model_factory("gemma2", head_dim=16, num_layers=4, sliding_window=16)
    prompt = _prompts(300)[-1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = LLM(str(model_dir), block_size=4)
    expected = first.generate([prompt], params, use_tqdm=False)[0].token_ids
    blocks = first.engine.prefix_blocks
    cached = blocks.cached()
    assert len(cached) == (len(prompt) + 8 - 1) // 4  # every full block, in both pools
    keys = [meta.key for meta in cached]
    kv = blocks.read(keys)
    second = LLM(str(model_dir), block_size=4)
    assert second.engine.prefix_blocks.adopt(cached, kv) == len(cached)
    assert torch.equal(second.engine.prefix_blocks.read(keys), kv)
    out = second.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(prompt) - 1) // 4 * 4 and out.token_ids == expected
    monkeypatch.setattr("ferry.worker.engine.loading.kv_split", lambda arch: None)
    one_pool = LLM(str(model_dir), block_size=4)
    assert one_pool.engine.runner.window_kv_cache is None
    one_pool.generate([prompt], params, use_tqdm=False)
    torch.testing.assert_close(one_pool.engine.prefix_blocks.read(keys), kv)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_a_short_pool_preempts_and_speculation_trims_both_pools(tiny_model_factory, speculative):
    """Gemma 2 with a 16-token window on a pool too small for its requests: preemption frees both
    pools' blocks, proposals' lookahead blocks are taken and trimmed in both, and every request
    still gets transformers' tokens, past its window."""
    model_dir = tiny_model_factory("gemma2", head_dim=16, num_layers=4, sliding_window=16)
    probe = LLM(str(model_dir), max_model_len=128)
    per_block = probe.engine.runner.bytes_per_block(probe.engine.arch, 16, torch.float32)
    spec = {"speculative": {"method": "ngram", "measure_speedup": False, "min_acceptance_rate": 0.0}}
    # 12 blocks of every layer for 8 requests of up to 82 tokens: preemption is certain.
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_bytes=12 * per_block, max_num_seqs=8,
              **(spec if speculative else {}))
    assert isinstance(llm.engine.core.kv, HybridKVCacheManager)
    prompts = _prompts(llm.engine.arch.vocab_size)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    if speculative:
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    _assert_all_free(llm)
