// y = x @ W^T (+ bias) with W in the GGUF tiles of quantized_linear_cpu.cpp, on integer units:
// x is rounded per 32-column block to int16 (one float scale per row and block), the weights'
// quants widen to int16 in registers, and AVX512_VNNI's vpdpwssd adds 32 int16 products into
// int32 lanes per instruction. Built only where the compiler targets AVX512_VNNI (native.py adds
// -mavx512vnni, and names the cache entry after it, only on a CPU that reports the feature).
//
// Why int16 and not llama.cpp's int8 activations: int8 rounding (1/254 of a block's largest
// |x|) moved greedy tokens on 15 of 20 SmolLM2 prompts and perplexity by 0.68%; int16's
// 1/65534 is ~250x smaller, below the other differences between two float32 summation orders.
//
// Per block b, for each row r of x and output row n (integer sums are exact, so the result does
// not depend on M or on the order of the products):
//   xs[r, b] = max_j |x[r, 32b + j]| / 32767,   xq[r, j] = round(x[r, j] / xs[r, b])   (int16)
//   s        = sum_j q[n, j] xq[r, j]                                        (int32, exact)
//   y       += d[n] (xs[r, b] s)                 (+ m[n] xsum[r, b] where the format has an offset)
// where q is the stored quant and xsum is the block's float32 sum of x (not of xq), as in the
// float kernel. Per format (quantized_tiles.h has the layout):
//   Q8_0        q -128..127, no offset
//   Q4_0, Q5_0  q 0..15 / 0..31, m = -8 d / -16 d;  Q4_1, Q5_1: m from the tile
//   Q4_K, Q5_K  q as Q4_1, Q5_1; for block b, plane p of its unit: d sc[p] for d, m = -(dmin mn[p])
//               (gguf's float32 products)
//   Q6_K        q - 32 (-32..31, formed when widening), no offset; columns 0..15 and 16..31 of a
//               plane have scales d sc[2p], d sc[2p+1], so their int32 sums stay apart:
//               y += d sc[2p] (xs s_low) + d sc[2p+1] (xs s_high). Folding sc into the int16 quants
//               would overflow: |sc (q - 32)| <= 4064, times 32 x 32767, exceeds int32.
// Every |q| <= 128, so 32 products with |xq| <= 32767 fit int32.
// |y - x W^T| is then at most sum_b xs[r, b] / 2 sum_{j in b} |d[n] q[n, j]| beyond float32
// rounding: the rounded x meets the stored quant, not w (for Q8_0 and Q6_K that is about |w|; for
// the others up to ~2|w| on average, since q runs around the offset).
//
// Register use: a vpdpwssd lane is one output row and two adjacent columns.
// - Batch 1 (`micro`): a zmm holds a tile's 8 rows at columns (j, j+1) in its low half and
//   (j+2, j+3) in its high half, so 32 bytes of a tile (4 columns x 8 rows, one unpack) feed one
//   instruction; the activations are shuffled to match (once per call) and the halves added
//   once per block.
//   4 groups side by side (4 int32 chains; Q6_K 8).
// - More rows (`micro_pairs`): a zmm holds 16 rows (two adjacent tiles) at one column pair, so
//   every lane wants the same two activations, a dword broadcast from memory: no shuffle per row
//   of x, and a lane's sum is a whole row's. 4 bits: 2 pairs x 4 rows of x (8 chains, each unpack
//   feeding 8 instructions); others: 1 pair x 8 rows. On a 2-core Zen 4 this took the 32-row
//   products of SmolLM2's layers from 32-39 ms to 23-28 ms (bench.quantized_linear).
// - 5 and 6 bits (quantized_unpack_vnni.h): the nibbles widen as for Q4, and the high bits, loaded
//   once per block with each row's 16-bit half duplicated into both words of its dword, are merged
//   into the int16 lanes: 5 bits by a vptestmw into a mask and a masked add of 16, 6 bits by a
//   variable shift of the 2 bits to the top of the word and an arithmetic shift back, merged by
//   vpternlogd. On one Zen 4 core (L3-resident SmolLM2-like shapes) their weights per second are
//   0.53-0.68x Q4_1's at batch 1 (Q5 0.68, Q5_K 0.62, Q6_K 0.53; Q4_K 0.94) and 0.85-0.87x at 32.
// Both kernels add the same exact int32 block sums into float32 in the same order, so a row gets
// the same floats alone as in any batch.
//
//   x: [M, K] float32 (rows may be strided), tiles as quantized_linear_cpu.cpp, out: [M, N].

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "quantized_amx.h"
#include "quantized_avx2.h"
#include "quantized_tiles.h"
#include "quantized_unpack_vnni.h"

