"""The transformers fallback (worker/models/fallback.py): architectures with no native decoder run
by their own transformers code with Ferry's paged KV cache and attention. Greedy tokens equal
transformers `generate`; the serving features that only see the KV pool work; what cannot run
is refused by name before serving."""

from __future__ import annotations

import logging

import pytest
import torch

from ferry.worker.engine import LLM, EngineConfig, SamplingParams, TensorParallelError
from ferry.worker.models.config import UnsupportedModelError
from ferry.worker.models.fallback import FallbackModel
from ferry.worker.models.llama import PackedLinear
from tests.engine.test_hf_parity import GREEDY, _assert_all_free, _prompts, _reference

FALLBACK_CASES = {
    "olmo2": {},  # q/k norm over all heads, post-norms
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.2},  # its head divides the logits
    "gpt_neox": {"num_kv_heads": 4, "rotary_pct": 0.5},  # LayerNorm, parallel residual, partial rotary
    "cohere": {"logit_scale": 0.5},  # its head scales the logits
    "gemma": {"head_dim": 16},  # GeGLU, (1 + w) norms, scaled embeddings
    # Gemma 2/3 are native too (tests/engine/test_gemma.py); here on the fallback (model_impl=
    # "transformers") for the windows and soft-capping it passes to the kernels. Gemma 2: every other
    # layer a 16-token window (sequences reach 82 tokens), attention logits soft-capped at 5, final
    # logits at 3, sandwich norms
    "gemma2": {"head_dim": 16, "sliding_window": 16, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
               "query_pre_attn_scalar": 24},
    # Gemma 3: local layers (16-token window, their own rope base) beside a global one with linear
    # scaling, q/k norms
    "gemma3_text": {"head_dim": 16, "sliding_window": 16, "num_layers": 4, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 24,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1000000.0}}},
}


NATIVE_TOO = ("gemma2", "gemma3_text")


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_greedy_matches_transformers(tiny_model_factory, case, caplog):
    model_dir = tiny_model_factory(case, **FALLBACK_CASES[case])
    with caplog.at_level(logging.INFO, logger="ferry.worker.engine.loading"):
        llm = LLM(str(model_dir), model_impl="transformers" if case in NATIVE_TOO else "auto")
    assert llm.engine.arch.implementation == "transformers"
    assert isinstance(llm.engine.runner.model, FallbackModel)
    assert any("model implementation: transformers fallback" in r.getMessage() for r in caplog.records)
    # The model's linear layers (the LM head too) run Ferry's packed CPU product
    linears = [m for m in llm.engine.runner.model.hf.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts)
    _assert_all_free(llm)


class _WrongProduct(PackedLinear):
    """A packed product that computes something else (as modeling code that reads a Linear's weight
    itself would go wrong once it is packed)."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_packing_that_moves_the_logits_is_undone(tiny_model_factory, monkeypatch):
    monkeypatch.setattr("ferry.worker.models.llama.PackedLinear", _WrongProduct)
    model_dir = tiny_model_factory("olmo2")
    llm = LLM(str(model_dir))
    model = llm.engine.runner.model
    assert not any(isinstance(m, PackedLinear) for m in model.hf.modules())
    assert model.head is model.hf.get_output_embeddings() and type(model.head) is torch.nn.Linear
    prompts = _prompts(llm.engine.arch.vocab_size)[:3]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == _reference(model_dir, prompts)


def test_chunks_preemption_prefix_cache_and_ngram_proposals_on_the_fallback(tiny_model_factory):
    """8-token steps (chunked prompts beside decodes), a pool too small for every request at once
    (preemption by recompute), shared prefixes from the prefix cache and n-gram proposals verified
    in the batch: the tokens stay transformers' own."""
    model_dir = tiny_model_factory("olmo2")
    probe = LLM(str(model_dir), max_model_len=160)
    per_block = probe.engine.runner.bytes_per_block(probe.engine.arch, 16, torch.float32)
    speculative = {"method": "ngram", "measure_speedup": False, "min_acceptance_rate": 0.0}
    llm = LLM(str(model_dir), max_model_len=160, max_num_batched_tokens=8, kv_cache_bytes=14 * per_block,
              speculative=speculative)
    prompts = _prompts(llm.engine.arch.vocab_size)
    prompts = prompts + [prompts[-1][:40] + [5, 6], [7, 8, 9] * 6]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    assert [o.token_ids for o in outputs] == _reference(model_dir, prompts, new_tokens=64)
    _assert_all_free(llm)


def test_a_native_architecture_on_the_fallback_gives_the_native_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2")
    prompts = _prompts(300)
    native = LLM(str(model_dir))
    fallback = LLM(str(model_dir), model_impl="transformers")
    assert native.engine.arch.implementation == "ferry" and fallback.engine.arch.implementation == "transformers"
    assert native.engine.model_salt != fallback.engine.model_salt  # other kernels, other KV bits: not shared
    assert [o.token_ids for o in fallback.generate(prompts, GREEDY, use_tqdm=False)] == [
        o.token_ids for o in native.generate(prompts, GREEDY, use_tqdm=False)]


def test_what_neither_path_runs_is_refused_by_name(tiny_model_factory):
    model_dir = tiny_model_factory("olmo2")
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture \['Olmo2ForCausalLM'\]"):
        LLM(str(model_dir), model_impl="ferry")
    with pytest.raises(UnsupportedModelError, match="transformers fallback, which serves float weights at "
                                                    "tensor_parallel_size=1 only"):
        LLM(str(model_dir), quantization="int8")
    dynamic = tiny_model_factory("olmo2", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                           "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic' is not supported under the transformers"):
        LLM(str(dynamic))
    with pytest.raises(TensorParallelError, match="transformers fallback, which is served at tensor_parallel_size=1"):
        LLM(str(model_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="model_impl must be one of"):
        EngineConfig(model=str(model_dir), model_impl="vllm")


def test_an_architecture_whose_transformers_code_takes_no_attention_function_is_refused(tmp_path):
    from transformers import StableLmConfig, StableLmForCausalLM

    config = StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=4)
    StableLmForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"StableLmForCausalLM\) takes no custom attention function"):
        LLM(str(tmp_path))
