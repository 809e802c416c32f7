// y = x @ W^T (+ bias) with W in the GGUF tiles of quantized_linear_cpu.cpp, on AVX2's integer
// units: quantized_linear_vnni.cpp's product for CPUs without AVX512_VNNI (AVX2-only cloud CPUs,
// AVX-512 parts before Ice Lake). The same rounding of x to int16 per 32-column block, the same
// exact int32 block sums, folded into float32 in the same order: the same floats as the VNNI
// kernel, bit for bit (tests/kernels/cpu/test_quantized_avx2.py compares the two builds).
//
// Why integers here too: AVX2 has no vpdpwssd, but vpmaddwd multiplies 16 int16 pairs into 8
// int32 lanes and a vpaddd adds them up: 16 multiply-adds in 2 instructions, as many per
// instruction as an FMA on floats, but the weights widen to int16 (vpmovzxbw, and / shift) instead
// of to floats (a vpmovzxbd and a cvtdq2ps per 8), and Intel cores issue two vpmaddwd a cycle.
// The float32-activation product this replaced ran a 32-row step of SmolLM2's Q4_K_M at 0.79x the
// float32 weights' rate; this one runs SmolLM2's projections 1.14-1.35x faster than it at 32 rows
// and as fast at batch 1 (Zen 4, where one thread stays near 52 GMAC/s however it is blocked:
// the integer units bound it; bench/README.md).
//
// Register use: a ymm of weights is one tile's 8 rows at a column pair (c, c+1), row i in dword i,
// so each row of x contributes one dword broadcast (x_c, x_c+1) from memory and a lane's int32
// sum is a whole output row's (no shuffles of x, no halves to add).
// - Batch 1 (`micro` from the tiles): 4 groups side by side, the next 4 prefetched.
// - More rows: each thread widens two groups once into int16 pairs (`widen_group`, 512 bytes a
//   block and group: L1/L2) and runs every 4 rows of x against them (8 int32 chains, each weight
//   load feeding 4 vpmaddwd); Q6_K, which keeps its two 16-column halves apart (two scales), one
//   group (8 chains as well).
// - 5 and 6 bits: each block's plane is first staged as one byte per quant
//   (quantized_avx2.h's stage), then reads as a Q8_0 plane.
//
//   x: [M, K] float32 (rows may be strided), tiles as quantized_linear_cpu.cpp, out: [M, N].

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "quantized_avx2.h"
#include "quantized_tiles.h"

namespace ferry::quantized {

#if defined(FERRY_QUANTIZED) && !defined(FERRY_QUANTIZED_VNNI)
namespace {

// Rows of x as int16 per block, with each block's scale: quantized_linear_vnni.cpp's rounding
// (max |x| / 32767 per block, round to nearest, saturate), on 8-float vectors.
//   xq: [M, K] int16, xscale: [M, blocks] float32
void quantize_rows(const float* x, int64_t x_stride, int64_t M, int64_t blocks, int16_t* xq, float* xscale) {
  const int64_t K = blocks * kBlock;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + r * x_stride + b * kBlock;
      const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
      const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
      const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float amax = _mm_cvtss_f32(h);
      const float inverse = amax > 0.f ? 32767.f / amax : 0.f;
      xscale[r * blocks + b] = amax / 32767.f;
      const __m256 k = _mm256_set1_ps(inverse);
      const auto rounded = [&](__m256 v) { return _mm256_cvtps_epi32(_mm256_mul_ps(v, k)); };
      // vpackssdw saturates as vpmovsdw does, but packs per 128-bit lane: a qword permute restores the order.
      const __m256i first = _mm256_permute4x64_epi64(_mm256_packs_epi32(rounded(v0), rounded(v1)), 0xD8);
      const __m256i second = _mm256_permute4x64_epi64(_mm256_packs_epi32(rounded(v2), rounded(v3)), 0xD8);
      int16_t* q = xq + r * K + b * kBlock;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), first);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), second);
    }
}

// Columns c and c + 1 of a plane's 8 rows (8 bytes a column, from p), each row's two side by side.
inline __m128i column_pair_bytes(const uint8_t* p) {
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                          _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
}

// A block's int16 weights at columns (c, c+1) (low) and (c+16, c+17) (high), dword i = row i's
// pair. quants: a 4-bit plane (a byte holds columns j and j + 16) or a byte plane (Q8_0, staged).
template <Format F>
inline void widen(const uint8_t* quants, int c, __m256i& low, __m256i& high) {
  if constexpr (quant_bits(F) == 4) {
    const __m256i both = _mm256_cvtepu8_epi16(column_pair_bytes(quants + 8 * c));
    low = _mm256_and_si256(both, _mm256_set1_epi16(0xF));
    high = _mm256_srli_epi16(both, 4);
  } else {  // Q8_0 -128..127, staged Q5 0..31, staged Q6_K q - 32: sign extension is exact
    low = _mm256_cvtepi8_epi16(column_pair_bytes(quants + 8 * c));
    high = _mm256_cvtepi8_epi16(column_pair_bytes(quants + 8 * (c + 16)));
  }
}

