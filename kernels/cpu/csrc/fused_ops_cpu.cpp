// Fused per-layer elementwise work on the CPU: what the reference does in 6-12 small PyTorch ops
// each, in one pass. At decode batch sizes a layer's elementwise ops cost more in dispatch
// overhead (~10 us each) than in arithmetic; these cut ~25 op calls per layer to 3.
//
//   rms_norm:         out = weight * rmsnorm(x (+ residual)), residual updated in place to x + residual
//   rotary_write_kv:  neox rotary on q and k in place, then k and v scattered into the block pool
//   silu_and_mul:     out = silu(gate) * up for gate_up = [gate | up] along the last dim
//
// Statistics in float32 as transformers computes them; bfloat16 / float16 through float.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "vec_avx2.h"

namespace {

// Rows per parallel task: enough work to be worth a thread hand-off.
int64_t grain_for(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t x_stride, scalar_t* residual, int64_t res_stride, const scalar_t* weight,
                   scalar_t* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain_for(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      scalar_t* rr = residual ? residual + r * res_stride : nullptr;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        // The residual stream keeps the model's dtype (as x + residual does in the reference).
        scalar_t v = rr ? static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i])) : xr[i];
        if (rr) rr[i] = v;
        const float f = static_cast<float>(v);
        sum[i] = f;
        squares += f * f;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      scalar_t* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) *
                                     static_cast<float>(static_cast<scalar_t>(sum[i] * inv)));
    }
  });
}

template <typename scalar_t>
inline void rotate_neox(scalar_t* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
    // As the reference: cos and sin cast to x's dtype first, products in x's dtype.
    const float c = static_cast<float>(static_cast<scalar_t>(cos[i])), s = static_cast<float>(static_cast<scalar_t>(sin[i]));
    x[i] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(a * c)) - static_cast<float>(static_cast<scalar_t>(b * s)));
    x[i + half] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(b * c)) + static_cast<float>(static_cast<scalar_t>(a * s)));
  }
}

template <>
inline void rotate_neox<float>(float* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

template <typename scalar_t>
void rotary_write_kv_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& positions, const torch::Tensor& cos_sin, torch::Tensor& k_cache,
                          torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t tokens = q.size(0), num_heads = q.size(1), num_kv_heads = k.size(1), head_dim = q.size(2);
  const int64_t half = head_dim / 2, block_size = k_cache.size(2);
  scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* k_ptr = k.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v.data_ptr<scalar_t>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t table_stride = cos_sin.stride(0);
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, grain_for((num_heads + 2 * num_kv_heads) * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * table_stride;
      const float* sin = cos + half;
      for (int64_t h = 0; h < num_heads; ++h) rotate_neox(q_ptr + t * qs + h * head_dim, cos, sin, half);
      for (int64_t h = 0; h < num_kv_heads; ++h) rotate_neox(k_ptr + t * ks + h * head_dim, cos, sin, half);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding token: computed, never cached
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
        std::copy_n(k_ptr + t * ks + h * head_dim, head_dim, kc + dst);
        std::copy_n(v_ptr + t * vs + h * head_dim, head_dim, vc + dst);
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gate_up, int64_t in_stride, scalar_t* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain_for(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * in_stride;
      const scalar_t* u = g + inter;
      scalar_t* o = out + r * inter;
      int64_t i = 0;
#ifdef FERRY_AVX2
      if constexpr (std::is_same_v<scalar_t, float>) {
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= inter; i += 8) {
          const __m256 x = _mm256_loadu_ps(g + i);
          const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, ferry::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        // silu in the model's dtype, then the product (as F.silu(gate) * up).
        const scalar_t act = static_cast<scalar_t>(x / (1.f + std::exp(-x)));
        o[i] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(!t.is_cuda(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, n] with a contiguous last dim");
}

}  // namespace

namespace ferry {

// x: [rows, hidden] (rows may be strided); residual: same shape, contiguous rows, updated in place; returns out.
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                       double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  torch::Tensor out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    scalar_t* res = nullptr;
    int64_t res_stride = 0;
    if (residual.has_value()) {
      check_rows(*residual, "residual");
      TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual must match x");
      res = residual->data_ptr<scalar_t>();
      res_stride = residual->stride(0);
    }
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), res, res_stride, weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// q: [T, H, D], k, v: [T, Hkv, D] (rows may be strided, heads contiguous); q and k rotated in place.
void rotary_write_kv(torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const torch::Tensor& positions,
                     const torch::Tensor& cos_sin, torch::Tensor k_cache, torch::Tensor v_cache,
                     const torch::Tensor& slot_mapping) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2), "q, k, v: heads contiguous in a row");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "q, k, v shapes disagree");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(2),
              "caches must be contiguous [blocks, kv heads, block size, head dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  k_cache.scalar_type() == k.scalar_type(),
              "q, k, v and the caches must share one dtype");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.stride(1) == 1 && cos_sin.size(1) == q.size(2),
              "cos_sin must be float32 [positions, head dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64 &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == q.size(0) &&
                  slot_mapping.numel() == q.size(0),
              "positions and slot_mapping: contiguous int64, one per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_write_kv", [&] {
    rotary_write_kv_rows<scalar_t>(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping);
  });
}

// gate_up: [rows, 2 * inter] (rows may be strided) -> [rows, inter]
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's last dim must be even");
  const int64_t inter = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.data_ptr<scalar_t>(),
                                gate_up.size(0), inter);
  });
  return out;
}

}  // namespace ferry
