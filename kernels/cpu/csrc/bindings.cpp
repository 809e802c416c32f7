// The Python module of Ferry's CPU kernels (built by kernels/cpu_native.py).
// Every entry releases the GIL: the worker's Redis threads keep running while a step computes.

#include "ferry_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention_short", &ferry::paged_attention_short, "paged attention for short query runs", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("seq_indices"), py::arg("scale"), py::arg("out"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, release());
  m.def("rms_norm", &ferry::rms_norm, "RMSNorm with an in-place residual add", release());
  m.def("rotary_write_kv", &ferry::rotary_write_kv, "neox rotary in place, then K/V into the block pool", release());
  m.def("silu_and_mul", &ferry::silu_and_mul, "silu(gate) * up", release());
  m.def("linear_packed_supported", &ferry::linear_packed_supported, "whether linear_packed was built (AVX2)");
  m.def("pack_linear_weight", &ferry::pack_linear_weight, "W [N, K] into linear_packed's [ceil(N/16), K, 16] panels", release());
  m.def("linear_packed", &ferry::linear_packed, "x @ W^T (+ b) with W in packed panels", release());
  m.def("linear_quantized_supported", &ferry::linear_quantized_supported,
        "whether linear_quantized was built (AVX2, F16C)");
  m.def("linear_quantized_vnni", &ferry::linear_quantized_vnni,
        "whether linear_quantized runs on AVX512_VNNI (vpdpwssd) rather than AVX2 (vpmaddwd): the same floats");
  m.def("linear_quantized_amx", &ferry::linear_quantized_amx,
        "whether products of several rows run on AMX's tile unit (the same floats as vpdpwssd)");
  m.def("set_linear_quantized_amx", &ferry::set_linear_quantized_amx,
        "switch the AMX path off (False) or back on; returns whether it now runs");
  m.def("linear_quantized_amx_products", &ferry::linear_quantized_amx_products,
        "how many products this process has run on AMX");
  m.def("linear_quantized", &ferry::linear_quantized, "x @ W^T (+ b) with W in GGUF blocks, regrouped into 8-row tiles",
        release());
  m.def("quantized_rows", &ferry::quantized_rows, "rows of a weight in GGUF tiles as float32 (embedding lookup)",
        release());
  m.def("stream_sum", &ferry::stream_sum, "sum of a float32 buffer read once: the memory-read floor", release());
  ferry::bind_decoder_stack(m);
}
