// AVX2 pieces of the GGUF-tile products (quantized_tiles.h has the layout): 5- and 6-bit planes
// staged as one signed byte per quant, and a block's multipliers for its tile's 8 rows.
#pragma once

#include "quantized_tiles.h"

#ifdef FERRY_QUANTIZED
#include <immintrin.h>

namespace ferry::quantized {

// 5- and 6-bit planes are rebuilt once per block as one byte per quant, in Q8_0's order
// (staged[j][i] = q(row i, column j), 32 columns x 8 rows; Q6_K: q - 32 as int8), so that the
// product then widens them as it does Q8_0 (vpmovsxbw from L1). Inserting the high bits per
// column pair instead costs an immediate shift, an and and an or per column; staging costs ~50
// byte-wide ops a block (Q6_K ~60), shared by all of a block's columns. (With float32 activations,
// staging took batch 1 from 253 to 190 us for Q5_0 and 371 to 251 us for Q6_K on one Zen 4 core.)
constexpr bool staged_format(Format f) { return quant_bits(f) == 5 || quant_bits(f) == 6; }
constexpr int64_t kStagedBytes = kBlock * kRowsPerTile;

template <Format F>
inline void stage(const uint8_t* plane, uint8_t* staged) {
  // Per 128-bit lane (4 rows), dword k of the result holds byte k of the 4 rows' high-bit words.
  const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  // Byte k of all 8 rows' words in every qword: qword c of a staged vector is column 4 t + c.
  const auto rows_byte = [](__m256i transposed, int k) {
    return _mm256_permutevar8x32_epi32(transposed, _mm256_setr_epi32(k, 4 + k, k, 4 + k, k, 4 + k, k, 4 + k));
  };
  const __m256i nibble = _mm256_set1_epi8(0xF);
  __m256i words[2];
  words[0] = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + 128)), transpose);
  if constexpr (quant_bits(F) == 6)
    words[1] = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + 160)), transpose);
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {  // columns 4 t .. 4 t + 4 and 16 + 4 t .. 16 + 4 t + 4
    const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + 32 * t));
    __m256i low = _mm256_and_si256(n, nibble), up = _mm256_and_si256(_mm256_srli_epi16(n, 4), nibble);
    if constexpr (quant_bits(F) == 5) {
      // Column 4 t + c is bit 4 (t % 2) + c of byte t / 2 (column 16 + ...: byte 2 + t / 2): the
      // and keeps bit c of qword c, then a lookup turns 1, 2, 4, 8 into 0x10 (vpshufb reads 4 bits).
      const __m256i bit = _mm256_setr_epi64x(0x0101010101010101, 0x0202020202020202, 0x0404040404040404,
                                             0x0808080808080808);
      const __m256i to_16 = _mm256_setr_epi8(0, 16, 16, 0, 16, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0,
                                             0, 16, 16, 0, 16, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0);
      __m256i first = rows_byte(words[0], t / 2), second = rows_byte(words[0], 2 + t / 2);
      if (t % 2) first = _mm256_srli_epi16(first, 4), second = _mm256_srli_epi16(second, 4);
      low = _mm256_or_si256(low, _mm256_shuffle_epi8(to_16, _mm256_and_si256(first, bit)));
      up = _mm256_or_si256(up, _mm256_shuffle_epi8(to_16, _mm256_and_si256(second, bit)));
    } else if constexpr (quant_bits(F) == 6) {
      // Column 4 t + c is bits 2c, 2c + 1 of byte t (h[1]: column 16 + ...): qwords 2, 3 shift their
      // byte's high nibble down, the and keeps the 2 bits (as 0-3 or 0, 4, 8, 12), and a lookup gives
      // 16 h - 32 in the high nibble: or the low 4 bits in and the byte is the int8 q - 32.
      const __m256i down = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
      const __m256i pair = _mm256_setr_epi64x(0x0303030303030303, 0x0C0C0C0C0C0C0C0C, 0x0303030303030303,
                                              0x0C0C0C0C0C0C0C0C);
      const __m256i to_signed = _mm256_setr_epi8(-32, -16, 0, 16, -16, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0,
                                                 -32, -16, 0, 16, -16, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0);
      const __m256i first = _mm256_srlv_epi32(rows_byte(words[0], t), down);
      const __m256i second = _mm256_srlv_epi32(rows_byte(words[1], t), down);
      low = _mm256_or_si256(low, _mm256_shuffle_epi8(to_signed, _mm256_and_si256(first, pair)));
      up = _mm256_or_si256(up, _mm256_shuffle_epi8(to_signed, _mm256_and_si256(second, pair)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(staged + 32 * t), low);
    _mm256_store_si256(reinterpret_cast<__m256i*>(staged + 128 + 32 * t), up);
  }
}

// A block's multipliers for a tile's 8 rows, from its unit's header (p: block_in_unit): the
// product adds scale s_low + scale2 s_high + m xsum, where s_low, s_high are the sums over columns
// 0..15 and 16..31 (scale2 = scale except for Q6_K, a scale per 16 columns) and m = 0 where the
// format has no offset. The K-quants' are gguf's float32 products d sc and -(dmin mn).
struct BlockScales {
  __m256 scale, scale2, m;
};

template <Format F>
inline BlockScales block_scales(const uint8_t* header, int64_t p) {
  const auto half8 = [&](int64_t at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + at)));
  };
  const auto bytes8 = [&](int64_t at) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(header + at)); };
  BlockScales s;
  const __m256 d = half8(0);
  s.scale = s.scale2 = d;
  s.m = _mm256_setzero_ps();
  if constexpr (F == Format::kQ4_0) s.m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
  if constexpr (F == Format::kQ5_0) s.m = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
  if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) s.m = half8(16);
  if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {  // d[8] dmin[8] sc[8][8] mn[8][8]
    s.scale = s.scale2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(32 + 8 * p))));
    const __m256 dm = _mm256_mul_ps(half8(16), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(96 + 8 * p))));
    s.m = _mm256_xor_ps(dm, _mm256_set1_ps(-0.f));
  }
  if constexpr (F == Format::kQ6_K) {  // d[8] sc[16][8] int8: halves 2 p (columns 0..15) and 2 p + 1
    s.scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(16 + 16 * p))));
    s.scale2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(24 + 16 * p))));
  }
  return s;
}

// A tile's 8 output rows (plus bias) into out; only the first `cols` where the matrix ends.
inline void store_tile_rows(__m256 v, float* out, const float* bias, int64_t cols) {
  if (cols < kRowsPerTile) {
    alignas(32) float lanes[kRowsPerTile];
    _mm256_store_ps(lanes, v);
    for (int64_t i = 0; i < cols; ++i) out[i] = lanes[i] + (bias ? bias[i] : 0.f);
    return;
  }
  if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
  _mm256_storeu_ps(out, v);
}

}  // namespace ferry::quantized
#endif
