// The AVX2 int8 GEMM kernels of int8_gemm.h: packing, register-blocked microkernels and
// their blocking over rows and column panels on torch's threads.
//
// A microkernel computes MR rows x NP panels (8 columns each) over all of k, holding the
// MR * NP int32 accumulators in registers; the NP panels (k * 8 * NP weights, tens of KB)
// stay in L1/L2 while every row block of the input passes over them.

#include "int8_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace pagedllm {
namespace {

// Tile shapes (rows x panels of 8 columns), the fastest of 6x2, 4x3, 3x4 (int16) and 4x2,
// 2x4, 3x3 (bytes) measured on the model's shapes on a Zen 3 (int8_choice.py's shapes).
constexpr int kRows16 = 4, kPanels16 = 3, kRows8 = 4, kPanels8 = 2;
constexpr int64_t kRowBlock = 64;  // rows whose inputs stay in L2 while panels pass
// Up to kPanelGemvMaxRows rows the product reads each weight once and is bound by memory:
// tiles of those rows x kFewPanels, prefetching kPrefetchBytes ahead in every panel (a panel
// is a short stream of k * 8 bytes: the hardware prefetcher alone ramps up too late).
constexpr int kFewRows = static_cast<int>(kPanelGemvMaxRows), kFewPanels = 4;
constexpr int64_t kPrefetchBytes = 512;

bool bytes_kernel(const std::string& gemm) {
  TORCH_CHECK(gemm == "avx2" || gemm == "avx2_int16", "unknown int8 GEMM kernel: ", gemm);
  return gemm == "avx2";
}

inline int32_t load_pair(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Writes the 8 sums of `acc` to out[0, valid) (valid < 8 on the last panel).
inline void store8(int32_t* out, __m256i acc, int64_t valid) {
  if (valid >= 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), acc);
    return;
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  for (int64_t c = 0; c < valid; ++c) out[c] = lanes[c];
}

// The tile loop of both kernels: MR rows x NP panels of int32 sums over kp input channels,
// D at a time. `row(r, i)` broadcasts row r's channels [i, i + D) (once per row, for all
// panels); `madd(row, panel)` their 8 columns' partial sums with a panel's load.
template <int MR, int NP, int D, bool Prefetch, typename W, typename Row, typename Madd>
void tile(const W* w, int64_t pstride, int64_t kp, int32_t* out, int64_t ldo, int64_t cols,
          Row&& row, Madd&& madd) {
  __m256i acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm256_setzero_si256();
  for (int64_t i = 0; i < kp; i += D) {
    __m256i wv[NP];
    for (int p = 0; p < NP; ++p) {
      const W* at = w + p * pstride + i * 8;
      if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T0);
      wv[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    }
    for (int r = 0; r < MR; ++r) {
      const auto x = row(r, i);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm256_add_epi32(acc[r][p], madd(x, wv[p]));
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) store8(out + r * ldo + p * 8, acc[r][p], cols - p * 8);
}

// "avx2_int16": x16 int16 [MR][ldx], panels int16 with `pstride` elements between panels.
template <int MR, int NP>
void madd16_tile(const int16_t* x, int64_t ldx, const int16_t* w, int64_t pstride, int64_t kp,
                 int32_t* out, int64_t ldo, int64_t cols) {
  tile<MR, NP, 2, false>(
      w, pstride, kp, out, ldo, cols,
      [&](int r, int64_t i) { return _mm256_set1_epi32(load_pair(x + r * ldx + i)); },
      [](__m256i xb, __m256i wv) { return _mm256_madd_epi16(xb, wv); });
}

// "avx2": x and |x| int8 [MR][ldx]; |x| * (w with x's sign), pairs summed to
// int16 (2 * 127 * 127 < 32768: no saturation), then to int32 by madd with ones.
template <int MR, int NP, bool Prefetch>
void maddubs_tile(const int8_t* x, const uint8_t* xa, int64_t ldx, const int8_t* w,
                  int64_t pstride, int64_t kp, int32_t* out, int64_t ldo, int64_t cols) {
  const __m256i ones = _mm256_set1_epi16(1);
  struct Row {
    __m256i sign, abs;
  };
  tile<MR, NP, 4, Prefetch>(
      w, pstride, kp, out, ldo, cols,
      [&](int r, int64_t i) {
        return Row{_mm256_set1_epi32(load_pair(x + r * ldx + i)),
                   _mm256_set1_epi32(load_pair(xa + r * ldx + i))};
      },
      [&](const Row& xr, __m256i wv) {
        const __m256i prod = _mm256_maddubs_epi16(xr.abs, _mm256_sign_epi8(wv, xr.sign));
        return _mm256_madd_epi16(prod, ones);
      });
}

// Calls tile(integral_constant<MR>, integral_constant<NP>) with MR == mr, NP == np.
template <int MaxMR, int MaxNP, int MR = 1, int NP = 1, typename Tile>
void dispatch_tile(int mr, int np, Tile&& tile) {
  if constexpr (MR < MaxMR) {
    if (mr != MR) return dispatch_tile<MaxMR, MaxNP, MR + 1, NP>(mr, np, tile);
  }
  if constexpr (NP < MaxNP) {
    if (np != NP) return dispatch_tile<MaxMR, MaxNP, MR, NP + 1>(mr, np, tile);
  }
  tile(std::integral_constant<int, MR>{}, std::integral_constant<int, NP>{});
}

// Runs tile(mr, np, row, panel) over every MR x NP tile of [m rows, n8 / 8 panels]: groups
// of panels split across threads, each thread passing its panels over blocks of rows.
template <int kMaxRows, int kMaxPanels, typename Tile>
void for_each_tile(int64_t m, int64_t panels, Tile&& tile) {
  const int64_t groups = (panels + kMaxPanels - 1) / kMaxPanels;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * kMaxPanels;
        const int np = static_cast<int>(std::min<int64_t>(kMaxPanels, panels - p0));
        for (int64_t r = r0; r < r1; r += kMaxRows)
          tile(static_cast<int>(std::min<int64_t>(kMaxRows, r1 - r)), np, r, p0);
      }
    }
  });
}

}  // namespace

