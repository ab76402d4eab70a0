// The int8 linear layer (W8A8) on the CPU: y = dequant(quant(x * inv_smooth) @ Wq^T) + b.
//
// Each row of the input (a token) is scaled by the layer's smoothing factors (SmoothQuant:
// activation outliers moved into the weights) and quantized to int8 with a scale of its
// own (per token, symmetric); the weights are int8 with one scale per output channel. The
// int8 product accumulates in int32, exactly, so how it is computed cannot change the
// result: for a few rows (decode) a matrix-vector loop that streams each weight row once
// across torch's threads (AVX-512 VNNI where the CPU has it, else AVX2); for more rows the
// GEMM the caller names (kernels/int8_choice.py measures which is fastest on this CPU):
// our AVX2 kernels over prepacked panels (int8_gemm.h), or torch's `_int_mm`, fast only
// with VNNI. One pass rescales to fp32 and adds the bias.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "int8_gemm.h"
#include "row_dispatch.h"
#include "vec.h"
#include "layer_kernels.h"

namespace {

inline float hmax_abs(const float* x, const float* smooth, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(smooth + i));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
  }
  float out = pagedllm::hmax(m);
  for (; i < k; ++i) out = std::max(out, std::fabs(x[i] * smooth[i]));
  return out;
}

// q[i] = round-half-even(x[i] * smooth[i] * inv_scale), as torch.round does.
inline void quantize_row(const float* x, const float* smooth, float inv_scale, int8_t* q,
                         int64_t k) {
  const __m256 s = _mm256_set1_ps(inv_scale);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(smooth + i)), s);
    __m256i n = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    alignas(32) int32_t tmp[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), n);
    for (int j = 0; j < 8; ++j) q[i + j] = static_cast<int8_t>(tmp[j]);
  }
  for (; i < k; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * smooth[i] * inv_scale));
}

// acc[r, j] = sum_i xq[r, i] * w[j, i] for rows [0, M), features [begin, end), J at a
// time. AVX2 multiplies unsigned by signed bytes: |x| times w carrying x's sign, whose
// 16-bit pair sums stay in range (2 * 127 * 127 < 32768); |x| is computed once per chunk
// and used for J weight rows.
template <int M, int J>
void gemv_rows(const int8_t* xp, const int8_t* wp, int32_t* ap, int64_t k, int64_t n,
               int64_t begin, int64_t end) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t k32 = k / 32 * 32;
  int64_t j = begin;
  for (; j + J <= end; j += J) {
    __m256i acc[M][J];
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < J; ++c) acc[r][c] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k32; i += 32) {
      __m256i xs[M], xa[M];
      for (int r = 0; r < M; ++r) {
        xs[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * k + i));
        xa[r] = _mm256_sign_epi8(xs[r], xs[r]);
      }
      for (int c = 0; c < J; ++c) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (j + c) * k + i));
        for (int r = 0; r < M; ++r) {
          const __m256i prod = _mm256_maddubs_epi16(xa[r], _mm256_sign_epi8(wv, xs[r]));
          acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(prod, ones));
        }
      }
    }
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < J; ++c) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][c]);
        int32_t total = 0;
        for (int32_t v : lanes) total += v;
        const int8_t* w = wp + (j + c) * k;
        for (int64_t t = k32; t < k; ++t) total += static_cast<int32_t>(xp[r * k + t]) * w[t];
        ap[r * n + j + c] = total;
      }
  }
  if (j < end) gemv_rows<M, 1>(xp, wp, ap, k, n, j, end);
}

