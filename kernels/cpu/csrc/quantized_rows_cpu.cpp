// Rows of a quantized weight as float32: the embedding lookup in a table kept in GGUF tiles (a
// tied LM head is also the embedding table; one quantized copy serves both). A decode step
// looks up one row per token, so this is a gather of a few KB, in the values gguf.quants
// dequantizes to (every format of quantized_tiles.h), each product and sum rounded to float32 on
// its own (no FMA contraction, so the floats are gguf's bit for bit).
//
//   tiles: [ceil(N / 8), units, unit bytes] uint8 (quantized_tiles.h)
//   ids:   [T] int64, each in [0, N)
//   out:   [T, K] float32

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>

#include <cstring>

#include "ferry_ops.h"
#include "quantized_tiles.h"

namespace ferry {

using quantized::Format;

namespace {

// Row `lane` of one tile group, all blocks, into out[0 .. blocks * 32), in gguf.quants' operations
// and order for each format (quantized_formats.py's `dequantize` is the same in torch).
template <Format F>
void decode_row(const uint8_t* group, int64_t blocks, int64_t lane, float* out) {
  using quantized::kRowsPerTile;
  const auto half = [&](const uint8_t* header, int64_t field) {  // fp16 field `field` of the row
    return static_cast<float>(reinterpret_cast<const c10::Half*>(header)[field * kRowsPerTile + lane]);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* header = quantized::block_header(F, group, b);
    const uint8_t* plane = quantized::block_plane(F, group, b);
    const int64_t p = quantized::block_in_unit(F, b);
    float* o = out + b * quantized::kBlock;
    if constexpr (F == Format::kQ8_0) {
      const float d = half(header, 0);
      for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(static_cast<int8_t>(plane[j * kRowsPerTile + lane])) * d;
      continue;
    }
    int q[32];  // the row's quants in this block, 0 .. 2^bits - 1
    for (int j = 0; j < 16; ++j) {
      const int byte = plane[j * kRowsPerTile + lane];
      q[j] = byte & 0xF;
      q[j + 16] = byte >> 4;
    }
    if constexpr (quantized::quant_bits(F) == 5) {
      uint32_t h;
      std::memcpy(&h, plane + 128 + 4 * lane, 4);
      for (int c = 0; c < 32; ++c) q[c] |= ((h >> c) & 1) << 4;
    }
    if constexpr (quantized::quant_bits(F) == 6) {
      for (int k = 0; k < 2; ++k) {
        uint32_t h;
        std::memcpy(&h, plane + 128 + 32 * k + 4 * lane, 4);
        for (int t = 0; t < 16; ++t) q[16 * k + t] |= ((h >> (2 * t)) & 3) << 4;
      }
    }
    if constexpr (F == Format::kQ4_0 || F == Format::kQ5_0) {
      const float d = half(header, 0);
      const int zero = F == Format::kQ4_0 ? 8 : 16;
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(q[j] - zero);
    } else if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) {
      const float d = half(header, 0), m = half(header, 1);
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(q[j]) + m;
    } else if constexpr (F == Format::kQ6_K) {
      const float d = half(header, 0);
      const auto* sc = reinterpret_cast<const int8_t*>(header + 16);
      for (int j = 0; j < 32; ++j) {
        const float scale = d * static_cast<float>(sc[(2 * p + j / 16) * kRowsPerTile + lane]);
        o[j] = scale * static_cast<float>(q[j] - 32);
      }
    } else {  // Q4_K, Q5_K: d[8] dmin[8] sc[8][8] mn[8][8]
      const float scale = half(header, 0) * static_cast<float>(header[32 + p * kRowsPerTile + lane]);
      const float offset = half(header, 1) * static_cast<float>(header[96 + p * kRowsPerTile + lane]);
      for (int j = 0; j < 32; ++j) o[j] = scale * static_cast<float>(q[j]) - offset;
    }
  }
}

}  // namespace

torch::Tensor quantized_rows(const torch::Tensor& tiles, const std::string& qtype, int64_t out_features,
                             const torch::Tensor& ids) {
  const Format format = quantized::parse_format(qtype);
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.scalar_type() == torch::kUInt8 &&
                  tiles.size(2) == quantized::unit_bytes(format),
              "tiles must be a contiguous uint8 [ceil(N/8), units, ", quantized::unit_bytes(format), "] tensor for ",
              qtype);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids must be int64 [T]");
  const torch::Tensor rows = ids.contiguous();
  const int64_t T = rows.size(0), blocks = tiles.size(1) * quantized::unit_planes(format), K = blocks * quantized::kBlock;
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
      quantized::dispatch_format(format, [&](auto f) { decode_row<decltype(f)::value>(group, blocks, lane, op + t * K); });
    }
  });
  return out;
}

}  // namespace ferry
