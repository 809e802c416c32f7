// y = x @ W^T (+ bias) with W kept in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K) and dequantized in registers; x, the accumulation and y stay float32.
//
// Why: a batch-1 decode step reads every weight once, so its time is the bytes of W over the
// memory bandwidth. Q4_1 is 5 bits a weight against float32's 32; the product only has to
// unpack faster than memory delivers the bytes.
//
// Layout (kernels/cpu/quantized_formats.py repacks once at load; the bytes are the GGUF tensor's,
// regrouped; quantized_tiles.h has the offsets): per 8 output rows, one unit per GGUF block (32
// columns, 256 for the K-quants), a header (each field for the 8 rows side by side) and one
// quants plane per 32 columns:
//
//   tiles: [ceil(N / 8), units, unit bytes] uint8 (rows past N are zero), plane of block b of
//   group g covers W[8g .. 8g+8, 32b .. 32b+32]; n[j][i] = q(i, j) | q(i, j+16) << 4
//     Q8_0  d[8] fp16                      | q[32][8] int8                  w[8g+i, 32b+j] = d[i] q[j][i]
//     Q4_0  d[8]                           | n[16][8]                       w = d (q - 8)
//     Q4_1  d[8] m[8] fp16                 | n[16][8]                       w = d q + m
//     Q5_0  d[8]                           | n[16][8] h[8] u32              w = d (q - 16)     (h[i] bit c: q(i, c) bit 4)
//     Q5_1  d[8] m[8]                      | n[16][8] h[8] u32              w = d q + m
//     Q4_K  d[8] dmin[8] sc[8][8] mn[8][8] | 8 planes n[16][8]              plane p: w = (d sc[p]) q - dmin mn[p]
//     Q5_K  as Q4_K                        | 8 planes n[16][8] h[8]
//     Q6_K  d[8] sc[16][8] int8            | 8 planes n[16][8] h[2][8]      columns 16k.. of plane p: w = (d sc[2p+k]) (q - 32)
//   (Q6_K: h[k][i] bits 2t, 2t+1 are q(i, 16k + t) bits 4, 5). Lane i of every vector is output
//   row 8g + i, so a plane needs no shuffles: 8 bytes widen (vpmovzxbd) to one vector of 8 rows
//   at one column (Q8_0) or, split into nibbles, to two (Q4: columns j and j + 16); the 8 rows'
//   scales are one F16C conversion (K: times the 8 rows' u8/int8 sub-block scales). 5- and 6-bit
//   planes are first staged as one byte per quant (see stage()).
//
// Per 32-column block, for each row r of x and output row n, in an order that does not depend on M:
//   s0  = sum_{j<16} q[n, j] x[r, j],   s1 = sum_{j<16} q[n, j+16] x[r, j+16]   (two FMA chains)
//   y  += d[n] (s0 + s1)      (+ m[n] xsum[r, b]: m = -8 d, -16 d for Q4_0, Q5_0; -dmin mn for K)
//   Q6_K, a scale per 16 columns: y += d0[n] s0 + d1[n] s1, with q - 32 widened signed (as Q8_0)
// where xsum[r, b] = sum of x[r, 32b .. 32b+32] is computed once per call and shared by every
// output row. So y is the product with the dequantized W up to float32 summation order, and a
// row of x gets the same floats alone or in any batch (as linear_cpu.cpp guarantees).
//
// Register blocking: a micro-kernel multiplies R rows of x by G tiles' 8-row groups (2 R G chain
// registers; the running totals, touched once per block, may live in L1). Batch 1 runs R = 1,
// G = 4 (8 FMA chains, 4 streams, the next 4 groups prefetched); 2-6 rows run R = M, G = 1 from
// the tiles; more rows widen 2 groups once into a float scratch and run R = 2, G = 2 over it, so a
// broadcast of x feeds 2 FMAs as in linear_cpu.cpp. Per 16 weights the widening costs ~5 vector
// ops (vpmovzxbd, and, shift, 2 cvtdq2ps) beside the 2 FMAs: with AVX2 a core widens Q4_1
// slower than its memory read delivers it, so batch 1 is bound by that widening (bench/README.md
// has the figures); with more rows the FMAs dominate as in the float32 product. 5/6-bit: 4 ops
// per 16 weights plus the staging's 3-4.
//
//   x:     [M, K] float32, rows may be strided
//   tiles: as above
//   bias:  [N] float32 or absent
//   out:   [M, N] float32

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "quantized_tiles.h"
#include "vec_avx2.h"

