"""Greedy tokens identical to transformers `generate` on the same weights, for every architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.models.config import UnsupportedModelError

PROMPT_LENGTHS = [1, 3, 7, 12, 16, 17, 33, 50]  # below, at and past block boundaries
NEW_TOKENS = 32


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _reference(model_dir, prompts, dtype=torch.float32, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def _assert_all_free(llm: LLM) -> None:
    usage = llm.engine.kv_usage()
    assert usage.num_used_blocks == 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert not llm.engine.has_unfinished_requests()


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

ARCH_CASES = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "llama-mha": {"num_kv_heads": 4},
    "llama-gqa4": {"num_heads": 8, "num_kv_heads": 2, "hidden_size": 64},
    "phi3": {},
}


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_matches_transformers(tiny_model_factory, case):
    arch = case.split("-")[0]
    model_dir = tiny_model_factory(arch, **ARCH_CASES[case])
    llm = LLM(str(model_dir))
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    assert all(o.finish_reason == "length" and o.num_prompt_tokens == len(p) for o, p in zip(outputs, prompts))
    _assert_all_free(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_and_mixed_batches_match(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    # 8 tokens a step: every prompt over 8 tokens is split, decodes ride along with prefill chunks.
    llm = LLM(str(model_dir), max_num_batched_tokens=8, enable_prefix_caching=False)
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    _assert_all_free(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_by_recompute_matches(tiny_model_factory, prefix_caching):
    model_dir = tiny_model_factory("llama")
    probe = LLM(str(model_dir), max_model_len=128)
    per_block = probe.engine.runner.bytes_per_block(probe.engine.arch, 16, torch.float32)
    # 10 blocks = 160 token slots for 8 requests that need up to 82 tokens each: preemption is certain.
    llm = LLM(str(model_dir), max_model_len=128, kv_cache_bytes=10 * per_block, enable_prefix_caching=prefix_caching)
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    _assert_all_free(llm)


def test_sharded_checkpoint_and_llama3_rope(tiny_model_factory):
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    model_dir = tiny_model_factory("llama", shard_size="40KB", rope_parameters=rope)
    assert (model_dir / "model.safetensors.index.json").is_file()
    llm = LLM(str(model_dir))
    assert llm.engine.arch.rope.kind == "llama3"
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)


# RoPE variants whose frequencies transformers' own init functions give (YaRN scales cos and sin too);
# `original_max_position_embeddings` below the prompts' lengths, so the scaled bands are exercised.
ROPE_VARIANTS = {
    "linear": ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "yarn": ("qwen2", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                       "original_max_position_embeddings": 32}),
    "yarn-mscale": ("llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0,
                              "beta_slow": 2.0, "attention_factor": 1.3, "original_max_position_embeddings": 16}),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_transformers(tiny_model_factory, variant):
    arch, rope = ROPE_VARIANTS[variant]
    model_dir = tiny_model_factory(arch, rope_parameters=rope)
    llm = LLM(str(model_dir))
    assert llm.engine.arch.rope.kind == rope["rope_type"]
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)


def test_a_rope_that_changes_with_the_sequence_length_is_refused_by_name(tiny_model_factory):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 32}
    model_dir = tiny_model_factory("llama", rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        LLM(str(model_dir))


# Phi-3.5 / Phi-3-128k's LongRoPE, with the switch at 24 positions: prompts that stay short, cross
# it while generating, and start past it (head_dim 16: 8 factors each).
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}
# Phi3Config also keeps the switch at the top level (its default, 4096, would win over the rope's).
LONGROPE_LENGTHS = {"max_position_embeddings": 96, "original_max_position_embeddings": 24}


LONGROPE_ENGINES = {
    "plain": {"enable_prefix_caching": False},
    "prefix-cache": {"enable_prefix_caching": True},
    # n-gram proposals never reach past the switch unrecomputed (the repeated prompt proposes)
    "ngram": {"speculative": {"method": "ngram", "measure_speedup": False, "min_acceptance_rate": 0.0}},
}


@pytest.mark.parametrize("engine", list(LONGROPE_ENGINES))
def test_longrope_matches_transformers_across_the_switch(tiny_model_factory, engine):
    """transformers rotates a sequence with the short factors while it is at most 24 tokens long;
    when it first grows past that it drops its cache and recomputes every key with the long ones.
    Ferry the same (a recompute at the switch), with prompts split into chunks, batched together
    and (with the prefix cache) sharing a prefix across prompts on both sides of the switch."""
    model_dir = tiny_model_factory("phi3", rope_parameters=LONGROPE, **LONGROPE_LENGTHS)
    llm = LLM(str(model_dir), max_num_batched_tokens=8, block_size=4, **LONGROPE_ENGINES[engine])
    assert llm.engine.arch.rope.kind == "longrope"
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, llm.engine.arch.vocab_size, (20,), generator=g).tolist()
    prompts = [shared[:5], shared, shared + [7, 8, 9, 10, 11], shared[:12] + list(range(30, 50)), [9] * 24]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)  # 32 new tokens: every prompt ends past 24
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    _assert_all_free(llm)


def test_a_longrope_prompt_past_the_switch_is_rotated_long_from_its_first_token(tiny_model_factory):
    """Greedy tokens of a tiny model hardly feel a rotation; each prompt token's logprob does. A
    30-token prompt (past the switch at 24) scored in chunks of 8 must read as transformers' one
    forward pass over it, which uses the long factors at every position."""
    model_dir = tiny_model_factory("phi3", rope_parameters=LONGROPE, **LONGROPE_LENGTHS)
    prompt = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    assert_prompt_logprobs_match(model_dir, prompt)


def assert_prompt_logprobs_match(model_dir, prompt: list[int]) -> None:
    """Each prompt token's logprob, scored by Ferry in chunks of 8, equals transformers' from one
    forward pass over the whole prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    llm = LLM(str(model_dir), max_num_batched_tokens=8, block_size=4)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    for position in range(1, len(prompt)):
        token = prompt[position]
        assert scored[position][token].logprob == pytest.approx(expected[position - 1, token].item(), abs=2e-4)


