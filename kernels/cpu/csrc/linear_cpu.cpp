// y = x @ W^T (+ bias) in float32 with W packed once, at load time, into column panels.
//
// BLAS packs W into its own layout on every call (one more pass over all the weights per
// product) and, with a few dozen rows of x, reaches about half of what the FMA units can do
// here; at decode batch sizes that pass and that half are most of a step. Packing W once makes
// the product one streaming read of W: each panel of 16 output columns is
//
//   panels: [ceil(N / 16), K, 16]   panels[p, k, c] = W[16 p + c, k]  (zero past N)
//
// so that for each k the 16 weights of a panel are one contiguous 64-byte line. The micro-kernel
// keeps a 6 x 16 block of out in 12 registers and, per k, broadcasts x[r, k] for 6 rows against
// the panel's two vectors: 12 FMAs per 2 loads + 6 broadcasts, the FMA units' limit rather than
// the loads'. Panels are split across cores; x (a block of rows at a time, kept small enough to
// stay in L2 with the panel) is read by every core.
//
//   x:      [M, K] float32, rows may be strided
//   panels: as above, float32
//   bias:   [N] float32 or absent
//   out:    [M, N] float32

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ferry_ops.h"
#include "vec_avx2.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-float vectors

#ifdef FERRY_AVX2
constexpr int kRows = 6;  // rows of x per micro-kernel call: 12 accumulators + 2 weights + 1 broadcast of 16 registers

// One row's 16 accumulated columns (+ bias) into out; `cols` < 16 only in the last panel of an N
// that is not a multiple of 16.
inline void store_panel_row(__m256 lo, __m256 hi, const float* bias, float* o, int64_t cols) {
  if (cols == kPanel) {
    if (bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
    return;
  }
  alignas(32) float row[kPanel];
  _mm256_store_ps(row, lo);
  _mm256_store_ps(row + 8, hi);
  for (int64_t c = 0; c < cols; ++c) o[c] = row[c] + (bias ? bias[c] : 0.f);
}

// ROWS (<= kRows) rows of x against one panel over all of K; writes `cols` (<= 16) columns of out.
// The accumulators are named locals, not an array: GCC otherwise stores an array back to the
// stack on every k, which costs more than the FMAs.
// PREFETCH: also ask for line k of the next panel (`next`) into L2 on each k. The first pass
// over a panel otherwise waits on memory (12 FMAs per 64-byte line is faster than DRAM feeds
// two cores); requested one panel ahead, the lines arrive while this panel computes.
template <int ROWS, bool PREFETCH>
inline void micro(const float* x, int64_t x_stride, const float* panel, int64_t K, const float* bias, float* out,
                  int64_t out_stride, int64_t cols, const float* next) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float* x0 = x;
  const float* x1 = x + x_stride;
  const float* x2 = x + 2 * x_stride;
  const float* x3 = x + 3 * x_stride;
  const float* x4 = x + 4 * x_stride;
  const float* x5 = x + 5 * x_stride;
// One row of the block: broadcast x[R, k] against the panel's two vectors (named registers a<R>0, a<R>1).
#define FERRY_PANEL_ROW(R)                          \
  if constexpr (ROWS > R) {                         \
    const __m256 b = _mm256_broadcast_ss(x##R + k); \
    a##R##0 = _mm256_fmadd_ps(b, w0, a##R##0);      \
    a##R##1 = _mm256_fmadd_ps(b, w1, a##R##1);      \
  }
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    FERRY_PANEL_ROW(0) FERRY_PANEL_ROW(1) FERRY_PANEL_ROW(2) FERRY_PANEL_ROW(3) FERRY_PANEL_ROW(4) FERRY_PANEL_ROW(5)
  }
#undef FERRY_PANEL_ROW
  const __m256 acc[kRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < ROWS; ++r) store_panel_row(acc[r][0], acc[r][1], bias, out + r * out_stride, cols);
}

// Adjacent panels that vector_against_panels multiplies one row against at a time.
constexpr int kVectorPanels = 4;

// One row of x against kVectorPanels adjacent full panels (cols == 16 each). Per output column
// it is micro<1>'s sum, in the same order over k, so a row's result does not depend on the batch
// it came in (speculative verification and plain decode agree to the bit). What differs: 8
// independent FMA chains and 4 memory streams in flight instead of 2 and 1. A one-row product is
// one read of W, and with a single panel at a time each core streams well below what it can
// (a late line stalls a chain that then catches up at one k per FMA latency).
inline void vector_against_panels(const float* x, const float* panels, int64_t K, const float* bias, float* out) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  const float* p0 = panels;
  const float* p1 = p0 + K * kPanel;
  const float* p2 = p1 + K * kPanel;
  const float* p3 = p2 + K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b = _mm256_broadcast_ss(x + k);
    const int64_t at = k * kPanel;
    a00 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p0 + at), a00);
    a01 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p0 + at + 8), a01);
    a10 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p1 + at), a10);
    a11 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p1 + at + 8), a11);
    a20 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p2 + at), a20);
    a21 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p2 + at + 8), a21);
    a30 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p3 + at), a30);
    a31 = _mm256_fmadd_ps(b, _mm256_loadu_ps(p3 + at + 8), a31);
  }
  const __m256 acc[kVectorPanels][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
  for (int j = 0; j < kVectorPanels; ++j)
    store_panel_row(acc[j][0], acc[j][1], bias ? bias + j * kPanel : nullptr, out + j * kPanel, kPanel);
}

