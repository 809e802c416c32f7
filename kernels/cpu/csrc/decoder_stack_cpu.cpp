// Every decoder layer of a Llama-family model in one native call, for steps whose sequences all
// have short query runs (decode, speculative verification).
//
// Why: at batch 1 a float32 step on a CPU is one streaming read of the weights (the packed
// products) plus ~270 small calls (9 per layer: norms, rotary + KV write, attention, silu * up,
// the four products). From Python each call costs a module call, the dispatch, argument
// conversion and a tensor allocation: a large share of the step. Here the same kernels run back to
// back from C++, with the layer's tensors held once instead of passed per call.
//
// The math is exactly worker/models/llama.py's DecoderLayer (same kernels, same order), so a
// step gives the same floats whichever path runs it:
//   h, residual = rms_norm(x + residual)                        [T, hidden]
//   q, k, v     = split(h @ Wqkv^T + b)                         [T, H, D], [T, Hkv, D] x 2
//   q, k        = rms_norm per head (Qwen3 only)
//   rotary(q, k); k, v -> block pool at slot_mapping
//   x           = attention(q, pool) @ Wo^T + b                 [T, hidden]
//   h, residual = rms_norm(x + residual)
//   x           = (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T + b
// and after the last layer, rms_norm(x + residual) with the final norm.
// Sliding-window layers attend over their window where the step's longest context exceeds it.
// Gemma 2/3 (GemmaDecoderLayer): attention logits soft-capped, Gemma 3's sliding layers rotated by
// their own table, and sandwich norms with GeGLU:
//   x           = rms_norm(attention output)                    (post-attention norm, no residual)
//   h, residual = rms_norm(x + residual)                        (pre-feedforward norm)
//   x           = rms_norm((gelu_tanh(h @ Wg^T) * (h @ Wu^T)) @ Wd^T)   (post-feedforward norm)
// A hybrid model's windowed layers may keep their KV in a pool of their own (worker/models/kv_split.py):
// given that pool, its slot mapping and block tables, each layer reads and writes its own pool at
// its index there; without it, layer i is place i of the one pool.

#include <string>
#include <vector>

#include "ferry_ops.h"

