"""LoRA adapters in the engine: greedy tokens equal to transformers with the adapter merged by peft,
for several adapters and the base model in one batch, through slot reuse, chunked prefill,
preemption, the prefix cache (kept apart per adapter), speculative decoding and tensor parallelism;
and every adapter Ferry cannot serve refused by name."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

from ferry.kernels.ops import QuantizedWeight
from ferry.worker.engine import LLM, FinishReason, LoraAdapterError, LoRARequest, SamplingParams, StructuredOutputs
from ferry.worker.models.lora_layers import LoraLinear
from tests.engine.test_hf_parity import LONGROPE_LENGTHS, PARTIAL_ROTARY
from tests.engine.test_structured import REGEX
from tests.lora_adapters import ATTENTION, MLP, reference_greedy, write_adapter

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Four adapters: different ranks, scalings and targets (rank 16 = the engine's max_lora_rank).
ADAPTERS = {
    "qv-r8": dict(r=8, alpha=16, targets=("q_proj", "v_proj"), seed=1),
    "all-r16": dict(r=16, alpha=8, targets=ATTENTION + MLP, seed=2),
    "o-down-r4-rslora": dict(r=4, alpha=4, targets=("o_proj", "down_proj"), seed=3, use_rslora=True),
    "kv-gate-up-pattern": dict(r=12, alpha=24, targets=("k_proj", "gate_proj", "up_proj"), seed=4,
                               alpha_pattern={"gate_proj": 6}),
}


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=g).tolist() for length in (5, 17, 33, 9)[:n]]


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    root = tmp_path_factory.mktemp("adapters")
    return base, {name: write_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def references(adapters):
    base, dirs = adapters
    prompts = _prompts(3)
    refs = {name: reference_greedy(base, d, prompts, NEW_TOKENS) for name, d in dirs.items()}
    refs[None] = reference_greedy(base, None, prompts, NEW_TOKENS)
    return prompts, refs


def _mixed_batch(dirs, prompts):
    """Every prompt under every adapter and under none, interleaved: the first row has an adapter."""
    rows = []
    for i, prompt in enumerate(prompts):
        for j, name in enumerate([*dirs, None]):
            rows.append((prompt, name, i, LoRARequest(name, j + 1, str(dirs[name])) if name else None))
    return rows


@pytest.mark.parametrize("engine", [
    pytest.param(dict(max_loras=4), id="every-adapter-in-a-slot"),
    # two slots for four adapters, 8-token steps, a pool too small for the batch: slots are reused,
    # prompts run in chunks, requests are preempted and recomputed
    pytest.param(dict(max_loras=2, max_num_batched_tokens=8, block_size=4, kv_cache_bytes=64 << 10, max_model_len=128),
                 id="slot-reuse-chunks-preemption"),
])
def test_adapters_and_the_base_in_one_batch_match_peft_merged(adapters, references, engine):
    base, dirs = adapters
    prompts, refs = references
    rows = _mixed_batch(dirs, prompts)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, **engine)
    outputs = llm.generate([r[0] for r in rows], GREEDY, use_tqdm=False, lora_request=[r[3] for r in rows])
    for (_, name, i, _), out in zip(rows, outputs, strict=True):
        assert out.token_ids == refs[name][i], (name, i)
    for name in dirs:  # each adapter really changes the output
        assert refs[name] != refs[None]
    lora = llm.engine.core.lora
    assert lora.stats.host_loads == 4
    if engine["max_loras"] == 2:
        assert lora.stats.slot_loads > 4  # adapters went in and out of the two slots
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert sorted(llm.engine.loras_held()) == sorted(dirs)


def test_host_memory_for_two_adapters_serves_four(adapters, references):
    # Four adapters through two slots and room for two in host memory, their requests interleaved:
    # memory holds what the next waiting requests need, so none is dropped while a request waits
    # for it (every read serves a request) and nothing waits for ever. An adapter whose requests are
    # admitted apart may leave its slot and memory between them and be read again: how often depends
    # on when the loader threads finish (CI once saw 5 reads where most runs make 4).
    base, dirs = adapters
    prompts, refs = references
    rows = _mixed_batch(dirs, prompts)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=2)
    outputs = llm.generate([r[0] for r in rows], GREEDY, use_tqdm=False, lora_request=[r[3] for r in rows])
    assert [o.token_ids for o in outputs] == [refs[r[1]][r[2]] for r in rows]
    stats = llm.engine.core.lora.stats
    assert len(dirs) <= stats.host_loads <= sum(r[3] is not None for r in rows) and stats.load_failures == 0
    assert len(llm.engine.core.lora._loaded) <= 2


def test_the_prefix_cache_is_kept_apart_per_adapter(adapters, references):
    base, dirs = adapters
    prompts, refs = references
    prompt = prompts[2]  # 33 tokens: two full blocks of 16
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16)
    qv = LoRARequest("qv-r8", 1, str(dirs["qv-r8"]))
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=qv)[0]
    base_out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("all-r16", 2, str(dirs["all-r16"])))[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=qv)[0]
    assert first.num_cached_tokens == 0
    assert base_out.num_cached_tokens == 0 and other.num_cached_tokens == 0  # no block shared across adapters
    assert again.num_cached_tokens == 32
    assert [first.token_ids, base_out.token_ids, other.token_ids, again.token_ids] == [
        refs["qv-r8"][2], refs[None][2], refs["all-r16"][2], refs["qv-r8"][2]]


def test_an_adapters_blocks_move_to_another_engine_and_serve_only_that_adapter(adapters, references):
    # What a snapshot does (worker.snapshots, through Engine.prefix_blocks): blocks keyed by the
    # adapter's content digest, adopted by a fresh engine, hit for the same adapter and no other.
    base, dirs = adapters
    prompts, refs = references
    prompt, qv = prompts[2], LoRARequest("qv-r8", 1, str(dirs["qv-r8"]))
    source = LLM(str(base), enable_lora=True, max_lora_rank=16)
    source.generate([prompt], GREEDY, use_tqdm=False, lora_request=qv)
    blocks = [b for b in source.engine.prefix_blocks.cached() if b.token_ids in (tuple(prompt[:16]),
                                                                                 tuple(prompt[16:32]))]
    assert len(blocks) == 2
    target = LLM(str(base), enable_lora=True, max_lora_rank=16)
    assert target.engine.prefix_blocks.adopt(blocks, source.engine.prefix_blocks.read([b.key for b in blocks])) == 2
    base_out = target.generate([prompt], GREEDY, use_tqdm=False)[0]
    other = target.generate([prompt], GREEDY, use_tqdm=False,
                            lora_request=LoRARequest("all-r16", 2, str(dirs["all-r16"])))[0]
    renamed = target.generate([prompt], GREEDY, use_tqdm=False,  # the same files under another name
                              lora_request=LoRARequest("qv-copy", 3, str(dirs["qv-r8"])))[0]
    assert (base_out.num_cached_tokens, other.num_cached_tokens, renamed.num_cached_tokens) == (0, 0, 32)
    assert [base_out.token_ids, other.token_ids, renamed.token_ids] == [refs[None][2], refs["all-r16"][2],
                                                                         refs["qv-r8"][2]]


def test_ngram_speculation_with_an_adapter_keeps_greedy_output(adapters, references):
    base, dirs = adapters
    prompts, refs = references
    speculative = {"method": "ngram", "measure_speedup": False, "min_acceptance_rate": 0.0}
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, speculative=speculative)
    lora = LoRARequest("all-r16", 1, str(dirs["all-r16"]))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    assert [o.token_ids for o in outputs] == refs["all-r16"]
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0


def test_structured_outputs_hold_with_an_adapter(adapters):
    base, dirs = adapters
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16)
    lora = LoRARequest("all-r16", 1, str(dirs["all-r16"]))
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(regex=REGEX))
    free = SamplingParams(max_tokens=40, temperature=0.0)
    outputs = llm.generate([[5, 6, 7]] * 2, [params, free], use_tqdm=False, lora_request=lora)
    assert re.fullmatch(REGEX, outputs[0].text)
    assert not re.fullmatch(REGEX, outputs[1].text)  # the grammar, not the adapter, made it match


def test_phi3_fused_projections_and_partial_rotary_take_adapters(tiny_model_factory, tmp_path):
    # Phi-3's checkpoint fuses q/k/v and gate/up: peft targets those fused modules. Partial rotary
    # reorders q/k rows at load; the adapter's B rows must follow.
    base = tiny_model_factory("phi3", num_heads=4, num_kv_heads=2, rope_parameters=PARTIAL_ROTARY["default"])
    adapter = write_adapter(base, tmp_path / "phi", r=8, targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    prompts = _prompts(2)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("phi", 1, str(adapter)))
    assert [o.token_ids for o in outputs] == reference_greedy(base, adapter, prompts, NEW_TOKENS)


def test_rank_64_adapters_batch_with_smaller_ones(tiny_model_factory, tmp_path):
    # max_lora_rank=64: a rank-64 adapter fills its slots, a rank-8 one is zero-padded beside it
    base = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    big = write_adapter(base, tmp_path / "r64", r=64, alpha=32, targets=("q_proj", "v_proj", "up_proj", "down_proj"),
                        seed=7)
    small = write_adapter(base, tmp_path / "r8", r=8, targets=("k_proj", "o_proj"), seed=8)
    prompts = _prompts(2)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=64, max_loras=2)
    loras = [LoRARequest("r64", 1, str(big)), LoRARequest("r8", 2, str(small))]
    outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[loras[0]] * 2 + [loras[1]] * 2)
    expected = reference_greedy(base, big, prompts, NEW_TOKENS) + reference_greedy(base, small, prompts, NEW_TOKENS)
    assert [o.token_ids for o in outputs] == expected


def test_longrope_sequences_keep_their_adapter_across_the_switch(tiny_model_factory, tmp_path):
    # LongRoPE (over 12 of 16 dims) recomputes a sequence with the long factors when it first grows
    # past 24 tokens, in a cache namespace of its own: the adapter's rows must follow it there. Base
    # rows in the same batch, the prefix cache on, and a second pass that hits what the first cached.
    base = tiny_model_factory("phi3", num_heads=4, num_kv_heads=2, rope_parameters=PARTIAL_ROTARY["longrope"],
                              **LONGROPE_LENGTHS)
    adapter = write_adapter(base, tmp_path / "long", r=8, targets=("qkv_proj", "o_proj", "gate_up_proj"), seed=5)
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 300, (20,), generator=g).tolist()
    prompts = [shared[:6], shared + [7, 8, 9, 10, 11], shared[:12] + list(range(30, 50))]  # before, at, past 24
    long = LoRARequest("long", 1, str(adapter))
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, max_num_batched_tokens=8, block_size=4,
              enable_prefix_caching=True)
    assert llm.engine.arch.rope.kind == "longrope"
    expected = reference_greedy(base, adapter, prompts, NEW_TOKENS) + reference_greedy(base, None, prompts, NEW_TOKENS)
    for _ in range(2):
        outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[long] * 3 + [None] * 3)
        assert [o.token_ids for o in outputs] == expected


def test_an_int8_base_takes_adapters_beside_its_quantized_product(tiny_model_factory, tmp_path):
    # "int8" keeps every matrix in Q8_0 blocks and computes in float; the adapter's update is added
    # beside that product. The base's weights are made Q8_0-exact first (quantized and back), so
    # int8 stores them as they are and transformers + peft on the same file is the reference.
    base = tiny_model_factory("llama", num_heads=4, num_kv_heads=2)
    adapter = write_adapter(base, tmp_path / "q8", r=8, targets=ATTENTION + MLP, seed=6)
    stored = tmp_path / "as-stored"
    shutil.copytree(base, stored)
    weights = load_file(stored / "model.safetensors")
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[1] % 32 == 0:
            blocks = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
            weights[name] = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)).reshape(w.shape)
    save_file(weights, stored / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts(2)
    llm = LLM(str(stored), enable_lora=True, max_lora_rank=8, quantization="int8")
    adapted = [m for m in llm.engine.runner.model.modules() if isinstance(m, LoraLinear)]
    assert adapted and all(isinstance(m.weight, QuantizedWeight) for m in adapted)
    lora = LoRARequest("q8", 1, str(adapter))
    outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[lora, lora, None, None])
    expected = reference_greedy(stored, adapter, prompts, NEW_TOKENS) + reference_greedy(stored, None, prompts,
                                                                                         NEW_TOKENS)
    assert [o.token_ids for o in outputs] == expected


def test_mixtral_attention_adapter_matches_and_expert_targets_are_refused(tiny_model_factory, tmp_path):
    base = tiny_model_factory("mixtral", num_heads=4, num_kv_heads=2)
    adapter = write_adapter(base, tmp_path / "attn", r=8, targets=ATTENTION)
    prompts = _prompts(2)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("attn", 1, str(adapter)))
    assert [o.token_ids for o in outputs] == reference_greedy(base, adapter, prompts, NEW_TOKENS)
    rank_8 = torch.zeros(8, 64)
    experts = _with_tensors(adapter, tmp_path, "experts", {"layers.0.mlp.experts.0.w1.lora_A.weight": rank_8})
    with pytest.raises(LoraAdapterError, match="does not"):
        llm.engine.add_lora(LoRARequest("experts", 2, str(experts)))
    dense_names = _with_tensors(adapter, tmp_path, "dense", {"layers.1.mlp.gate_proj.lora_A.weight": rank_8,
                                                             "layers.1.mlp.gate_proj.lora_B.weight": rank_8.T})
    with pytest.raises(LoraAdapterError, match="mixture-of-experts layer"):
        llm.engine.add_lora(LoRARequest("dense", 3, str(dense_names)))


def test_two_ranks_hold_their_shard_of_each_adapter(adapters, references):
    base, dirs = adapters
    prompts, refs = references
    rows = _mixed_batch({k: dirs[k] for k in ("all-r16", "o-down-r4-rslora")}, prompts[:2])
    with LLM(str(base), enable_lora=True, max_lora_rank=16, tensor_parallel_size=2, max_loras=1) as llm:
        outputs = llm.generate([r[0] for r in rows], GREEDY, use_tqdm=False, lora_request=[r[3] for r in rows])
        assert llm.engine.core.lora.stats.slot_loads >= 2  # one slot: each rank emptied and refilled it
    assert [o.token_ids for o in outputs] == [refs[r[1]][r[2]] for r in rows]


# --- refusals ----------------------------------------------------------------------------------------


def _corrupt(directory, tmp_path):
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((directory / "adapter_config.json").read_text())
    data = (directory / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return bad


def _with_tensors(directory, tmp_path, name, extra: dict[str, torch.Tensor]):
    """A copy of an adapter with more tensors in it (named under peft's base_model.model.model. prefix)."""
    out = tmp_path / name
    out.mkdir()
    (out / "adapter_config.json").write_text((directory / "adapter_config.json").read_text())
    tensors = load_file(directory / "adapter_model.safetensors")
    tensors |= {f"base_model.model.model.{key}": value.contiguous() for key, value in extra.items()}
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def _with_config(directory, tmp_path, name, **changes):
    out = tmp_path / name
    out.mkdir()
    config = json.loads((directory / "adapter_config.json").read_text()) | changes
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((directory / "adapter_model.safetensors").read_bytes())
    return out


def test_adapters_ferry_cannot_serve_are_refused_by_name(adapters, tiny_model_factory, tmp_path):
    base, dirs = adapters
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8)
    wider = tiny_model_factory("llama", hidden_size=96, num_heads=4, num_kv_heads=2)
    cases = {
        "rank 16, over max_lora_rank=8": dirs["all-r16"],
        "another base model": write_adapter(wider, tmp_path / "wider", r=4),
        "unreadable": _corrupt(dirs["qv-r8"], tmp_path),
        "DoRA": _with_config(dirs["qv-r8"], tmp_path, "dora", use_dora=True),
        "modules_to_save": _with_config(dirs["qv-r8"], tmp_path, "saved", modules_to_save=["lm_head"]),
        "not a directory": tmp_path / "missing",
        "does not": _with_tensors(dirs["qv-r8"], tmp_path, "embed",
                                  {"embed_tokens.lora_A.weight": torch.zeros(4, 384)}),
        "lora_A but no lora_B": _with_tensors(dirs["qv-r8"], tmp_path, "half", {
            "layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(4, 64)}),
    }
    for i, (words, path) in enumerate(cases.items()):
        with pytest.raises(LoraAdapterError, match=words) as raised:
            llm.engine.add_lora(LoRARequest(f"bad-{i}", i + 1, str(path)))
        assert f"bad-{i}" in str(raised.value)
    assert llm.engine.loras_held() == []
    base_only = LLM(str(base))
    with pytest.raises(LoraAdapterError, match="enable_lora"):
        base_only.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(dirs["qv-r8"])))
    assert not base_only.engine.has_unfinished_requests()


