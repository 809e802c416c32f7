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
//   y       += d[n] (xs[r, b] s)                 (+ m[n] xsum[r, b] for Q4_1; m = -8 d for Q4_0)
// where q is the stored quant (Q4: 0..15, the offset being m or -8 d; Q8_0: -128..127) and
// xsum is the block's float32 sum of x (not of xq), as in the float kernel. |y - x W^T| is then
// at most sum_b xs[r, b] / 2 sum_{j in b} |w[n, j]| beyond float32 rounding.
//
// Register use: a vpdpwssd lane is one output row and two adjacent columns; a zmm holds a tile's
// 8 rows at columns (j, j+1) in its low half and (j+2, j+3) in its high half, so 32 bytes of a
// tile (4 columns x 8 rows, one unpack) feed one instruction per row of x; the halves are added
// once per block. Batch 1 runs 4 groups side by side (4 int32 chains); more rows run 4 rows x 2
// groups, each group's 32 bytes widened once for the 4 rows, 8 chains.
//
//   x: [M, K] float32 (rows may be strided), tiles as quantized_linear_cpu.cpp, out: [M, N].

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <vector>

#include "quantized_tiles.h"

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

// 32 tile bytes (columns c .. c+4 of 8 rows, 8 bytes a column) as 32 int16 in activation_quad's
// pairing: row i's (c, c+1) in dword i, its (c+2, c+3) in dword 8 + i.
inline __m512i interleaved_bytes(const uint8_t* quants, bool is_signed) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants));
  const __m256i pairs = _mm256_unpacklo_epi8(v, _mm256_bsrli_epi128(v, 8));
  return is_signed ? _mm512_cvtepi8_epi16(pairs) : _mm512_cvtepu8_epi16(pairs);
}

// R rows of x against G adjacent tile groups over all K (cols < 8 only in the matrix's last group).
// next: the G groups this thread reads after these (prefetched into L2 a block's share at a time).
template <Format F, int R, int G>
inline void micro(const uint8_t* tiles, int64_t group_stride, int64_t blocks, const int16_t* xq, int64_t K,
                  const float* xscale, const float* xsum, const float* bias, float* out, int64_t out_stride,
                  int64_t cols, const uint8_t* next) {
  __m256 total[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) total[r][g] = _mm256_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = tiles + b * tile_bytes(F);
    if (next) {
      const char* ahead = reinterpret_cast<const char*>(next) + b * G * tile_bytes(F);
      for (int64_t line = 0; line < G * tile_bytes(F); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    __m512i acc[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_si512();
    if constexpr (F == Format::kQ8_0) {
#pragma GCC unroll 8
      for (int j = 0; j < 32; j += 4) {
        __m512i xr[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xr[r] = activation_quad(xq + r * K + b * kBlock + j);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512i w = interleaved_bytes(tile + g * group_stride + quants_offset(F) + 8 * j, true);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], w, xr[r]);
        }
      }
    } else {  // a byte holds column j (low nibble) and column j + 16 (high nibble)
#pragma GCC unroll 4
      for (int j = 0; j < 16; j += 4) {
        __m512i low[R], high[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          low[r] = activation_quad(xq + r * K + b * kBlock + j);
          high[r] = activation_quad(xq + r * K + b * kBlock + j + 16);
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512i w = interleaved_bytes(tile + g * group_stride + quants_offset(F) + 8 * j, false);
          const __m512i w_low = _mm512_and_si512(w, nibble), w_high = _mm512_srli_epi16(w, 4);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], w_low, low[r]);
            acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], w_high, high[r]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint8_t* header = tile + g * group_stride;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header)));
      __m256 m = d;
      if constexpr (F == Format::kQ4_1)
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 16)));
      if constexpr (F == Format::kQ4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(acc[r][g]), _mm512_extracti64x4_epi64(acc[r][g], 1));
        const __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xscale[r * blocks + b]));
        total[r][g] = _mm256_fmadd_ps(d, sum, total[r][g]);
        if constexpr (has_offset(F))
          total[r][g] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * blocks + b]), total[r][g]);
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

