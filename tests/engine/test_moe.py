"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE): greedy tokens
identical to transformers `generate` on the same random weights, through every engine feature that
touches a step's batch, on every backend; checkpoints stored per expert and stacked."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.models.config import ModelArch
from ferry.worker.models.loader import checkpoint_tensors
from ferry.worker.models.moe import SparseMoe
from ferry.worker.models.sharding import Shard
from tests.engine.test_hf_parity import GREEDY, _assert_all_free, _prompts, _reference

FAMILIES = {
    "mixtral": {},
    "qwen2_moe": {},  # a shared expert beside the routed ones, weights not renormalised
    "qwen3_moe": {"head_dim": 32},  # q/k norm, renormalised weights
    # dense and sparse layers in one model: layer 0 dense (mlp_only_layers), then every second one sparse
    "qwen2_moe-mixed-layers": {"num_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2},
    "mixtral-top1-of-4": {"num_local_experts": 4, "num_experts_per_tok": 1},
    "qwen3_moe-top4-of-16": {"num_experts": 16, "num_experts_per_tok": 4},
}


def _family(case: str) -> str:
    return case.split("-")[0]


@pytest.mark.parametrize("case", list(FAMILIES))
def test_greedy_matches_transformers(tiny_model_factory, case):
    model_dir = tiny_model_factory(_family(case), **FAMILIES[case])
    llm = LLM(str(model_dir))
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    _assert_all_free(llm)


def test_sparse_and_dense_layers_follow_the_config(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2_moe", **FAMILIES["qwen2_moe-mixed-layers"])
    llm = LLM(str(model_dir))
    assert llm.engine.arch.moe.sparse_layers == (1, 3)
    kinds = [isinstance(layer.mlp, SparseMoe) for layer in llm.engine.runner.model.layers]
    assert kinds == [False, True, False, True]


def test_every_token_routes_on_its_own_through_chunks_preemption_and_the_prefix_cache(tiny_model_factory):
    """64 new tokens per prompt with 8-token steps (prompts in chunks, decodes beside them), a KV
    pool too small for all of them (preemption by recompute) and the prefix cache on: each row
    picks its experts alone, so the tokens are transformers' whatever batch they share."""
    model_dir = tiny_model_factory("mixtral")
    probe = LLM(str(model_dir), max_model_len=160)
    per_block = probe.engine.runner.bytes_per_block(probe.engine.arch, 16, torch.float32)
    llm = LLM(str(model_dir), max_model_len=160, max_num_batched_tokens=8, kv_cache_bytes=14 * per_block,
              enable_prefix_caching=True)
    prompts = _prompts(llm.engine.arch.vocab_size)
    prompts = prompts + [prompts[-1][:40] + [5, 6]]  # shares 2 full blocks with the 50-token prompt
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv.prefix_hits > 0
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts, new_tokens=64)
    _assert_all_free(llm)


def test_the_pytorch_reference_backend_matches(tiny_model_factory, monkeypatch):
    """FERRY_ATTENTION_BACKEND=torch: the experts stay float stacks and run `reference.fused_moe`
    (the oracle of the Triton kernel) instead of the packed native products."""
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "torch")
    model_dir = tiny_model_factory("qwen2_moe")
    llm = LLM(str(model_dir))
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert isinstance(experts.w13, torch.nn.Parameter)
    prompts = _prompts(llm.engine.arch.vocab_size)[:4]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == _reference(model_dir, prompts)


def _stacked_copy(model_dir, tmp_path):
    """The checkpoint with each layer's experts saved stacked, as transformers 5 holds them:
    mlp.experts.gate_up_proj [E, 2 * I, H] (gate rows then up rows) and down_proj [E, H, I]."""
    tensors = load_file(model_dir / "model.safetensors")
    config = AutoConfig.from_pretrained(model_dir)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = [], []
        for e in range(config.num_experts):
            gate, up = tensors.pop(f"{prefix}{e}.gate_proj.weight"), tensors.pop(f"{prefix}{e}.up_proj.weight")
            gate_up.append(torch.cat([gate, up]))
            down.append(tensors.pop(f"{prefix}{e}.down_proj.weight"))
        tensors[prefix + "gate_up_proj"], tensors[prefix + "down_proj"] = torch.stack(gate_up), torch.stack(down)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for path in model_dir.iterdir():
        if path.name != "model.safetensors":
            (stacked / path.name).write_bytes(path.read_bytes())
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    return stacked