namespace ferry::quantized {

#ifdef FERRY_QUANTIZED_VNNI
namespace {

// Rows of x as int16 per block, with each block's scale.
//   xq: [M, K] int16, xscale: [M, blocks] float32
void quantize_rows(const float* x, int64_t x_stride, int64_t M, int64_t blocks, int16_t* xq, float* xscale) {
  const int64_t K = blocks * kBlock;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + r * x_stride + b * kBlock;
      const __m512 a = _mm512_loadu_ps(p), c = _mm512_loadu_ps(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, c)));
      const float inverse = amax > 0.f ? 32767.f / amax : 0.f;
      xscale[r * blocks + b] = amax / 32767.f;
      const __m512 k = _mm512_set1_ps(inverse);
      int16_t* q = xq + r * K + b * kBlock;
      // Round to nearest (the default mode), then saturate: |x| k <= 32767 up to one rounding.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, k))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(c, k))));
    }
}

// Four int16 activations x[j .. j+4) as a zmm: (x_j, x_j+1) in each low dword, (x_j+2, x_j+3) high.
inline __m512i activation_quad(const int16_t* x) {
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}

// activation_quad of x[at + j ..], or with QUADS already shuffled: xq then holds each 4 columns'
// quad (64 bytes, expand_quads), so batch 1 loads it instead of shuffling it for every 4 groups
// (4-6% faster at batch 1).
template <bool QUADS>
inline __m512i quad(const int16_t* xq, int64_t at, int j) {
  if constexpr (QUADS) return _mm512_loadu_si512(xq + 8 * (at + j));
  return activation_quad(xq + at + j);
}

// One row's quads for quad<true>: [K / 4][32] int16.
std::vector<int16_t> expand_quads(const int16_t* xq, int64_t K) {
  std::vector<int16_t> quads(8 * K);
  for (int64_t j = 0; j < K; j += 4) _mm512_storeu_si512(quads.data() + 8 * j, activation_quad(xq + j));
  return quads;
}

// 32 tile bytes (columns c .. c+4 of 8 rows, 8 bytes a column) as 32 int16 in activation_quad's
// pairing: row i's (c, c+1) in dword i, its (c+2, c+3) in dword 8 + i.
inline __m512i interleaved_bytes(const uint8_t* quants, bool is_signed) {
  const __m256i pairs = vnni::interleave_halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants)));
  return is_signed ? _mm512_cvtepi8_epi16(pairs) : _mm512_cvtepu8_epi16(pairs);
}

