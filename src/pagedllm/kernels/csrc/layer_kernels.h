// The kernels of a decoder layer as C++ functions, for the ops that chain them in one call
// (decoder_layer.cpp); each is also registered as an op of its own in its source file.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <string>

namespace pagedllm {

// Those returning a tensor write it into `into` when it is defined (a contiguous float32
// tensor of the output's shape), and return it; otherwise into a new tensor.

// The output a kernel writes: `into` when defined (checked), else a new [rows, n] tensor.
inline at::Tensor output_rows(const at::Tensor& into, int64_t rows, int64_t n,
                              const at::Tensor& like) {
  if (!into.defined()) return at::empty({rows, n}, like.options());
  TORCH_CHECK(into.is_contiguous() && into.scalar_type() == at::kFloat && into.dim() == 2 &&
                  into.size(0) == rows && into.size(1) == n,
              "out must be a contiguous float32 [", rows, ", ", n, "] tensor");
  return into;
}

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const at::Tensor& into = {});
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps, const at::Tensor& into = {});
void rotary(const at::Tensor& positions, at::Tensor qkv, const at::Tensor& cos,
            const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& gate_up, const at::Tensor& into = {});

// int8_linear.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& inv_smooth, const at::Tensor& weight_t,
                       const at::Tensor& weight_scale, const at::Tensor& weight_sums,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& panels, const std::string& kernel);

// gguf_linear.cpp
at::Tensor gguf_linear_parts(const at::Tensor& x, at::TensorList weights,
                             at::IntArrayRef ggml_types, const std::string& kernel,
                             const std::string& method, const at::Tensor& into = {});

// paged_attention.cpp
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key,
                     const at::Tensor& value, const at::Tensor& slot_mapping, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     const at::Tensor& work_items, const at::Tensor& merges, double scale,
                     int64_t window);

}  // namespace pagedllm
