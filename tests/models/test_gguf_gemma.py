"""Gemma 2 and Gemma 3 GGUFs (llama.cpp's `gemma2` / `gemma3`): the conversion gives back the HF
checkpoint the file was written from (norms stored as w + 1, the sandwich norms under their own
names, the config fields llama.cpp hardcodes), Ferry's greedy tokens from the file are transformers'
on that checkpoint, and a vision projector or tower is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.models.config import UnsupportedModelError
from ferry.worker.models.gguf import read_gguf
from ferry.worker.models.gguf_cache import converted_checkpoint
from ferry.worker.models.gguf_gemma import gemma_config_kwargs, layer_types, query_pre_attn_scalar
from ferry.worker.models.loader import weight_files
from tests.engine.test_gemma import GEMMA3_ROPE, _random_norms
from tests.engine.test_hf_parity import GREEDY, _prompts, _reference
from tests.gguf_files import write_gguf
from tests.tiny_models import make_model

ENGINE = dict(kv_cache_bytes=8 << 20, max_model_len=256)
# Shapes llama.cpp's fixed rules describe: query_pre_attn_scalar = head_dim (here unlike hidden /
# heads = 16 for Gemma 2), Gemma 2's every other layer and Gemma 3's every 6th layer global, Gemma
# 3's local layers at rope base 10000 beside linear-scaled global ones. A 16-token window, and
# prompts of up to 50 tokens: the windows slide. Tied embeddings, as Gemma's (no output.weight).
CASES = {
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "head_dim": 32, "sliding_window": 16,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 32}),
    "gemma3": ("gemma3_text", {"tie_word_embeddings": True, "head_dim": 16, "sliding_window": 16, "num_layers": 6,
                               "query_pre_attn_scalar": 16, "rope_parameters": GEMMA3_ROPE}),
}
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "query_pre_attn_scalar",
                 "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                 "rope_parameters", "hidden_activation")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """case -> the tiny HF checkpoint (random norm weights: transformers initialises them to 0)."""
    made = {}

    def make(case: str):
        if case not in made:
            arch, kwargs = CASES[case]
            made[case] = _random_norms(make_model(tmp_path_factory.mktemp(f"{case}-hf"), arch, **kwargs))
        return made[case]

    return make


@pytest.fixture(scope="module")
def gemma_gguf(gemma, tmp_path_factory):
    """(case, qtype) -> a GGUF written from the case's checkpoint as llama.cpp's converter writes it."""
    made = {}
    out = tmp_path_factory.mktemp("gemma-gguf")

    def make(case: str, qtype: str):
        if (case, qtype) not in made:
            made[case, qtype] = write_gguf(gemma(case), out / f"{case}-{qtype}.gguf", qtype)
        return made[case, qtype]

    return make


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma-cache")


@pytest.mark.parametrize("case", list(CASES))
def test_an_f32_gemma_gguf_converts_back_to_its_checkpoint(gemma, gemma_gguf, cache, case):
    """Every tensor is the original's: the norms, w + 1 in the file, as (w + 1) - 1 in float32, the
    rest exactly; the config's Gemma fields are the original's."""
    model_dir = converted_checkpoint(gemma_gguf(case, "F32"), cache)
    converted = {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}
    original = load_file(str(gemma(case) / "model.safetensors"))
    assert "output.weight" not in {t.gguf_name for t in read_gguf(gemma_gguf(case, "F32")).tensors}
    assert converted.keys() == original.keys()
    norms = [name for name in original if "norm" in name]
    assert len(norms) == 1 + CASES[case][1].get("num_layers", 2) * (6 if case == "gemma3" else 4)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor + 1 - 1 if name in norms else tensor), name
    config, expected = AutoConfig.from_pretrained(model_dir), AutoConfig.from_pretrained(gemma(case))
    assert type(config) is type(expected)
    for key in CONFIG_FIELDS:
        assert getattr(config, key) == getattr(expected, key), key


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_prompt_logprobs_from_a_gemma_gguf_match_transformers_on_its_checkpoint(
    gemma, gemma_gguf, cache, case
):
    """Greedy tokens, and each prompt token's logprob (which the attention scale and the final
    soft-cap move even where the greedy order holds), are transformers' on the checkpoint."""
    llm = LLM(str(gemma_gguf(case, "F32")), model_cache_dir=str(cache), quantization="none", **ENGINE)
    assert llm.engine.arch.gemma is not None
    prompts = [p for p in _prompts(llm.engine.arch.vocab_size) if len(p) in (1, 17, 50)]  # 17, 50: past the window
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _reference(gemma(case), prompts)
    prompt = prompts[-1]
    model = AutoModelForCausalLM.from_pretrained(gemma(case), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert [scored[i][token].logprob for i, token in enumerate(prompt) if i] == pytest.approx(
        [expected[i - 1, token].item() for i, token in enumerate(prompt) if i], abs=2e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_a_q8_0_gemma_gguf_kept_quantized_decodes_as_its_dequantized_engine(gemma_gguf, cache, case):
    path = gemma_gguf(case, "Q8_0")
    kept = LLM(str(path), model_cache_dir=str(cache), quantization="gguf", **ENGINE)
    plain = LLM(str(path), model_cache_dir=str(cache), quantization="none", **ENGINE)
    assert kept.engine.runner.model.layers[0].self_attn.qkv_proj.weight.qtype == "Q8_0"
    prompts = [p for p in _prompts(kept.engine.arch.vocab_size) if len(p) in (1, 17, 50)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in kept.generate(prompts, params, use_tqdm=False)] == [
        o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


def test_query_pre_attn_scalar_is_head_dim_except_for_the_27b_shapes():
    """llama.cpp scales queries by head_dim ** -0.5, except Gemma 2 27B (46 layers) and Gemma 3 27B
    (62 layers): (hidden / heads) ** -0.5. The released configs' query_pre_attn_scalar agree."""
    assert query_pre_attn_scalar("gemma2", 46, 4608, 32, 128) == 144  # Gemma 2 27B
    assert query_pre_attn_scalar("gemma2", 42, 3584, 16, 256) == 256  # Gemma 2 9B
    assert query_pre_attn_scalar("gemma2", 26, 2304, 8, 256) == 256  # Gemma 2 2B
    assert query_pre_attn_scalar("gemma3", 62, 5376, 32, 128) == 168  # Gemma 3 27B
    assert query_pre_attn_scalar("gemma3", 48, 3840, 16, 256) == 256  # Gemma 3 12B
    assert query_pre_attn_scalar("gemma3", 46, 2560, 8, 256) == 256  # 46 layers is a 27B for Gemma 2 only


def test_layer_types_follow_llama_cpps_sliding_window_patterns():
    assert layer_types("gemma2", 4, sliding=True) == ["sliding_attention", "full_attention"] * 2
    gemma3 = layer_types("gemma3", 12, sliding=True)
    assert [i for i, kind in enumerate(gemma3) if kind == "full_attention"] == [5, 11]
    assert layer_types("gemma3", 12, sliding=False) == ["full_attention"] * 12


def test_gemma_metadata_defaults_are_llama_cpps():
    """A Gemma 2 file without window or soft-caps gets llama.cpp's 4096, 50 and 30; a Gemma 3 file
    without a window has every layer global; Gemma 3's local layers rotate at base 10000 whatever
    the file's rope says."""
    common = {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
              "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}

    def no_keys(key, default):
        return default

    gemma2 = gemma_config_kwargs("gemma2", no_keys, common)
    assert (gemma2["sliding_window"], gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (
        4096, 50.0, 30.0)
    gemma3 = gemma_config_kwargs("gemma3", no_keys, common)
    assert gemma3["sliding_window"] is None and set(gemma3["layer_types"]) == {"full_attention"}
    assert gemma3["final_logit_softcapping"] is None
    assert gemma3["rope_parameters"] == {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": common["rope_parameters"]}


def test_a_vision_projector_or_tower_is_refused_by_name(gemma, tmp_path):
    mmproj = tmp_path / "mmproj.gguf"
    writer = GGUFWriter(mmproj, "clip")
    writer.add_tensor("mm.input_projection.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"vision projector \(mmproj\)"):
        read_gguf(mmproj)
    tower = {"v.blk.0.attn_q.weight": np.zeros((8, 8), dtype=np.float32)}
    path = write_gguf(gemma("gemma3"), tmp_path / "with-tower.gguf", extra=tower)
    with pytest.raises(UnsupportedModelError, match=r"vision tower's tensors \(v\.blk\.0\.attn_q\.weight\)"):
        read_gguf(path)
