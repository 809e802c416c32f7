"""Gemma 2 and Gemma 3 (text) on Ferry's native decoder: greedy tokens identical to transformers
`generate` on the same weights, whole prompts, chunked prefill, the prefix cache, two ranks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma2Config, Gemma3TextConfig

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.engine.hybrid_kv import HybridKVCacheManager
from ferry.worker.models.config import ModelArch, UnsupportedModelError
from ferry.worker.models.llama import GemmaDecoderLayer, LlamaModel
from tests.engine.test_hf_parity import GREEDY, _assert_all_free, _prompts, _reference, assert_prompt_logprobs_match
from tests.tiny_models import make_model

GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
CASES = {
    # every other layer a 16-token window (sequences reach 82 tokens), attention and final
    # logits soft-capped, attention scaled by 24 ** -0.5 rather than head_dim's
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 16, "attn_logit_softcapping": 5.0,
                          "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24}),
    # local layers (16-token window, their own rope) beside global ones with linear scaling, q/k norms
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 16, "num_layers": 4, "sliding_window_pattern": 2,
                               "query_pre_attn_scalar": 24, "rope_parameters": GEMMA3_ROPE}),
}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    made = {}

    def factory(case: str):
        if case not in made:
            arch, kwargs = CASES[case]
            made[case] = _random_norms(make_model(tmp_path_factory.mktemp(f"{case}-native"), arch, **kwargs))
        return made[case]

    return factory


def _random_norms(model_dir):
    """transformers initialises Gemma's norm weights to 0 (a scale of 1 + 0): random ones instead,
    so every norm's (1 + w) and where it sits in the layer matter to the tokens."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if "norm" in name:
            tensors[name] = (torch.randn(tensor.shape, generator=g) * 0.3).to(tensor.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


_REFERENCES: dict = {}


def _expected(model_dir, prompts):
    key = (str(model_dir), repr(prompts))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(model_dir, prompts)
    return _REFERENCES[key]


def _check_native(llm: LLM) -> None:
    assert llm.engine.arch.implementation == "ferry"
    model = llm.engine.runner.model
    assert isinstance(model, LlamaModel) and all(isinstance(layer, GemmaDecoderLayer) for layer in model.layers)
    assert model.native_stack is not None  # decode steps whose contexts fit every window


# "chunked": 8 tokens a step, every prompt over 8 tokens is split, decodes ride along with chunks.
ENGINES = {"plain": {}, "chunked": {"max_num_batched_tokens": 8, "enable_prefix_caching": False}}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(gemma_dir, case, engine):
    model_dir = gemma_dir(case)
    llm = LLM(str(model_dir), **ENGINES[engine])
    _check_native(llm)
    prompts = _prompts(llm.engine.arch.vocab_size)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _expected(model_dir, prompts)
    _assert_all_free(llm)


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_cache_matches(gemma_dir, case):
    model_dir = gemma_dir(case)
    llm = LLM(str(model_dir), block_size=4, enable_prefix_caching=True)
    _check_native(llm)
    prompts = _prompts(llm.engine.arch.vocab_size)
    prompts = prompts + [prompts[-1][:40] + [5, 6], prompts[-2][:30] + [7]]  # sharing blocks past the window
    expected = _expected(model_dir, prompts)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # every prompt's full blocks are cached now
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert llm.engine.kv.prefix_hits > 0 and max(o.num_cached_tokens for o in again) >= 40
    _assert_all_free(llm)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_match_transformers(gemma_dir, case):
    """Greedy tokens cannot see the final soft-cap (tanh keeps the order); each prompt token's
    logprob does. A 50-token prompt scored in chunks of 8 reads as transformers' one pass over it."""
    assert_prompt_logprobs_match(gemma_dir(case), _prompts(300)[-1])


def test_two_ranks_match_transformers(gemma_dir):
    model_dir = gemma_dir("gemma3")
    prompts = _prompts(300)[-3:]  # 17, 33 and 50 tokens: past the window
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = dict(block_size=4, max_num_batched_tokens=8, max_model_len=128, kv_cache_bytes=1 << 20)
    with LLM(str(model_dir), tensor_parallel_size=2, **engine) as llm:
        assert llm.engine.arch.implementation == "ferry"
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # Both pools' blocks gathered from both ranks (a snapshot's read), as one rank holds them;
        # written to other blocks of both pools and read back the same.
        keys = [meta.key for meta in llm.engine.prefix_blocks.cached()]
        gathered = llm.engine.prefix_blocks.read(keys)
        kv = llm.engine.core.kv
        assert isinstance(kv, HybridKVCacheManager)
        spare = [[b for b in pool.free_queue if pool.block_meta[b] is None][: len(keys)]
                 for pool in (kv.full, kv.windowed)]
        llm.engine.executor.write_blocks(spare[0], gathered, spare[1])
        assert torch.equal(llm.engine.executor.read_blocks(*spare), gathered)
    assert [o.token_ids for o in outputs] == [tokens[:12] for tokens in _expected(model_dir, prompts)]
    one_rank = LLM(str(model_dir), **engine)
    one_rank.generate(prompts, params, use_tqdm=False)
    torch.testing.assert_close(one_rank.engine.prefix_blocks.read(keys), gathered, atol=1e-5, rtol=1e-4)


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, architectures=None)


@pytest.mark.parametrize(("config", "field"), [
    (Gemma2Config(**{**TINY, "hidden_activation": "gelu", "architectures": ["Gemma2ForCausalLM"]}),
     "hidden_activation"),
    (Gemma3TextConfig(**{**TINY, "use_bidirectional_attention": True, "architectures": ["Gemma3ForCausalLM"]}),
     "use_bidirectional_attention"),
])
def test_what_native_gemma_does_not_implement_is_refused_by_name(config, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelArch.from_hf_config(config)
