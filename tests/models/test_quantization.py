"""Quantized weights in the engine (worker/models/quantization.py): a GGUF's blocks (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept as they are and int8 quantized at load, against the
float32 engine on the same weights.

"gguf" multiplies the very values the dequantized engine holds, in another summation order, so
greedy tokens must agree (the check allows one prompt of five to part on a near-tie) and
perplexity must stay within 0.5%. "int8" changes the weights (about 0.5% relative error per
block), so only perplexity is compared, within 1%.
"""

from __future__ import annotations

import math

import pytest
import torch
from gguf import GGUFReader

from bench.model_families import rounded_checkpoint
from ferry.kernels.ops import QuantizedWeight
from ferry.worker.engine import LLM, Engine, EngineConfig, SamplingParams
from ferry.worker.engine.model_runner import SeqChunk
from ferry.worker.models.llama import PackedLinear, QuantizedEmbedding
from ferry.worker.models.quantization import QuantizationError
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.snapshots import fingerprint
from tests.gguf_files import write_gguf
from tests.tiny_models import CORPUS

NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_bytes=8 << 20, max_model_len=256)
HELD_OUT = (
    "A worker pulls jobs from the queue only while its engine has room, and hands back the rest "
    "when it drains. def step(self):\n    return self.scheduler.schedule()\n"
)
# (tiny model, its options, GGUF type): untied head and permuted llama q/k rows; a tied
# quantized table (lookup and head); Qwen2's q/k/v biases beside quantized projections; the
# K-quants on rows of 256 (their block), one tied; Phi-3's fused tensors.
WIDE = {"hidden_size": 256}
CASES = [
    ("llama", {}, "Q8_0"),
    ("llama", {"tie_word_embeddings": True}, "Q4_0"),
    ("qwen2", {}, "Q4_1"),
    ("llama", {}, "Q5_0"),
    ("llama", WIDE, "Q4_K"),
    ("qwen2", {**WIDE, "tie_word_embeddings": True}, "Q6_K"),
    ("phi3", {}, "Q5_1"),  # q/k/v and gate/up fused in the file itself
]
# What llama.cpp's Q4_K_M makes of a model whose hidden size is no multiple of 256 (SmolLM2's
# 576): Q5_0 where it wants Q4_K, Q8_0 where it wants Q6_K (some layers' v), the K-quants in
# ffn_down (rows of the intermediate size). Layer 0's q/k/v then mixes Q5_0 and Q8_0.
Q4_K_M_LIKE = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q5_1",
    "blk.0.attn_v.weight": "Q8_0",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q4_K",
}