namespace {

using ferry::quantized::Format;
using ferry::quantized::block_header;
using ferry::quantized::block_in_unit;
using ferry::quantized::block_plane;
using ferry::quantized::dispatch_format;
using ferry::quantized::has_offset;
using ferry::quantized::kBlock;
using ferry::quantized::kRowsPerTile;
using ferry::quantized::parse_format;
using ferry::quantized::quant_bits;
using ferry::quantized::tile_bytes;
using ferry::quantized::unit_bytes;
using ferry::quantized::unit_planes;

constexpr int64_t kVectorGroups = 4;  // tiles side by side for one row of x (batch 1)

#ifdef FERRY_QUANTIZED

// 5- and 6-bit planes are rebuilt once per block as one byte per quant, in Q8_0's order
// (staged[j][i] = q(row i, column j), 32 columns x 8 rows; Q6_K: q - 32 as int8), so each chunk
// then widens as Q8_0 does (2 vpmovsxbd from L1, 2 cvtdq2ps). Inserting the high bits per chunk
// instead (an immediate shift, an and and an or per column) took 11-13 vector ops per 16 weights
// against Q4's 5: batch 1 ran at 1.75x (Q5_0) and 2.1x (Q6_K) Q4_1's time per weight. Staging
// costs ~50 byte-wide ops a block (Q6_K ~60: 3-4 per chunk), and took batch 1 on the harness's
// shapes (1 thread, AVX2 build on a Zen 4 EPYC) from 253 to 190 us for Q5_0, 371 to 251 us for
// Q6_K. Staging the 4-bit formats too made Q4_1 7% slower: their split is only 2 ops a chunk.
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

// Column j and column j + 16 of a tile's 8 rows as floats: the quants of chunk j. quants: the
// plane, or for a staged format the staged bytes.
template <Format F>
inline void unpack(const uint8_t* quants, int j, __m256& first, __m256& second) {
  if constexpr (F == Format::kQ8_0 || staged_format(F)) {  // Q5: 0 .. 31, so sign extension is exact
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + 8 * j));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + 8 * (j + 16)));
    first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + 8 * j)));
    first = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    second = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
}

// A block's multipliers for the 8 rows, from its unit's header (p: the block's plane in the unit):
// total += d0 first + d1 second + m xsum. d1 differs from d0 only for Q6_K (a scale per 16 columns);
// m = 0 where has_offset is false. The K scales are gguf's float32 products d sc and dmin mn.
template <Format F>
inline void block_scales(const uint8_t* header, int64_t p, __m256& d0, __m256& d1, __m256& m) {
  const auto half8 = [&](int64_t at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + at)));
  };
  const auto u8 = [&](int64_t at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(header + at))));
  };
  const __m256 d = half8(0);
  d0 = d1 = d;
  m = _mm256_setzero_ps();
  if constexpr (F == Format::kQ4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
  if constexpr (F == Format::kQ5_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
  if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) m = half8(16);
  if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {  // d[8] dmin[8] sc[8][8] mn[8][8]
    d0 = d1 = _mm256_mul_ps(d, u8(32 + 8 * p));
    m = _mm256_xor_ps(_mm256_mul_ps(half8(16), u8(96 + 8 * p)), _mm256_set1_ps(-0.f));
  }
  if constexpr (F == Format::kQ6_K) {  // d[8] sc[16][8] int8: halves 2 p (columns j) and 2 p + 1 (j + 16)
    const auto i8 = [&](int64_t at) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(header + at))));
    };
    d0 = _mm256_mul_ps(d, i8(16 + 16 * p));
    d1 = _mm256_mul_ps(d, i8(24 + 16 * p));
  }
}

