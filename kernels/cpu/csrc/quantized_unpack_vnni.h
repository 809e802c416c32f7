// Register-level helpers of quantized_linear_vnni.cpp for the 5- and 6-bit formats and the K-quants:
// the high quant bits merged into the int16 lanes vpdpwssd reads, and each block's 16 rows' float
// scales (8 rows: quantized_avx2.h's block_scales). Shapes follow that file: in `micro` a zmm
// holds 8 rows x columns (c, c+1) in dwords 0..7 and (c+2, c+3) in dwords 8..15; in `micro_pairs`
// 16 rows (two groups) x (c, c+1).
#pragma once

#include <immintrin.h>

#include "quantized_tiles.h"

namespace ferry::quantized::vnni {

// A block's high bits, each dword a row's 16 bits of h twice (its two words then test or shift
// columns c and c + 1 at once). 5 bits: v[0] = columns 0..15, v[1] = 16..31. 6 bits: v[0], v[1] =
// h[0] (columns 0..7, 8..15), v[2], v[3] = h[1] (16..23, 24..31), bit 1 of each pair flipped.
struct HighBits {
  __m512i v[4];
};

// Each 128-bit lane's bytes 0..7 interleaved with its bytes 8..15: one vpshufb (an unpack of the
// vector with itself shifted by 8 bytes is two shuffles; one made batch 1 4-5% faster). On a tile
// plane's 32 bytes (columns c .. c+3, 8 rows each) it pairs each row's columns (c, c+1) in lane 0
// and (c+2, c+3) in lane 1: the VNNI kernels' int16 pairs and the AMX kernel's byte quads.
inline __m256i interleave_halves(__m256i v) {
  return _mm256_shuffle_epi8(v, _mm256_set_epi8(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0,
                                                15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0));
}

// Each dword = its low (high) word twice: vpshufb within 128-bit lanes.
inline __m512i duplicate_low_words(__m512i h) {
  return _mm512_shuffle_epi8(h, _mm512_set4_epi32(0x0D0C0D0C, 0x09080908, 0x05040504, 0x01000100));
}
inline __m512i duplicate_high_words(__m512i h) {
  return _mm512_shuffle_epi8(h, _mm512_set4_epi32(0x0F0E0F0E, 0x0B0A0B0A, 0x07060706, 0x03020302));
}

// Per-word constants of a column step, as dwords (word 0 | word 1 << 16).
constexpr int word_pair(unsigned first, unsigned second) { return static_cast<int>(first | second << 16); }

// h0, h1: 8 rows' u32 words (5 bits: h; 6 bits: h[0], h[1]), dword i for row i of each half.
template <Format F>
inline HighBits high_bits(__m512i h0, __m512i h1) {
  HighBits hb;
  if constexpr (quant_bits(F) == 6) {
    // Flipping bit 5 of q makes the 2 bits, sign-extended, q / 16 - 2: merge6 then yields q - 32.
    const __m512i flip = _mm512_set1_epi32(static_cast<int>(0xAAAAAAAAu));
    h0 = _mm512_xor_si512(h0, flip);
    h1 = _mm512_xor_si512(h1, flip);
    hb.v[0] = duplicate_low_words(h0);
    hb.v[1] = duplicate_high_words(h0);
    hb.v[2] = duplicate_low_words(h1);
    hb.v[3] = duplicate_high_words(h1);
  } else {
    hb.v[0] = duplicate_low_words(h0);
    hb.v[1] = duplicate_high_words(h0);
  }
  return hb;
}

// `micro`: the plane's high bits for its 8 rows, broadcast to both halves.
template <Format F>
inline HighBits tile_high_bits(const uint8_t* plane) {
  const __m256i* h = reinterpret_cast<const __m256i*>(plane + 128);
  const __m512i h0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(h));
  return high_bits<F>(h0, quant_bits(F) == 6 ? _mm512_broadcast_i64x4(_mm256_loadu_si256(h + 1)) : h0);
}

// `micro_pairs`: two groups' planes, the first's rows in the low half.
template <Format F>
inline HighBits pair_high_bits(const uint8_t* plane, const uint8_t* next_plane) {
  const auto both = [&](int64_t at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + at))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(next_plane + at)), 1);
  };
  const __m512i h0 = both(128);
  return high_bits<F>(h0, quant_bits(F) == 6 ? both(160) : h0);
}

// 5 bits: nib (the low 4 bits in bits 0..3, nothing above) plus 16 where the word's column bit is
// set. pattern: per word, the bit of its column in v (a constant per column step). A test into a
// mask register and a masked add: 2 ops a vector, no clean-up of the other columns' bits (a
// vpsllvw/vpsrlw/vpternlogd variant ran 8-9% slower at batch 1, a zero-masked move into
// vpternlogd 4-5%).
inline __m512i merge5(__m512i nib, __m512i v, __m512i pattern) {
  return _mm512_mask_add_epi16(nib, _mm512_test_epi16_mask(v, pattern), nib, _mm512_set1_epi16(16));
}

