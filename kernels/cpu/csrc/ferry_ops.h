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
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias);
bool linear_quantized_supported();
bool linear_quantized_vnni();
torch::Tensor linear_quantized(const torch::Tensor& x, const torch::Tensor& tiles, const std::string& qtype,
                               int64_t out_features, const c10::optional<torch::Tensor>& bias);
torch::Tensor quantized_rows(const torch::Tensor& tiles, const std::string& qtype, int64_t out_features,
                             const torch::Tensor& ids);
double stream_sum(const torch::Tensor& buffer);
void bind_decoder_stack(pybind11::module& m);
}  // namespace ferry
