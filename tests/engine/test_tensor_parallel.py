"""Tensor parallelism on the CPU: real rank processes over gloo, greedy tokens equal to one rank's
and to transformers', each rank reading only its slice, start-up refusals, a killed rank."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from transformers import AutoConfig

from ferry.worker.engine import LLM, EngineConfig, RankFailedError, SamplingParams, TensorParallelError
from ferry.worker.models.config import ModelArch
from ferry.worker.models.loader import checkpoint_tensors, load_model
from ferry.worker.models.sharding import Shard
from tests.engine.test_hf_parity import LONGROPE, PARTIAL_ROTARY, _reference

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SHARED = list(range(20, 56))  # 36 tokens: 9 full blocks of 4, shared by every prompt below
PROMPTS = [SHARED + [7], SHARED + [9, 11, 13], list(range(60, 65)), [3]]
# Small blocks and an 8-token budget: prompts split into chunks, decodes ride along with them.
ENGINE = dict(block_size=4, max_num_batched_tokens=8, max_model_len=128, kv_cache_bytes=1 << 20)

CASES = {
    "llama-gqa": ("llama", {"num_heads": 4, "num_kv_heads": 2}),
    "qwen2-biases": ("qwen2", {"num_heads": 4, "num_kv_heads": 2}),
    "qwen3-qk-norm": ("qwen3", {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}),
    "phi3-fused-checkpoint": ("phi3", {"num_heads": 4, "num_kv_heads": 2}),  # each rank slices the fused q/k/v
    # LongRoPE: the 37+-token prompts are past the switch at 24, the others stay short
    "phi3-longrope": ("phi3", {"num_heads": 4, "num_kv_heads": 2, "rope_parameters": LONGROPE,
                               "max_position_embeddings": 160, "original_max_position_embeddings": 24}),
    # Phi-4-mini's kind: LongRoPE over 12 of each head's 16 dims, q/k dims reordered on each rank
    "phi3-partial-rotary": ("phi3", {"num_heads": 4, "num_kv_heads": 2, "rope_parameters": PARTIAL_ROTARY["longrope"],
                                     "max_position_embeddings": 160, "original_max_position_embeddings": 24}),
    # every expert (and Qwen2-MoE's shared expert) cut to half its features on each rank
    "mixtral-experts": ("mixtral", {"num_heads": 4, "num_kv_heads": 2}),
    "qwen2_moe-shared-expert": ("qwen2_moe", {"num_heads": 4, "num_kv_heads": 2}),
}


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_rank_and_transformers(tiny_model_factory, case):
    arch, kwargs = CASES[case]
    model_dir = tiny_model_factory(arch, **kwargs)
    one = _tokens(LLM(str(model_dir), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))
    assert one == [tokens[:NEW_TOKENS] for tokens in _reference(model_dir, PROMPTS)]  # greedy: a prefix
    with LLM(str(model_dir), tensor_parallel_size=2, **ENGINE) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # every prompt's full blocks are cached now
        assert _tokens(first) == one
        assert _tokens(again) == one
        assert [o.num_cached_tokens for o in again][:2] == [36, 36]
        assert llm.engine.kv.prefix_hits > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_four_ranks_replicate_kv_heads_and_verify_proposals(tiny_model_factory):
    # 4 q heads and 2 kv heads over 4 ranks: one q head each, every kv head on two ranks.
    model_dir = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    one = _tokens(LLM(str(model_dir), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))
    # n-gram proposals, verified in the sharded batch (greedy output stays exactly the same).
    speculative = {"method": "ngram", "measure_speedup": False, "min_acceptance_rate": 0.0}
    with LLM(str(model_dir), tensor_parallel_size=4, speculative=speculative, **ENGINE) as llm:
        assert llm.engine.runner.kv_cache.shape[3] == 1  # each rank's pool: its one kv head
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == one
        assert llm.engine.stats().spec_decode.num_draft_tokens > 0


def test_each_rank_reads_only_its_slice(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2", num_heads=4, num_kv_heads=2)
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(model_dir))
    whole = {name: t for name, _, _, t in checkpoint_tensors(model_dir, arch)}
    d, hidden, inter = arch.head_dim, arch.hidden_size, arch.intermediate_size
    for rank in (0, 1):
        read = {name: t for name, _, _, t in checkpoint_tensors(model_dir, arch, Shard(rank, 2))}
        layer = "model.layers.0."
        assert read[layer + "self_attn.q_proj.weight"].shape == (2 * d, hidden)  # 2 of 4 q heads
        assert read[layer + "self_attn.k_proj.weight"].shape == (d, hidden)  # 1 of 2 kv heads
        assert read[layer + "self_attn.v_proj.bias"].shape == (d,)
        assert read[layer + "self_attn.o_proj.weight"].shape == (hidden, 2 * d)
        assert read[layer + "mlp.gate_proj.weight"].shape == (inter // 2, hidden)
        assert read[layer + "mlp.down_proj.weight"].shape == (hidden, inter // 2)
        assert torch.equal(read[layer + "mlp.down_proj.weight"],
                           whole[layer + "mlp.down_proj.weight"][:, rank * inter // 2:(rank + 1) * inter // 2])
        assert torch.equal(read[layer + "self_attn.k_proj.weight"], whole[layer + "self_attn.k_proj.weight"][
            rank * d:(rank + 1) * d])
        assert read["model.embed_tokens.weight"].shape == whole["model.embed_tokens.weight"].shape  # replicated
        sharded = sum(t.nbytes for n, t in whole.items() if "layers." in n and "norm" not in n)
        read_sharded = sum(t.nbytes for n, t in read.items() if "layers." in n and "norm" not in n)
        assert read_sharded * 2 == sharded  # the layers' matrices: exactly half of them, per rank
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"), 64, shard=Shard(1, 2))
    layer = model.layers[0]
    assert layer.self_attn.num_heads == 2 and layer.self_attn.num_kv_heads == 1
    assert layer.self_attn.o_proj.bias is None  # a row-parallel bias is added once, by rank 0
    assert layer.mlp.intermediate_size == inter // 2


@pytest.mark.parametrize(
    ("size", "model", "message"),
    [
        (3, {"num_heads": 4, "num_kv_heads": 2}, "num_attention_heads=4 is not divisible"),
        (6, {"num_heads": 12, "num_kv_heads": 4, "hidden_size": 96}, "num_key_value_heads=4 neither divides"),
        (3, {"num_heads": 6, "num_kv_heads": 6, "hidden_size": 48, "intermediate_size": 50},
         "intermediate_size=50 is not divisible"),
    ],
)
def test_indivisible_layouts_are_refused_before_loading(tiny_model_factory, size, model, message):
    model_dir = tiny_model_factory("llama", **model)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=message):
        LLM(str(model_dir), tensor_parallel_size=size)
    assert time.monotonic() - started < 10  # no rank was started


def test_more_ranks_than_gpus_and_quantized_weights_are_refused(llama_dir):
    if not torch.cuda.is_available():
        with pytest.raises(TensorParallelError, match="needs 2 GPUs; 0 are visible"):
            LLM(str(llama_dir), tensor_parallel_size=2, device="cuda")
    with pytest.raises(TensorParallelError, match="quantization='int8' is served at tensor_parallel_size=1 only"):
        LLM(str(llama_dir), tensor_parallel_size=2, quantization="int8")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            EngineConfig(model=str(llama_dir), tensor_parallel_size=bad)


def test_a_killed_rank_fails_the_step_with_a_typed_error(llama_dir):
    llm = LLM(str(llama_dir), tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    try:
        engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        for _ in range(8):
            engine.step()
        [rank1] = engine.executor.group.pids
        os.kill(rank1, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 15
        with pytest.raises(RankFailedError):  # and from then on, at once
            engine.step()
    finally:
        started = time.monotonic()
        llm.close()
        assert time.monotonic() - started < 15


def test_a_hung_rank_fails_the_step_after_the_timeout(llama_dir):
    llm = LLM(str(llama_dir), tensor_parallel_size=2, tensor_parallel_timeout_s=3, **ENGINE)
    engine = llm.engine
    [rank1] = engine.executor.group.pids
    try:
        engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        engine.step()
        os.kill(rank1, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="tensor-parallel step failed"):
            while engine.has_unfinished_requests():
                engine.step()
        assert 2 < time.monotonic() - started < 20
    finally:
        llm.close()  # kills the stopped rank
    assert not os.path.exists(f"/proc/{rank1}") or "zombie" in open(f"/proc/{rank1}/status").read()