template <int ROWS>
inline void micro_maybe_prefetch(const float* x, int64_t x_stride, const float* panel, int64_t K, const float* bias,
                                 float* out, int64_t out_stride, int64_t cols, const float* next) {
  if (next)
    micro<ROWS, true>(x, x_stride, panel, K, bias, out, out_stride, cols, next);
  else
    micro<ROWS, false>(x, x_stride, panel, K, bias, out, out_stride, cols, nullptr);
}

// next: the panel this thread reads after this one (prefetched during the first row block), or null.
void rows_against_panel(const float* x, int64_t x_stride, int64_t rows, const float* panel, int64_t K,
                        const float* bias, float* out, int64_t out_stride, int64_t cols, const float* next) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows, next = nullptr)
    micro_maybe_prefetch<kRows>(x + m * x_stride, x_stride, panel, K, bias, out + m * out_stride, out_stride, cols, next);
  const float* xr = x + m * x_stride;
  float* o = out + m * out_stride;
  switch (rows - m) {
    case 5: micro_maybe_prefetch<5>(xr, x_stride, panel, K, bias, o, out_stride, cols, next); break;
    case 4: micro_maybe_prefetch<4>(xr, x_stride, panel, K, bias, o, out_stride, cols, next); break;
    case 3: micro_maybe_prefetch<3>(xr, x_stride, panel, K, bias, o, out_stride, cols, next); break;
    case 2: micro_maybe_prefetch<2>(xr, x_stride, panel, K, bias, o, out_stride, cols, next); break;
    case 1: micro_maybe_prefetch<1>(xr, x_stride, panel, K, bias, o, out_stride, cols, next); break;
    default: break;
  }
}
#endif

}  // namespace

namespace ferry {

bool linear_packed_supported() {
#ifdef FERRY_AVX2
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(!weight.is_cuda() && weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "weight must be a float32 CPU [N, K] tensor");
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), num_panels = (N + kPanel - 1) / kPanel;
  torch::Tensor panels = torch::empty({num_panels, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* panel = dst + p * K * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t n = p * kPanel + c;
        if (n < N) {
          const float* row = src + n * K;  // read W's row in order, write it down the panel's column
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + c] = row[k];
        } else {
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + c] = 0.f;
        }
      }
    }
  });
  return panels;
}

torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& out_rows) {
  TORCH_CHECK(!x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a float32 CPU [M, K] tensor with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel && panels.size(1) == x.size(1) &&
                  panels.scalar_type() == torch::kFloat32,
              "panels must be a contiguous float32 [ceil(N/16), K, 16] tensor whose K is x's");
  TORCH_CHECK(out_features > (panels.size(0) - 1) * kPanel && out_features <= panels.size(0) * kPanel,
              "out_features does not match the number of panels");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, num_panels = panels.size(0);
  const float* bias_ptr = nullptr;
  torch::Tensor bias_contiguous;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "bias must be float32 [N]");
    bias_contiguous = bias->contiguous();
    bias_ptr = bias_contiguous.data_ptr<float>();
  }
  torch::Tensor out = product_output(out_rows, x, M, N);
#ifdef FERRY_AVX2
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  if (M == 1) {  // decode at batch 1: several panels at a time (vector_against_panels)
    at::parallel_for(0, num_panels, kVectorPanels, [&](int64_t begin, int64_t end) {
      const int64_t full_end = std::min(end, N / kPanel);  // panels with 16 real columns
      int64_t p = begin;
      for (; p + kVectorPanels <= full_end; p += kVectorPanels)
        vector_against_panels(xp, wp + p * K * kPanel, K, bias_ptr ? bias_ptr + p * kPanel : nullptr, op + p * kPanel);
      for (; p < end; ++p) {
        const int64_t n = p * kPanel;
        rows_against_panel(xp, x_stride, 1, wp + p * K * kPanel, K, bias_ptr ? bias_ptr + n : nullptr, op + n, N,
                           std::min(kPanel, N - n), nullptr);
      }
    });
    return out;
  }
  // Rows of x per pass over the panels: ~192 KiB of x, which stays in L2 (512 KiB and up) with
  // the panel being read; a multiple of the micro-kernel's 6 rows.
  const int64_t block_rows = std::max<int64_t>(kRows, (192 << 10) / (K * 4) / kRows * kRows);
  for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, M - m0);
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = p * kPanel;
        const float* next = p + 1 < end ? wp + (p + 1) * K * kPanel : nullptr;
        rows_against_panel(xp + m0 * x_stride, x_stride, rows, wp + p * K * kPanel, K,
                           bias_ptr ? bias_ptr + n : nullptr, op + m0 * N + n, N, std::min(kPanel, N - n), next);
      }
    });
  }
#else
  TORCH_CHECK(false, "linear_packed needs AVX2");
#endif
  return out;
}

}  // namespace ferry
