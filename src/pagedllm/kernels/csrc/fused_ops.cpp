// The element-wise work of a decoder layer, fused: one pass (and one op dispatch) each
// where eager torch takes several. At batch 1 a layer's matrix products are short, and
// the dozens of small ops around them cost as much: fusing them is most of a lean step.
//
//   rms_norm(x, w, eps)                 x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, residual, w, eps)   residual += x (in place), then rms_norm(residual)
//   rotary(positions, qkv, cos, sin, heads, kv_heads, head_dim)
//                                       rotate the q and k parts of the fused projection in
//                                       place (rotate-half layout, as Llama's)
//   silu_and_mul(gate_up)               silu(gate) * up, the halves of the fused projection
//
// float32 only; rows are spread over torch's thread pool. From C++ (layer_kernels.h) each
// op that returns a tensor can write into a given one instead.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec.h"
#include "layer_kernels.h"

namespace {

constexpr int64_t kGrain = 8;  // rows per task: small rows are cheap, don't split finer

inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float out = pagedllm::hsum(acc);
  for (; i < n; ++i) out += x[i] * x[i];
  return out;
}

inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                            _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// out = x * rsqrt(mean(x^2) + eps) * w, one row.
inline void norm_row(const float* x, const float* w, double eps, float* out, int64_t n) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / n + static_cast<float>(eps));
  scale_row(x, w, inv, out, n);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              name, " must be a float32 [rows, n] tensor with contiguous rows");
}

}  // namespace

namespace pagedllm {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const at::Tensor& into) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor out = pagedllm::output_rows(into, rows, n, x);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x.data_ptr<float>() + r * x.stride(0), w, eps, out.data_ptr<float>() + r * n, n);
    }
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps, const at::Tensor& into) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor out = pagedllm::output_rows(into, rows, n, x);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x.data_ptr<float>() + r * x.stride(0);
      float* rr = residual.data_ptr<float>() + r * residual.stride(0);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(rr + i, _mm256_add_ps(_mm256_loadu_ps(rr + i), _mm256_loadu_ps(xr + i)));
      for (; i < n; ++i) rr[i] += xr[i];
      norm_row(rr, w, eps, out.data_ptr<float>() + r * n, n);
    }
  });
  return out;
}

void rotary(const at::Tensor& positions, at::Tensor qkv, const at::Tensor& cos,
            const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim,
              "cos and sin must be contiguous [positions, head_dim]");
  const int64_t rows = qkv.size(0), half = head_dim / 2, heads = num_heads + num_kv_heads;
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos.data_ptr<float>() + pos[r] * head_dim;
      const float* s = sin.data_ptr<float>() + pos[r] * head_dim;
      float* row = qkv.data_ptr<float>() + r * qkv.stride(0);
      for (int64_t h = 0; h < heads; ++h) {  // the q heads, then the k heads
        float* x = row + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, const at::Tensor& into) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  const at::Tensor out = pagedllm::output_rows(into, rows, n, gate_up);
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      const float* u = g + n;
      float* o = out.data_ptr<float>() + r * n;
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = pagedllm::exp8(_mm256_sub_ps(zero, gv));
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
      for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def(
      "rotary(Tensor positions, Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, "
      "int num_kv_heads, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", [](const at::Tensor& x, const at::Tensor& weight, double eps) {
    return pagedllm::rms_norm(x, weight, eps);
  });
  m.impl("add_rms_norm",
         [](const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
           return pagedllm::add_rms_norm(x, residual, weight, eps);
         });
  m.impl("rotary", &pagedllm::rotary);
  m.impl("silu_and_mul", [](const at::Tensor& gate_up) { return pagedllm::silu_and_mul(gate_up); });
}