// The same products with AVX-512 VNNI, where the CPU has it: 64 byte pairs per
// instruction. VNNI multiplies unsigned by signed bytes into int32 without saturation, so
// x is shifted into [1, 255] and the shift taken back out with the weight rows' sums:
// sum (x + 128) * w = sum x * w + 128 * sum w. Rows r, features [begin, end).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void gemv_rows_vnni(
    const uint8_t* xu, const int8_t* wp, const int32_t* wsum, int32_t* ap, int64_t m, int64_t k,
    int64_t n, int64_t begin, int64_t end) {
  const int64_t k64 = k / 64 * 64;
  for (int64_t j = begin; j < end; ++j) {
    const int8_t* w = wp + j * k;
    for (int64_t r = 0; r < m; ++r) {
      const uint8_t* x = xu + r * k;
      __m512i acc = _mm512_setzero_si512();
      for (int64_t i = 0; i < k64; i += 64)
        acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(x + i), _mm512_loadu_si512(w + i));
      int32_t total = _mm512_reduce_add_epi32(acc);
      for (int64_t t = k64; t < k; ++t) total += static_cast<int32_t>(x[t]) * w[t];
      ap[r * n + j] = total - 128 * wsum[j];
    }
  }
}

}  // namespace

namespace pagedllm {

// The int32 products of a few quantized rows with the [out, in] int8 weights, which
// `weight_t` ([in, out]) is a view of; `weight_sums` [out] are the rows' sums.
at::Tensor int8_gemv(const at::Tensor& xq, const at::Tensor& weight_t,
                     const at::Tensor& weight_sums, bool vnni) {
  const int64_t m = xq.size(0), k = xq.size(1), n = weight_t.size(1);
  TORCH_CHECK(weight_t.stride(0) == 1 && weight_t.stride(1) == k, "weights must be [out, in] rows");
  TORCH_CHECK(!vnni || cpu_has_vnni(), "this CPU has no AVX-512 VNNI");
  auto acc = at::empty({m, n}, xq.options().dtype(at::kInt));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = weight_t.data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  if (vnni) {
    std::vector<uint8_t> shifted(static_cast<size_t>(m * k));
    for (int64_t i = 0; i < m * k; ++i) shifted[i] = static_cast<uint8_t>(xp[i] + 128);
    const int32_t* wsum = weight_sums.data_ptr<int32_t>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      gemv_rows_vnni(shifted.data(), wp, wsum, ap, m, k, n, begin, end);
    });
    return acc;
  }
  pagedllm::gemv_dispatch(m, n, [&](auto rows, auto at_once, int64_t begin, int64_t end) {
    gemv_rows<decltype(rows)::value, decltype(at_once)::value>(xp, wp, ap, k, n, begin, end);
  });
  return acc;
}