constexpr int64_t kPairSteps = kBlock / 4;           // column pairs c = 0, 2, .., 14 (each with c + 16)
constexpr int64_t kWideBlock = 2 * kPairSteps;       // ymm of widened weights per block and group

inline __m256i broadcast_pair(const int16_t* x) {  // (x[0], x[1]) in every dword
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm256_set1_epi32(pair);
}

// A group's weights widened as micro reads them: [blocks][kPairSteps][low, high] ymm.
template <Format F>
void widen_group(const uint8_t* group_tiles, int64_t blocks, __m256i* wide) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* quants = block_plane(F, group_tiles, b);
    alignas(32) uint8_t staged[kStagedBytes];
    if constexpr (staged_format(F)) {
      stage<F>(quants, staged);
      quants = staged;
      asm volatile("" : : "r"(staged) : "memory");  // read back from L1 (see micro)
    }
    for (int c = 0; c < 16; c += 2) {
      __m256i low, high;
      widen<F>(quants, c, low, high);
      _mm256_store_si256(wide + (b * kPairSteps + c / 2) * 2, low);
      _mm256_store_si256(wide + (b * kPairSteps + c / 2) * 2 + 1, high);
    }
  }
}

// R rows of x against G adjacent tile groups over all K (cols < 8 only in the matrix's last
// group). WIDE: the groups' weights come from `wide` (widen_group's, one group after the other)
// instead of the tiles. next: the G groups read after these, a block's share prefetched per block
// (null: none).
template <Format F, int R, int G, bool WIDE>
inline void micro(const uint8_t* tiles, int64_t group_stride, int64_t blocks, const int16_t* xq, int64_t K,
                  const float* xscale, const float* xsum, const float* bias, float* out, int64_t out_stride,
                  int64_t cols, const uint8_t* next, const __m256i* wide) {
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
    alignas(32) uint8_t staged[staged_format(F) && !WIDE ? G : 1][kStagedBytes];
    if constexpr (!WIDE) {
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        quants[g] = block_plane(F, tiles + g * group_stride, b);
        if constexpr (staged_format(F)) {
          stage<F>(quants[g], staged[g]);
          quants[g] = staged[g];
        }
      }
      // vpmovsxbw must read the staged bytes from L1: kept in registers, GCC carves them apart with shuffles.
      if constexpr (staged_format(F)) asm volatile("" : : "r"(&staged[0][0]) : "memory");
    }
    // acc: the block's int32 sums; Q6_K sums columns 16..31 apart in acc2 (another scale).
    __m256i acc[R][G], acc2[R][G];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[r][g] = acc2[r][g] = _mm256_setzero_si256();
    const int16_t* xb = xq + b * kBlock;
#pragma GCC unroll 8
    for (int c = 0; c < 16; c += 2) {
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        __m256i low, high;
        if constexpr (WIDE) {
          const __m256i* w = wide + ((g * blocks + b) * kPairSteps + c / 2) * 2;
          low = _mm256_load_si256(w);
          high = _mm256_load_si256(w + 1);
        } else {
          widen<F>(quants[g], c, low, high);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r][g] = _mm256_add_epi32(acc[r][g], _mm256_madd_epi16(low, broadcast_pair(xb + r * K + c)));
          const __m256i upper = _mm256_madd_epi16(high, broadcast_pair(xb + r * K + c + 16));
          if constexpr (F == Format::kQ6_K)
            acc2[r][g] = _mm256_add_epi32(acc2[r][g], upper);
          else
            acc[r][g] = _mm256_add_epi32(acc[r][g], upper);
        }
      }
    }
    // The fold of quantized_linear_vnni.cpp's `micro`, operation for operation: the same floats.
    // (Kept written out: moved into a shared inline function, this kernel's 32-row pass ran
    // 1.4x slower on Zen 4 with GCC 12.)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const BlockScales s = block_scales<F>(block_header(F, tiles + g * group_stride, b), block_in_unit(F, b));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(xscale[r * blocks + b]);
        total[r][g] = _mm256_fmadd_ps(s.scale, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][g]), xs), total[r][g]);
        if constexpr (F == Format::kQ6_K)
          total[r][g] = _mm256_fmadd_ps(s.scale2, _mm256_mul_ps(_mm256_cvtepi32_ps(acc2[r][g]), xs), total[r][g]);
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

constexpr int kBatchOneGroups = 4;  // tile groups side by side for one row of x
constexpr int kWideRows = 4;        // rows of x per micro-kernel against widened groups
// Widened groups side by side: 4 x 2 int32 chains, Q6_K's second chains make it 4 x 1 x 2.
constexpr int wide_groups(Format f) { return f == Format::kQ6_K ? 1 : 2; }