namespace ferry {
namespace {

// One projection: float32 panels [ceil(N / 16), K, 16] (linear_cpu.cpp, format "F32") or GGUF
// tiles [ceil(N / 8), units, unit bytes] (quantized_tiles.h; format "Q8_0", "Q4_0", ..., "Q6_K"),
// optional bias [N]; or (format "fused") parts whose outputs are concatenated, for a fused weight
// whose parts a GGUF file stores in different types (kernels/cpu/quantized.py's QuantizedParts).
struct Projection {
  torch::Tensor weight;
  std::string format;
  int64_t out_features;
  c10::optional<torch::Tensor> bias;
  std::vector<Projection> parts;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (format == "F32") return linear_packed(x, weight, out_features, bias);
    if (format != "fused") return linear_quantized(x, weight, format, out_features, bias);
    std::vector<torch::Tensor> outs;
    for (const Projection& part : parts) outs.push_back(part(x));
    torch::Tensor out = torch::cat(outs, 1);
    return bias.has_value() ? out.add_(*bias) : out;
  }
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;  // [hidden]
  c10::optional<torch::Tensor> q_norm, k_norm;     // [head_dim], Qwen3, Gemma 3
  Projection qkv, o, gate_up, down;
  // Gemma: the MLP's sandwich norms [hidden] (both or neither); with them the post-attention norm
  // normalises the attention output alone
  c10::optional<torch::Tensor> pre_feedforward_norm, post_feedforward_norm;
  bool gelu;          // GeGLU (gelu, tanh approximation) instead of SwiGLU
  double softcap;     // attention logit soft-capping, 0 = off
  int64_t window;     // sliding window in positions, 0 = full attention
  bool local_rope;    // rotated by the second rotary table (Gemma 3's sliding layers)
  bool windowed;      // a sliding-window layer: the windowed pool's, where the step passes one
  int64_t pool_index; // its place in its own kind's pool
};

// GeGLU as kernels/reference.py's gelu_tanh_and_mul (the same ATen ops, so the same floats).
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& gate_up) {
  const std::vector<torch::Tensor> halves = gate_up.split(gate_up.size(-1) / 2, -1);
  return at::gelu(halves[0], "tanh") * halves[1];
}

}  // namespace

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
               torch::Tensor final_norm)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        final_norm_(std::move(final_norm)) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, Projection qkv, Projection o, Projection gate_up,
                 Projection down, c10::optional<torch::Tensor> pre_feedforward_norm,
                 c10::optional<torch::Tensor> post_feedforward_norm, bool gelu, double softcap, int64_t window,
                 bool local_rope, bool windowed, int64_t pool_index) {
    TORCH_CHECK(qkv.out_features == (num_heads_ + 2 * num_kv_heads_) * head_dim_,
                "qkv projection width disagrees with the heads");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    TORCH_CHECK(pre_feedforward_norm.has_value() == post_feedforward_norm.has_value(),
                "the feedforward sandwich norms come together");
    TORCH_CHECK(softcap >= 0.0 && window >= 0 && pool_index >= 0, "softcap, window and pool_index must not be negative");
    for (const Projection* p : {&qkv, &o, &gate_up, &down})
      TORCH_CHECK(p->format == "F32" || linear_quantized_supported(), "no native product for format ", p->format);
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), std::move(q_norm), std::move(k_norm),
                            std::move(qkv), std::move(o), std::move(gate_up), std::move(down),
                            std::move(pre_feedforward_norm), std::move(post_feedforward_norm), gelu, softcap, window,
                            local_rope, windowed, pool_index});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: [T, hidden] float32, the embeddings (read, not written); kv_cache: [L, 2, blocks, Hkv, block, D];
  // the attention metadata as paged_attention_short takes it (seq_indices: every sequence), and the
  // longest context: a layer's window applies where it is shorter (else full attention is the same).
  // cos_sin_local: the local layers' rotary table, where some layer has local_rope. A hybrid
  // model's windowed pool: window_kv_cache [windowed layers, 2, blocks, Hkv, block, D] with its
  // slot mapping and block tables (kv_cache then holds the other layers only).
  // Returns the final-normed hidden states [T, hidden].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_sin,
                        const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        const torch::Tensor& query_start_loc, const torch::Tensor& seq_indices,
                        int64_t max_seq_len, const c10::optional<torch::Tensor>& cos_sin_local,
                        const c10::optional<torch::Tensor>& window_kv_cache,
                        const c10::optional<torch::Tensor>& window_slot_mapping,
                        const c10::optional<torch::Tensor>& window_block_tables) const {
    const bool split = window_kv_cache.has_value();
    TORCH_CHECK(!split || (window_slot_mapping.has_value() && window_block_tables.has_value()),
                "a windowed pool comes with its slot mapping and block tables");
    int64_t num_windowed = 0;
    for (const Layer& layer : layers_) {
      num_windowed += layer.windowed;
      TORCH_CHECK(!layer.local_rope || cos_sin_local.has_value(), "a local-rope layer needs cos_sin_local");
    }
    for (const torch::Tensor* pool : {&kv_cache, split ? &*window_kv_cache : &kv_cache})
      TORCH_CHECK(pool->dim() == 6 && pool->is_contiguous(),
                  "kv pools must be contiguous [layers, 2, blocks, kv heads, block size, head dim]");
    TORCH_CHECK(kv_cache.size(0) == (split ? num_layers() - num_windowed : num_layers()) &&
                    (!split || window_kv_cache->size(0) == num_windowed),
                "the kv pools' layers disagree with the stack's");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [tokens, hidden]");
    const int64_t T = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor hidden = x;
    torch::Tensor residual;  // the un-normalised stream; the first norm starts it from x itself
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& layer = layers_[i];
      torch::Tensor h = add_and_norm(hidden, residual, layer.input_norm);
      torch::Tensor qkv = layer.qkv(h);  // [T, q_size + 2 kv_size]
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads_, head_dim_});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads_, head_dim_});
      if (layer.q_norm.has_value()) {
        q = rms_norm(q.reshape({-1, head_dim_}), c10::nullopt, *layer.q_norm, eps_).view({T, num_heads_, head_dim_});
        k = rms_norm(k.reshape({-1, head_dim_}), c10::nullopt, *layer.k_norm, eps_).view({T, num_kv_heads_, head_dim_});
      }
      const bool own_pool = split && layer.windowed;  // this layer's pool, slots and tables
      const torch::Tensor& pool = own_pool ? *window_kv_cache : kv_cache;
      const torch::Tensor layer_kv = pool.select(0, split ? layer.pool_index : i);
      const torch::Tensor k_cache = layer_kv.select(0, 0), v_cache = layer_kv.select(0, 1);
      rotary_write_kv(q, k, v, positions, layer.local_rope ? *cos_sin_local : cos_sin, k_cache, v_cache,
                      own_pool ? *window_slot_mapping : slot_mapping);
      torch::Tensor attended = torch::empty({T, num_heads_, head_dim_}, x.options());
      const int64_t window = layer.window > 0 && layer.window < max_seq_len ? layer.window : 0;
      paged_attention_short(q, k_cache, v_cache, own_pool ? *window_block_tables : block_tables, seq_lens,
                            query_start_loc, seq_indices, scale_, attended, window, layer.softcap);
      hidden = layer.o(attended.view({T, q_size}));
      if (layer.pre_feedforward_norm.has_value()) {  // Gemma's sandwich
        hidden = rms_norm(hidden, c10::nullopt, layer.post_attention_norm, eps_);
        h = add_and_norm(hidden, residual, *layer.pre_feedforward_norm);
        hidden = rms_norm(layer.down(activate(layer, layer.gate_up(h))), c10::nullopt, *layer.post_feedforward_norm,
                          eps_);
        continue;
      }
      h = add_and_norm(hidden, residual, layer.post_attention_norm);
      hidden = layer.down(activate(layer, layer.gate_up(h)));
    }
    return add_and_norm(hidden, residual, final_norm_);
  }

 private:
  static torch::Tensor activate(const Layer& layer, const torch::Tensor& gate_up) {
    return layer.gelu ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
  }

  // rms_norm(x + residual) with residual updated in place; the first call adopts x as the residual
  // (as llama.py does), so x must not be written afterwards: it is a fresh tensor or the caller's
  // embeddings, which rms_norm only reads here.
  torch::Tensor add_and_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight) const {
    if (!residual.defined()) {
      residual = x.clone();  // the caller's x stays untouched
      return rms_norm(x, c10::nullopt, weight, eps_);
    }
    return rms_norm(x, residual, weight, eps_);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};

void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection", "one projection's weight (float32 panels or GGUF tiles) and bias")
      .def(py::init([](torch::Tensor weight, std::string format, int64_t out_features,
                       c10::optional<torch::Tensor> bias) {
             return Projection{std::move(weight), std::move(format), out_features, std::move(bias), {}};
           }),
           py::arg("weight"), py::arg("format"), py::arg("out_features"), py::arg("bias"))
      .def_static(
          "fused",
          [](std::vector<Projection> parts, int64_t out_features, c10::optional<torch::Tensor> bias) {
            int64_t rows = 0;
            for (const Projection& part : parts) rows += part.out_features;
            TORCH_CHECK(!parts.empty() && rows == out_features, "the parts' rows must add up to out_features");
            return Projection{torch::Tensor(), "fused", out_features, std::move(bias), std::move(parts)};
          },
          py::arg("parts"), py::arg("out_features"), py::arg("bias"));
  py::class_<DecoderStack>(m, "DecoderStack", "every decoder layer of a Llama-family model in one native call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("final_norm"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
}

}  // namespace ferry