// R rows of x against G adjacent tile groups over all K (cols < 8 only in the matrix's last group).
// next: the G groups this thread reads after these (prefetched into L2 a block's share at a time).
// xq: the rows' int16 x (row stride K), or with QUADS their quads (see quad).
template <Format F, int R, int G, bool QUADS = false>
inline void micro(const uint8_t* tiles, int64_t group_stride, int64_t blocks, const int16_t* xq, int64_t K,
                  const float* xscale, const float* xsum, const float* bias, float* out, int64_t out_stride,
                  int64_t cols, const uint8_t* next) {
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
    const uint8_t* plane[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) plane[g] = block_plane(F, tiles + g * group_stride, b);
    // acc: the block's int32 sums; Q6_K sums columns 16..31 apart in acc2 (another scale).
    __m512i acc[R][G], acc2[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[r][g] = acc2[r][g] = _mm512_setzero_si512();
    if constexpr (F == Format::kQ8_0) {
#pragma GCC unroll 8
      for (int j = 0; j < 32; j += 4) {
        __m512i xr[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xr[r] = quad<QUADS>(xq, r * K + b * kBlock, j);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512i w = interleaved_bytes(plane[g] + 8 * j, true);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], w, xr[r]);
        }
      }
    } else {  // a byte holds column j (low nibble) and column j + 16 (high nibble)
      vnni::HighBits hb[G];
      if constexpr (quant_bits(F) > 4) {
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) hb[g] = vnni::tile_high_bits<F>(plane[g]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 16; j += 4) {
        __m512i low[R], high[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          low[r] = quad<QUADS>(xq, r * K + b * kBlock, j);
          high[r] = quad<QUADS>(xq, r * K + b * kBlock, j + 16);
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          __m512i w_low, w_high;
          vnni::widen_quad<F>(interleaved_bytes(plane[g] + 8 * j, false), hb[g], j, w_low, w_high);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], w_low, low[r]);
            if constexpr (F == Format::kQ6_K)
              acc2[r][g] = _mm512_dpwssd_epi32(acc2[r][g], w_high, high[r]);
            else
              acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], w_high, high[r]);
          }
        }
      }
    }
    const auto halves = [](__m512i a) {  // (c, c+1) and (c+2, c+3) lanes of a row: one row's sum
      return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1)));
    };
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const BlockScales s = block_scales<F>(block_header(F, tiles + g * group_stride, b), block_in_unit(F, b));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(xscale[r * blocks + b]);
        total[r][g] = _mm256_fmadd_ps(s.scale, _mm256_mul_ps(halves(acc[r][g]), xs), total[r][g]);
        if constexpr (F == Format::kQ6_K)
          total[r][g] = _mm256_fmadd_ps(s.scale2, _mm256_mul_ps(halves(acc2[r][g]), xs), total[r][g]);
        if constexpr (has_offset(F))
          total[r][g] = _mm256_fmadd_ps(s.m, _mm256_set1_ps(xsum[r * blocks + b]), total[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      store_tile_rows(total[r][g], out + r * out_stride + g * kRowsPerTile, bias ? bias + g * kRowsPerTile : nullptr,
                      g == G - 1 ? cols : kRowsPerTile);
}

// 16 bytes of a tile (columns c, c+1 of its 8 rows) and the same of the next group's tile as
// 32 int16 pairs: dword i = row i's (c, c+1) for i < 8, dword 8 + i = the next group's row i's.
// Every lane then wants the same activations, (x_c, x_c+1): one dword broadcast from memory.
inline __m512i pair_columns(const uint8_t* quants, const uint8_t* next_quants, bool is_signed) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(quants))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(next_quants)), 1);
  const __m256i pairs = vnni::interleave_halves(v);
  return is_signed ? _mm512_cvtepi8_epi16(pairs) : _mm512_cvtepu8_epi16(pairs);
}

