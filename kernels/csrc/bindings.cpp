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
bool linear_few_rows_supported();
torch::Tensor linear_few_rows(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
}  // namespace ferry

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention_short", &ferry::paged_attention_short, "paged attention for short query runs", release());
  m.def("rms_norm", &ferry::rms_norm, "RMSNorm with an in-place residual add", release());
  m.def("rotary_write_kv", &ferry::rotary_write_kv, "neox rotary in place, then K/V into the block pool", release());
  m.def("silu_and_mul", &ferry::silu_and_mul, "silu(gate) * up", release());
  m.def("linear_few_rows_supported", &ferry::linear_few_rows_supported, "whether linear_few_rows was built (AVX2)");
  m.def("linear_few_rows", &ferry::linear_few_rows, "x @ W^T (+ b) for a few rows of x, W streamed once", release());
}
