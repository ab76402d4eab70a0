// A linear layer computed on GGUF weights as the file stores them: y = x @ W^T with W a
// [out, in] tensor of ggml blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; F16, BF16).
//
// As llama.cpp does: each input row is quantized once into 8-bit blocks of the kind the
// weight type multiplies with (Q8_0, Q8_1 or Q8_K; ggml's "vec_dot_type"), then every weight
// row is multiplied with every input row block by block, the int8 products summed exactly
// in integers and each block's scales applied in fp32 (ggml's kernels, ggml_x86_quants.h).
// The output features are split across torch's threads, so a decode step reads each weight
// once. F16 and BF16 weights are converted to fp32 eight at a time and multiply the fp32
// inputs directly. The kernels exist twice, for AVX2 and for AVX-512 VNNI (the same source
// under another target); "auto" takes VNNI where cpu_features.h says so.
//
// With many input rows (prompt chunks, batched decode) the weights of every block type take
// the "gemm" method (ggml_x86_gemm.h): each weight block is unpacked once for several input
// rows (Q4_0, Q4_1, Q4_K, Q6_K: 16 weight rows interleaved, 8 on AVX2), over tiles of rows that
// stay in cache while every group of input rows passes. Its outputs equal the one-row "gemv"
// method's bit for bit; "auto" picks it from each type's threshold in kernels/policy.py
// (passed by the build) on.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "ggml_blocks.h"
#include "gguf_interleaved_layout.h"
#include "layer_kernels.h"
#include "vec.h"

namespace pagedllm::gguf_avx2 {
#include "ggml_x86_quants.h"
#include "ggml_x86_gemm.h"
#include "ggml_x86_interleaved.h"
}  // namespace pagedllm::gguf_avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define PAGEDLLM_GGML_VNNI
namespace pagedllm::gguf_vnni {
#include "ggml_x86_quants.h"
#include "ggml_x86_gemm.h"
#include "ggml_x86_interleaved.h"
}  // namespace pagedllm::gguf_vnni
#undef PAGEDLLM_GGML_VNNI
#pragma GCC pop_options

