"""Weights kept quantized in GGUF block formats, for the cpu backend's fused-dequantization product
(`csrc/quantized_linear_cpu.cpp`, `csrc/quantized_linear_vnni.cpp`; `native.linear` runs it).

`pack_quantized_weight` regroups a GGUF tensor's blocks once, at load, into tiles of 8 output rows
x one block (`quantized_formats.py` documents the formats and the layout): the same bytes, so a
quantized model holds about the GGUF tensor's size in memory. This module is plain torch: packing
and dequantizing need no native build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.kernels.cpu.quantized_formats import (
    BLOCK,
    FORMATS,
    TILE_ROWS,
    decode_blocks,
    dequantize,
    pack_tiles,
    unpack_tiles,
)

__all__ = ["FORMATS", "QuantizedParts", "QuantizedWeight", "pack_quantized_weight", "quantize_int8_weight"]


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An nn.Linear weight [out_features, in_features] kept in a GGUF block format, as tiles of
    8 rows x one GGUF block (32 columns, 256 for the K-quants; layout in quantized_formats.py)."""

    tiles: torch.Tensor  # [ceil(out_features / 8), in_features / block columns, unit bytes] uint8
    qtype: str  # a key of FORMATS: "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held (the GGUF tensor's, plus the zero rows that fill the last tile)."""
        return self.tiles.numel()

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        """The weights as float32, exactly as `gguf.quants.dequantize` computes them."""
        return _dequantize_tiles(self.tiles, self.qtype)[: self.out_features]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., in_features] float32
        """Rows `ids` as float32: an embedding lookup in a quantized table (tied embeddings),
        which reads only the tiles of the rows asked for."""
        flat = ids.reshape(-1)
        rows = _dequantize_tiles(self.tiles[flat // TILE_ROWS], self.qtype).view(-1, TILE_ROWS, self.in_features)
        picked = rows[torch.arange(flat.numel()), flat % TILE_ROWS]
        return picked.reshape(*ids.shape, self.in_features)


@dataclass(frozen=True, slots=True)
class QuantizedParts:
    """A fused weight (q/k/v, gate/up) whose parts a GGUF file stores in different block types
    (llama.cpp's Q4_K_M gives some layers' v more bits than q and k): each part stays in its own
    tiles and the product runs part by part into one output, so nothing is expanded or re-quantized."""

    parts: tuple[QuantizedWeight, ...]  # in output-row order, one in_features

    def __post_init__(self) -> None:
        if len({p.in_features for p in self.parts}) != 1:
            raise ValueError("the parts of a fused weight must share in_features")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def qtype(self) -> str:  # for logs and repr: "Q5_0+Q5_0+Q8_0"
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        return torch.cat([p.dequantize() for p in self.parts])


def pack_quantized_weight(raw_blocks: torch.Tensor, qtype: str, out_features: int, in_features: int) -> QuantizedWeight:
    """Regroup a GGUF tensor's blocks into the product's tiles.

    raw_blocks: uint8 [out_features, bytes per row], the tensor's data as a GGUF file stores it
    (`gguf.GGUFReader` gives exactly this for a 2-D quantized tensor), bytes per row being
    in_features / (32 or 256) blocks of the qtype's size. qtype: a key of FORMATS. Raises
    ValueError for another qtype, an in_features that is not a multiple of the block, or a shape
    that disagrees with the bytes."""
    if qtype not in FORMATS:
        raise ValueError(f"quantization type {qtype!r} is not supported (supported: {', '.join(FORMATS)})")
    fmt = FORMATS[qtype]
    if in_features <= 0 or in_features % fmt.columns:
        raise ValueError(f"in_features {in_features} is not a multiple of the {qtype} block of {fmt.columns} weights")
    expected = (out_features, in_features // fmt.columns * fmt.gguf_bytes)
    if raw_blocks.dtype != torch.uint8 or tuple(raw_blocks.shape) != expected:
        raise ValueError(
            f"{qtype} blocks for a [{out_features}, {in_features}] weight must be uint8 {list(expected)}, "
            f"got {raw_blocks.dtype} {list(raw_blocks.shape)}"
        )
    q, fields = decode_blocks(raw_blocks, fmt)
    return QuantizedWeight(pack_tiles(q, fields, fmt), qtype, out_features, in_features)


def quantize_int8_weight(weight: torch.Tensor) -> QuantizedWeight:
    """Weight-only int8 for a float checkpoint, quantized at load: Q8_0 (one fp16 scale per 32
    weights of a row, d = max |w| / 127, q = round(w / d)), so it runs through the Q8_0 product.
    Relative error (Frobenius) about 0.5% on Gaussian-like weights. Raises ValueError where
    in_features is not a multiple of 32."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be a matrix [out_features, in_features], got shape {list(weight.shape)}")
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of the Q8_0 block of {BLOCK} weights")
    blocks = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
    d = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)  # the scale as the block stores it
    inverse = torch.where(d > 0, 1 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    raw = torch.cat([d.view(torch.uint8).reshape(out_features, -1, 2), q.view(torch.uint8)], dim=2)
    return pack_quantized_weight(raw.reshape(out_features, -1), "Q8_0", out_features, in_features)


def _dequantize_tiles(tiles: torch.Tensor, qtype: str) -> torch.Tensor:  # [g, units, bytes] -> [g * 8, K] float32
    fmt = FORMATS[qtype]
    q, fields = unpack_tiles(tiles, fmt)
    return dequantize(q, fields, fmt)
