// The greedy token of each row of logits and its log-probability, in two passes over the
// row where torch's max + logsumexp take five (and allocate between them):
//
//   greedy_logprobs(logits [n, vocab] float32) -> (tokens [n] int64, logprobs [n] float32)
//
// tokens[i] is the first index of row i's largest logit (torch.max's choice);
// logprobs[i] = logits[i, tokens[i]] - logsumexp(logits[i]) = -log(sum_j exp(x_j - max)).
// A row that holds a NaN gives the first NaN's index, as torch.max does.
// A NaN or infinite maximum gives a NaN log-probability, as torch's max - logsumexp does.
// Rows are spread over torch's thread pool; a lone row is cut into parts for every thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

struct Best {
  float value;
  int64_t index;
};

// The first index of the largest value of x[begin, end) (of the first NaN, if any).
Best first_max(const float* x, int64_t begin, int64_t end) {
  int64_t i = begin;
  // Vector pass for the largest value; the scalar scan below finds its first index.
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  for (; i + 8 <= end; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float top = pagedllm::hmax(m);
  for (; i < end; ++i) top = std::isnan(x[i]) || x[i] > top ? x[i] : top;
  const bool any_nan = std::isnan(top) || _mm256_movemask_ps(nan) != 0;
  for (int64_t j = begin; j < end; ++j) {
    if (any_nan ? std::isnan(x[j]) : x[j] == top) return Best{x[j], j};
  }
  return Best{-std::numeric_limits<float>::infinity(), begin};  // an empty range
}

// sum_j exp(x_j - top) over x[begin, end), in double between blocks of 512 (a float sum
// over the whole vocabulary would drift by up to ~1e-4 relative).
double exp_sum(const float* x, int64_t begin, int64_t end, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  double total = 0.0;
  for (int64_t b = begin; b < end; b += 512) {
    const int64_t e = std::min(end, b + 512);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = b;
    for (; i + 8 <= e; i += 8)
      acc = _mm256_add_ps(acc, pagedllm::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift)));
    float tail = 0.0f;
    for (; i < e; ++i) tail += std::exp(x[i] - top);
    total += static_cast<double>(pagedllm::hsum(acc)) + tail;
  }
  return total;
}

std::tuple<at::Tensor, at::Tensor> greedy_logprobs(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_cpu(),
              "logits must be a float32 CPU matrix [rows, vocab]");
  const at::Tensor x = logits.contiguous();
  const int64_t n = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "logits need at least one column");
  at::Tensor tokens = at::empty({n}, x.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({n}, x.options());
  if (n == 0) return {tokens, logprobs};
  const float* data = x.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  // Each row cut into `parts` ranges (one per thread when rows are fewer than threads),
  // reduced after each pass: the largest logit, then the sum of exponentials.
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads() / n);
  const int64_t span = (vocab + parts - 1) / parts;
  auto range = [&](int64_t p) { return std::make_pair(p * span, std::min(vocab, (p + 1) * span)); };
  std::vector<Best> bests(n * parts);
  at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [b, e] = range(t % parts);
      bests[t] = first_max(data + (t / parts) * vocab, b, std::max(b, e));
    }
  });
  for (int64_t r = 0; r < n; ++r) {  // the first part's maximum wins ties: the first index
    Best& best = bests[r * parts];
    for (int64_t p = 1; p < parts; ++p) {
      const Best& c = bests[r * parts + p];
      if (!std::isnan(best.value) && (std::isnan(c.value) || c.value > best.value)) best = c;
    }
  }
  std::vector<double> sums(n * parts);
  at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [b, e] = range(t % parts);
      const float top = bests[(t / parts) * parts].value;
      sums[t] = std::isfinite(top) ? exp_sum(data + (t / parts) * vocab, b, e, top) : 0.0;
    }
  });
  for (int64_t r = 0; r < n; ++r) {
    const Best& best = bests[r * parts];
    double total = 0.0;
    for (int64_t p = 0; p < parts; ++p) total += sums[r * parts + p];
    tok[r] = best.index;
    // torch's max - logsumexp is NaN for a NaN, an infinite or an all -inf row
    lp[r] = std::isfinite(best.value) ? static_cast<float>(-std::log(total)) : NAN;
  }
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("greedy_logprobs(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("greedy_logprobs", &greedy_logprobs); }