namespace pagedllm {
namespace {

using QuantizeRow = void (*)(const float* x, void* blocks, int64_t k);
using BlockDot = float (*)(int n, const void* weight_row, const void* activation_row);
// out[r * out_stride + j] = weight row j . activation row r for j < count (rows row_bytes
// apart), r < rows.
using RowsPanel = void (*)(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                           const uint8_t* activations, int64_t activation_stride, int rows,
                           float* out, int64_t out_stride);

#ifndef PAGEDLLM_GGUF_GEMM_MIN_ROWS
#error "PAGEDLLM_GGUF_GEMM_MIN_ROWS must be defined by the build (kernels/policy.py)"
#endif
constexpr int64_t kGemmMinRows = PAGEDLLM_GGUF_GEMM_MIN_ROWS;
#ifndef PAGEDLLM_GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS
#error "PAGEDLLM_GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS must be defined by the build (kernels/policy.py)"
#endif
#ifndef PAGEDLLM_GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS
#error "PAGEDLLM_GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS must be defined by the build (policy.py)"
#endif
constexpr int kInPlaceMaxRows = PAGEDLLM_GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS;
struct BlockKernels {
  QuantizeRow quantize;  // nullptr: F16/BF16, the fp32 input is used as it is
  BlockDot dot;
  RowsPanel rows = nullptr;  // nullptr: no gemm method for the type
  int64_t gemm_min_rows = kGemmMinRows;  // the input rows from which "auto" takes it
  // On weights in the interleaved layout (gguf_interleaved_layout.h), at every row count;
  // nullptr: the type has none.
  RowsPanel grouped = nullptr;
};

// One GGML type: its id in GGUF files, values and bytes per block, the bytes per block of
// its quantized activations, and its kernels in each build.
struct GgufType {
  int64_t id;
  const char* name;
  int64_t block;
  int64_t bytes;
  int64_t activation_bytes;
  BlockKernels avx2, vnni;
};

template <typename T>
float dot_fp(int n, const void* weight_row, const void* activation_row) {
  const T* w = static_cast<const T*>(weight_row);
  const float* x = static_cast<const float*>(activation_row);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(load8(w + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), acc0);
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += static_cast<float>(w[i]) * x[i];
  return sum;
}

// A type's kernels in one build (namespace ns); grouped: its panel on the interleaved layout
// (nullptr: none).
#define PAGEDLLM_BUILD(ns, quantize, dot, rows, block, min_rows, grouped) \
  {ns::quantize, ns::dot, ns::Panel<ns::rows, block>::run, min_rows, grouped}
#define PAGEDLLM_GEMM_KERNELS(quantize, dot, rows, block, min_rows)           \
  PAGEDLLM_BUILD(gguf_avx2, quantize, dot, rows, block, min_rows, nullptr), \
      PAGEDLLM_BUILD(gguf_vnni, quantize, dot, rows, block, min_rows, nullptr)
#define PAGEDLLM_GROUPED_KERNELS(quantize, dot, rows, block, min_rows, kind)                   \
  PAGEDLLM_BUILD(gguf_avx2, quantize, dot, rows, block, min_rows,                           \
                 (gguf_avx2::grouped_panel<gguf_avx2::kind, kInPlaceMaxRows>)),             \
      PAGEDLLM_BUILD(gguf_vnni, quantize, dot, rows, block, min_rows,                       \
                     (gguf_vnni::grouped_panel<gguf_vnni::kind, kInPlaceMaxRows>))

const GgufType kTypes[] = {
    {1, "F16", 1, 2, 4, {nullptr, dot_fp<c10::Half>}, {nullptr, dot_fp<c10::Half>}},
    {30, "BF16", 1, 2, 4, {nullptr, dot_fp<c10::BFloat16>}, {nullptr, dot_fp<c10::BFloat16>}},
    {2, "Q4_0", 32, 18, 36,
     PAGEDLLM_GROUPED_KERNELS(quantize_row_q8_1, dot_q4_0, InterleavedQ4_0, ggml::block_q8_1,
                              PAGEDLLM_GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS, InterleavedQ4_0)},
    {3, "Q4_1", 32, 20, 36,
     PAGEDLLM_GROUPED_KERNELS(quantize_row_q8_1, dot_q4_1, InterleavedQ4_1, ggml::block_q8_1,
                              PAGEDLLM_GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS, InterleavedQ4_1)},
    {6, "Q5_0", 32, 22, 34,
     PAGEDLLM_GEMM_KERNELS(quantize_row_q8_0, vec_dot_q5_0_q8_0, RowsQ5_0, ggml::block_q8_0, kGemmMinRows)},
    {8, "Q8_0", 32, 34, 34,
     PAGEDLLM_GEMM_KERNELS(quantize_row_q8_0, vec_dot_q8_0_q8_0, RowsQ8_0, ggml::block_q8_0, kGemmMinRows)},
    {12, "Q4_K", 256, 144, 292,
     PAGEDLLM_GROUPED_KERNELS(quantize_row_q8_K, dot_q4_K, RowsQ4K, ggml::block_q8_K, kGemmMinRows,
                              InterleavedQ4K)},
    {13, "Q5_K", 256, 176, 292,
     PAGEDLLM_GEMM_KERNELS(quantize_row_q8_K, vec_dot_q5_K_q8_K, RowsQ5K, ggml::block_q8_K, kGemmMinRows)},
    {14, "Q6_K", 256, 210, 292,
     PAGEDLLM_GEMM_KERNELS(quantize_row_q8_K, dot_q6_K, RowsQ6K, ggml::block_q8_K, kGemmMinRows)},
};
#undef PAGEDLLM_BUILD
#undef PAGEDLLM_GEMM_KERNELS
#undef PAGEDLLM_GROUPED_KERNELS

const GgufType& gguf_type(int64_t id) {
  for (const GgufType& t : kTypes)
    if (t.id == id) return t;
  TORCH_CHECK_VALUE(false, "GGML type ", id, " has no kernel here (F16=1, BF16=30, Q4_0=2, ",
                    "Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
}

}  // namespace

// The build a `kernel` name runs: "avx2" or "vnni" ("auto": VNNI where cpu_features.h says).
std::string gguf_kernel(const std::string& kernel) {
  TORCH_CHECK_VALUE(kernel == "auto" || kernel == "avx2" || kernel == "vnni",
                    "kernel must be 'auto', 'avx2' or 'vnni', not '", kernel, "'");
  TORCH_CHECK_VALUE(kernel != "vnni" || cpu_has_vnni(), "this CPU has no AVX-512 VNNI");
  return kernel == "vnni" || (kernel == "auto" && has_vnni()) ? "vnni" : "avx2";
}

namespace {

enum class Method { kAuto, kGemv, kGemm };

Method checked_method(const std::string& method) {
  TORCH_CHECK_VALUE(method == "auto" || method == "gemv" || method == "gemm",
                    "method must be 'auto', 'gemv' or 'gemm', not '", method, "'");
  return method == "auto" ? Method::kAuto : method == "gemv" ? Method::kGemv : Method::kGemm;
}

// Whether `rows` input rows take a type's gemm method under `method`: "gemv" (one input row
// at a time), "gemm" (where the type has it) or "auto" (from the type's gemm_min_rows on).
bool use_gemm(const BlockKernels& kernels, Method method, int64_t rows) {
  return kernels.rows != nullptr &&
         (method == Method::kGemm || (method == Method::kAuto && rows >= kernels.gemm_min_rows));
}

const BlockKernels& kernels_for(const GgufType& type, const std::string& kernel) {
  return gguf_kernel(kernel) == "vnni" ? type.vnni : type.avx2;
}

// The checked input width: a whole number of the type's blocks.
int64_t input_width(const at::Tensor& x, const GgufType& type) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat,
                    "x must be a float32 [rows, in] tensor, not ", x.scalar_type(), " ",
                    x.sizes());
  const int64_t k = x.size(1);
  TORCH_CHECK_VALUE(k % type.block == 0, "the input width ", k, " is not a multiple of ",
                    type.name, "'s block of ", type.block, " values");
  TORCH_CHECK_VALUE(k <= INT32_MAX, "the input width ", k, " is too large");
  return k;
}

// Each row of x (contiguous fp32 [rows, k]) quantized into `row_bytes` of activation blocks.
std::vector<uint8_t> quantize_rows(const float* x, int64_t rows, int64_t k, int64_t row_bytes,
                                   QuantizeRow quantize) {
  std::vector<uint8_t> blocks(static_cast<size_t>(rows * row_bytes));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize(x + r * k, blocks.data() + r * row_bytes, k);
  });
  return blocks;
}

