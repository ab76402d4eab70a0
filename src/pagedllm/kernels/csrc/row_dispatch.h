// The row dispatch of the matrix-vector kernels (dense_linear.cpp, int8_linear.cpp): a
// kernel templated on its row count M (1..PAGEDLLM_GEMV_MAX_ROWS) and on J, the output
// features it computes at once, run over the output features on torch's threads.
//
// PAGEDLLM_GEMV_MAX_ROWS comes from the build (kernels/cpu.py passes
// kernels/policy.py's GEMV_MAX_ROWS as -D), so the threshold is defined once, in Python.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

#ifndef PAGEDLLM_GEMV_MAX_ROWS
#error "PAGEDLLM_GEMV_MAX_ROWS must be defined by the build (kernels/policy.py)"
#endif

namespace pagedllm {

constexpr int64_t kGemvMaxRows = PAGEDLLM_GEMV_MAX_ROWS;
static_assert(kGemvMaxRows >= 1 && kGemvMaxRows <= 16, "one template per row count");

// Output features per inner step for M rows: M * J independent accumulators, enough to
// hide the multiply-add latency even for a single row.
template <int M>
constexpr int features_at_once() {
  return M == 1 ? 4 : M == 2 ? 2 : 1;
}

// Calls kernel(std::integral_constant<int, M>, std::integral_constant<int, J>, begin, end)
// for blocks [begin, end) of the n output features, in parallel, with M == m
// (m <= kGemvMaxRows; the caller checks; no rows: nothing to do).
template <int M = 1, typename Kernel>
void gemv_dispatch(int64_t m, int64_t n, Kernel&& kernel) {
  if (m < 1) return;  // no rows: nothing to compute (never a template for rows it lacks)
  if constexpr (M < kGemvMaxRows) {
    if (m != M) return gemv_dispatch<M + 1>(m, n, kernel);
  }
  constexpr int J = features_at_once<M>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    kernel(std::integral_constant<int, M>{}, std::integral_constant<int, J>{}, begin, end);
  });
}

}  // namespace pagedllm
