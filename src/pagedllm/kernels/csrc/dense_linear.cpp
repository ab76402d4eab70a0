// y = x @ W^T + b for a few rows of x: the matrix-vector case of a decode step.
//
// With one to a few tokens in a step, a linear layer is a matrix-vector product whose
// cost is reading the weights. torch's fp32 product does that on one thread here, at less
// than half the memory bandwidth; this splits the output features across torch's
// threads, streams each weight row once and uses it for every input row. For more rows
// the product is compute-bound and the caller uses torch's (blocked, faster) GEMM.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "row_dispatch.h"
#include "vec.h"

namespace {

// Output features [begin, end) for M rows, J features at a time.
template <int M, int J>
void gemv_rows(const float* xp, const float* wp, const float* bp, float* op, int64_t k,
               int64_t n, int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + J <= end; j += J) {
    __m256 acc[M][J];
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < J; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      __m256 xv[M];
      for (int r = 0; r < M; ++r) xv[r] = _mm256_loadu_ps(xp + r * k + i);
      for (int c = 0; c < J; ++c) {
        const __m256 wv = _mm256_loadu_ps(wp + (j + c) * k + i);
        for (int r = 0; r < M; ++r) acc[r][c] = _mm256_fmadd_ps(wv, xv[r], acc[r][c]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < J; ++c)
        op[r * n + j + c] = pagedllm::hsum(acc[r][c]) + (bp ? bp[j + c] : 0.0f);
  }
  if (j < end) gemv_rows<M, 1>(xp, wp, bp, op, k, n, j, end);  // the last few features
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be a contiguous float32 [out, in] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(m >= 1 && m <= pagedllm::kGemvMaxRows && weight.size(1) == k && k % 8 == 0,
              "dense_linear takes 1 to ", pagedllm::kGemvMaxRows,
              " rows and in_features a multiple of 8");
  auto out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  pagedllm::gemv_dispatch(m, n, [&](auto rows, auto at_once, int64_t begin, int64_t end) {
    gemv_rows<decltype(rows)::value, decltype(at_once)::value>(xp, wp, bp, op, k, n, begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("dense_linear", &dense_linear); }
