// The GGUF tile layout shared by quantized_linear_cpu.cpp (the product) and quantized_rows_cpu.cpp
// (the embedding lookup): one tile per 8 output rows x one 32-column block, laid out as the
// product's header comment describes (kernels/cpu/quantized.py writes it).
#pragma once

#include <torch/extension.h>

#include <string>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FERRY_QUANTIZED 1
#endif
// The integer product (quantized_linear_vnni.cpp): int16 activations on vpdpwssd.
#if defined(FERRY_QUANTIZED) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define FERRY_QUANTIZED_VNNI 1
#endif

namespace ferry::quantized {

constexpr int64_t kRowsPerTile = 8;  // output rows of a tile: one 8-float vector
constexpr int64_t kBlock = 32;       // columns per GGUF block

enum class Format { kQ8_0, kQ4_0, kQ4_1 };

// Tile bytes and where the quants start (after the fp16 header: d[8], then m[8] for Q4_1).
constexpr int64_t tile_bytes(Format f) { return f == Format::kQ8_0 ? 272 : f == Format::kQ4_0 ? 144 : 160; }
constexpr int64_t quants_offset(Format f) { return f == Format::kQ4_1 ? 32 : 16; }
constexpr bool has_offset(Format f) { return f != Format::kQ8_0; }  // uses xsum (m, or -8 d)

inline Format parse_format(const std::string& qtype) {
  if (qtype == "Q8_0") return Format::kQ8_0;
  if (qtype == "Q4_0") return Format::kQ4_0;
  if (qtype == "Q4_1") return Format::kQ4_1;
  TORCH_CHECK(false, "unsupported quantization type ", qtype, " (the native kernels run Q8_0, Q4_0, Q4_1)");
}

#ifdef FERRY_QUANTIZED_VNNI
// out = x @ W^T (+ bias) with x rounded per block to int16 (quantized_linear_vnni.cpp);
// xsum: [M, blocks] float32 block sums of x, or null for Q8_0.
void linear_int16(Format format, const float* x, int64_t x_stride, int64_t M, const uint8_t* tiles,
                  int64_t num_groups, int64_t blocks, const float* xsum, const float* bias, float* out, int64_t N);
#endif

}  // namespace ferry::quantized