// R rows of x against G adjacent tile groups over all K: out[r, 8g + i] for i < cols (cols < 8
// only in the matrix's last group). The per-block sums are named register arrays indexed by
// compile-time constants only (fully unrolled loops), so GCC keeps them in registers; the running
// totals, touched once per block, live in `total`.
//
// next: the G groups this thread reads after these (null: none). Block b asks for the same share of
// those (into L2) as it reads itself: with only the hardware prefetcher, a batch-1 pass over
// SmolLM2's Q4_1 layers took 1.35-1.75x as long on one core (a group is a stream of a few KB).
//
// unpacked: the G groups' quants already widened by unpack_group (one after the other), read
// instead of the tiles' bytes; the floats, and so every sum, are the same.
template <Format F, int R, int G, bool UNPACKED>
inline void micro(const uint8_t* tiles, int64_t group_stride, int64_t blocks, const float* x, int64_t x_stride,
                  const float* xsum, const float* bias, float* out, int64_t out_stride, int64_t cols,
                  const uint8_t* next, const float* unpacked) {
  __m256 total[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) total[r][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if (next) {
      const char* ahead = reinterpret_cast<const char*>(next) + b * G * tile_bytes(F);
      for (int64_t line = 0; line < G * tile_bytes(F); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    const uint8_t* quants[G];
    alignas(32) uint8_t staged[staged_format(F) && !UNPACKED ? G : 1][kStagedBytes];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      quants[g] = block_plane(F, tiles + g * group_stride, b);
      if constexpr (staged_format(F) && !UNPACKED) {
        stage<F>(quants[g], staged[g]);
        quants[g] = staged[g];
      }
    }
    // The chunks must read the staged bytes from L1 (vpmovsxbd with a memory operand): without
    // this, GCC keeps them in registers and carves out each 8 bytes with 2-3 shuffles, 10% slower
    // than the per-chunk unpacking this replaces.
    if constexpr (staged_format(F) && !UNPACKED) asm volatile("" : : "r"(&staged[0][0]) : "memory");
    __m256 first[R][G], second[R][G];  // the block's two FMA chains (columns j and j + 16)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) first[r][g] = second[r][g] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        __m256 w0, w1;
        if constexpr (UNPACKED) {
          const float* u = unpacked + (g * blocks * 32 + (b * 16 + j) * 2) * kRowsPerTile;
          w0 = _mm256_loadu_ps(u);
          w1 = _mm256_loadu_ps(u + kRowsPerTile);
        } else {
          unpack<F>(quants[g], j, w0, w1);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * x_stride + b * kBlock + j;
          first[r][g] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xr), first[r][g]);
          second[r][g] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xr + 16), second[r][g]);
        }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      __m256 d0, d1, m;
      block_scales<F>(block_header(F, tiles + g * group_stride, b), block_in_unit(F, b), d0, d1, m);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (F == Format::kQ6_K) {
          total[r][g] = _mm256_fmadd_ps(d0, first[r][g], total[r][g]);
          total[r][g] = _mm256_fmadd_ps(d1, second[r][g], total[r][g]);
        } else {
          total[r][g] = _mm256_fmadd_ps(d0, _mm256_add_ps(first[r][g], second[r][g]), total[r][g]);
        }
        if constexpr (has_offset(F))
          total[r][g] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum + r * blocks + b), total[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* o = out + r * out_stride + g * kRowsPerTile;
      const float* bg = bias ? bias + g * kRowsPerTile : nullptr;
      __m256 v = total[r][g];
      if (g == G - 1 && cols < kRowsPerTile) {
        alignas(32) float lanes[kRowsPerTile];
        _mm256_store_ps(lanes, v);
        for (int64_t i = 0; i < cols; ++i) o[i] = lanes[i] + (bg ? bg[i] : 0.f);
        continue;
      }
      if (bg) v = _mm256_add_ps(v, _mm256_loadu_ps(bg));
      _mm256_storeu_ps(o, v);
    }
}

// Rows [m0, m0 + R) of x against tile groups [group, end), G at a time. after: the group this
// thread reads once these are done, prefetched during the last one (null: none or not needed).
template <Format F, int R>
void rows_against_groups(const uint8_t* tiles, int64_t group, int64_t end, int64_t blocks, int64_t N,
                         const float* x, int64_t x_stride, const float* xsum, const float* bias, float* out,
                         const uint8_t* after) {
  const int64_t group_stride = blocks * tile_bytes(F);
  constexpr int G = R == 1 ? kVectorGroups : 1;
  int64_t g = group;
  for (; g + G <= end; g += G) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - (g + G - 1) * kRowsPerTile);
    const uint8_t* next = g + 2 * G <= end ? tiles + (g + G) * group_stride : nullptr;
    micro<F, R, G, false>(tiles + g * group_stride, group_stride, blocks, x, x_stride, xsum,
                          bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next, nullptr);
  }
  for (; g < end; ++g) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - g * kRowsPerTile);
    const uint8_t* next = g + 1 < end ? tiles + (g + 1) * group_stride : after;
    micro<F, R, 1, false>(tiles + g * group_stride, group_stride, blocks, x, x_stride, xsum,
                          bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next, nullptr);
  }
}

