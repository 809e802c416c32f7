// The Python module of Ferry's CPU kernels (built by kernels/cpu_native.py).
// Every entry releases the GIL: the worker's Redis threads keep running while a step computes.

#include <torch/extension.h>

namespace ferry {
void paged_attention_short(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           const torch::Tensor& query_start_loc, const torch::Tensor& seq_indices, double scale,
                           torch::Tensor out);
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
}  // namespace ferry

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention_short", &ferry::paged_attention_short, "paged attention for short query runs", release());
  m.def("rms_norm", &ferry::rms_norm, "RMSNorm with an in-place residual add", release());
  m.def("rotary_write_kv", &ferry::rotary_write_kv, "neox rotary in place, then K/V into the block pool", release());
  m.def("silu_and_mul", &ferry::silu_and_mul, "silu(gate) * up", release());
  m.def("linear_packed_supported", &ferry::linear_packed_supported, "whether linear_packed was built (AVX2)");
  m.def("pack_linear_weight", &ferry::pack_linear_weight, "W [N, K] into linear_packed's [ceil(N/16), K, 16] panels", release());
  m.def("linear_packed", &ferry::linear_packed, "x @ W^T (+ b) with W in packed panels", release());
}