@pytest.fixture(scope="module")
def gguf_path(tiny_model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized-gguf")

    def make(arch: str, options: dict, qtype: str, types: dict[str, str] | None = None):
        mixed = "-mixed" if types else ""
        name = f"{arch}-{'-'.join(f'{k}={v}' for k, v in sorted(options.items()))}-{qtype}{mixed}.gguf"
        path = out / name
        if not path.exists():
            write_gguf(tiny_model_factory(arch, **options), path, qtype, types=types)
        return path

    return make


def load(model, tmp_path, **kwargs) -> LLM:
    return LLM(str(model), model_cache_dir=str(tmp_path / "cache"), **ENGINE, **kwargs)


def perplexity(eng: Engine, text: str) -> float:
    """exp(mean negative log-likelihood) of `text` read by the model in one prefill, through the
    engine's own runner and kernels (blocks taken from the front of a pool no request uses)."""
    ids = eng.encode(text)
    blocks = list(range(-(-len(ids) // eng.block_size)))
    logits = eng.runner.forward([SeqChunk(ids, 0, blocks, num_logits=len(ids))])
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return math.exp(nll.item())


def greedy(llm: LLM, prompts: list[str] = CORPUS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("arch", "options", "qtype"), CASES, ids=[f"{a}-{q}" for a, _, q in CASES])
def test_gguf_blocks_kept_quantized_decode_as_the_dequantized_engine(gguf_path, tmp_path, arch, options, qtype):
    path = gguf_path(arch, options, qtype)
    quantized, plain = load(path, tmp_path, quantization="gguf"), load(path, tmp_path, quantization="none")
    model = quantized.engine.runner.model
    projections = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(projections) == 4 * quantized.engine.arch.num_layers
    assert {p.weight.qtype for p in projections} == {qtype}
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.native_stack is not None
    if not options.get("tie_word_embeddings"):
        assert model.lm_head.qtype == qtype  # the file's untied head, kept quantized too
    got, want = greedy(quantized), greedy(plain)
    assert agreeing(got, want) >= len(CORPUS) - 1, f"{agreeing(got, want)}/{len(CORPUS)} prompts agree"
    assert perplexity(quantized.engine, HELD_OUT) == pytest.approx(perplexity(plain.engine, HELD_OUT), rel=5e-3)


# Mixture-of-experts files: each layer's stacked experts (ffn_*_exps, [E, rows, cols]) stay in
# their blocks, expert by expert. Mixtral in one type; Qwen2-MoE on rows of 256 with llama.cpp's
# Q4_K_M choice for experts in layer 0 (gate/up Q4_K, down Q6_K) and, in layer 1, gate and up in
# two types (each expert's gate_up as QuantizedParts) beside down in F16, which the product does
# not read: those experts are dequantized and packed as float32 beside the kept ones.
MOE_WIDE = {"hidden_size": 256, "moe_intermediate_size": 256}
MOE_MIX = {
    "blk.0.ffn_gate_exps.weight": "Q4_K",
    "blk.0.ffn_up_exps.weight": "Q4_K",
    "blk.0.ffn_down_exps.weight": "Q6_K",
    "blk.1.ffn_gate_exps.weight": "Q4_K",
    "blk.1.ffn_up_exps.weight": "Q8_0",
    "blk.1.ffn_down_exps.weight": "F16",
}
MOE_CASES = [
    ("mixtral", {}, "Q4_0", None, [("Q4_0", "Q4_0")] * 2),
    ("qwen2_moe", MOE_WIDE, "Q5_0", MOE_MIX, [("Q4_K", "Q6_K"), ("Q4_K+Q8_0", "packed")]),
]


@pytest.mark.parametrize(("arch", "options", "qtype", "types", "kinds"), MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_gguf_experts_stay_in_their_blocks_and_decode_as_the_dequantized_engine(gguf_path, tmp_path, arch, options,
                                                                                 qtype, types, kinds):
    path = gguf_path(arch, options, qtype, types)
    quantized, plain = load(path, tmp_path, quantization="gguf"), load(path, tmp_path, quantization="none")
    experts = [layer.mlp.experts for layer in quantized.engine.runner.model.layers]
    assert [(e.w13.qtype, e.w2.qtype) for e in experts] == kinds
    # Kept experts are held at the file's size: the tiles regroup the blocks (K-quants' headers
    # unpacked: +3%).
    kept = [p for e in experts for p in (e.w13, e.w2) if p.qtype != "packed"]
    held = sum(t.numel() * t.element_size() for p in kept for t in p.held_tensors)
    in_file = sum(int(t.n_bytes) for t in GGUFReader(path).tensors
                  if "_exps." in t.name and t.tensor_type.name != "F16")
    assert in_file <= held <= 1.03 * in_file
    assert not any("experts" in name for name, _ in quantized.engine.runner.model.named_parameters())
    got, want = greedy(quantized), greedy(plain)
    assert agreeing(got, want) >= len(CORPUS) - 1, f"{agreeing(got, want)}/{len(CORPUS)} prompts agree"
    assert perplexity(quantized.engine, HELD_OUT) == pytest.approx(perplexity(plain.engine, HELD_OUT), rel=5e-3)


def test_int8_holds_every_expert_as_the_float_engine_on_the_rounded_checkpoint(tiny_model_factory, tmp_path):
    """int8 on a MoE checkpoint: each expert's matrices in Q8_0 blocks, the routers float. It then
    decodes as the float engine on the checkpoint rounded through the same blocks (perplexity
    against the unrounded one moves ~2% on this tiny random model, mostly from the dense layers)."""
    model_dir = tiny_model_factory("qwen3_moe", moe_intermediate_size=64)
    rounded = rounded_checkpoint(model_dir, tmp_path / "rounded")
    quantized, plain = load(model_dir, tmp_path, quantization="int8"), load(rounded, tmp_path)
    layers = quantized.engine.runner.model.layers
    assert {(layer.mlp.experts.w13.qtype, layer.mlp.experts.w2.qtype) for layer in layers} == {("Q8_0", "Q8_0")}
    assert len(layers[0].mlp.experts.w13.experts) == 8
    assert not any(isinstance(layer.mlp.gate.weight, QuantizedWeight) for layer in layers)
    got, want = greedy(quantized), greedy(plain)
    assert agreeing(got, want) >= len(CORPUS) - 1, f"{agreeing(got, want)}/{len(CORPUS)} prompts agree"
    assert perplexity(quantized.engine, HELD_OUT) == pytest.approx(perplexity(plain.engine, HELD_OUT), rel=5e-3)


def test_int8_keeps_perplexity_within_one_percent(llama_dir, tmp_path):
    quantized, plain = load(llama_dir, tmp_path, quantization="int8"), load(llama_dir, tmp_path)
    model = quantized.engine.runner.model
    assert {p.weight.qtype for p in model.modules() if isinstance(p, PackedLinear)} == {"Q8_0"}
    assert model.lm_head.qtype == "Q8_0" and isinstance(model.embed_tokens, QuantizedEmbedding)
    assert plain.engine.quantization == "none"  # an HF checkpoint's default
    assert perplexity(quantized.engine, HELD_OUT) == pytest.approx(perplexity(plain.engine, HELD_OUT), rel=1e-2)
    assert len(greedy(quantized)[0]) == NEW_TOKENS


def test_default_keeps_a_quantized_gguf_quantized_on_the_cpu_only(gguf_path, tmp_path):
    assert load(gguf_path("llama", {}, "Q4_1"), tmp_path).engine.quantization == "gguf"
    assert load(gguf_path("llama", {}, "F32"), tmp_path).engine.quantization == "none"  # nothing to keep


def test_a_q4_k_m_mix_keeps_every_matrix_in_its_own_type(gguf_path, tmp_path):
    """Per-tensor types as llama.cpp's Q4_K_M writes them for a hidden size of 64 (no multiple
    of 256), the K-quants on ffn_down's rows of 512 (the intermediate size): every matrix stays in
    its file's type, layer 0's q/k/v as Q5_0 + Q5_0 + Q8_0 parts side by side, and the engine
    still decodes as the dequantized one."""
    path = gguf_path("llama", {"intermediate_size": 512}, "Q5_0", Q4_K_M_LIKE)
    quantized, plain = load(path, tmp_path, quantization="gguf"), load(path, tmp_path, quantization="none")
    model = quantized.engine.runner.model
    kinds = {name: m.weight.qtype for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert kinds["layers.0.self_attn.qkv_proj"] == "Q5_0+Q5_0+Q8_0"
    assert kinds["layers.1.self_attn.qkv_proj"] == "Q5_0"
    assert (kinds["layers.0.mlp.down_proj"], kinds["layers.1.mlp.down_proj"]) == ("Q6_K", "Q4_K")
    assert model.lm_head.qtype == "Q5_1" and model.embed_tokens.weight.qtype == "Q8_0"
    assert model.native_stack is not None
    got, want = greedy(quantized), greedy(plain)
    assert agreeing(got, want) >= len(CORPUS) - 1, f"{agreeing(got, want)}/{len(CORPUS)} prompts agree"
    assert perplexity(quantized.engine, HELD_OUT) == pytest.approx(perplexity(plain.engine, HELD_OUT), rel=5e-3)


def test_gguf_types_the_product_cannot_read_are_dequantized(gguf_path, tmp_path):
    path = gguf_path("llama", WIDE, "Q3_K")
    kept, plain = load(path, tmp_path, quantization="gguf"), load(path, tmp_path, quantization="none")
    held = [getattr(m, "weight", None) for m in kept.engine.runner.model.modules()]
    assert kept.engine.quantization == "gguf" and not any(isinstance(w, QuantizedWeight) for w in held)
    assert greedy(kept, CORPUS[:2]) == greedy(plain, CORPUS[:2])


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        ("hf", {"quantization": "gguf"}, "not a GGUF file"),
        ("q4_1", {"quantization": "int8"}, r"already quantized \(Q4_1"),
        ("q4_1", {"quantization": "gguf", "device": "cuda"}, "CPU only"),
        ("hf", {"quantization": "int8", "device": "cuda"}, "CPU only"),
        ("q4_1", {"quantization": "gguf", "dtype": "bfloat16"}, "float32"),
    ],
)
def test_bad_combinations_are_refused_before_loading(llama_dir, gguf_path, tmp_path, model, kwargs, message):
    path = llama_dir if model == "hf" else gguf_path("llama", {}, "Q4_1")
    with pytest.raises(QuantizationError, match=message):
        load(path, tmp_path, **kwargs)


def test_unknown_quantization_and_the_worker_variable(monkeypatch):
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(model="m", quantization="awq")
    monkeypatch.setenv("FERRY_QUANTIZATION", "int8")
    assert WorkerSettings().engine.quantization == "int8"


def test_quantized_engine_batches_caches_prefixes_speculates_and_fingerprints_apart(gguf_path, tmp_path):
    path = gguf_path("llama", {"tie_word_embeddings": True}, "Q4_0")
    quantized, plain = load(path, tmp_path, quantization="gguf"), load(path, tmp_path, quantization="none")
    assert fingerprint(quantized.engine) != fingerprint(plain.engine)
    assert quantized.engine.model_salt != plain.engine.model_salt  # no prefix-cache key is shared
    batched = greedy(quantized)  # all five prompts in one continuously batched run
    one_by_one = [greedy(quantized, [prompt])[0] for prompt in CORPUS]  # each prompt again: prefix-cache hits
    assert one_by_one == batched
    assert quantized.engine.stats().prefix_cache_hits > 0
    speculative = load(path, tmp_path, quantization="gguf", speculative={"method": "ngram", "measure_speedup": False})
    assert greedy(speculative) == batched
    assert speculative.engine.stats().spec_decode.num_accepted_tokens > 0
