// The entry points of Ferry's CPU kernels, for the Python bindings and for native callers
// (the decoder stack), one declaration each. Layouts are documented beside each definition.

#pragma once

#include <torch/extension.h>

#include <string>

namespace ferry {
// window: sliding-window size, 0 = none; softcap: logit soft-capping, 0 = none.
void paged_attention_short(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           const torch::Tensor& query_start_loc, const torch::Tensor& seq_indices, double scale,
                           torch::Tensor out, int64_t window = 0, double softcap = 0.0);
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                       double eps);
void rotary_write_kv(torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const torch::Tensor& positions,
                     const torch::Tensor& cos_sin, torch::Tensor k_cache, torch::Tensor v_cache,
                     const torch::Tensor& slot_mapping);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
bool linear_packed_supported();
torch::Tensor pack_linear_weight(const torch::Tensor& weight);
// The products write into `out` where given (a contiguous float32 [M, N]: a row range of a larger
// buffer, so a mixture-of-experts layer's experts fill one buffer with no copies), else a new tensor.
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias,
                            const c10::optional<torch::Tensor>& out = c10::nullopt);
bool linear_quantized_supported();
bool linear_quantized_vnni();
// Whether products of several rows run on AMX (a build for a CPU with AMX-INT8, and Linux granted
// the tile state); set_...: switch it off or back on (tests compare both paths), returns the new state.
bool linear_quantized_amx();
bool set_linear_quantized_amx(bool enabled);
int64_t linear_quantized_amx_products();  // products run on AMX so far in this process
torch::Tensor linear_quantized(const torch::Tensor& x, const torch::Tensor& tiles, const std::string& qtype,
                               int64_t out_features, const c10::optional<torch::Tensor>& bias,
                               const c10::optional<torch::Tensor>& out = c10::nullopt);
// `out` checked for a product of M rows and N columns, or a new [M, N] tensor like x.
inline torch::Tensor product_output(const c10::optional<torch::Tensor>& out, const torch::Tensor& x, int64_t M,
                                    int64_t N) {
  if (!out.has_value()) return torch::empty({M, N}, x.options());
  TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == torch::kFloat32 && out->dim() == 2 &&
                  out->size(0) == M && out->size(1) == N && out->is_contiguous(),
              "out must be a contiguous float32 CPU [", M, ", ", N, "] tensor");
  return *out;
}
torch::Tensor quantized_rows(const torch::Tensor& tiles, const std::string& qtype, int64_t out_features,
                             const torch::Tensor& ids);
double stream_sum(const torch::Tensor& buffer);
void bind_decoder_stack(pybind11::module& m);
}  // namespace ferry