PARTIAL_ROTARY = {
    # Phi-3 shapes with half of each 16-dim head rotated
    "default": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    # Phi-4-mini's kind: LongRoPE over 12 of 16 dims (6 factors each), with the switch at 24
    "longrope": {**LONGROPE, "partial_rotary_factor": 0.75, "short_factor": LONGROPE["short_factor"][:6],
                 "long_factor": LONGROPE["long_factor"][:6]},
}


@pytest.mark.parametrize("rope", list(PARTIAL_ROTARY))
def test_partial_rotary_matches_transformers(tiny_model_factory, rope):
    """transformers rotates the first dims of each head and passes the rest; Ferry's kernels rotate
    whole heads, so the loader reorders q/k dims and the table leaves the passed ones unrotated."""
    model_dir = tiny_model_factory("phi3", rope_parameters=PARTIAL_ROTARY[rope], **LONGROPE_LENGTHS)
    llm = LLM(str(model_dir), max_num_batched_tokens=8, block_size=4)
    assert llm.engine.arch.rope.rotary_dim == (8 if rope == "default" else 12)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, llm.engine.arch.vocab_size, (n,), generator=g).tolist() for n in (5, 30)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)


def test_a_partial_rotary_of_an_odd_number_of_dims_is_refused_natively_and_served_by_the_fallback(
        tiny_model_factory):
    model_dir = tiny_model_factory("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5625})  # 9 of 16 dims
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5625 rotates 9 of 16"):
        LLM(str(model_dir), model_impl="ferry")
    llm = LLM(str(model_dir))  # transformers' own Phi-3 code rotates the 9 dims
    assert llm.engine.arch.implementation == "transformers"
    prompts = _prompts(llm.engine.arch.vocab_size)[:3]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == _reference(model_dir, prompts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_transformers(tiny_model_factory, dtype):
    """Half precision: rounding differs between implementations, so compare the first tokens and
    require most of the sequence to agree rather than every token."""
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."))
    assert llm.engine.runner.kv_cache.dtype == dtype
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    reference = _reference(model_dir, prompts, dtype=dtype)
    agree = sum(o.token_ids[0] == r[0] for o, r in zip(outputs, reference))
    assert agree >= 7


# Sliding-window attention, honoured by the kernels: windows of 12-16 tokens and sequences of up to
# 82 (over 5x the window), prompts in 8-token chunks that cross the window's edge.
WINDOW_CASES = {
    "mistral": {"sliding_window": 16},
    # Qwen2's windows start at max_window_layers: layer 0 full, layers 1-2 sliding
    "qwen2": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1, "num_layers": 3},
    "mixtral": {"sliding_window": 16},
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_sliding_window_matches_transformers_past_the_window(tiny_model_factory, case):
    model_dir = tiny_model_factory(case, **WINDOW_CASES[case])
    llm = LLM(str(model_dir), max_num_batched_tokens=8)
    assert llm.engine.max_model_len == 1024  # the model's own limit: no cap at the window any more
    window = WINDOW_CASES[case]["sliding_window"]
    layers = llm.engine.runner.model.layers
    assert [layer.self_attn.window for layer in layers] == (
        [None, window, window] if case == "qwen2" else [window] * len(layers))
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # from the prefix cache this time
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    _assert_all_free(llm)


def test_a_sliding_window_model_holds_about_its_window_of_kv_per_sequence(tiny_model_factory):
    """Every layer windowed (Mistral): blocks before the next token's window are released as the
    sequence grows, so a sequence 4x past its window holds window / block_size + 1 blocks; the
    tokens are still transformers' (those blocks are never read again), also for a second request
    that takes the first one's prompt from the prefix cache."""
    window, block = 16, 4
    model_dir = tiny_model_factory("mistral", sliding_window=window)
    llm = LLM(str(model_dir), block_size=block, max_num_batched_tokens=8)
    assert llm.engine.core.kv.window == window
    prompt = _prompts(llm.engine.arch.vocab_size)[-1]  # 50 tokens
    params = SamplingParams(max_tokens=4 * window, temperature=0.0, ignore_eos=True)
    held = []
    llm.engine.add_request("a", prompt, params)
    tokens = []
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            tokens += output.new_token_ids
        held.append(llm.engine.kv_usage().num_used_blocks)
    assert tokens == _reference(model_dir, [prompt], new_tokens=4 * window)[0]
    # decoding 114 tokens in: the window's 16 positions span at most 5 blocks, plus the step's own
    assert max(held[-40:]) <= window // block + 2
    assert max(held) < -(-(len(prompt) + 4 * window) // block)  # well under the whole sequence's 29
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == tokens
    _assert_all_free(llm)
