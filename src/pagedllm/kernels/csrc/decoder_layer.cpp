// A Llama decoder layer in one call, with int8 or GGUF linear layers: the kernels the model's
// Python forward calls one by one (fused_ops.cpp, int8_linear.cpp or gguf_linear.cpp,
// paged_attention.cpp), called here in the same order on the same tensors, so the numbers
// are the same bits. What it saves is what lies between them: a dozen Python calls and op
// dispatches a layer, which at batch 1 cost about as much as the layer's arithmetic.
//
//   int8_decoder_layer(hidden, residual?, positions, cos, sin, weights, kernels, <paged>,
//                      num_heads, num_kv_heads, head_dim, eps, scale, window) -> (out, residual)
//   gguf_decoder_layer(hidden, residual?, positions, cos, sin, input_norm, post_norm, weights,
//                      ggml_types, parts, qkv_bias?, <paged>, num_heads, ...) -> (out, residual)
//
// <paged>: k_cache, v_cache, slot_mapping, block_tables, query_start_loc, context_lens,
// work_items, merges (paged_attention's arguments). int8 weights: the input and
// post-attention norms' weights, then for qkv, o, gate_up and down each: inv_smooth,
// weight_t, weight_scale, weight_sums, bias, panels (an empty tensor for "none"); kernels:
// the four layers' GEMM names, comma-separated. GGUF weights: the blocks of qkv's parts,
// then o's, gate_up's and down's, `parts` of them each (e.g. 3, 1, 2, 1), of `ggml_types`.
// residual: None for the first layer (then `hidden`, the embeddings, is the residual
// stream); the residual stream is updated in place, as the model's is. Returns the layer's
// output and the residual.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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
  const at::Tensor act = pagedllm::silu_and_mul(linear(2, x));
  return {linear(3, act), residual};
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

std::tuple<at::Tensor, at::Tensor> gguf_decoder_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& input_norm, const at::Tensor& post_norm, at::TensorList weights,
    at::IntArrayRef ggml_types, at::IntArrayRef parts, const std::optional<at::Tensor>& qkv_bias,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
    const at::Tensor& context_lens, const at::Tensor& work_items, const at::Tensor& merges,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    int64_t window) {
  TORCH_CHECK(parts.size() == 4, "expected the part counts of four layers, got ", parts.size());
  std::vector<int64_t> first{0};
  for (int64_t n : parts) first.push_back(first.back() + n);
  TORCH_CHECK(first.back() == static_cast<int64_t>(weights.size()) &&
                  weights.size() == ggml_types.size(),
              "the part counts sum to ", first.back(), "; got ", weights.size(), " weights and ",
              ggml_types.size(), " types");
  const Linear linear = [&](int which, const at::Tensor& x) {
    const int64_t n = parts[which];
    at::Tensor y = pagedllm::gguf_linear_parts(x, weights.slice(first[which], n),
                                               ggml_types.slice(first[which], n), "auto");
    if (which == 0 && qkv_bias.has_value() && qkv_bias->defined()) y.add_(*qkv_bias);
    return y;
  };
  return llama_layer(hidden, residual, positions, cos, sin, input_norm, post_norm, linear,
                     {k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                      context_lens, work_items, merges},
                     {num_heads, num_kv_heads, head_dim, eps, scale, window});
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
      "gguf_decoder_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor positions, Tensor cos, "
      "Tensor sin, Tensor input_norm, Tensor post_norm, Tensor[] weights, int[] ggml_types, "
      "int[] parts, Tensor? qkv_bias, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor context_lens, "
      "Tensor work_items, Tensor merges, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("int8_decoder_layer", &int8_decoder_layer);
  m.impl("gguf_decoder_layer", &gguf_decoder_layer);
}
