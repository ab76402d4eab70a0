// Llama decoder layers in one call, with int8 or GGUF linear layers: the kernels the model's
// Python forward calls one by one (fused_ops.cpp, int8_linear.cpp or gguf_linear.cpp,
// paged_attention.cpp), called here in the same order on the same tensors, so the numbers
// are the same bits. What it saves is what lies between them: a dozen Python calls and op
// dispatches a layer, which at batch 1 cost about as much as the layer's arithmetic.
//
//   int8_decoder_layer(hidden, residual?, positions, cos, sin, weights, kernels, k_cache,
//                      v_cache, <step>, <shape>) -> (out, residual): one layer
//   gguf_decoder_layers(hidden, positions, cos, sin, norms, weights, ggml_types, parts,
//                       qkv_biases, k_caches, v_caches, <step>, <shape>) -> (out, residual):
//                       every layer of the model (their argument lists are read once a
//                       step instead of once a layer)
//
// <step>: slot_mapping, block_tables, query_start_loc, context_lens, work_items, merges
// (paged_attention's arguments besides the caches); <shape>: num_heads, num_kv_heads,
// head_dim, eps, scale, window. int8 weights: the input and post-attention norms' weights,
// then for qkv, o, gate_up and down each: inv_smooth, weight_t, weight_scale, weight_sums,
// bias, panels (an empty tensor for "none"); kernels: the four layers' GEMM names,
// comma-separated. GGUF: per layer its two norms' weights, its q/k/v bias (an empty tensor
// for none), and the blocks of qkv's parts, then o's, gate_up's and down's, `parts` of them
// each (e.g. 3, 1, 2, 1), of `ggml_types`. residual: None for the first layer (then
// `hidden`, the embeddings, is the residual stream); the residual stream is updated in
// place, as the model's is. Returns the last layer's output and the residual.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "layer_kernels.h"

namespace {

// paged_attention's arguments other than the step's q, k, v.
struct PagedCache {
  at::Tensor k_cache, v_cache;
  const at::Tensor &slot_mapping, &block_tables, &query_start_loc, &context_lens, &work_items,
      &merges;
};

struct LayerShape {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t window;
};

// Which linear layer: qkv, o, gate_up, down.
using Linear = std::function<at::Tensor(int which, const at::Tensor& x)>;

// The MLP takes a prompt's rows this many at a time, so that its gate/up output and their
// product ([rows, 3 x FFN] floats: 116 MB for 512 tokens of a 7B) are never held for all
// of them at once; each row's arithmetic is the same (the products give the same bits at
// any row count).
constexpr int64_t kMlpRows = 128;

at::Tensor mlp(const Linear& linear, const at::Tensor& x) {
  const int64_t t = x.size(0);
  if (t <= kMlpRows) return linear(3, pagedllm::silu_and_mul(linear(2, x)));
  at::Tensor out;
  for (int64_t r0 = 0; r0 < t; r0 += kMlpRows) {
    const int64_t n = std::min(kMlpRows, t - r0);
    const at::Tensor part = linear(3, pagedllm::silu_and_mul(linear(2, x.narrow(0, r0, n))));
    if (!out.defined()) out = at::empty({t, part.size(1)}, part.options());
    out.narrow(0, r0, n).copy_(part);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& input_norm, const at::Tensor& post_norm, const Linear& linear,
    PagedCache cache, const LayerShape& s) {
  const int64_t t = hidden.size(0), q_size = s.num_heads * s.head_dim,
                kv_size = s.num_kv_heads * s.head_dim;
  at::Tensor residual, x;
  if (residual_in.has_value() && residual_in->defined()) {
    residual = *residual_in;
    x = pagedllm::add_rms_norm(hidden, residual, input_norm, s.eps);
  } else {
    residual = hidden;
    x = pagedllm::rms_norm(hidden, input_norm, s.eps);
  }
  const at::Tensor qkv = linear(0, x);
  pagedllm::rotary(positions, qkv, cos, sin, s.num_heads, s.num_kv_heads, s.head_dim);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, s.num_heads, s.head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, s.num_kv_heads, s.head_dim});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({t, s.num_kv_heads, s.head_dim});
  at::Tensor attn = at::empty({t, s.num_heads, s.head_dim}, hidden.options());
  pagedllm::paged_attention(attn, q, k, v, cache.slot_mapping, cache.k_cache, cache.v_cache,
                            cache.block_tables, cache.query_start_loc, cache.context_lens,
                            cache.work_items, cache.merges, s.scale, s.window);
  const at::Tensor o = linear(1, attn.view({t, q_size}));
  x = pagedllm::add_rms_norm(o, residual, post_norm, s.eps);
  return {mlp(linear, x), residual};
}

