"""Weights kept quantized in GGUF block formats, for the cpu backend's fused-dequantization product
(`csrc/quantized_linear_cpu.cpp`; `native.linear` runs it).

A GGUF tensor stores each output row as blocks of 32 weights (ggml's formats):

    Q8_0  34 bytes: fp16 d, int8 q[32]                              w = d q
    Q4_0  18 bytes: fp16 d, 16 bytes, byte j = q(j) | q(j+16) << 4   w = d (q - 8)
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes as Q4_0                 w = d q + m

`pack_quantized_weight` regroups those bytes once, at load, into tiles of 8 output rows x one
block (the kernel's layout, documented in the .cpp): the same bytes, so a quantized model holds
the GGUF tensor's size in memory (plus at most 7 zero rows). This module is plain torch: packing
and dequantizing need no native build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per GGUF block
TILE_ROWS = 8  # output rows per tile: one 8-float vector in the kernel
# GGUF type -> (bytes per block, fp16 fields before the quants: d, or d and m)
FORMATS = {"Q8_0": (34, 1), "Q4_0": (18, 1), "Q4_1": (20, 2)}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An nn.Linear weight [out_features, in_features] kept in a GGUF block format, as tiles of
    8 rows x 32 columns: tiles[g, b] holds the fp16 scales of rows 8g..8g+7 (d[8], then m[8] for
    Q4_1) followed by their quants column by column (32 x 8 int8 for Q8_0; 16 x 8 bytes of
    nibble pairs for Q4_0/Q4_1, columns j and j + 16 in the low and high nibble)."""

    tiles: torch.Tensor  # [ceil(out_features / 8), in_features / 32, 8 * bytes per block] uint8
    qtype: str  # "Q8_0", "Q4_0" or "Q4_1"
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held (the GGUF tensor's, plus the zero rows that fill the last tile)."""
        return self.tiles.numel()

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        """The weights as float32, exactly as `gguf.quants.dequantize` computes them."""
        return _dequantize_tiles(self.tiles, self.qtype).reshape(-1, self.in_features)[: self.out_features]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., in_features] float32
        """Rows `ids` as float32: an embedding lookup in a quantized table (tied embeddings),
        which reads only the tiles of the rows asked for."""
        flat = ids.reshape(-1)
        rows = _dequantize_tiles(self.tiles[flat // TILE_ROWS], self.qtype)  # [n, 8, in_features]
        picked = rows[torch.arange(flat.numel()), flat % TILE_ROWS]
        return picked.reshape(*ids.shape, self.in_features)


def pack_quantized_weight(raw_blocks: torch.Tensor, qtype: str, out_features: int, in_features: int) -> QuantizedWeight:
    """Regroup a GGUF tensor's blocks into the product's tiles.

    raw_blocks: uint8 [out_features, bytes per row], the tensor's data as a GGUF file stores it
    (`gguf.GGUFReader` gives exactly this for a 2-D quantized tensor), bytes per row being
    in_features / 32 blocks of the qtype's size. qtype: "Q8_0", "Q4_0" or "Q4_1". Raises
    ValueError for another qtype, an in_features that is not a multiple of 32, or a shape that
    disagrees with the bytes."""
    if qtype not in FORMATS:
        raise ValueError(f"quantization type {qtype!r} is not supported (supported: {', '.join(FORMATS)})")
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of the {qtype} block of {BLOCK} weights")
    block_bytes, fields = FORMATS[qtype]
    blocks = in_features // BLOCK
    expected = (out_features, blocks * block_bytes)
    if raw_blocks.dtype != torch.uint8 or tuple(raw_blocks.shape) != expected:
        raise ValueError(
            f"{qtype} blocks for a [{out_features}, {in_features}] weight must be uint8 {list(expected)}, "
            f"got {raw_blocks.dtype} {list(raw_blocks.shape)}"
        )
    groups = -(-out_features // TILE_ROWS)
    padded = torch.zeros(groups * TILE_ROWS, expected[1], dtype=torch.uint8)  # zero rows: d = m = 0, so w = 0
    padded[:out_features] = raw_blocks
    by_row = padded.view(groups, TILE_ROWS, blocks, block_bytes)
    header = 2 * fields
    # [group, block, field, row, byte]: each fp16 field for the tile's 8 rows side by side.
    scales = by_row[..., :header].reshape(groups, TILE_ROWS, blocks, fields, 2).permute(0, 2, 3, 1, 4)
    # [group, block, column chunk, row]: the kernel widens one chunk's 8 bytes to one vector.
    quants = by_row[..., header:].permute(0, 2, 3, 1)
    tiles = torch.cat([scales.reshape(groups, blocks, -1), quants.reshape(groups, blocks, -1)], dim=2)
    return QuantizedWeight(tiles.contiguous(), qtype, out_features, in_features)


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


def _dequantize_tiles(tiles: torch.Tensor, qtype: str) -> torch.Tensor:  # [g, blocks, tile] -> [g, 8, blocks * 32]
    groups, blocks, _ = tiles.shape
    fields = FORMATS[qtype][1]
    header = 2 * fields * TILE_ROWS
    scales = tiles[..., :header].contiguous().view(torch.float16).float().view(groups, blocks, fields, 1, TILE_ROWS)
    quants = tiles[..., header:].contiguous()
    if qtype == "Q8_0":
        q = quants.view(torch.int8).view(groups, blocks, BLOCK, TILE_ROWS).float()
    else:
        nibbles = quants.view(groups, blocks, BLOCK // 2, TILE_ROWS)
        q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=2).float()  # columns j, then j + 16
    d = scales[:, :, 0]
    # gguf.quants computes in float32 in this order: d * q (+ m), d * (q - 8).
    if qtype == "Q4_1":
        w = d * q + scales[:, :, 1]
    elif qtype == "Q4_0":
        w = d * (q - 8)
    else:
        w = q * d
    return w.permute(0, 3, 1, 2).reshape(groups, TILE_ROWS, blocks * BLOCK)  # [g, row, column]
