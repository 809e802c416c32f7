// y = x @ W^T (+ bias) with W kept in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K): the entry point. It checks the arguments, sums each 32-column block of x once (the
// offsets' term), and hands the product to the integer kernel this build has:
// quantized_linear_vnni.cpp (AVX512_VNNI, vpdpwssd) or quantized_linear_int16_avx2.cpp (AVX2,
// vpmaddwd). Both round x per block to int16, widen the quants to int16 in registers and add
// exact int32 block sums into float32 in the same order, so they give the same floats.
//
// Why keep W in its blocks: a batch-1 decode step reads every weight once, so its time is the
// bytes of W over the memory bandwidth. Q4_1 is 5 bits a weight against float32's 32; the product
// only has to unpack faster than memory delivers the bytes. With many rows of x the products
// are compute-bound, and integer multiply-adds do 2-4x the work of float FMAs per instruction.
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
//   (Q6_K: h[k][i] bits 2t, 2t+1 are q(i, 16k + t) bits 4, 5). Lane i of a kernel's vector is
//   output row 8g + i (two tiles side by side in a zmm), so a plane needs no transposes.
//
//   x:     [M, K] float32, rows may be strided
//   tiles: as above
//   bias:  [N] float32 or absent
//   out:   [M, N] float32

#include <torch/extension.h>

#include <string>
#include <vector>

#include "quantized_tiles.h"
#include "ferry_ops.h"
#include "vec_avx2.h"

namespace {

using ferry::quantized::Format;
using ferry::quantized::has_offset;
using ferry::quantized::kBlock;
using ferry::quantized::kRowsPerTile;
using ferry::quantized::parse_format;
using ferry::quantized::unit_bytes;
using ferry::quantized::unit_planes;

#ifdef FERRY_QUANTIZED
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

bool linear_quantized_vnni() {
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
                               int64_t out_features, const c10::optional<torch::Tensor>& bias,
                               const c10::optional<torch::Tensor>& out_rows) {
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
  torch::Tensor out = product_output(out_rows, x, M, N);
#ifdef FERRY_QUANTIZED
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(has_offset(format) ? M * blocks : 0);  // [M, blocks]
  if (has_offset(format)) block_sums(xp, x.stride(0), M, blocks, xsum.data());
  const float* xsum_ptr = has_offset(format) ? xsum.data() : nullptr;
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t groups = tiles.size(0);
  ferry::quantized::linear_int16(format, xp, x.stride(0), M, tp, groups, blocks, xsum_ptr, bias_ptr, op, N);
#else
  TORCH_CHECK(false, "linear_quantized needs AVX2, FMA and F16C");
#endif
  return out;
}

}  // namespace ferry