constexpr int kInt8Fields = 6;  // inv_smooth, weight_t, weight_scale, weight_sums, bias, panels

std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> int8_decoder_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList weights, const std::string& kernels, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& context_lens,
    const at::Tensor& work_items, const at::Tensor& merges, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window) {
  TORCH_CHECK(weights.size() == 2 + 4 * kInt8Fields, "expected ", 2 + 4 * kInt8Fields,
              " weight tensors, got ", weights.size());
  std::vector<std::string> gemm;
  std::stringstream names(kernels);
  for (std::string name; std::getline(names, name, ',');) gemm.push_back(name);
  TORCH_CHECK(gemm.size() == 4, "expected four comma-separated kernel names, got ", kernels);
  const Linear linear = [&](int which, const at::Tensor& x) {
    at::TensorList w = weights.slice(2 + which * kInt8Fields, kInt8Fields);
    return pagedllm::int8_linear(x, w[0], w[1], w[2], w[3], given(w[4]), given(w[5]),
                                 gemm[which]);
  };
  return llama_layer(hidden, residual, positions, cos, sin, weights[0], weights[1], linear,
                     {k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                      context_lens, work_items, merges},
                     {num_heads, num_kv_heads, head_dim, eps, scale, window});
}

// The model's decoder layers one after another, each on its GGUF blocks.
std::tuple<at::Tensor, at::Tensor> gguf_decoder_layers(
    const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
    at::IntArrayRef ggml_types, at::IntArrayRef parts, at::TensorList qkv_biases,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
    const at::Tensor& context_lens, const at::Tensor& work_items, const at::Tensor& merges,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    int64_t window) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && qkv_biases.size() == layers &&
                  norms.size() == 2 * layers && parts.size() == 4 * layers,
              "expected per layer: two norms, four part counts, a bias (empty: none) and a K "
              "and V cache; got ", norms.size(), ", ", parts.size(), ", ", qkv_biases.size(),
              ", ", k_caches.size(), ", ", v_caches.size(), " for ", layers, " layers");
  std::vector<int64_t> first{0};  // of each linear layer's parts in `weights`
  for (int64_t n : parts) first.push_back(first.back() + n);
  TORCH_CHECK(first.back() == static_cast<int64_t>(weights.size()) &&
                  weights.size() == ggml_types.size(),
              "the part counts sum to ", first.back(), "; got ", weights.size(), " weights and ",
              ggml_types.size(), " types");
  at::Tensor out = hidden;
  std::optional<at::Tensor> residual;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor& bias = qkv_biases[l];
    const Linear linear = [&](int which, const at::Tensor& x) {
      const size_t i = 4 * l + which;
      const int64_t n = parts[i];
      at::Tensor y = pagedllm::gguf_linear_parts(x, weights.slice(first[i], n),
                                                 ggml_types.slice(first[i], n), "auto", "auto");
      if (which == 0 && bias.numel() > 0) y.add_(bias);
      return y;
    };
    std::tie(out, residual) = llama_layer(
        out, residual, positions, cos, sin, norms[2 * l], norms[2 * l + 1], linear,
        {k_caches[l], v_caches[l], slot_mapping, block_tables, query_start_loc, context_lens,
         work_items, merges},
        {num_heads, num_kv_heads, head_dim, eps, scale, window});
  }
  return {out, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "int8_decoder_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor positions, Tensor cos, "
      "Tensor sin, Tensor[] weights, str kernels, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor context_lens, "
      "Tensor work_items, Tensor merges, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale, int window) -> (Tensor, Tensor)");
  m.def(
      "gguf_decoder_layers(Tensor(a!) hidden, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor[] norms, Tensor[] weights, int[] ggml_types, int[] parts, Tensor[] qkv_biases, "
      "Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, Tensor work_items, Tensor merges, "
      "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("int8_decoder_layer", &int8_decoder_layer);
  m.impl("gguf_decoder_layers", &gguf_decoder_layers);
}
