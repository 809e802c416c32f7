// The memory-read floor that bench/quantized_linear.py sets beside the products: the sum of a
// buffer read once as float32 vectors, split across cores the way the products split their
// weights. Eight independent accumulators keep the adds off the critical path, so the time is
// the read alone.
//
//   buffer: [n] float32, contiguous

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec_avx2.h"

namespace ferry {

double stream_sum(const torch::Tensor& buffer) {
  TORCH_CHECK(!buffer.is_cuda() && buffer.is_contiguous() && buffer.scalar_type() == torch::kFloat32,
              "buffer must be a contiguous float32 CPU tensor");
  const float* p = buffer.data_ptr<float>();
  const int64_t n = buffer.numel();
  constexpr int64_t kChunk = 16384;  // floats per task: 64 KiB
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks, 0.0);
  at::parallel_for(0, chunks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      int64_t i = lo;
      float tail = 0.f;
#ifdef FERRY_AVX2
      __m256 a[8];
      for (auto& v : a) v = _mm256_setzero_ps();
      for (; i + 64 <= hi; i += 64)
        for (int k = 0; k < 8; ++k) a[k] = _mm256_add_ps(a[k], _mm256_loadu_ps(p + i + 8 * k));
      for (int k = 1; k < 8; ++k) a[0] = _mm256_add_ps(a[0], a[k]);
      tail = hsum8(a[0]);
#endif
      for (; i < hi; ++i) tail += p[i];
      partial[c] = tail;
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

}  // namespace ferry