int64_t int8_panel_depth(const std::string& gemm) { return bytes_kernel(gemm) ? 4 : 2; }

at::Tensor int8_pack_panels(const at::Tensor& weight_q, const std::string& gemm) {
  TORCH_CHECK(weight_q.dim() == 2 && weight_q.scalar_type() == at::kChar,
              "weights must be int8 [out, in]");
  const at::Tensor w = weight_q.contiguous();
  const int64_t n = w.size(0), k = w.size(1), d = int8_panel_depth(gemm);
  const int64_t n8 = (n + 7) / 8, kp = (k + d - 1) / d * d;
  const auto type = d == 2 ? at::kShort : at::kChar;
  at::Tensor out = at::zeros({n8, kp / d, 8, d}, w.options().dtype(type));
  const int8_t* src = w.data_ptr<int8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t base = (j / 8) * kp * 8 + (j % 8) * d;  // panel j/8, column j%8
      for (int64_t i = 0; i < k; ++i) {
        const int64_t at = base + (i / d) * 8 * d + i % d;
        if (d == 2)
          out.data_ptr<int16_t>()[at] = src[j * k + i];
        else
          out.data_ptr<int8_t>()[at] = src[j * k + i];
      }
    }
  });
  return out;
}

void int8_gemm_avx2(const at::Tensor& xq, const at::Tensor& panels, const std::string& gemm,
                    int64_t n, int32_t* out) {
  const int64_t m = xq.size(0), k = xq.size(1), d = int8_panel_depth(gemm);
  const int64_t n8 = (n + 7) / 8, kp = (k + d - 1) / d * d, pstride = kp * 8;
  TORCH_CHECK(xq.is_contiguous() && panels.size(0) == n8 && panels.size(1) * d == kp &&
                  panels.element_size() == (d == 2 ? 2 : 1),
              "the panels do not match the layer (packed for another kernel?)");
  const int8_t* xp = xq.data_ptr<int8_t>();
  auto cols = [&](int64_t p0) { return n - p0 * 8; };
  if (d == 2) {  // inputs widened to int16 rows of kp (zero padded)
    std::vector<int16_t> x16(static_cast<size_t>(m * kp), 0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) x16[r * kp + i] = xp[r * k + i];
    const int16_t* wp = panels.data_ptr<int16_t>();
    constexpr int MR = kRows16, NP = kPanels16;
    for_each_tile<MR, NP>(m, n8, [&](int mr, int np, int64_t r, int64_t p0) {
      dispatch_tile<MR, NP>(mr, np, [&](auto MR, auto NP) {
        madd16_tile<decltype(MR)::value, decltype(NP)::value>(
            x16.data() + r * kp, kp, wp + p0 * pstride, pstride, kp, out + r * n + p0 * 8, n,
            cols(p0));
      });
    });
    return;
  }
  std::vector<int8_t> xs(static_cast<size_t>(m * kp), 0);  // rows of kp, zero padded
  std::vector<uint8_t> xa(static_cast<size_t>(m * kp), 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) {
      xs[r * kp + i] = xp[r * k + i];
      xa[r * kp + i] = static_cast<uint8_t>(std::abs(static_cast<int>(xp[r * k + i])));
    }
  const int8_t* wp = panels.data_ptr<int8_t>();
  auto run = [&](auto max_rows, auto max_panels, auto prefetch) {
    constexpr int MR = decltype(max_rows)::value, NP = decltype(max_panels)::value;
    for_each_tile<MR, NP>(m, n8, [&](int mr, int np, int64_t r, int64_t p0) {
      dispatch_tile<MR, NP>(mr, np, [&](auto MR, auto NP) {
        maddubs_tile<decltype(MR)::value, decltype(NP)::value, decltype(prefetch)::value>(
            xs.data() + r * kp, xa.data() + r * kp, kp, wp + p0 * pstride, pstride, kp,
            out + r * n + p0 * 8, n, cols(p0));
      });
    });
  };
  if (m <= kFewRows)
    run(std::integral_constant<int, kFewRows>{}, std::integral_constant<int, kFewPanels>{}, std::true_type{});
  else
    run(std::integral_constant<int, kRows8>{}, std::integral_constant<int, kPanels8>{}, std::false_type{});
}

}  // namespace pagedllm
