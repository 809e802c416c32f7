// The GGUF tile layout shared by the products (quantized_linear_cpu.cpp, quantized_linear_vnni.cpp)
// and the embedding lookup (quantized_rows_cpu.cpp): one unit per 8 output rows x one GGUF block,
// as described below (kernels/cpu/quantized_formats.py writes it).
#pragma once

#include <torch/extension.h>

#include <string>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FERRY_QUANTIZED 1
#endif
// The integer product (quantized_linear_vnni.cpp): int16 activations on vpdpwssd.
#if defined(FERRY_QUANTIZED) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define FERRY_QUANTIZED_VNNI 1
#endif
// The many-rows product on the tile unit (quantized_linear_amx.cpp): AMX-INT8 beside VNNI.
#if defined(FERRY_QUANTIZED_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FERRY_QUANTIZED_AMX 1
#endif

namespace ferry::quantized {

constexpr int64_t kRowsPerTile = 8;  // output rows of a tile: one 8-float vector
constexpr int64_t kBlock = 32;       // columns per quants plane (and per legacy GGUF block)

enum class Format { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K };

// The layout (kernels/cpu/quantized_formats.py writes it; its docstring is the full description):
// a group's tiles are [units][unit bytes], a unit = 8 rows x one GGUF block (32 columns; 256 for
// the K-quants, i.e. 8 planes). A unit starts with its header (each field for the 8 rows side by
// side), then one quants plane per 32 columns:
//   Q8_0  d[8] fp16                                           | q[32][8] int8                 w = d q
//   Q4_0  d[8]                                                | n[16][8]                      w = d (q - 8)
//   Q4_1  d[8] m[8]                                           | n[16][8]                      w = d q + m
//   Q5_0  d[8]                                                | n[16][8] h[8] u32             w = d (q - 16)
//   Q5_1  d[8] m[8]                                           | n[16][8] h[8] u32             w = d q + m
//   Q4_K  d[8] dmin[8] sc[8 planes][8] u8 mn[8][8] u8         | 8 x n[16][8]                  plane p: w = (d sc[p]) q - dmin mn[p]
//   Q5_K  as Q4_K                                             | 8 x (n[16][8] h[8] u32)
//   Q6_K  d[8] sc[16 halves][8] int8                          | 8 x (n[16][8] h[2][8] u32)    half k of plane p: w = (d sc[2p+k]) (q - 32)
// n[j][i] = low 4 bits of q(row i, column j) | those of column j + 16 << 4. 5 bits: bit c of h[i]
// is bit 4 of q(i, c). 6 bits: bits 2t, 2t + 1 of h[k][i] are bits 4, 5 of q(i, 16k + t).
constexpr int quant_bits(Format f) {
  return f == Format::kQ8_0 ? 8 : (f == Format::kQ5_0 || f == Format::kQ5_1 || f == Format::kQ5_K) ? 5
                                  : f == Format::kQ6_K ? 6 : 4;
}
constexpr bool is_k_quant(Format f) { return f == Format::kQ4_K || f == Format::kQ5_K || f == Format::kQ6_K; }
constexpr int64_t unit_planes(Format f) { return is_k_quant(f) ? 8 : 1; }  // 32-column planes per unit
constexpr int64_t plane_bytes(Format f) {
  return quant_bits(f) == 8 ? 256 : quant_bits(f) == 4 ? 128 : quant_bits(f) == 5 ? 160 : 192;
}
constexpr int64_t header_bytes(Format f) {
  switch (f) {
    case Format::kQ4_1: case Format::kQ5_1: return 32;          // d, m
    case Format::kQ4_K: case Format::kQ5_K: return 32 + 128;    // d, dmin, sc, mn
    case Format::kQ6_K: return 16 + 128;                        // d, sc
    default: return 16;                                         // d
  }
}
constexpr int64_t unit_bytes(Format f) { return header_bytes(f) + unit_planes(f) * plane_bytes(f); }
// Bytes per 32 columns of a group (a group's stride is blocks * tile_bytes: units divide evenly).
constexpr int64_t tile_bytes(Format f) { return unit_bytes(f) / unit_planes(f); }
// Where a legacy tile's quants start (after its header); for every format, see block_plane.
constexpr int64_t quants_offset(Format f) { return header_bytes(f); }
// The result needs the block's sum of x: w = d q + m with m != 0 (Q4_0: m = -8 d, Q5_0: -16 d,
// K: -dmin mn). Q8_0 and Q6_K (q - 32 applied when widening) multiply signed quants.
constexpr bool has_offset(Format f) { return f != Format::kQ8_0 && f != Format::kQ6_K; }

// 32-column block b of a group (its tiles start at `group`): the unit's header and the plane.
inline const uint8_t* block_header(Format f, const uint8_t* group, int64_t b) {
  return group + (b / unit_planes(f)) * unit_bytes(f);
}
inline const uint8_t* block_plane(Format f, const uint8_t* group, int64_t b) {
  return block_header(f, group, b) + header_bytes(f) + (b % unit_planes(f)) * plane_bytes(f);
}
// Which plane of its unit block b is (the index into sc/mn; Q6_K: halves 2 p and 2 p + 1).
inline int64_t block_in_unit(Format f, int64_t b) { return b % unit_planes(f); }

inline Format parse_format(const std::string& qtype) {
  if (qtype == "Q8_0") return Format::kQ8_0;
  if (qtype == "Q4_0") return Format::kQ4_0;
  if (qtype == "Q4_1") return Format::kQ4_1;
  if (qtype == "Q5_0") return Format::kQ5_0;
  if (qtype == "Q5_1") return Format::kQ5_1;
  if (qtype == "Q4_K") return Format::kQ4_K;
  if (qtype == "Q5_K") return Format::kQ5_K;
  if (qtype == "Q6_K") return Format::kQ6_K;
  TORCH_CHECK(false, "unsupported quantization type ", qtype,
              " (the native kernels run Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
}

// Calls fn(std::integral_constant<Format, F>{}) for the runtime format: one switch for every kernel.
template <typename Fn>
inline void dispatch_format(Format f, Fn&& fn) {
  switch (f) {
    case Format::kQ8_0: fn(std::integral_constant<Format, Format::kQ8_0>{}); break;
    case Format::kQ4_0: fn(std::integral_constant<Format, Format::kQ4_0>{}); break;
    case Format::kQ4_1: fn(std::integral_constant<Format, Format::kQ4_1>{}); break;
    case Format::kQ5_0: fn(std::integral_constant<Format, Format::kQ5_0>{}); break;
    case Format::kQ5_1: fn(std::integral_constant<Format, Format::kQ5_1>{}); break;
    case Format::kQ4_K: fn(std::integral_constant<Format, Format::kQ4_K>{}); break;
    case Format::kQ5_K: fn(std::integral_constant<Format, Format::kQ5_K>{}); break;
    case Format::kQ6_K: fn(std::integral_constant<Format, Format::kQ6_K>{}); break;
  }
}

#ifdef FERRY_QUANTIZED
// out = x @ W^T (+ bias) with x rounded per block to int16 (quantized_linear_vnni.cpp with
// AVX512_VNNI, quantized_linear_int16_avx2.cpp without: the same floats);
// xsum: [M, blocks] float32 block sums of x, or null for Q8_0.
void linear_int16(Format format, const float* x, int64_t x_stride, int64_t M, const uint8_t* tiles,
                  int64_t num_groups, int64_t blocks, const float* xsum, const float* bias, float* out, int64_t N);
#endif

}  // namespace ferry::quantized
