// Rows of a GGUF tensor back to fp32: ggml's reference dequantization (ggml-quants.c's
// dequantize_row_*, the same arithmetic in the same order) of the types the kernels compute
// on, for the rows a step looks up in an embedding table kept as blocks:
//
//   gguf_dequantize_rows(blocks, rows, ggml_type) -> float32 [len(rows), in_features]
//
// blocks: uint8 [table rows, bytes per row] as the file stores them; rows: int64 indices.
// Only the rows asked for are read and written: a 512-token prompt's lookup in a 152k-row
// table touches 512 rows, and needs no buffer beyond its output.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <string.h>
#include <torch/library.h>

#include <cstdint>

#include "ggml_blocks.h"

namespace pagedllm {
namespace {

using namespace ggml;

// GGML's type numbers (ggml.h's enum ggml_type).
enum : int64_t { kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
                 kQ6_K = 14, kBF16 = 30 };

// (values, bytes) of one block of `ggml_type`.
std::pair<int64_t, int64_t> geometry(int64_t ggml_type) {
  switch (ggml_type) {
    case kF16: return {1, 2};
    case kBF16: return {1, 2};
    case kQ4_0: return {QK4_0, sizeof(block_q4_0)};
    case kQ4_1: return {QK4_1, sizeof(block_q4_1)};
    case kQ5_0: return {QK5_0, sizeof(block_q5_0)};
    case kQ8_0: return {QK8_0, sizeof(block_q8_0)};
    case kQ4_K: return {QK_K, sizeof(block_q4_K)};
    case kQ5_K: return {QK_K, sizeof(block_q5_K)};
    case kQ6_K: return {QK_K, sizeof(block_q6_K)};
    default:
      TORCH_CHECK_VALUE(false, "GGML type ", ggml_type, " has no dequantization here (F16=1, ",
                        "Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14, BF16=30)");
  }
}

inline void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

void q4_0(const block_q4_0* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_0) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < QK4_0 / 2; ++j) {
      y[j] = ((x[i].qs[j] & 0x0F) - 8) * d;
      y[j + QK4_0 / 2] = ((x[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void q4_1(const block_q4_1* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_1) {
    const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
    for (int j = 0; j < QK4_1 / 2; ++j) {
      y[j] = (x[i].qs[j] & 0x0F) * d + m;
      y[j + QK4_1 / 2] = (x[i].qs[j] >> 4) * d + m;
    }
  }
}

void q5_0(const block_q5_0* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK5_0) {
    const float d = fp16_to_fp32(x[i].d);
    uint32_t qh;
    memcpy(&qh, x[i].qh, sizeof(qh));
    for (int j = 0; j < QK5_0 / 2; ++j) {
      const uint8_t xh_0 = ((qh >> (j + 0)) << 4) & 0x10;
      const uint8_t xh_1 = ((qh >> (j + 12))) & 0x10;
      y[j] = (((x[i].qs[j] & 0x0F) | xh_0) - 16) * d;
      y[j + QK5_0 / 2] = (((x[i].qs[j] >> 4) | xh_1) - 16) * d;
    }
  }
}

void q8_0(const block_q8_0* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK8_0) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < QK8_0; ++j) y[j] = x[i].qs[j] * d;
  }
}

void q4_k(const block_q4_K* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* q = x[i].qs;
    const float d = fp16_to_fp32(x[i].d), min = fp16_to_fp32(x[i].dmin);
    uint8_t sc, m;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
      scale_min_k4(is + 0, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(is + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    }
  }
}

void q5_k(const block_q5_K* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t *ql = x[i].qs, *qh = x[i].qh;
    const float d = fp16_to_fp32(x[i].d), min = fp16_to_fp32(x[i].dmin);
    uint8_t sc, m, u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
      scale_min_k4(is + 0, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(is + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
  }
}

void q6_k(const block_q6_K* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const uint8_t *ql = x[i].ql, *qh = x[i].qh;
    const int8_t* sc = x[i].scales;
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int8_t q1 = (int8_t)((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int8_t q3 = (int8_t)((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = d * sc[is + 0] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
}

// One row of `n` values (`nb` blocks) of `ggml_type`.
void dequantize_row(int64_t ggml_type, const uint8_t* row, float* y, int64_t n, int64_t nb) {
  switch (ggml_type) {
    case kF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t j = 0; j < n; ++j) y[j] = fp16_to_fp32(h[j]);
      break;
    }
    case kBF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t bits = static_cast<uint32_t>(h[j]) << 16;
        memcpy(y + j, &bits, sizeof(bits));
      }
      break;
    }
    case kQ4_0: q4_0(reinterpret_cast<const block_q4_0*>(row), y, nb); break;
    case kQ4_1: q4_1(reinterpret_cast<const block_q4_1*>(row), y, nb); break;
    case kQ5_0: q5_0(reinterpret_cast<const block_q5_0*>(row), y, nb); break;
    case kQ8_0: q8_0(reinterpret_cast<const block_q8_0*>(row), y, nb); break;
    case kQ4_K: q4_k(reinterpret_cast<const block_q4_K*>(row), y, nb); break;
    case kQ5_K: q5_k(reinterpret_cast<const block_q5_K*>(row), y, nb); break;
    case kQ6_K: q6_k(reinterpret_cast<const block_q6_K*>(row), y, nb); break;
  }
}

}  // namespace

at::Tensor gguf_dequantize_rows(const at::Tensor& blocks, const at::Tensor& rows,
                                int64_t ggml_type) {
  const auto [values, bytes] = geometry(ggml_type);
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                        blocks.is_contiguous(),
                    "blocks must be a contiguous uint8 [rows, bytes per row] tensor, not ",
                    blocks.scalar_type(), " ", blocks.sizes());
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 1,
                    "rows must be a 1-D int64 tensor, not ", rows.scalar_type(), " ",
                    rows.sizes());
  const int64_t row_bytes = blocks.size(1), table_rows = blocks.size(0);
  TORCH_CHECK_VALUE(row_bytes % bytes == 0, "a row of ", row_bytes, " bytes is not a whole ",
                    "number of ", bytes, "-byte blocks");
  const int64_t nb = row_bytes / bytes, n = nb * values;
  const at::Tensor index = rows.contiguous();
  const int64_t* r = index.data_ptr<int64_t>();
  const int64_t count = index.numel();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK_INDEX(r[i] >= 0 && r[i] < table_rows, "row ", r[i], " is out of range for a ",
                      "table of ", table_rows, " rows");
  at::Tensor out = at::empty({count, n}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dequantize_row(ggml_type, src + r[i] * row_bytes, dst + i * n, n, nb);
  });
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("gguf_dequantize_rows(Tensor blocks, Tensor rows, int ggml_type) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("gguf_dequantize_rows", &pagedllm::gguf_dequantize_rows);
}