// 6 bits: q - 32 (signed). nib: bits 0..3 are the low 4 bits (others ignored); shift: per word, the
// left shift that puts its column's 2 bits (in v) at bits 14, 15. Arithmetically shifted back to
// 4, 5 they sign-extend (bit 5 flipped by high_bits: 16 (bits - 2) = q - 32 - low bits), and one
// vpternlogd takes bits 0..3 from nib and the rest from them. (Two tests and masked adds a vector,
// as merge5, ran 15-19% slower; words pre-aligned for an immediate shift, ~6% at batch 1.)
inline __m512i merge6(__m512i nib, __m512i v, __m512i shift) {
  const __m512i high = _mm512_srai_epi16(_mm512_sllv_epi16(v, shift), 10);
  return _mm512_ternarylogic_epi32(nib, high, _mm512_set1_epi16(0xF), 0xE4);  // C ? A : B
}

// `micro`, step j (columns j .. j+3 and j+16 .. j+19): low and high columns' int16 quants (Q6_K:
// minus 32), from w = interleaved bytes (row i's byte pair in its dword's two words).
template <Format F>
inline void widen_quad(__m512i w, const HighBits& hb, int j, __m512i& low, __m512i& high) {
  const __m512i nibble = _mm512_set1_epi16(0xF);
  if constexpr (quant_bits(F) == 5) {
    const __m512i pattern = _mm512_inserti64x4(_mm512_set1_epi32(word_pair(1u << j, 2u << j)),
                                               _mm256_set1_epi32(word_pair(4u << j, 8u << j)), 1);
    low = merge5(_mm512_and_si512(w, nibble), hb.v[0], pattern);
    high = merge5(_mm512_srli_epi16(w, 4), hb.v[1], pattern);
  } else if constexpr (quant_bits(F) == 6) {
    const int base = 2 * (j % 8);  // the bits of column j in its word
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi32(word_pair(14 - base, 12 - base)),
                                             _mm256_set1_epi32(word_pair(10 - base, 8 - base)), 1);
    low = merge6(w, hb.v[j / 8], shift);
    high = merge6(_mm512_srli_epi16(w, 4), hb.v[2 + j / 8], shift);
  } else {
    low = _mm512_and_si512(w, nibble);
    high = _mm512_srli_epi16(w, 4);
  }
}

// `micro_pairs`, step c (columns c, c+1 and c+16, c+17): as widen_quad, every dword at (c, c+1).
template <Format F>
inline void widen_pair(__m512i w, const HighBits& hb, int c, __m512i& low, __m512i& high) {
  const __m512i nibble = _mm512_set1_epi16(0xF);
  if constexpr (quant_bits(F) == 5) {
    const __m512i pattern = _mm512_set1_epi32(word_pair(1u << c, 2u << c));
    low = merge5(_mm512_and_si512(w, nibble), hb.v[0], pattern);
    high = merge5(_mm512_srli_epi16(w, 4), hb.v[1], pattern);
  } else if constexpr (quant_bits(F) == 6) {
    const int base = 2 * (c % 8);
    const __m512i shift = _mm512_set1_epi32(word_pair(14 - base, 12 - base));
    low = merge6(w, hb.v[c / 8], shift);
    high = merge6(_mm512_srli_epi16(w, 4), hb.v[2 + c / 8], shift);
  } else {
    low = _mm512_and_si512(w, nibble);
    high = _mm512_srli_epi16(w, 4);
  }
}

// A block's float factors for its int32 sums, for two tiles' 16 rows (`micro_pairs`): y += scale
// (xs s) + m xsum; Q6_K: scale for columns 0..15 and scale2 for 16..31 (m unused). Computed as
// quantized_avx2.h's block_scales does for 8 rows (`micro`, and the AVX2 kernel), so a row's floats
// do not depend on the kernel: K scales as gguf's float32 d * sc, m = -(dmin mn).
struct Scales16 {
  __m512 scale, m, scale2;
};

inline __m128i bytes8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

inline __m512 halfs16(const uint8_t* p, const uint8_t* q) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), 1));
}
inline __m128i bytes16(const uint8_t* p, const uint8_t* q) { return _mm_unpacklo_epi64(bytes8(p), bytes8(q)); }

// Two groups' headers (the first's rows in lanes 0..7).
template <Format F>
inline Scales16 pair_scales(const uint8_t* header, const uint8_t* next, int64_t p) {
  Scales16 s;
  const __m512 d = halfs16(header, next);
  s.scale = s.m = s.scale2 = d;
  if constexpr (F == Format::kQ4_0) s.m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
  if constexpr (F == Format::kQ5_0) s.m = _mm512_mul_ps(d, _mm512_set1_ps(-16.f));
  if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) s.m = halfs16(header + 16, next + 16);
  if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {
    const int64_t sc = 32 + 8 * p, mn = 96 + 8 * p;
    s.scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(header + sc, next + sc))));
    const __m512 dm = _mm512_mul_ps(halfs16(header + 16, next + 16),
                                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(header + mn, next + mn))));
    s.m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  if constexpr (F == Format::kQ6_K) {
    const int64_t lo = 16 + 16 * p, hi = lo + 8;
    s.scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(header + lo, next + lo))));
    s.scale2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(header + hi, next + hi))));
  }
  return s;
}

}  // namespace ferry::quantized::vnni