// Rows [0, R) against groups [group, end), G at a time, then the tail one by one.
template <Format F, int R, int G>
void rows_against_groups(const uint8_t* tiles, int64_t group, int64_t end, int64_t blocks, int64_t N,
                         const int16_t* xq, const float* xscale, const float* xsum, const float* bias, float* out,
                         bool prefetch) {
  const int64_t group_stride = blocks * tile_bytes(F), K = blocks * kBlock;
  int64_t g = group;
  for (; g + G <= end; g += G) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - (g + G - 1) * kRowsPerTile);
    const uint8_t* next = prefetch && g + 2 * G <= end ? tiles + (g + G) * group_stride : nullptr;
    micro<F, R, G>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                   bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next);
  }
  for (; g < end; ++g) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - g * kRowsPerTile);
    const uint8_t* next = prefetch && g + 1 < end ? tiles + (g + 1) * group_stride : nullptr;
    micro<F, R, 1>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                   bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next);
  }
}

constexpr int64_t kBatchOneGroups = 4;  // tile groups side by side for one row of x
constexpr int64_t kBatchGroups = 2;     // and for 4 rows of x (each group widened once for the 4)
constexpr int kBatchRows = 4;

template <Format F>
void product(const int16_t* xq, const float* xscale, const float* xsum, int64_t M, const uint8_t* tiles,
             int64_t num_groups, int64_t blocks, const float* bias, float* out, int64_t N) {
  const int64_t K = blocks * kBlock;
  if (M == 1) {
    at::parallel_for(0, num_groups, kBatchOneGroups, [&](int64_t begin, int64_t end) {
      rows_against_groups<F, 1, kBatchOneGroups>(tiles, begin, end, blocks, N, xq, xscale, xsum, bias, out, true);
    });
    return;
  }
  // Each thread takes a pair of groups and runs every 4 rows of x against it: the pair's tiles
  // (2 x K/32 x 160 bytes, <= 15 KB for SmolLM2) stay in L1 over the rows.
  at::parallel_for(0, num_groups, kBatchGroups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += kBatchGroups) {
      const int64_t stop = std::min(end, g + kBatchGroups);
      for (int64_t m0 = 0; m0 < M; m0 += kBatchRows) {
        const int16_t* xr = xq + m0 * K;
        const float* sr = xscale + m0 * blocks;
        const float* ur = xsum ? xsum + m0 * blocks : nullptr;
        float* o = out + m0 * N;
        switch (std::min<int64_t>(kBatchRows, M - m0)) {
          case 1: rows_against_groups<F, 1, kBatchGroups>(tiles, g, stop, blocks, N, xr, sr, ur, bias, o, false); break;
          case 2: rows_against_groups<F, 2, kBatchGroups>(tiles, g, stop, blocks, N, xr, sr, ur, bias, o, false); break;
          case 3: rows_against_groups<F, 3, kBatchGroups>(tiles, g, stop, blocks, N, xr, sr, ur, bias, o, false); break;
          default:
            rows_against_groups<F, kBatchRows, kBatchGroups>(tiles, g, stop, blocks, N, xr, sr, ur, bias, o, false);
            break;
        }
      }
    }
  });
}

}  // namespace

void linear_int16(Format format, const float* x, int64_t x_stride, int64_t M, const uint8_t* tiles,
                  int64_t num_groups, int64_t blocks, const float* xsum, const float* bias, float* out, int64_t N) {
  std::vector<int16_t> xq(M * blocks * kBlock);
  std::vector<float> xscale(M * blocks);
  quantize_rows(x, x_stride, M, blocks, xq.data(), xscale.data());
  switch (format) {
    case Format::kQ8_0:
      product<Format::kQ8_0>(xq.data(), xscale.data(), xsum, M, tiles, num_groups, blocks, bias, out, N);
      break;
    case Format::kQ4_0:
      product<Format::kQ4_0>(xq.data(), xscale.data(), xsum, M, tiles, num_groups, blocks, bias, out, N);
      break;
    case Format::kQ4_1:
      product<Format::kQ4_1>(xq.data(), xscale.data(), xsum, M, tiles, num_groups, blocks, bias, out, N);
      break;
  }
}
#endif

}  // namespace ferry::quantized
