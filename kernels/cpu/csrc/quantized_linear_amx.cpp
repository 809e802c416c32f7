// The many-rows quantized product on AMX (Intel Sapphire Rapids and later): the same int16
// activations, exact int32 block sums and float fold as quantized_linear_vnni.cpp's micro_pairs,
// so the same floats bit for bit, with the integer products on the tile unit instead of vpdpwssd.
// Built only where the CPU reports amx_tile and amx_int8 (native.py adds -mamx-tile -mamx-int8
// and names the cache entry after them), and used only where Linux grants the tile state.
//
// AMX multiplies bytes, not int16 words, so each int16 activation is split exactly:
//   xq = 256 hi + lo,   lo = xq & 0xFF (unsigned 0..255),   hi = xq >> 8 (signed -128..127)
//   s  = sum_j q_j xq_j = 256 sum_j q_j hi_j + sum_j q_j lo_j
// tdpbusd (unsigned A x signed B) gives the lo sums and tdpbssd the hi sums, both exact (a block's
// |sum q lo| <= 32 x 255 x 128, |256 sum q hi| <= 256 x 32 x 128 x 128: int32), so s is the
// vpdpwssd kernel's integer and the fold below is micro_pairs' to the instruction.
//
// Tiles (palette 1, registers under configure): A = 16 rows of x, each a block's 32 lo bytes then
// its 32 hi bytes; B = the block for 16 output rows (two 8-row tile groups, as micro_pairs pairs
// them) in AMX's 4-byte layout B[k / 4][4 n + k % 4] = q(n, k), against one half of A with zeros
// against the other; C = [16 rows of x][16 outputs] int32. One tile op does 16 x 16 x 32 useful
// multiply-adds where a vpdpwssd zmm does 32, so what costs is the rest: unpacking the weights
// into B (once per pair of groups, shared by all rows of x) and folding each block's C into
// floats (as many vector ops as micro_pairs' fold). On SmolLM2's shapes at 32 rows the product
// ran 1.2-1.35x the vpdpwssd kernel's speed; software-pipelining the next block's tile ops under
// this block's fold, and prefetching the next pair's weights, measured no better. Q6_K (a scale
// per 16 columns: four sums a block) stays on vpdpwssd.
//
//   x: as linear_int16 (already rounded: xq [M, K] int16, xscale [M, blocks]), out: [M, N].

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "quantized_amx.h"
#include "quantized_avx2.h"
#include "quantized_tiles.h"
#include "quantized_unpack_vnni.h"

namespace ferry::quantized {

#ifdef FERRY_QUANTIZED_AMX
namespace {

constexpr int64_t kTileRows = 16;  // rows of x a tile op covers, and output rows of a B tile

std::atomic<bool> amx_enabled{true};
std::atomic<int64_t> amx_products{0};  // products run on the tile unit, for tests and diagnostics

// Linux hands a process the 8 KB tile state only when asked (arch_prctl, once per process);
// where it refuses (an old kernel, a hypervisor without it) every product stays on vpdpwssd.
bool amx_granted() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The tile configuration: 64 bytes, as the ISA defines it.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 32 bytes = columns c .. c+3 of a tile's 8 rows (8 bytes a column, as a Q8_0 plane) into AMX's
// B order for those 4 columns: row i's 4 bytes side by side (16 bytes for rows 0..3, then 4..7).
inline void columns_to_b(__m256i columns, uint8_t* b_row) {
  // (c, c+1) pairs per row in lane 0, (c+2, c+3) in lane 1, then the two lanes word-interleaved.
  const __m256i pairs = vnni::interleave_halves(columns);
  const __m128i first = _mm256_castsi256_si128(pairs), second = _mm256_extracti128_si256(pairs, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(b_row), _mm_unpacklo_epi16(first, second));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(b_row + 16), _mm_unpackhi_epi16(first, second));
}

// One tile group's 32-column block into the B rows of its 8 outputs: b[k / 4][64-byte row],
// this group's bytes at `half` (0 or 32) of each row. Quants as the vpdpwssd kernel widens them:
// Q8_0 signed, 4 bits 0..15, 5 bits 0..31 (the staged bytes of quantized_avx2.h).
template <Format F>
inline void block_to_b(const uint8_t* plane, uint8_t* b, int64_t half) {
  if constexpr (F == Format::kQ8_0 || staged_format(F)) {
    alignas(32) uint8_t staged[kStagedBytes];
    const uint8_t* bytes = plane;
    if constexpr (staged_format(F)) {
      stage<F>(plane, staged);
      bytes = staged;
    }
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; ++k4)
      columns_to_b(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * k4)), b + 64 * k4 + half);
  } else {  // a byte holds column j (low nibble) and j + 16 (high nibble)
    const __m256i nibble = _mm256_set1_epi8(0xF);
#pragma GCC unroll 4
    for (int k4 = 0; k4 < 4; ++k4) {
      const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + 32 * k4));
      columns_to_b(_mm256_and_si256(n, nibble), b + 64 * k4 + half);
      columns_to_b(_mm256_and_si256(_mm256_srli_epi16(n, 4), nibble), b + 64 * (4 + k4) + half);
    }
  }
}

