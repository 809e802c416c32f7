// The GGUF tile layout shared by quantized_linear_cpu.cpp (the product) and quantized_rows_cpu.cpp
// (the embedding lookup): one tile per 8 output rows x one 32-column block, laid out as the
// product's header comment describes (kernels/cpu/quantized.py writes it).
#pragma once

#include <torch/extension.h>

#include <string>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FERRY_QUANTIZED 1
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

}  // namespace ferry::quantized