def test_a_checkpoint_with_stacked_experts_loads_the_same(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3_moe", **FAMILIES["qwen3_moe"])
    stacked = _stacked_copy(model_dir, tmp_path)
    prompts = _prompts(300)[:4]
    expected = [o.token_ids for o in LLM(str(model_dir)).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in LLM(str(stacked)).generate(prompts, GREEDY, use_tqdm=False)] == expected


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_each_rank_reads_half_of_every_experts_features(tiny_model_factory, tmp_path, layout):
    model_dir = tiny_model_factory("qwen2_moe")
    if layout == "stacked":
        model_dir = _stacked_copy(model_dir, tmp_path)
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(model_dir))
    inter, shared, hidden = arch.moe.intermediate_size, arch.moe.shared_intermediate_size, arch.hidden_size
    whole = {(n, str(p)): t for n, _, p, t in checkpoint_tensors(model_dir, arch)}
    total = sum(t.nbytes for (n, _), t in whole.items() if "experts" in n or "shared_expert." in n)
    for rank in (0, 1):
        read = {(n, str(p)): t for n, _, p, t in checkpoint_tensors(model_dir, arch, Shard(rank, 2))}
        mine = slice(rank * inter // 2, (rank + 1) * inter // 2)
        for (name, part), tensor in read.items():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # routers: whole on each rank
                assert torch.equal(tensor, whole[(name, part)])
        assert read[("model.layers.0.mlp.shared_expert.down_proj.weight", "None")].shape == (hidden, shared // 2)
        if layout == "per-expert":
            down = "model.layers.1.mlp.experts.3.down_proj.weight", "ExpertPart(expert=3, piece=None)"
            assert torch.equal(read[down], whole[down][:, mine])
            gate = "model.layers.1.mlp.experts.3.gate_proj.weight", "ExpertPart(expert=3, piece='gate')"
            assert torch.equal(read[gate], whole[gate][mine])
        else:
            up = "model.layers.1.mlp.experts.gate_up_proj", "ExpertPart(expert=None, piece='up')"
            both = whole["model.layers.1.mlp.experts.gate_up_proj", "ExpertPart(expert=None, piece='gate')"]
            assert both.shape == (arch.moe.num_experts, inter, hidden)
            assert torch.equal(read[up], torch.cat([both, whole[up]], dim=1)[:, inter + mine.start:inter + mine.stop])
        part = sum(t.nbytes for (n, _), t in read.items() if "experts" in n or "shared_expert." in n)
        assert part * 2 == total  # each rank: exactly half of every expert's and the shared expert's weights


def test_moe_configs_are_read_or_refused_by_field():
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    from ferry.worker.models.config import UnsupportedModelError
    from ferry.worker.models.sharding import TensorParallelError, check_divisible

    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    qwen2 = Qwen2MoeConfig(**shape, num_experts=0, architectures=["Qwen2MoeForCausalLM"])
    assert ModelArch.from_hf_config(qwen2).moe is None  # no experts: transformers runs every layer dense
    qwen3 = Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=6, architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=6 must be in 1..num_experts=4"):
        ModelArch.from_hf_config(qwen3)
    odd = Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30,
                         intermediate_size=64, architectures=["Qwen3MoeForCausalLM"])
    arch = ModelArch.from_hf_config(odd)
    assert arch.qk_norm and arch.moe.sparse_layers == (0, 1, 2, 3)
    with pytest.raises(TensorParallelError, match="moe_intermediate_size=30 is not divisible by tensor_parallel_size"):
        check_divisible(arch, 4)
