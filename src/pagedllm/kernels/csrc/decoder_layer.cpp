// Llama decoder layers in one call, with int8 or GGUF linear layers: the kernels the model's
// Python forward calls one by one (fused_ops.cpp, int8_linear.cpp or gguf_linear.cpp,
// paged_attention.cpp), called here in the same order on the same tensors, so the numbers
// are the same bits. What it saves is what lies between them: a dozen Python calls and op
// dispatches a layer, which at batch 1 cost about as much as the layer's arithmetic.
//
//   int8_decoder_layer(hidden, residual?, positions, cos, sin, weights, kernels, k_cache,
//                      v_cache, <step>, <shape>) -> (out, residual): one layer
//   gguf_decoder_layers(hidden, positions, cos, sin, norms, weights, ggml_types, parts,
//                       qkv_biases, k_caches, v_caches, <step>, workspace, <shape>)
//                       -> (out, residual): every layer of the model (their argument lists
//                       are read once a step instead of once a layer); `workspace`, a 1-d
//                       float32 tensor the caller keeps, holds the step's activations and is
//                       grown (resized in place) when a step needs more
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
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
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

// Which linear layer (0-3: qkv, o, gate_up, down) on x, written into `into` when the
// kernel can (a defined tensor of the output's shape), else into a new tensor: returns it.
using Linear =
    std::function<at::Tensor(int which, const at::Tensor& x, const at::Tensor& into)>;

// A layer's activations for a step's rows: views of one workspace that the caller keeps
// from step to step, or undefined tensors (each kernel then allocates its own). A 7B's
// 512-token prompt allocated and freed two dozen buffers of 2-20 MB a layer, and the heap
// they came from kept growing between prompts around the holes they left (the
// process's peak 49-81 MB higher on a 7B shape: docs/benchmarks.md).
struct Activations {
  at::Tensor x;        // [rows, hidden]: the input norm's output, then the post-attention one
  at::Tensor qkv;      // [rows, q + 2 kv]
  at::Tensor attn;     // [rows, q]
  at::Tensor o;        // [rows, hidden]
  at::Tensor gate_up;  // [MLP rows, 2 ffn]
  at::Tensor act;      // [MLP rows, ffn]
  at::Tensor out;      // [rows, hidden]: the layer's output (the next layer's input)
};

// The MLP takes a prompt's rows this many at a time, so that its gate/up output and their
// product ([rows, 3 x FFN] floats: 116 MB for 512 tokens of a 7B) are never held for all
// of them at once; each row's arithmetic is the same (the products give the same bits at
// any row count).
constexpr int64_t kMlpRows = 128;

// Rows [r0, r0 + n) of `t` when it is defined (chunks of a buffer), else undefined.
at::Tensor rows_of(const at::Tensor& t, int64_t r0, int64_t n) {
  return t.defined() ? t.narrow(0, r0, n) : t;
}

at::Tensor mlp(const Linear& linear, const at::Tensor& x, const Activations& a) {
  const int64_t t = x.size(0);
  if (t <= kMlpRows) {
    const at::Tensor gate_up = linear(2, x, rows_of(a.gate_up, 0, t));
    return linear(3, pagedllm::silu_and_mul(gate_up, rows_of(a.act, 0, t)), a.out);
  }
  at::Tensor out = a.out;
  for (int64_t r0 = 0; r0 < t; r0 += kMlpRows) {
    const int64_t n = std::min(kMlpRows, t - r0);
    const at::Tensor gate_up = linear(2, x.narrow(0, r0, n), rows_of(a.gate_up, 0, n));
    const at::Tensor act = pagedllm::silu_and_mul(gate_up, rows_of(a.act, 0, n));
    const at::Tensor part = linear(3, act, rows_of(out, r0, n));
    if (!out.defined()) out = at::empty({t, part.size(1)}, part.options());
    const at::Tensor rows = out.narrow(0, r0, n);
    if (part.data_ptr() != rows.data_ptr()) rows.copy_(part);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& input_norm, const at::Tensor& post_norm, const Linear& linear,
    PagedCache cache, const LayerShape& s, const Activations& a) {
  const int64_t t = hidden.size(0), q_size = s.num_heads * s.head_dim,
                kv_size = s.num_kv_heads * s.head_dim;
  at::Tensor residual, x;
  if (residual_in.has_value() && residual_in->defined()) {
    residual = *residual_in;
    x = pagedllm::add_rms_norm(hidden, residual, input_norm, s.eps, a.x);
  } else {
    residual = hidden;
    x = pagedllm::rms_norm(hidden, input_norm, s.eps, a.x);
  }
  const at::Tensor qkv = linear(0, x, a.qkv);
  pagedllm::rotary(positions, qkv, cos, sin, s.num_heads, s.num_kv_heads, s.head_dim);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, s.num_heads, s.head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, s.num_kv_heads, s.head_dim});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({t, s.num_kv_heads, s.head_dim});
  const at::Tensor attn = a.attn.defined()
                              ? a.attn.view({t, s.num_heads, s.head_dim})
                              : at::empty({t, s.num_heads, s.head_dim}, hidden.options());
  pagedllm::paged_attention(attn, q, k, v, cache.slot_mapping, cache.k_cache, cache.v_cache,
                            cache.block_tables, cache.query_start_loc, cache.context_lens,
                            cache.work_items, cache.merges, s.scale, s.window);
  const at::Tensor o = linear(1, attn.view({t, q_size}), a.o);
  // The input norm's output is spent (the q/k/v product has read it): its rows take this one.
  x = pagedllm::add_rms_norm(o, residual, post_norm, s.eps, a.x);
  return {mlp(linear, x, a), residual};
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
  const Linear linear = [&](int which, const at::Tensor& x, const at::Tensor&) {
    at::TensorList w = weights.slice(2 + which * kInt8Fields, kInt8Fields);
    return pagedllm::int8_linear(x, w[0], w[1], w[2], w[3], given(w[4]), given(w[5]),
                                 gemm[which]);
  };
  return llama_layer(hidden, residual, positions, cos, sin, weights[0], weights[1], linear,
                     {k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                      context_lens, work_items, merges},
                     {num_heads, num_kv_heads, head_dim, eps, scale, window}, {});
}