inline __m512i broadcast_pair(const int16_t* x) {  // (x[0], x[1]) in every dword
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// R rows of x against P pairs of adjacent tile groups (16 output rows a pair) over all K; the
// many-rows kernel. Against `micro`, a zmm of weights holds 16 rows x 2 columns instead of 8 rows
// x 4, so the activations need no shuffle (a dword broadcast from memory), and a lane's int32
// sum is a whole row's: no halves to add per block. cols: valid output rows of the last pair (<= 16).
// next, next_bytes: tiles this thread reads after these, prefetched into L2 a block's share at a
// time (as `micro`), so the next groups stream in while these multiply.
template <Format F, int R, int P>
inline void micro_pairs(const uint8_t* tiles, int64_t group_stride, int64_t blocks, const int16_t* xq, int64_t K,
                        const float* xscale, const float* xsum, const float* bias, float* out, int64_t out_stride,
                        int64_t cols, const uint8_t* next = nullptr, int64_t next_bytes = 0) {
  __m512 total[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) total[r][p] = _mm512_setzero_ps();
  const int64_t share = next ? (next_bytes + blocks - 1) / blocks : 0;  // bytes of `next` per block
  for (int64_t b = 0; b < blocks; ++b) {
    if (next) {
      const char* ahead = reinterpret_cast<const char*>(next) + b * share;
      const int64_t stop = std::min(share, next_bytes - b * share);
      for (int64_t line = 0; line < stop; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    const uint8_t* plane[P];  // each pair's first group's; its second group's is group_stride further
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) plane[p] = block_plane(F, tiles + 2 * p * group_stride, b);
    __m512i acc[R][P], acc2[R][P];  // as in micro: acc2 only for Q6_K's columns 16..31
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[r][p] = acc2[r][p] = _mm512_setzero_si512();
    const int16_t* xb = xq + b * kBlock;
    if constexpr (F == Format::kQ8_0) {
#pragma GCC unroll 16
      for (int c = 0; c < 32; c += 2) {
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          const __m512i w = pair_columns(plane[p] + 8 * c, plane[p] + group_stride + 8 * c, true);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][p] = _mm512_dpwssd_epi32(acc[r][p], w, broadcast_pair(xb + r * K + c));
        }
      }
    } else {  // a byte holds column c (low nibble) and column c + 16 (high nibble)
      vnni::HighBits hb[P];
      if constexpr (quant_bits(F) > 4) {
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) hb[p] = vnni::pair_high_bits<F>(plane[p], plane[p] + group_stride);
      }
#pragma GCC unroll 8
      for (int c = 0; c < 16; c += 2) {
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          __m512i w_low, w_high;
          vnni::widen_pair<F>(pair_columns(plane[p] + 8 * c, plane[p] + group_stride + 8 * c, false), hb[p], c,
                              w_low, w_high);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc[r][p] = _mm512_dpwssd_epi32(acc[r][p], w_low, broadcast_pair(xb + r * K + c));
            if constexpr (F == Format::kQ6_K)
              acc2[r][p] = _mm512_dpwssd_epi32(acc2[r][p], w_high, broadcast_pair(xb + r * K + c + 16));
            else
              acc[r][p] = _mm512_dpwssd_epi32(acc[r][p], w_high, broadcast_pair(xb + r * K + c + 16));
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const uint8_t* header = block_header(F, tiles + 2 * p * group_stride, b);
      const vnni::Scales16 s = vnni::pair_scales<F>(header, header + group_stride, block_in_unit(F, b));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(xscale[r * blocks + b]);
        total[r][p] = _mm512_fmadd_ps(s.scale, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][p]), xs), total[r][p]);
        if constexpr (F == Format::kQ6_K)
          total[r][p] = _mm512_fmadd_ps(s.scale2, _mm512_mul_ps(_mm512_cvtepi32_ps(acc2[r][p]), xs), total[r][p]);
        if constexpr (has_offset(F))
          total[r][p] = _mm512_fmadd_ps(s.m, _mm512_set1_ps(xsum[r * blocks + b]), total[r][p]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      float* o = out + r * out_stride + p * 2 * kRowsPerTile;
      const int64_t valid = p == P - 1 ? cols : 2 * kRowsPerTile;
      const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
      __m512 v = total[r][p];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + p * 2 * kRowsPerTile));
      _mm512_mask_storeu_ps(o, keep, v);
    }
}

// Rows [0, R) against groups [group, end), G at a time, then the tail one by one.
template <Format F, int R, int G, bool QUADS = false>
void rows_against_groups(const uint8_t* tiles, int64_t group, int64_t end, int64_t blocks, int64_t N,
                         const int16_t* xq, const float* xscale, const float* xsum, const float* bias, float* out,
                         bool prefetch) {
  const int64_t group_stride = blocks * tile_bytes(F), K = blocks * kBlock;
  int64_t g = group;
  for (; g + G <= end; g += G) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - (g + G - 1) * kRowsPerTile);
    const uint8_t* next = prefetch && g + 2 * G <= end ? tiles + (g + G) * group_stride : nullptr;
    micro<F, R, G, QUADS>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                   bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next);
  }
  for (; g < end; ++g) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - g * kRowsPerTile);
    const uint8_t* next = prefetch && g + 1 < end ? tiles + (g + 1) * group_stride : nullptr;
    micro<F, R, 1, QUADS>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                   bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next);
  }
}

constexpr int64_t kBatchOneGroups = 4;  // tile groups side by side for one row of x
// More rows of x: pairs of groups side by side, against this many rows at a time. A Q8_0 pair
// (one weight register a column pair, against 4 dot products for Q4's 8) runs against 8 rows, and
// so do the 5- and 6-bit formats, whose high bits make a weight register dearer: at 32 rows 1 x 8
// ran 9-18% faster than 2 x 4 for them, and 3% slower for Q4_K.
constexpr int batch_pairs(Format f) { return quant_bits(f) == 4 ? 2 : 1; }
constexpr int batch_rows(Format f) { return quant_bits(f) == 4 ? 4 : 8; }

