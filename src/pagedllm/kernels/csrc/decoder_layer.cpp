// A Llama decoder layer with int8 linear layers, in one call: the kernels the model's
// Python forward calls one by one (fused_ops.cpp, int8_linear.cpp, paged_attention.cpp),
// called here in the same order on the same tensors, so the numbers are the same bits.
// What it saves is what lies between them: a dozen Python calls and op dispatches a layer,
// which at batch 1 cost about as much as the layer's arithmetic.
//
//   int8_decoder_layer(hidden, residual?, positions, cos, sin, weights, kernels,
//                      k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
//                      context_lens, work_items, merges, num_heads, num_kv_heads, head_dim,
//                      eps, scale, window) -> (out, residual)
//
// weights: the input and post-attention norms' weights, then for qkv, o, gate_up and down
// each: inv_smooth, weight_t, weight_scale, weight_sums, bias, panels (an empty tensor for
// "none"); kernels: the four layers' GEMM names, comma-separated. residual: None for the
// first layer (then `hidden`, the embeddings, is the residual stream); the residual stream
// is updated in place, as the model's is. Returns the layer's output and the residual.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "layer_kernels.h"

namespace {

constexpr int kLinearFields = 6;  // inv_smooth, weight_t, weight_scale, weight_sums, bias, panels

std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

at::Tensor linear(const at::Tensor& x, at::TensorList w, const std::string& kernel) {
  return pagedllm::int8_linear(x, w[0], w[1], w[2], w[3], given(w[4]), given(w[5]), kernel);
}

std::tuple<at::Tensor, at::Tensor> int8_decoder_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList weights, const std::string& kernels, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& context_lens,
    const at::Tensor& work_items, const at::Tensor& merges, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window) {
  TORCH_CHECK(weights.size() == 2 + 4 * kLinearFields, "expected ", 2 + 4 * kLinearFields,
              " weight tensors, got ", weights.size());
  std::vector<std::string> gemm;
  std::stringstream names(kernels);
  for (std::string name; std::getline(names, name, ',');) gemm.push_back(name);
  TORCH_CHECK(gemm.size() == 4, "expected four comma-separated kernel names, got ", kernels);
  auto params = [&](int i) { return weights.slice(2 + i * kLinearFields, kLinearFields); };
  const int64_t t = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;

  at::Tensor residual, x;
  if (residual_in.has_value() && residual_in->defined()) {
    residual = *residual_in;
    x = pagedllm::add_rms_norm(hidden, residual, weights[0], eps);
  } else {
    residual = hidden;
    x = pagedllm::rms_norm(hidden, weights[0], eps);
  }
  const at::Tensor qkv = linear(x, params(0), gemm[0]);
  pagedllm::rotary(positions, qkv, cos, sin, num_heads, num_kv_heads, head_dim);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
  at::Tensor attn = at::empty({t, num_heads, head_dim}, hidden.options());
  pagedllm::paged_attention(attn, q, k, v, slot_mapping, k_cache, v_cache, block_tables,
                            query_start_loc, context_lens, work_items, merges, scale, window);
  const at::Tensor o = linear(attn.view({t, q_size}), params(1), gemm[1]);
  x = pagedllm::add_rms_norm(o, residual, weights[1], eps);
  const at::Tensor act = pagedllm::silu_and_mul(linear(x, params(2), gemm[2]));
  return {linear(act, params(3), gemm[3]), residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "int8_decoder_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor positions, Tensor cos, "
      "Tensor sin, Tensor[] weights, str kernels, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor context_lens, "
      "Tensor work_items, Tensor merges, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("int8_decoder_layer", &int8_decoder_layer); }
