"""The GGUF block formats the CPU product keeps quantized, and their tile layout (issues 25 and 41).

A GGUF tensor stores each output row as blocks (ggml's formats; `gguf.quants` is the reference):

    Q8_0   34 B / 32 weights:  fp16 d, int8 q[32]                            w = d q
    Q4_0   18 B / 32:          fp16 d, 16 B nibbles                          w = d (q - 8)
    Q4_1   20 B / 32:          fp16 d, fp16 m, 16 B nibbles                  w = d q + m
    Q5_0   22 B / 32:          fp16 d, u32 high bits, 16 B nibbles           w = d (q - 16)
    Q5_1   24 B / 32:          fp16 d, fp16 m, u32 high bits, 16 B nibbles   w = d q + m
    Q4_K  144 B / 256:         fp16 d, fp16 dmin, 12 B of 6-bit sc[8] and mn[8], 128 B nibbles
                               sub-block s of 32:  w = (d sc[s]) q - (dmin mn[s])
    Q5_K  176 B / 256:         as Q4_K plus 32 B of high bits
    Q6_K  210 B / 256:         128 B low nibbles, 64 B 2-bit highs, int8 sc[16], fp16 d
                               sub-block s of 16:  w = (d sc[s]) (q - 32)

`pack_tiles` regroups a tensor's blocks once, at load, into the product's tiles: one *unit* per 8
output rows x one GGUF block (32 columns, or 256 for the K-quants), [groups, units, unit bytes]:

    header: each field for the 8 rows side by side, in the order of `BlockFormat.header`
            (d[8] fp16; m[8] fp16; Q4_K/Q5_K: dmin[8] fp16, sc[8 blocks][8 rows] u8, mn[8][8] u8;
            Q6_K: sc[16 halves][8 rows] int8; the 6-bit K scales are unpacked at load)
    then per 32-column block of the unit, its quants plane:
      8-bit (Q8_0):  q[32 columns][8 rows] int8
      4/5/6-bit:     n[16][8] bytes, n[j][i] = low 4 bits of q(row i, column j) | those of column
                     j + 16 << 4; then for 5 bits h[8] u32, bit c of h[i] = bit 4 of q(i, c); for
                     6 bits h[2][8] u32, bits 2t, 2t+1 of h[k][i] = bits 4, 5 of q(i, 16k + t)

So a row's quants for column j and j + 16 sit in one byte (the kernels widen 8 bytes to the 8 rows'
lanes), the high bits of a row in one 32-bit lane, and every 32-column block carries its scales:
the same bytes as the file's (the K-quants' 12 packed scale bytes become 16), so a kept tensor holds
1.00-1.03x its GGUF size plus at most 7 zero rows (d = 0: w = 0). The C++ side reads this layout
(csrc/quantized_tiles.h); this module is plain torch (kernels/ imports torch and triton only) and needs no
native build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE_ROWS = 8  # output rows per tile: one 8-float vector in the kernel
BLOCK = 32  # columns per quants plane


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One GGUF block type as the product holds it."""

    name: str
    gguf_bytes: int  # bytes per GGUF block
    columns: int  # weights per GGUF block: 32, or 256 for the K-quants
    bits: int  # bits per quant: 8, 4, 5 or 6
    header: tuple[tuple[str, int, int], ...]  # (field, values per row, bytes per value), in tile order

    @property
    def blocks(self) -> int:  # 32-column planes per unit
        return self.columns // BLOCK

    @property
    def plane_bytes(self) -> int:  # one 32-column block of 8 rows' quants
        return {8: 256, 4: 128, 5: 160, 6: 192}[self.bits]

    @property
    def high_width(self) -> int:  # bits of each quant past its low nibble: 0 (4 and 8 bits), 1 or 2
        return {5: 1, 6: 2}.get(self.bits, 0)

    @property
    def high_per_word(self) -> int:  # columns whose high bits share one u32 lane of the high plane
        return 32 // self.high_width

    @property
    def header_bytes(self) -> int:
        return TILE_ROWS * sum(count * size for _, count, size in self.header)

    @property
    def unit_bytes(self) -> int:  # one tile: 8 rows x one GGUF block
        return self.header_bytes + self.blocks * self.plane_bytes


_K_HEADER = (("d", 1, 2), ("dmin", 1, 2), ("sc", 8, 1), ("mn", 8, 1))
FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q8_0", 34, 32, 8, (("d", 1, 2),)),
        BlockFormat("Q4_0", 18, 32, 4, (("d", 1, 2),)),
        BlockFormat("Q4_1", 20, 32, 4, (("d", 1, 2), ("m", 1, 2))),
        BlockFormat("Q5_0", 22, 32, 5, (("d", 1, 2),)),
        BlockFormat("Q5_1", 24, 32, 5, (("d", 1, 2), ("m", 1, 2))),
        BlockFormat("Q4_K", 144, 256, 4, _K_HEADER),
        BlockFormat("Q5_K", 176, 256, 5, _K_HEADER),
        BlockFormat("Q6_K", 210, 256, 6, (("d", 1, 2), ("sc", 16, 1))),
    )
}