// Batch 1: groups [begin, end) G at a time from the tiles, then the tail one by one.
template <Format F>
void one_row(const uint8_t* tiles, int64_t begin, int64_t end, int64_t blocks, int64_t N, const int16_t* xq,
             const float* xscale, const float* xsum, const float* bias, float* out) {
  const int64_t group_stride = blocks * tile_bytes(F), K = blocks * kBlock;
  // The first groups have no predecessor to prefetch them: ask for all of their lines now.
  const char* first = reinterpret_cast<const char*>(tiles + begin * group_stride);
  const int64_t first_bytes = std::min<int64_t>(kBatchOneGroups, end - begin) * group_stride;
  for (int64_t line = 0; line < first_bytes; line += 64) _mm_prefetch(first + line, _MM_HINT_T0);
  constexpr int G = kBatchOneGroups;
  int64_t g = begin;
  for (; g + G <= end; g += G) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - (g + G - 1) * kRowsPerTile);
    const uint8_t* next = g + 2 * G <= end ? tiles + (g + G) * group_stride : nullptr;
    micro<F, 1, G, false>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                          bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next, nullptr);
  }
  for (; g < end; ++g) {
    const int64_t cols = std::min<int64_t>(kRowsPerTile, N - g * kRowsPerTile);
    const uint8_t* next = g + 1 < end ? tiles + (g + 1) * group_stride : nullptr;
    micro<F, 1, 1, false>(tiles + g * group_stride, group_stride, blocks, xq, K, xscale, xsum,
                          bias ? bias + g * kRowsPerTile : nullptr, out + g * kRowsPerTile, N, cols, next, nullptr);
  }
}

// `rows` (<= R) rows of x against `groups` (<= G) widened groups: the largest micro that fits.
// next: the G groups after these, prefetched into L2 over the pass (null: none).
template <Format F, int R, int G>
void some_rows(int64_t rows, int64_t groups, const uint8_t* tiles, int64_t blocks, const int16_t* xq,
               const float* xscale, const float* xsum, const float* bias, float* out, int64_t N, int64_t cols,
               const __m256i* wide, const uint8_t* next) {
  if constexpr (R > 1) {
    if (rows < R)
      return some_rows<F, R - 1, G>(rows, groups, tiles, blocks, xq, xscale, xsum, bias, out, N, cols, wide, next);
  }
  if constexpr (G > 1) {
    if (groups < G)
      return some_rows<F, R, G - 1>(rows, groups, tiles, blocks, xq, xscale, xsum, bias, out, N, cols, wide, next);
  }
  micro<F, R, G, true>(tiles, blocks * tile_bytes(F), blocks, xq, blocks * kBlock, xscale, xsum, bias, out, N, cols,
                       next, wide);
}

template <Format F>
void product(const int16_t* xq, const float* xscale, const float* xsum, int64_t M, const uint8_t* tiles,
             int64_t num_groups, int64_t blocks, const float* bias, float* out, int64_t N) {
  if (M == 1) {
    at::parallel_for(0, num_groups, kBatchOneGroups, [&](int64_t begin, int64_t end) {
      one_row<F>(tiles, begin, end, blocks, N, xq, xscale, xsum, bias, out);
    });
    return;
  }
  constexpr int G = wide_groups(F);
  const int64_t group_stride = blocks * tile_bytes(F), K = blocks * kBlock;
  at::parallel_for(0, num_groups, G, [&](int64_t begin, int64_t end) {
    // 32-byte aligned (C++17 aligned new). Zero-filled: left uninitialized (new[]), the 32-row pass
    // ran 1.4x slower on Zen 4, for a reason not found.
    std::vector<__m256i> wide(G * blocks * kWideBlock);
    for (int64_t g = begin; g < end; g += G) {
      const int64_t groups = std::min<int64_t>(G, end - g);
      for (int64_t i = 0; i < groups; ++i)
        widen_group<F>(tiles + (g + i) * group_stride, blocks, wide.data() + i * blocks * kWideBlock);
      const int64_t cols = std::min<int64_t>(kRowsPerTile, N - (g + groups - 1) * kRowsPerTile);
      // The first pass over the rows also streams the next groups' tiles into L2, so their
      // widening reads them from there.
      const uint8_t* next = groups == G && g + 2 * G <= end ? tiles + (g + G) * group_stride : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kWideRows)
        some_rows<F, kWideRows, G>(std::min<int64_t>(kWideRows, M - m0), groups, tiles + g * group_stride, blocks,
                                   xq + m0 * K, xscale + m0 * blocks, xsum ? xsum + m0 * blocks : nullptr,
                                   bias ? bias + g * kRowsPerTile : nullptr, out + m0 * N + g * kRowsPerTile, N, cols,
                                   wide.data(), m0 == 0 ? next : nullptr);
    }
  });
}

}  // namespace

void linear_int16(Format format, const float* x, int64_t x_stride, int64_t M, const uint8_t* tiles,
                  int64_t num_groups, int64_t blocks, const float* xsum, const float* bias, float* out, int64_t N) {
  std::vector<int16_t> xq(M * blocks * kBlock);
  std::vector<float> xscale(M * blocks);
  quantize_rows(x, x_stride, M, blocks, xq.data(), xscale.data());
  dispatch_format(format, [&](auto f) {
    product<decltype(f)::value>(xq.data(), xscale.data(), xsum, M, tiles, num_groups, blocks, bias, out, N);
  });
}
#endif

}  // namespace ferry::quantized