// One weight of a product: its rows of blocks, its kernels, and where its outputs go.
struct Part {
  const uint8_t* weight;
  int64_t rows, row_bytes;
  int64_t first_column;  // of the output
  const BlockKernels* kernels;
  const uint8_t* activations;  // x as this part's type multiplies it
  int64_t activation_row_bytes;
  bool grouped;  // in the interleaved layout: taken by kernels->grouped, 16 rows at a time
};

// Output features [lo, hi) of part p by its panel: one call, so that what a panel makes
// from the activations alone (an interleaved panel's Act) is made once per thread; the
// panels that read a weight row once per group of input rows tile the rows themselves
// (rows_panel).
void multiply_panel(const Part& p, int64_t lo, int64_t hi, int64_t rows, int64_t k,
                    int64_t total, float* out) {
  const RowsPanel panel = p.grouped ? p.kernels->grouped : p.kernels->rows;
  panel(static_cast<int>(k), p.weight + (lo - p.first_column) * p.row_bytes, p.row_bytes,
        hi - lo, p.activations, p.activation_row_bytes, static_cast<int>(rows), out + lo, total);
}

// How many threads share `units` output units: as many as torch has, but at least `grain`
// units each. Thread t of n takes rows [t / n, (t + 1) / n) of every part, in whole units
// (part_share), so each thread has the same mix of block types: a fused q/k/v can mix Q4_K's
// q and k with Q6_K's v, whose rows are 1.46x longer and cost more arithmetic per byte.
// Split by rows across the parts, the thread with the v rows read 30% more; split by bytes,
// it still finished last (docs/kernels.md, "GGUF block kernels").
int64_t share_threads(int64_t units, int64_t grain) {
  const int64_t most = (units + grain - 1) / grain;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), most));
}
// Thread t's output features [lo, hi) of part p.
std::pair<int64_t, int64_t> part_share(const Part& p, int64_t unit, int64_t t, int64_t threads) {
  const int64_t units = p.rows / unit;
  return {p.first_column + units * t / threads * unit,
          p.first_column + units * (t + 1) / threads * unit};
}