// Rows [0, R) against groups [group, end): pairs of groups P at a time, a last pair alone, and a
// last odd group with `micro`.
// next_groups: groups after `end` to prefetch while the last full step of pairs runs.
template <Format F, int R>
void rows_against_pairs(const uint8_t* tiles, int64_t group, int64_t end, int64_t blocks, int64_t N,
                        const int16_t* xq, const float* xscale, const float* xsum, const float* bias, float* out,
                        int64_t next_groups = 0) {
  const int64_t group_stride = blocks * tile_bytes(F), K = blocks * kBlock;
  int64_t g = group;
  const auto valid_rows = [&](int64_t last_group) {  // output rows of the pair starting at last_group
    return std::min<int64_t>(2 * kRowsPerTile, N - last_group * kRowsPerTile);
  };
  constexpr int P = batch_pairs(F);
  for (; g + 2 * P <= end; g += 2 * P) {
    const bool last = g + 4 * P > end;
    micro_pairs<F, R, P>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                         bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, valid_rows(g + 2 * P - 2),
                         last && next_groups ? tiles + end * group_stride : nullptr, next_groups * group_stride);
  }
  for (; g + 2 <= end; g += 2)
    micro_pairs<F, R, 1>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                         bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, valid_rows(g));
  if (g < end) rows_against_groups<F, R, 1>(tiles, g, end, blocks, N, xq, xscale, xsum, bias, out, false);
}

// The first `rows` (<= R) rows of x against groups [group, end).
template <Format F, int R>
void some_rows_against_pairs(int64_t rows, const uint8_t* tiles, int64_t group, int64_t end, int64_t blocks,
                             int64_t N, const int16_t* xq, const float* xscale, const float* xsum, const float* bias,
                             float* out, int64_t next_groups) {
  if constexpr (R > 1) {
    if (rows < R)
      return some_rows_against_pairs<F, R - 1>(rows, tiles, group, end, blocks, N, xq, xscale, xsum, bias, out,
                                               next_groups);
  }
  rows_against_pairs<F, R>(tiles, group, end, blocks, N, xq, xscale, xsum, bias, out, next_groups);
}

template <Format F>
void product(const int16_t* xq, const float* xscale, const float* xsum, int64_t M, const uint8_t* tiles,
             int64_t num_groups, int64_t blocks, const float* bias, float* out, int64_t N) {
  const int64_t K = blocks * kBlock;
  if (M == 1) {
    const std::vector<int16_t> quads = expand_quads(xq, K);
    at::parallel_for(0, num_groups, kBatchOneGroups, [&](int64_t begin, int64_t end) {
      rows_against_groups<F, 1, kBatchOneGroups, true>(tiles, begin, end, blocks, N, quads.data(), xscale, xsum, bias,
                                                       out, true);
    });
    return;
  }
  // Each thread takes the groups of one step (4-bit: 4, others: 2) and runs every few rows of x
  // against them: their tiles (<= 4 x K/32 x 160 bytes, 31 KB for SmolLM2) stay in L1 or L2
  // over the rows.
  constexpr int64_t step = 2 * batch_pairs(F);
  constexpr int rows = batch_rows(F);
  // The next step's tiles are prefetched during the first rows' pass over these (the later
  // passes read these from cache): the memory stream overlaps the products.
  at::parallel_for(0, num_groups, step, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += step) {
      const int64_t stop = std::min(end, g + step), next_groups = std::min(end, stop + step) - stop;
      for (int64_t m0 = 0; m0 < M; m0 += rows)
        some_rows_against_pairs<F, rows>(std::min<int64_t>(rows, M - m0), tiles, g, stop, blocks, N, xq + m0 * K,
                                         xscale + m0 * blocks, xsum ? xsum + m0 * blocks : nullptr, bias, out + m0 * N,
                                         m0 == 0 ? next_groups : 0);
    }
  });
}

}  // namespace

void linear_int16(Format format, const float* x, int64_t x_stride, int64_t M, const uint8_t* tiles,
                  int64_t num_groups, int64_t blocks, const float* xsum, const float* bias, float* out, int64_t N) {
  std::vector<int16_t> xq(M * blocks * kBlock);
  std::vector<float> xscale(M * blocks);
  quantize_rows(x, x_stride, M, blocks, xq.data(), xscale.data());
#ifdef FERRY_QUANTIZED_AMX
  if (M >= kAmxMinRows && amx_format(format) && amx_ready())
    return linear_int16_amx(format, xq.data(), xscale.data(), xsum, M, tiles, num_groups, blocks, bias, out, N);
#endif
  dispatch_format(format, [&](auto f) {
    product<decltype(f)::value>(xq.data(), xscale.data(), xsum, M, tiles, num_groups, blocks, bias, out, N);
  });
}
#endif

}  // namespace ferry::quantized