int64_t weight_rows(const at::Tensor& w) {  // [rows, bytes] or interleaved [rows / 16, 16, bytes]
  return w.dim() == 3 ? w.size(0) * w.size(1) : w.size(0);
}

// The activations of a step's `rows` rows, carved from `workspace` (grown when too small;
// never shrunk, so it holds the largest step's buffers from then on, as a compute buffer
// sized for the token budget would).
Activations carve(const at::Tensor& workspace, int64_t rows, int64_t hidden, int64_t qkv,
                  int64_t q, int64_t ffn) {
  const int64_t mlp_rows = std::min(rows, kMlpRows);
  const std::pair<int64_t, int64_t> shapes[] = {{rows, hidden},       {rows, qkv},
                                                {rows, q},            {rows, hidden},
                                                {mlp_rows, 2 * ffn}, {mlp_rows, ffn},
                                                {rows, hidden}};
  // Each buffer starts on a cache line (16 floats).
  const auto padded = [](int64_t n) { return (n + 15) / 16 * 16; };
  int64_t need = 0;
  for (const auto& [r, c] : shapes) need += padded(r * c);
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.dim() == 1,
              "the workspace must be a 1-d float32 tensor");
  if (workspace.numel() < need) workspace.resize_({need});
  std::vector<at::Tensor> views;
  int64_t offset = 0;
  for (const auto& [r, c] : shapes) {
    views.push_back(workspace.narrow(0, offset, r * c).view({r, c}));
    offset += padded(r * c);
  }
  return {views[0], views[1], views[2], views[3], views[4], views[5], views[6]};
}

// The model's decoder layers one after another, each on its GGUF blocks.
std::tuple<at::Tensor, at::Tensor> gguf_decoder_layers(
    const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
    at::IntArrayRef ggml_types, at::IntArrayRef parts, at::TensorList qkv_biases,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
    const at::Tensor& context_lens, const at::Tensor& work_items, const at::Tensor& merges,
    const at::Tensor& workspace, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, double scale, int64_t window) {
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
  const int64_t rows = hidden.size(0), q = num_heads * head_dim;
  int64_t qkv = 0, gate_up = 0;
  for (int64_t j = 0; j < parts[0]; ++j) qkv += weight_rows(weights[j]);
  for (int64_t j = first[2]; j < first[3]; ++j) gate_up += weight_rows(weights[j]);
  Activations a = carve(workspace, rows, hidden.size(1), qkv, q, gate_up / 2);
  at::Tensor out = hidden;
  std::optional<at::Tensor> residual;
  for (size_t l = 0; l < layers; ++l) {
    // The last layer's output leaves the call: a tensor of its own, not the workspace's.
    if (l + 1 == layers) a.out = at::empty_like(a.out);
    const at::Tensor& bias = qkv_biases[l];
    const Linear linear = [&](int which, const at::Tensor& x, const at::Tensor& into) {
      const size_t i = 4 * l + which;
      const int64_t n = parts[i];
      at::Tensor y = pagedllm::gguf_linear_parts(
          x, weights.slice(first[i], n), ggml_types.slice(first[i], n), "auto", "auto", into);
      if (which == 0 && bias.numel() > 0) y.add_(bias);
      return y;
    };
    std::tie(out, residual) = llama_layer(
        out, residual, positions, cos, sin, norms[2 * l], norms[2 * l + 1], linear,
        {k_caches[l], v_caches[l], slot_mapping, block_tables, query_start_loc, context_lens,
         work_items, merges},
        {num_heads, num_kv_heads, head_dim, eps, scale, window}, a);
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
      "Tensor(e!) workspace, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("int8_decoder_layer", &int8_decoder_layer);
  m.impl("gguf_decoder_layers", &gguf_decoder_layers);
}