// x [rows, k] @ the parts' rows^T, stacked, into out [rows, sum of the parts' rows]: the
// activations are quantized once per kind of block, and the output features of all parts
// are split over the threads in one parallel region (in whole groups of 16 where a part
// is interleaved, so every part's rows are); each part takes its type's gemm method where
// `method` says so (use_gemm), or its interleaved layout's.
void multiply_parts(const float* x, int64_t rows, int64_t k, std::vector<Part>& parts,
                    float* out, Method method) {
  std::vector<std::pair<QuantizeRow, std::vector<uint8_t>>> quantized;
  int64_t total = 0, widest_row = 1;
  for (Part& p : parts) {
    total += p.rows;
    widest_row = std::max(widest_row, p.row_bytes);
    const QuantizeRow quantize = p.kernels->quantize;
    if (quantize == nullptr) {  // F16/BF16: the fp32 input as it is
      p.activations = reinterpret_cast<const uint8_t*>(x);
      continue;
    }
    auto same = std::find_if(quantized.begin(), quantized.end(),
                             [&](const auto& q) { return q.first == quantize; });
    if (same == quantized.end()) {
      quantized.emplace_back(quantize, quantize_rows(x, rows, k, p.activation_row_bytes, quantize));
      same = quantized.end() - 1;
    }
    p.activations = same->second.data();
  }
  const bool grouped =
      std::any_of(parts.begin(), parts.end(), [](const Part& p) { return p.grouped; });
  const int64_t unit = grouped ? kInterleavedGroupRows : 1;
  for (const Part& p : parts)
    TORCH_CHECK_VALUE(p.rows % unit == 0, "a layer with interleaved parts needs every part's ",
                      "rows in groups of ", unit, "; a part has ", p.rows);
  // Each weight row is read once and used for every input row while it is in cache.
  const int64_t grain = std::max<int64_t>(1, 16384 / widest_row / unit);
  const int64_t threads = share_threads(total / unit, grain);
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t end_thread) {
   for (int64_t t = first_thread; t < end_thread; ++t) {
    for (const Part& p : parts) {
      const auto [lo, hi] = part_share(p, unit, t, threads);
      if (lo >= hi) continue;
      if (p.grouped || use_gemm(*p.kernels, method, rows)) {
        multiply_panel(p, lo, hi, rows, k, total, out);
        continue;
      }
      const BlockDot dot = p.kernels->dot;
      for (int64_t j = lo; j < hi; ++j) {
        const uint8_t* w = p.weight + (j - p.first_column) * p.row_bytes;
        for (int64_t r = 0; r < rows; ++r)
          out[r * total + j] = dot(static_cast<int>(k), w, p.activations + r * p.activation_row_bytes);
      }
    }
   }
  });
}

// The checked part of a product: `weight` holds `out_features` rows of `type` blocks, as
// the file stores them ([rows, bytes per row]) or interleaved ([rows / 16, 16, bytes per
// row], gguf_interleave).
Part weight_part(const at::Tensor& weight, const GgufType& type, const std::string& kernel,
                 int64_t k, int64_t out_features, int64_t first_column) {
  TORCH_CHECK_VALUE(out_features >= 0, "out_features must be >= 0, not ", out_features);
  const int64_t row_bytes = k / type.block * type.bytes;
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kByte && weight.is_contiguous(),
                    "the weight must be a contiguous uint8 tensor of ", type.name, " blocks");
  TORCH_CHECK_VALUE(weight.numel() == out_features * row_bytes, "the weight has ",
                    weight.numel(), " bytes; ", out_features, " rows of ", k, " ", type.name,
                    " values take ", out_features * row_bytes);
  const BlockKernels& kernels = kernels_for(type, kernel);
  const bool grouped = weight.dim() == 3;
  TORCH_CHECK_VALUE(!grouped || (weight.size(1) == kInterleavedGroupRows && kernels.grouped),
                    "a [groups, 16, bytes per row] weight is interleaved: Q4_0, Q4_1 or Q4_K ",
                    "only, not ", type.name, " ", weight.sizes());
  return {weight.data_ptr<uint8_t>(), out_features, row_bytes, first_column, &kernels, nullptr,
          k / type.block * type.activation_bytes, grouped};
}

}  // namespace