// The int32 product xq @ weight_t by the named kernel: "gemv avx2", "gemv vnni" (up to
// kGemvMaxRows rows), "gemm avx2", "gemm avx2_int16" (with `panels` packed for it),
// "_int_mm"; "auto": the gemv of this CPU for few rows, else "_int_mm" with VNNI and our
// AVX2 GEMM without (never `_int_mm` there: a plain loop).
at::Tensor int8_matmul(const at::Tensor& xq, const at::Tensor& weight_t,
                       const at::Tensor& weight_sums, const std::optional<at::Tensor>& panels,
                       const std::string& kernel) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(),
              "xq must be a contiguous int8 [rows, in] tensor");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.numel() == weight_t.size(1),
              "weight_sums must be int32 [out]");
  const int64_t m = xq.size(0), n = weight_t.size(1);
  std::string name = kernel;
  if (name == "auto") {
    if (m <= pagedllm::kGemvMaxRows)
      name = has_vnni() ? "gemv vnni" : "gemv avx2";
    else if (has_vnni())
      name = "_int_mm";
    else
      name = panels.has_value() && panels->scalar_type() == at::kShort ? "gemm avx2_int16"
                                                                        : "gemm avx2";
  }
  if (name == "gemv avx2" || name == "gemv vnni") {
    TORCH_CHECK(m <= pagedllm::kGemvMaxRows, "a gemv kernel takes at most ",
                pagedllm::kGemvMaxRows, " rows");
    return int8_gemv(xq, weight_t, weight_sums, name == "gemv vnni");
  }
  if (name == "_int_mm") return at::_int_mm(xq, weight_t);
  TORCH_CHECK(name.rfind("gemm ", 0) == 0, "unknown int8 kernel: ", kernel);
  const std::string gemm = name.substr(5);
  const at::Tensor packed = panels.has_value() && panels->defined()
                                ? *panels
                                : pagedllm::int8_pack_panels(weight_t.t(), gemm);
  auto acc = at::empty({m, n}, xq.options().dtype(at::kInt));
  pagedllm::int8_gemm_avx2(xq, packed, gemm, n, acc.data_ptr<int32_t>());
  return acc;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& inv_smooth, const at::Tensor& weight_t,
                       const at::Tensor& weight_scale, const at::Tensor& weight_sums,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& panels, const std::string& kernel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(weight_t.scalar_type() == at::kChar && weight_t.dim() == 2, "weight_t must be int8 [in, out]");
  const int64_t m = x.size(0), k = x.size(1), n = weight_t.size(1);
  TORCH_CHECK(weight_t.size(0) == k && inv_smooth.numel() == k && weight_scale.numel() == n,
              "shapes do not match");
  auto xq = at::empty({m, k}, x.options().dtype(at::kChar));
  auto row_scale = at::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = inv_smooth.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* rs = row_scale.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float amax = hmax_abs(xp + r * k, sp, k);
      const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
      rs[r] = scale;
      quantize_row(xp + r * k, sp, 1.0f / scale, qp + r * k, k);
    }
  });
  // A layer's kernel is the GEMM it was given; its rows up to kGemvMaxRows take the gemv,
  // except that the fewest rows read the AVX2 GEMM's panels where the layer has them.
  std::string chosen = kernel;
  if (m <= pagedllm::kGemvMaxRows) {
    const bool int8_panels = panels.has_value() && panels->defined() &&
                             panels->scalar_type() == at::kChar;
    chosen = m <= pagedllm::kPanelGemvMaxRows && int8_panels && !has_vnni() ? "gemm avx2" : "auto";
  }
  const at::Tensor acc = int8_matmul(xq, weight_t, weight_sums, panels, chosen);
  auto out = at::empty({m, n}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Eight columns: (acc * row scale) * weight scale (+ bias), rounded after each operation
  // as the torch path is: the empty asm keeps the compiler from fusing the last multiply
  // and the add into one fused multiply-add (GCC's intrinsics are plain vector arithmetic).
  auto rescale8 = [](const int32_t* a, __m256 s, const float* w, const float* b, float* o) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    v = _mm256_mul_ps(_mm256_mul_ps(v, s), _mm256_loadu_ps(w));
    __asm__("" : "+x"(v));
    if (b != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(b));
    _mm256_storeu_ps(o, v);
  };
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const __m256 s = _mm256_set1_ps(rs[r]);
      const int32_t* a = ap + r * n;
      float* o = op + r * n;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) rescale8(a + j, s, ws + j, bp ? bp + j : nullptr, o + j);
      if (j < n) {  // the last columns through the same instructions
        int32_t ta[8] = {};
        float tw[8] = {}, tb[8] = {}, to[8];
        const int64_t left = n - j;
        std::copy(a + j, a + n, ta);
        std::copy(ws + j, ws + n, tw);
        if (bp != nullptr) std::copy(bp + j, bp + n, tb);
        rescale8(ta, s, tw, bp ? tb : nullptr, to);
        std::copy(to, to + left, o + j);
      }
    }
  });
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "int8_linear(Tensor x, Tensor inv_smooth, Tensor weight_t, Tensor weight_scale, "
      "Tensor weight_sums, Tensor? bias, Tensor? panels=None, str kernel='auto') -> Tensor");
  m.def(
      "int8_matmul(Tensor xq, Tensor weight_t, Tensor weight_sums, Tensor? panels, "
      "str kernel) -> Tensor");
  m.def("int8_pack_panels(Tensor weight_q, str gemm) -> Tensor");
  // (the CPU has VNNI, the kernels use it: not forced off by PAGEDLLM_NO_VNNI)
  m.def("int8_has_vnni() -> (bool, bool)", [] { return std::make_tuple(pagedllm::cpu_has_vnni(), pagedllm::has_vnni()); });
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("int8_linear", &pagedllm::int8_linear);
  m.impl("int8_matmul", &pagedllm::int8_matmul);
  m.impl("int8_pack_panels", &pagedllm::int8_pack_panels);
}