def test_an_adapter_failing_to_load_ends_only_its_requests(adapters, references, tmp_path):
    base, dirs = adapters
    prompts, refs = references
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16)
    broken = LoRARequest("broken", 1, str(_corrupt(dirs["qv-r8"], tmp_path)))
    good = LoRARequest("qv-r8", 2, str(dirs["qv-r8"]))
    outputs = llm.generate(prompts[:2] * 3, GREEDY, use_tqdm=False,
                           lora_request=[broken, broken, good, good, None, None])
    assert [o.finish_reason for o in outputs[:2]] == [FinishReason.ERROR] * 2
    assert all(isinstance(o.error, LoraAdapterError) and "broken" in str(o.error) for o in outputs[:2])
    assert [o.token_ids for o in outputs[2:]] == refs["qv-r8"][:2] + refs[None][:2]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_the_transformers_fallback_refuses_lora_before_loading(tiny_model_factory):
    base = tiny_model_factory("llama")
    with pytest.raises(LoraAdapterError, match="fallback"):
        LLM(str(base), enable_lora=True, model_impl="transformers")


def test_lora_rows_leave_the_base_rows_bitwise_alone(adapters):
    base, dirs = adapters
    prompts = _prompts(3)
    plain = LLM(str(base))
    expected = plain.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
                              use_tqdm=False)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16)
    lora = LoRARequest("all-r16", 1, str(dirs["all-r16"]))
    mixed = llm.generate(prompts * 2, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
                         use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    for want, got in zip(expected, mixed[3:], strict=True):
        assert got.token_ids == want.token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in got.logprobs] == \
            [{t: lp.logprob for t, lp in e.items()} for e in want.logprobs]