Fields = dict[str, torch.Tensor]  # field -> uint8 [rows, units, values per row, bytes per value]


def decode_blocks(raw: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, Fields]:
    """A GGUF tensor's rows (uint8 [rows, units * gguf_bytes]) as their quants, uint8 [rows,
    units * columns] (Q8_0: the int8 bits; others 0 .. 2^bits - 1), and their header fields."""
    rows = raw.shape[0]
    units = raw.shape[1] // fmt.gguf_bytes
    b = raw.reshape(rows, units, fmt.gguf_bytes)

    def field(start: int, count: int, size: int) -> torch.Tensor:
        return b[..., start : start + count * size].reshape(rows, units, count, size)

    def nibbles_q4(qs: torch.Tensor) -> torch.Tensor:  # [.., 16] -> [.., 32]: byte j holds q(j), q(j + 16)
        return torch.cat([qs & 0xF, qs >> 4], dim=-1)

    def high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:  # [.., 4] little-endian u32 -> [.., count] bits
        word = qh.to(torch.int64)
        word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
        return ((word.unsqueeze(-1) >> torch.arange(count)) & 1).to(torch.uint8)

    name = fmt.name
    legacy_fields = {f: field(2 * i, 1, 2) for i, (f, _, _) in enumerate(fmt.header)} if fmt.columns == 32 else {}
    if name == "Q8_0":
        return b[..., 2:].reshape(rows, -1), legacy_fields
    if name in ("Q4_0", "Q4_1"):
        at = 2 * len(fmt.header)
        return nibbles_q4(b[..., at:]).reshape(rows, -1), legacy_fields
    if name in ("Q5_0", "Q5_1"):
        at = 2 * len(fmt.header)
        q = nibbles_q4(b[..., at + 4 :]) | high_bits(b[..., at : at + 4], 32) << 4
        return q.reshape(rows, -1), legacy_fields
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        fields = {"d": field(0, 1, 2), "dmin": field(2, 1, 2),
                  "sc": sc.reshape(rows, units, 8, 1), "mn": mn.reshape(rows, units, 8, 1)}
        qs = b[..., -128:].reshape(rows, units, 4, 1, 32)  # chunk of 64 weights: low nibbles, then high
        q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(rows, units, 256)
        if name == "Q5_K":  # bit s of qh[l]: bit 4 of weight 32 s + l
            qh = b[..., 16:48].reshape(rows, units, 1, 32)
            q = q | (((qh >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1) << 4).reshape(rows, units, 256)
        return q.reshape(rows, -1), fields
    if name == "Q6_K":
        ql = b[..., :128].reshape(rows, units, 2, 1, 64)  # half of 128 weights: low nibbles, then high
        low = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(rows, units, 256)
        qh = b[..., 128:192].reshape(rows, units, 2, 1, 32)  # weight 128 H + 32 s + l: bits 2s of qh[32 H + l]
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3
        q = low | (high.reshape(rows, units, 256) << 4)
        return q.reshape(rows, -1), {"d": field(208, 1, 2), "sc": field(192, 16, 1)}
    raise ValueError(f"no decoder for {name}")


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., 12] -> 2 x [..., 8] uint8
    """Q4_K/Q5_K's 6-bit sub-block scales and mins, as gguf.quants' Q4_K.get_scale_min unpacks
    them: bytes 0-3 hold sc[0..3] (low 6 bits), 4-7 mn[0..3]; bytes 8-11 the low 4 bits of sc[4..7]
    and mn[4..7], whose top 2 bits sit in the top bits of bytes 0-3 and 4-7."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def pack_tiles(q: torch.Tensor, fields: Fields, fmt: BlockFormat) -> torch.Tensor:
    """Quants [rows, K] and fields (decode_blocks) as tiles uint8 [ceil(rows / 8), K / columns,
    unit_bytes]; rows past the last are zero."""
    rows, columns = q.shape
    groups, units = -(-rows // TILE_ROWS), columns // fmt.columns
    padded_rows = groups * TILE_ROWS

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(padded_rows, *t.shape[1:], dtype=torch.uint8)
        out[:rows] = t
        return out

    parts = []
    for name, count, size in fmt.header:  # [g, unit, count, row, byte]
        f = pad(fields[name]).reshape(groups, TILE_ROWS, units, count, size).permute(0, 2, 3, 1, 4)
        parts.append(f.reshape(groups, units, -1))
    qb = pad(q).reshape(groups, TILE_ROWS, units, fmt.blocks, BLOCK).permute(0, 2, 3, 4, 1)  # [g, u, b, col, row]
    if fmt.bits == 8:
        planes = qb.reshape(groups, units, fmt.blocks, -1)
    else:
        nib = (qb[..., :16, :] & 0xF) | ((qb[..., 16:, :] & 0xF) << 4)  # [g, u, b, 16, row]
        planes_list = [nib.reshape(groups, units, fmt.blocks, -1)]
        if fmt.high_width:
            per_word, width = fmt.high_per_word, fmt.high_width
            high = (qb >> 4).to(torch.int64).reshape(groups, units, fmt.blocks, BLOCK // per_word, per_word, TILE_ROWS)
            shift = (torch.arange(per_word) * width).reshape(per_word, 1)
            word = (high << shift).sum(dim=4)  # [g, u, b, words per row, row]: bits never overlap, so sum = or
            word_bytes = torch.stack([(word >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8)
            planes_list.append(word_bytes.reshape(groups, units, fmt.blocks, -1))
        planes = torch.cat(planes_list, dim=-1)
    parts.append(planes.reshape(groups, units, -1))
    return torch.cat(parts, dim=2).contiguous()


def unpack_tiles(tiles: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, Fields]:
    """pack_tiles' inverse: quants uint8 [groups * 8, K] and fields [groups * 8, units, count, size]."""
    groups, units, _ = tiles.shape
    fields, at = {}, 0
    for name, count, size in fmt.header:
        n = TILE_ROWS * count * size
        f = tiles[..., at : at + n].reshape(groups, units, count, TILE_ROWS, size).permute(0, 3, 1, 2, 4)
        fields[name] = f.reshape(groups * TILE_ROWS, units, count, size)
        at += n
    planes = tiles[..., at:].reshape(groups, units, fmt.blocks, fmt.plane_bytes)
    if fmt.bits == 8:
        qb = planes.reshape(groups, units, fmt.blocks, BLOCK, TILE_ROWS)
    else:
        nib = planes[..., :128].reshape(groups, units, fmt.blocks, 16, TILE_ROWS)
        qb = torch.cat([nib & 0xF, nib >> 4], dim=3)  # [g, u, b, col, row]
        if fmt.high_width:
            per_word, width = fmt.high_per_word, fmt.high_width
            word_bytes = planes[..., 128:].reshape(groups, units, fmt.blocks, BLOCK // per_word, TILE_ROWS, 4)
            word = sum(word_bytes[..., k].to(torch.int64) << (8 * k) for k in range(4))  # [g, u, b, words, row]
            shift = (torch.arange(per_word) * width).reshape(per_word, 1)
            high = (word.unsqueeze(4) >> shift) & ((1 << width) - 1)  # [g, u, b, words, per_word, row]
            qb = qb | (high.reshape(groups, units, fmt.blocks, BLOCK, TILE_ROWS) << 4).to(torch.uint8)
    q = qb.permute(0, 4, 1, 2, 3).reshape(groups * TILE_ROWS, units * fmt.columns)
    return q, fields


def dequantize(q: torch.Tensor, fields: Fields, fmt: BlockFormat) -> torch.Tensor:  # -> [rows, K] float32
    """The weights in float32, computed as `gguf.quants.dequantize` does (same operations, same
    order, each rounded to float32), so the values are gguf's bit for bit."""
    rows = q.shape[0]

    def half(name: str) -> torch.Tensor:  # fp16 field [rows, units, 1, 2] -> float32 [rows, units, 1]
        return fields[name].contiguous().view(torch.float16).float().squeeze(-1)

    if fmt.columns == 32:
        qf = q.reshape(rows, -1, 32)
        d = half("d")
        if fmt.name == "Q8_0":
            w = d * qf.view(torch.int8).float()
        elif fmt.name in ("Q4_1", "Q5_1"):
            w = d * qf.float() + half("m")
        else:
            w = d * (qf.to(torch.int32) - (8 if fmt.bits == 4 else 16)).float()
        return w.reshape(rows, -1)
    qf = q.reshape(rows, -1, 256)
    d = half("d")  # [rows, units, 1]
    if fmt.name == "Q6_K":
        scale = (d * fields["sc"].view(torch.int8).float().reshape(rows, -1, 16)).unsqueeze(-1)  # [r, u, 16, 1]
        w = scale * (qf.to(torch.int32) - 32).float().reshape(rows, -1, 16, 16)
        return w.reshape(rows, -1)
    scale = (d * fields["sc"].float().reshape(rows, -1, 8)).unsqueeze(-1)  # [r, u, 8, 1]
    offset = (half("dmin") * fields["mn"].float().reshape(rows, -1, 8)).unsqueeze(-1)
    return (scale * qf.float().reshape(rows, -1, 8, 32) - offset).reshape(rows, -1)
