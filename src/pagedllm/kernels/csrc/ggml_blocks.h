// GGUF's quantized blocks as C++ structs, and the 8-bit activation blocks they multiply with.
//
// Taken from ggml v0.20.2 (https://github.com/ggml-org/ggml), src/ggml-common.h: the
// block_* structs of the types the GGUF kernels compute on (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
// Q5_K, Q6_K) and the activation blocks Q8_0, Q8_1, Q8_K; the fp16 conversions of
// src/ggml-impl.h on F16C. Changed: plain structs instead of ggml's unions; our Q8_1 block
// keeps the exact integer sum of its quants (`sum`) where ggml keeps fp16(d * sum), so a
// Q4_1 product equals (dequantized weights) . (dequantized activations) to fp32 rounding.
//
// MIT License
//
// Copyright (c) 2023-2026 The ggml authors
//
// Permission is hereby granted, free of charge, to any person obtaining a copy
// of this software and associated documentation files (the "Software"), to deal
// in the Software without restriction, including without limitation the rights
// to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
// copies of the Software, and to permit persons to whom the Software is
// furnished to do so, subject to the following conditions:
//
// The above copyright notice and this permission notice shall be included in all
// copies or substantial portions of the Software.
//
// THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
// IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
// FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
// AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
// LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
// OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
// SOFTWARE.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagedllm::ggml {

using ggml_half = uint16_t;

inline float fp16_to_fp32(ggml_half h) { return _cvtsh_ss(h); }
inline ggml_half fp32_to_fp16(float f) { return _cvtss_sh(f, 0); }  // round to nearest even

constexpr int QK4_0 = 32;
constexpr int QK4_1 = 32;
constexpr int QK5_0 = 32;
constexpr int QK8_0 = 32;
constexpr int QK8_1 = 32;
constexpr int QK_K = 256;
constexpr int K_SCALE_SIZE = 12;

struct block_q4_0 {
  ggml_half d;
  uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_q4_0) == 18, "wrong q4_0 block size/padding");

struct block_q4_1 {
  ggml_half d;
  ggml_half m;
  uint8_t qs[QK4_1 / 2];
};
static_assert(sizeof(block_q4_1) == 20, "wrong q4_1 block size/padding");

struct block_q5_0 {
  ggml_half d;
  uint8_t qh[4];
  uint8_t qs[QK5_0 / 2];
};
static_assert(sizeof(block_q5_0) == 22, "wrong q5_0 block size/padding");

struct block_q8_0 {
  ggml_half d;
  int8_t qs[QK8_0];
};
static_assert(sizeof(block_q8_0) == 34, "wrong q8_0 block size/padding");

struct block_q8_1 {
  ggml_half d;
  int16_t sum;  // sum of qs (ggml: fp16(d * sum))
  int8_t qs[QK8_1];
};
static_assert(sizeof(block_q8_1) == 36, "wrong q8_1 block size/padding");

struct block_q4_K {
  ggml_half d;
  ggml_half dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q4_K) == 144, "wrong q4_K block size/padding");

struct block_q5_K {
  ggml_half d;
  ggml_half dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 176, "wrong q5_K block size/padding");

struct block_q6_K {
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  ggml_half d;
};
static_assert(sizeof(block_q6_K) == 210, "wrong q6_K block size/padding");

struct block_q8_K {
  float d;
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];
};
static_assert(sizeof(block_q8_K) == 292, "wrong q8_K block size/padding");

}  // namespace pagedllm::ggml
