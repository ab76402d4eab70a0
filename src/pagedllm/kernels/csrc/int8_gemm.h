// The int8 GEMM for many rows (more than PAGEDLLM_GEMV_MAX_ROWS) with AVX2 alone, so that
// the int8 linear layer never depends on torch's int8 matmul (a plain loop on a CPU
// without AVX-512 VNNI: ten times slower than fp32).
//
// Both kernels read the weights prepacked once at load into column panels: 8 output
// columns side by side, interleaved by D consecutive input channels, so that one 256-bit
// load holds D channels of 8 columns and one broadcast of D channels of an input row
// multiplies all of them: 8 int32 partial sums at once, no horizontal reductions.
//   "avx2"       : int8 panels  [n8/8][kp/4][8][4], `maddubs(|x|, sign(w, x))` then
//                  `madd(ones)` (D = 4), as the gemv kernel does.
//   "avx2_int16" : int16 panels [n8/8][kp/2][8][2], `_mm256_madd_epi16` (D = 2; fewer
//                  instructions per pair, twice the bytes: slower on a Zen 3).
// n8 = n rounded up to 8, kp = k rounded up to D; padding is zeros. The int32 sums are
// exact, so the result equals any other int8 product bit for bit.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#ifndef PAGEDLLM_PANEL_GEMV_MAX_ROWS
#error "PAGEDLLM_PANEL_GEMV_MAX_ROWS must be defined by the build (kernels/policy.py)"
#endif

namespace pagedllm {

// Up to this many rows (and without VNNI), a layer with "avx2" panels multiplies with them
// rather than with the row-major gemv (kernels/policy.py's PANEL_GEMV_MAX_ROWS).
constexpr int64_t kPanelGemvMaxRows = PAGEDLLM_PANEL_GEMV_MAX_ROWS;

// Input channels per panel row of a GEMM kernel ("avx2": 4, "avx2_int16": 2).
int64_t int8_panel_depth(const std::string& gemm);

// The panels of int8 weights [n, k] for `gemm` (layout above).
at::Tensor int8_pack_panels(const at::Tensor& weight_q, const std::string& gemm);

// out[m, n] (int32) = xq[m, k] @ W^T with W's panels for `gemm`, on torch's threads.
void int8_gemm_avx2(const at::Tensor& xq, const at::Tensor& panels, const std::string& gemm,
                    int64_t n, int32_t* out);

}  // namespace pagedllm