// x's int16 rows as AMX's A operand: per row and block, 64 bytes = the block's 32 lo bytes
// (unsigned) then its 32 hi bytes (signed). [M, blocks, 64]
void split_rows(const int16_t* xq, int64_t M, int64_t blocks, uint8_t* x_bytes) {
  for (int64_t i = 0; i < M * blocks; ++i) {
    const __m512i v = _mm512_loadu_si512(xq + kBlock * i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x_bytes + 64 * i), _mm512_cvtepi16_epi8(v));  // the low bytes
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x_bytes + 64 * i + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
  }
}

// Tile registers (GCC's tile intrinsics paste the number into the instruction, so the calls spell
// them out): A of rows 0..15 and 16..31 of a 32-row step: 0, 1; B_lo, B_hi: 2, 3; C (lo, hi) of the
// first 16 rows: 4, 5, of the next 16: 6, 7. One A tile holds a row's lo and hi bytes side by side
// (K = 64); B_lo has the quants against the lo half and zeros against the hi half, B_hi the
// reverse, so tdpbusd(A, B_lo) reads only lo bytes (as unsigned) and tdpbssd(A, B_hi) only hi
// bytes (as signed). The four products of a block are independent chains the core overlaps.
void configure(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64;
  config.rows[0] = config.rows[1] = config.rows[4] = config.rows[5] = config.rows[6] = config.rows[7] =
      static_cast<uint8_t>(rows);
  config.rows[2] = config.rows[3] = 16;
  _tile_loadconfig(&config);
}