// A group's quants as floats in micro's reading order: [blocks][16 chunks][column j, j + 16][8 rows];
// next: the group read after this one, whose tiles it prefetches (null: none).
template <Format F>
void unpack_group(const uint8_t* group_tiles, int64_t blocks, float* unpacked, const uint8_t* next) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (next)
      for (int64_t line = 0; line < tile_bytes(F); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next) + b * tile_bytes(F) + line, _MM_HINT_T1);
    const uint8_t* quants = block_plane(F, group_tiles, b);
    alignas(32) uint8_t staged[kStagedBytes];
    if constexpr (staged_format(F)) {
      stage<F>(quants, staged);
      quants = staged;
      asm volatile("" : : "r"(staged) : "memory");  // read back from L1, as in micro
    }
    for (int j = 0; j < 16; ++j) {
      __m256 w0, w1;
      unpack<F>(quants, j, w0, w1);
      _mm256_storeu_ps(unpacked + ((b * 16 + j) * 2) * kRowsPerTile, w0);
      _mm256_storeu_ps(unpacked + ((b * 16 + j) * 2 + 1) * kRowsPerTile, w1);
    }
  }
}

constexpr int kMaxRows = 6;  // rows of x per micro-kernel: 6 x 2 chains + 2 weights + 2 broadcasts of 16 registers

template <Format F>
void product(const float* x, int64_t x_stride, int64_t M, const uint8_t* tiles, int64_t num_groups, int64_t blocks,
             const float* xsum, const float* bias, float* out, int64_t N) {
  const int64_t group_stride = blocks * tile_bytes(F);
  if (M == 1) {  // decode at batch 1: each thread walks its groups 4 at a time
    at::parallel_for(0, num_groups, kVectorGroups, [&](int64_t begin, int64_t end) {
      // The first groups have no predecessor to prefetch them: ask for all of their lines now.
      const char* first = reinterpret_cast<const char*>(tiles + begin * group_stride);
      const int64_t first_bytes = std::min<int64_t>(kVectorGroups, end - begin) * group_stride;
      for (int64_t line = 0; line < first_bytes; line += 64) _mm_prefetch(first + line, _MM_HINT_T0);
      rows_against_groups<F, 1>(tiles, begin, end, blocks, N, x, x_stride, xsum, bias, out, nullptr);
    });
    return;
  }
  if (M <= kMaxRows) {  // one block of rows: each group unpacked once, straight from its tiles
    at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* after = g + 1 < end ? tiles + (g + 1) * group_stride : nullptr;
        switch (M) {
          case 2: rows_against_groups<F, 2>(tiles, g, g + 1, blocks, N, x, x_stride, xsum, bias, out, after); break;
          case 3: rows_against_groups<F, 3>(tiles, g, g + 1, blocks, N, x, x_stride, xsum, bias, out, after); break;
          case 4: rows_against_groups<F, 4>(tiles, g, g + 1, blocks, N, x, x_stride, xsum, bias, out, after); break;
          case 5: rows_against_groups<F, 5>(tiles, g, g + 1, blocks, N, x, x_stride, xsum, bias, out, after); break;
          default: rows_against_groups<F, 6>(tiles, g, g + 1, blocks, N, x, x_stride, xsum, bias, out, after); break;
        }
      }
    });
    return;
  }
  // More rows: two groups at a time are widened once into `unpacked` (2 K x 8 floats, L1/L2), then
  // every pair of rows of x runs against both: each broadcast of x feeds two FMAs, as in
  // linear_cpu.cpp's micro-kernel. Six rows against one group (one broadcast per FMA) reached
  // ~0.65x the float32 product's rate; unpacking per row block was not what bound it.
  const int64_t group_floats = blocks * kBlock * kRowsPerTile;
  // Rows of x per pass over the groups: ~192 KiB of x, which stays in L2 beside the unpacked pair.
  const int64_t block_rows = std::max<int64_t>(2, (192 << 10) / (blocks * kBlock * 4) / 2 * 2);
  for (int64_t m_begin = 0; m_begin < M; m_begin += block_rows) {
    const int64_t m_end = std::min(M, m_begin + block_rows);
    at::parallel_for(0, num_groups, 2, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(2 * group_floats);
      float* unpacked = scratch.data();
      for (int64_t g = begin; g < end; g += 2) {
        const int64_t pair = std::min<int64_t>(2, end - g);
        for (int64_t p = 0; p < pair; ++p) {
          const uint8_t* next = g + p + 2 < end ? tiles + (g + p + 2) * group_stride : nullptr;
          unpack_group<F>(tiles + (g + p) * group_stride, blocks, unpacked + p * group_floats, next);
        }
        const int64_t cols = std::min<int64_t>(kRowsPerTile, N - (g + pair - 1) * kRowsPerTile);
        const uint8_t* t = tiles + g * group_stride;
        const float* b = bias ? bias + g * kRowsPerTile : nullptr;
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 2) {
          const float* xr = x + m0 * x_stride;
          const float* sr = xsum ? xsum + m0 * blocks : nullptr;
          float* o = out + m0 * N + g * kRowsPerTile;
          const bool two_rows = m0 + 1 < m_end;
          if (pair == 2 && two_rows)
            micro<F, 2, 2, true>(t, group_stride, blocks, xr, x_stride, sr, b, o, N, cols, nullptr, unpacked);
          else if (pair == 2)
            micro<F, 1, 2, true>(t, group_stride, blocks, xr, x_stride, sr, b, o, N, cols, nullptr, unpacked);
          else if (two_rows)
            micro<F, 2, 1, true>(t, group_stride, blocks, xr, x_stride, sr, b, o, N, cols, nullptr, unpacked);
          else
            micro<F, 1, 1, true>(t, group_stride, blocks, xr, x_stride, sr, b, o, N, cols, nullptr, unpacked);
        }
      }
    });
  }
}

