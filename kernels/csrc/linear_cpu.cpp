// y = x @ W^T (+ bias) for a few rows of x: the decode-time matrix products on the CPU.
//
// With one to a few dozen rows, every weight is used only that many times after it is read
// from memory, so the product is bound by how fast W streams in. The BLAS path packs W into its
// own layout first (another full pass over W) and stays single-threaded for one row; this
// kernel reads W once, in place, on every core: each task takes 4 rows of W (contiguous, so
// the hardware prefetcher follows them), keeps them in L1 while every row of x passes over
// them, and holds the partial dot products in registers.
//
//   x:      [M, K] float32, rows may be strided, K % 8 == 0
//   weight: [N, K] float32, contiguous (nn.Linear's layout)
//   bias:   [N] float32 or absent
//   out:    [M, N] float32

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec_avx2.h"

namespace {

#ifdef FERRY_AVX2
constexpr int kWeightRows = 4;  // rows of W per tile: 4 streams, 4 accumulators per row of x

// ROWS rows of x against W_ROWS (<= kWeightRows) rows of W: ROWS * W_ROWS accumulators.
template <int ROWS, int W_ROWS>
inline void tile(const float* x, int64_t x_stride, const float* w, int64_t K, float* out, int64_t out_stride) {
  __m256 acc[ROWS][W_ROWS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < W_ROWS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[W_ROWS];
    for (int c = 0; c < W_ROWS; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
      for (int c = 0; c < W_ROWS; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < W_ROWS; ++c) out[r * out_stride + c] = ferry::hsum8(acc[r][c]);
}

template <int W_ROWS>
inline void all_rows(const float* x, int64_t x_stride, int64_t M, const float* w, int64_t K, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<2, W_ROWS>(x + m * x_stride, x_stride, w, K, out + m * N, N);
  if (m < M) tile<1, W_ROWS>(x + m * x_stride, x_stride, w, K, out + m * N, N);
}
#endif

}  // namespace

namespace ferry {

bool linear_few_rows_supported() {
#ifdef FERRY_AVX2
  return true;
#else
  return false;
#endif
}

torch::Tensor linear_few_rows(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!x.is_cuda() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU [M, K] tensor, contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1), "weight must be contiguous [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.size(1) % 8 == 0, "K must be a multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor out = torch::empty({M, N}, x.options());
#ifdef FERRY_AVX2
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t tiles = (N + kWeightRows - 1) / kWeightRows;
  // ~64 KiB of W per task: small enough to balance two cores, large enough to amortise the hand-off.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kWeightRows * K * 4));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kWeightRows;
      const float* w = wp + n * K;
      float* o = op + n;
      switch (std::min<int64_t>(kWeightRows, N - n)) {
        case 4: all_rows<4>(xp, x_stride, M, w, K, o, N); break;
        case 3: all_rows<3>(xp, x_stride, M, w, K, o, N); break;
        case 2: all_rows<2>(xp, x_stride, M, w, K, o, N); break;
        default: all_rows<1>(xp, x_stride, M, w, K, o, N); break;
      }
    }
  });
  if (bias.has_value()) out.add_(*bias);
#else
  TORCH_CHECK(false, "linear_few_rows needs AVX2");
#endif
  return out;
}

}  // namespace ferry