template <Format F>
void product_amx(const int16_t* xq, const float* xscale, const float* xsum, int64_t M, const uint8_t* tiles,
                 int64_t num_groups, int64_t blocks, const float* bias, float* out, int64_t N) {
  static_assert(amx_format(F), "Q6_K's half-block scales keep it on vpdpwssd");
  const int64_t group_stride = blocks * tile_bytes(F), x_stride = blocks * 64;
  // Rounded up to 32 rows, zeros after M: a last step's second tile may read past M (its sums
  // for those rows are never folded).
  std::vector<uint8_t> x_bytes((M + 2 * kTileRows - 1) / (2 * kTileRows) * 2 * kTileRows * x_stride, 0);
  split_rows(xq, M, blocks, x_bytes.data());
  constexpr int64_t b_rows = kBlock / 4;  // one block's B rows for 16 outputs (64 bytes each)
  const int64_t num_pairs = (num_groups + 1) / 2;
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    // b: 8 zero rows, then per block its 8 quant rows and 8 zero rows: B_lo of block b starts at
    // its quant rows, B_hi 8 rows before them (the zeros before, its quants after).
    std::vector<uint8_t> b((b_rows + blocks * 2 * b_rows) * 64, 0);
    alignas(64) int32_t c[4][kTileRows][16];  // C tiles 4..7 read back
    int64_t configured_rows = 0;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t first = 2 * pair;
      const bool single = first + 1 >= num_groups;  // an odd last group: the other 8 outputs are zeros
      const uint8_t* group = tiles + first * group_stride;
      const uint8_t* second = single ? group : group + group_stride;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        uint8_t* rows = b.data() + (b_rows + blk * 2 * b_rows) * 64;
        block_to_b<F>(block_plane(F, group, blk), rows, 0);
        if (!single) block_to_b<F>(block_plane(F, second, blk), rows, 32);
      }
      const int64_t valid = std::min<int64_t>(2 * kRowsPerTile, N - first * kRowsPerTile);
      const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(keep, bias + first * kRowsPerTile) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
        // Two tiles of rows when there are more than 16 left, else one (with `rows` rows).
        const bool two = M - m0 > kTileRows;
        const int64_t rows = two ? kTileRows : M - m0;
        const int64_t second_rows = two ? std::min(kTileRows, M - m0 - kTileRows) : 0;
        if (rows != configured_rows) {
          configure(rows);
          configured_rows = rows;
        }
        __m512 total[2 * kTileRows];
        for (int64_t r = 0; r < rows + second_rows; ++r) total[r] = _mm512_setzero_ps();
        const uint8_t* x0 = x_bytes.data() + m0 * x_stride;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const uint8_t* b_low = b.data() + (b_rows + blk * 2 * b_rows) * 64;
          _tile_loadd(2, b_low, 64);
          _tile_loadd(3, b_low - b_rows * 64, 64);
          _tile_loadd(0, x0 + blk * 64, x_stride);
          _tile_zero(4);
          _tile_zero(5);
          _tile_dpbusd(4, 0, 2);
          _tile_dpbssd(5, 0, 3);
          if (two) {
            _tile_loadd(1, x0 + kTileRows * x_stride + blk * 64, x_stride);
            _tile_zero(6);
            _tile_zero(7);
            _tile_dpbusd(6, 1, 2);
            _tile_dpbssd(7, 1, 3);
          }
          _tile_stored(4, c[0], 64);
          _tile_stored(5, c[1], 64);
          if (two) {
            _tile_stored(6, c[2], 64);
            _tile_stored(7, c[3], 64);
          }
          const uint8_t* header = block_header(F, group, blk);
          const vnni::Scales16 s =
              vnni::pair_scales<F>(header, single ? header : header + group_stride, block_in_unit(F, blk));
          const auto fold = [&](int64_t r, const int32_t* low, const int32_t* high) {  // micro_pairs' fold
            const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high), 8), _mm512_load_si512(low));
            const __m512 xs = _mm512_set1_ps(xscale[(m0 + r) * blocks + blk]);
            total[r] = _mm512_fmadd_ps(s.scale, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), xs), total[r]);
            if constexpr (has_offset(F))
              total[r] = _mm512_fmadd_ps(s.m, _mm512_set1_ps(xsum[(m0 + r) * blocks + blk]), total[r]);
          };
          for (int64_t r = 0; r < rows; ++r) fold(r, c[0][r], c[1][r]);
          for (int64_t r = 0; r < second_rows; ++r) fold(kTileRows + r, c[2][r], c[3][r]);
        }
        for (int64_t r = 0; r < rows + second_rows; ++r) {
          __m512 v = total[r];
          if (bias) v = _mm512_add_ps(v, bias_v);
          _mm512_mask_storeu_ps(out + (m0 + r) * N + first * kRowsPerTile, keep, v);
        }
      }
    }
    if (configured_rows) _tile_release();
  });
}

}  // namespace

bool amx_ready() { return amx_enabled.load(std::memory_order_relaxed) && amx_granted(); }

void linear_int16_amx(Format format, const int16_t* xq, const float* xscale, const float* xsum, int64_t M,
                      const uint8_t* tiles, int64_t num_groups, int64_t blocks, const float* bias, float* out,
                      int64_t N) {
  amx_products.fetch_add(1, std::memory_order_relaxed);
  TORCH_CHECK(amx_format(format), "the AMX product does not take this format (amx_format)");
  dispatch_format(format, [&](auto f) {
    if constexpr (amx_format(decltype(f)::value))
      product_amx<decltype(f)::value>(xq, xscale, xsum, M, tiles, num_groups, blocks, bias, out, N);
  });
}
#endif

}  // namespace ferry::quantized

namespace ferry {

bool linear_quantized_amx() {
#ifdef FERRY_QUANTIZED_AMX
  return quantized::amx_ready();
#else
  return false;
#endif
}

int64_t linear_quantized_amx_products() {
#ifdef FERRY_QUANTIZED_AMX
  return quantized::amx_products.load();
#else
  return 0;
#endif
}

bool set_linear_quantized_amx(bool enabled) {
#ifdef FERRY_QUANTIZED_AMX
  quantized::amx_enabled.store(enabled);
  return quantized::amx_ready();
#else
  (void)enabled;
  return false;
#endif
}

}  // namespace ferry