// xsum[r, b] = sum of x[r, 32b .. 32b + 32], in a fixed order (so a row's sums do not depend on M).
void block_sums(const float* x, int64_t x_stride, int64_t M, int64_t blocks, float* xsum) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + r * x_stride + b * kBlock;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      xsum[r * blocks + b] = ferry::hsum8(s);
    }
}
#endif

}  // namespace

namespace ferry {

bool linear_quantized_int16() {
#ifdef FERRY_QUANTIZED_VNNI
  return true;
#else
  return false;
#endif
}

bool linear_quantized_supported() {
#ifdef FERRY_QUANTIZED
  return true;
#else
  return false;
#endif
}

torch::Tensor linear_quantized(const torch::Tensor& x, const torch::Tensor& tiles, const std::string& qtype,
                               int64_t out_features, const c10::optional<torch::Tensor>& bias) {
  const Format format = parse_format(qtype);
  TORCH_CHECK(!x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a float32 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.scalar_type() == torch::kUInt8 &&
                  tiles.size(2) == unit_bytes(format),
              "tiles must be a contiguous uint8 [ceil(N/8), units, ", unit_bytes(format), "] tensor for ", qtype);
  const int64_t blocks = tiles.size(1) * unit_planes(format);  // 32-column blocks
  TORCH_CHECK(blocks * kBlock == x.size(1), "x has ", x.size(1), " columns, the weight ", blocks * kBlock);
  TORCH_CHECK(out_features > (tiles.size(0) - 1) * kRowsPerTile && out_features <= tiles.size(0) * kRowsPerTile,
              "out_features does not match the number of tile groups");
  const int64_t M = x.size(0), N = out_features;
  const float* bias_ptr = nullptr;
  torch::Tensor bias_contiguous;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "bias must be float32 [N]");
    bias_contiguous = bias->contiguous();
    bias_ptr = bias_contiguous.data_ptr<float>();
  }
  torch::Tensor out = torch::empty({M, N}, x.options());
#ifdef FERRY_QUANTIZED
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(has_offset(format) ? M * blocks : 0);  // [M, blocks]
  if (has_offset(format)) block_sums(xp, x.stride(0), M, blocks, xsum.data());
  const float* xsum_ptr = has_offset(format) ? xsum.data() : nullptr;
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t groups = tiles.size(0);
#ifdef FERRY_QUANTIZED_VNNI
  ferry::quantized::linear_int16(format, xp, x.stride(0), M, tp, groups, blocks, xsum_ptr, bias_ptr, op, N);
#else
  dispatch_format(format, [&](auto f) {
    product<decltype(f)::value>(xp, x.stride(0), M, tp, groups, blocks, xsum_ptr, bias_ptr, op, N);
  });
#endif
#else
  TORCH_CHECK(false, "linear_quantized needs AVX2, FMA and F16C");
#endif
  return out;
}

}  // namespace ferry
