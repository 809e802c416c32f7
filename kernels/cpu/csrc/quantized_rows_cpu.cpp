// Rows of a quantized weight as float32: the embedding lookup in a table kept in GGUF tiles (a
// tied LM head is also the embedding table; one quantized copy serves both). A decode step
// looks up one row per token, so this is a gather of a few KB, in the values gguf.quants
// dequantizes to: w = d q (Q8_0), d (q - 8) (Q4_0), d q + m (Q4_1), each product and sum
// rounded to float32 on its own (no FMA contraction, so the floats are gguf's bit for bit).
//
//   tiles: [ceil(N / 8), K / 32, TILE] uint8 (quantized_tiles.h)
//   ids:   [T] int64, each in [0, N)
//   out:   [T, K] float32

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>

#include "ferry_ops.h"
#include "quantized_tiles.h"

namespace ferry {

using quantized::Format;

namespace {

// Row `lane` of one tile group, all blocks, into out[0 .. blocks * 32).
template <Format F>
void decode_row(const uint8_t* group, int64_t blocks, int64_t lane, float* out) {
  using quantized::kRowsPerTile;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = group + b * quantized::tile_bytes(F);
    const auto* scales = reinterpret_cast<const c10::Half*>(tile);
    const float d = static_cast<float>(scales[lane]);
    const uint8_t* quants = tile + quantized::quants_offset(F);
    float* o = out + b * quantized::kBlock;
    if constexpr (F == Format::kQ8_0) {
      for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(static_cast<int8_t>(quants[j * kRowsPerTile + lane])) * d;
    } else {
      const float m = F == Format::kQ4_1 ? static_cast<float>(scales[kRowsPerTile + lane]) : 0.f;
      for (int j = 0; j < 16; ++j) {
        const int byte = quants[j * kRowsPerTile + lane];
        if constexpr (F == Format::kQ4_1) {
          o[j] = d * static_cast<float>(byte & 0xF) + m;
          o[j + 16] = d * static_cast<float>(byte >> 4) + m;
        } else {
          o[j] = d * static_cast<float>((byte & 0xF) - 8);
          o[j + 16] = d * static_cast<float>((byte >> 4) - 8);
        }
      }
    }
  }
}

}  // namespace

torch::Tensor quantized_rows(const torch::Tensor& tiles, const std::string& qtype, int64_t out_features,
                             const torch::Tensor& ids) {
  const Format format = quantized::parse_format(qtype);
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.scalar_type() == torch::kUInt8 &&
                  tiles.size(2) == quantized::tile_bytes(format),
              "tiles must be a contiguous uint8 [ceil(N/8), K/32, ", quantized::tile_bytes(format), "] tensor for ",
              qtype);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids must be int64 [T]");
  const torch::Tensor rows = ids.contiguous();
  const int64_t T = rows.size(0), blocks = tiles.size(1), K = blocks * quantized::kBlock;
  const int64_t* id = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < out_features, "row id ", id[t], " is outside [0, ", out_features, ")");
  torch::Tensor out = torch::empty({T, K}, tiles.options().dtype(torch::kFloat32));
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t group_stride = blocks * quantized::tile_bytes(format);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* group = tp + (id[t] / quantized::kRowsPerTile) * group_stride;
      const int64_t lane = id[t] % quantized::kRowsPerTile;
      switch (format) {
        case Format::kQ8_0: decode_row<Format::kQ8_0>(group, blocks, lane, op + t * K); break;
        case Format::kQ4_0: decode_row<Format::kQ4_0>(group, blocks, lane, op + t * K); break;
        case Format::kQ4_1: decode_row<Format::kQ4_1>(group, blocks, lane, op + t * K); break;
      }
    }
  });
  return out;
}

}  // namespace ferry