// x [rows, in] fp32 @ W^T -> fp32 [rows, out], W the rows of `weights` stacked in order, each
// a uint8 [its rows, bytes per row] tensor of `ggml_types[i]` blocks (a fused q/k/v or
// gate/up whose parts the file stores apart, possibly in different types).
at::Tensor gguf_linear_parts(const at::Tensor& x, at::TensorList weights,
                             at::IntArrayRef ggml_types, const std::string& kernel,
                             const std::string& method, const at::Tensor& into) {
  TORCH_CHECK_VALUE(!weights.empty() && weights.size() == ggml_types.size(), "got ",
                    weights.size(), " weights and ", ggml_types.size(), " types");
  const at::Tensor xc = x.contiguous();
  std::vector<Part> parts;
  int64_t total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const GgufType& type = gguf_type(ggml_types[i]);
    const int64_t k = input_width(xc, type);
    const int64_t dims = weights[i].dim();
    TORCH_CHECK_VALUE(dims == 2 || dims == 3, "weight ", i, " must be [rows, bytes per row] ",
                      "or interleaved [rows / 16, 16, bytes per row]");
    const int64_t rows_i = dims == 2 ? weights[i].size(0) : weights[i].size(0) * weights[i].size(1);
    parts.push_back(weight_part(weights[i], type, kernel, k, rows_i, total));
    total += rows_i;
  }
  const int64_t rows = xc.size(0);
  const Method m = checked_method(method);
  const at::Tensor out = output_rows(into, rows, total, xc);
  if (rows > 0 && total > 0)
    multiply_parts(xc.data_ptr<float>(), rows, xc.size(1), parts, out.data_ptr<float>(), m);
  return out;
}

// x [rows, in] fp32 @ the weight's [out_features, in] values^T -> fp32 [rows, out_features];
// `weight` holds the raw blocks, out_features rows of in / block * bytes bytes each.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type,
                       int64_t out_features, const std::string& kernel,
                       const std::string& method) {
  const GgufType& type = gguf_type(ggml_type);
  const at::Tensor xc = x.contiguous();
  const int64_t k = input_width(xc, type);
  std::vector<Part> parts{weight_part(weight, type, kernel, k, out_features, 0)};
  const int64_t rows = xc.size(0);
  const Method m = checked_method(method);
  at::Tensor out = at::empty({rows, out_features}, xc.options());
  if (rows > 0 && out_features > 0)
    multiply_parts(xc.data_ptr<float>(), rows, k, parts, out.data_ptr<float>(), m);
  return out;
}

// The activation blocks gguf_linear multiplies `ggml_type` weights with: each row of x
// quantized as the weight type's vec_dot_type, as uint8 [rows, bytes] (for tests).
at::Tensor gguf_quantize_activations(const at::Tensor& x, int64_t ggml_type,
                                     const std::string& kernel) {
  const GgufType& type = gguf_type(ggml_type);
  const BlockKernels& kernels = kernels_for(type, kernel);
  const int64_t k = input_width(x, type);
  TORCH_CHECK_VALUE(kernels.quantize != nullptr, type.name, " weights multiply fp32 inputs");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), row_bytes = k / type.block * type.activation_bytes;
  std::vector<uint8_t> blocks =
      quantize_rows(xc.data_ptr<float>(), rows, k, row_bytes, kernels.quantize);
  at::Tensor out = at::empty({rows, row_bytes}, xc.options().dtype(at::kByte));
  if (!blocks.empty()) memcpy(out.data_ptr<uint8_t>(), blocks.data(), blocks.size());
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "gguf_linear(Tensor x, Tensor weight, int ggml_type, int out_features, "
      "str kernel='auto', str method='auto') -> Tensor");
  m.def(
      "gguf_linear_parts(Tensor x, Tensor[] weights, int[] ggml_types, str kernel='auto', "
      "str method='auto') -> Tensor");
  m.def("gguf_quantize_activations(Tensor x, int ggml_type, str kernel='auto') -> Tensor");
  m.def("gguf_kernel(str kernel='auto') -> str", &pagedllm::gguf_kernel);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("gguf_linear", &pagedllm::gguf_linear);
  m.impl("gguf_linear_parts", [](const at::Tensor& x, at::TensorList weights,
                                 at::IntArrayRef ggml_types, const std::string& kernel,
                                 const std::string& method) {
    return pagedllm::gguf_linear_parts(x, weights, ggml_types, kernel, method);
  });
  m.impl("gguf_quantize_activations", &pagedllm::gguf_quantize_activations);
}
