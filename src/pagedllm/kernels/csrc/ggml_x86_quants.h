// ggml's x86 kernels for GGUF blocks: quantize one fp32 activation row into Q8_0, Q8_1 or
// Q8_K blocks, and the dot product of a row of weight blocks with a row of activation
// blocks (Q5_0.Q8_0, Q8_0.Q8_0, Q5_K.Q8_K; Q4_0's, Q4_1's, Q4_K's and Q6_K's are in
// ggml_x86_interleaved.h, with the arithmetic of their interleaved gemm).
//
// Included twice by gguf_linear.cpp, each time inside a namespace of its own: once for
// AVX2 and once under `#pragma GCC target` with AVX-512 VNNI and PAGEDLLM_GGML_VNNI
// defined, which makes mul_sum_us8_pairs_float use `dpbusd` (g++ does not define the ISA
// macros under the pragma; the K-quant dot products are the same code in both). So this
// file has no include guard and includes nothing itself.
//
// Taken from ggml v0.20.2 (https://github.com/ggml-org/ggml), src/ggml-cpu/arch/x86/quants.c:
// the helpers, quantize_row_q8_0/q8_1 and the ggml_vec_dot_* functions above, their
// __AVX2__ branches only; and quantize_row_q8_K_ref with nearest_int from
// src/ggml-quants.c (ggml's x86 build uses that scalar code for Q8_K too). Changed: C++
// casts; each dot product returns its float instead of taking ggml's strides and row
// counts; Q8_1 keeps the integer sum of its quants (see ggml_blocks.h); each dot prefetches
// its weights (prefetch_weights_ahead, vec.h).
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

using namespace ::pagedllm::ggml;

#define MM256_SET_M128I(a, b) _mm256_insertf128_si256(_mm256_castsi128_si256(b), (a), 1)

// horizontally add 8 floats
static inline float hsum_float_8(const __m256 x) {
  __m128 res = _mm256_extractf128_ps(x, 1);
  res = _mm_add_ps(res, _mm256_castps256_ps128(x));
  res = _mm_add_ps(res, _mm_movehl_ps(res, res));
  res = _mm_add_ss(res, _mm_movehdup_ps(res));
  return _mm_cvtss_f32(res);
}

// horizontally add 8 int32_t
static inline int hsum_i32_8(const __m256i a) {
  const __m128i sum128 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extractf128_si256(a, 1));
  const __m128i hi64 = _mm_unpackhi_epi64(sum128, sum128);
  const __m128i sum64 = _mm_add_epi32(hi64, sum128);
  const __m128i hi32 = _mm_shuffle_epi32(sum64, _MM_SHUFFLE(2, 3, 0, 1));
  return _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32));
}

// spread 32 bits to 32 bytes { 0x00, 0xFF }
static inline __m256i bytes_from_bits_32(const uint8_t* x) {
  uint32_t x32;
  memcpy(&x32, x, sizeof(uint32_t));
  const __m256i shuf_mask = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                              0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf_mask);
  const __m256i bit_mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  bytes = _mm256_or_si256(bytes, bit_mask);
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// Unpack 32 4-bit fields into 32 bytes, each one in [ 0 .. 15 ]
static inline __m256i bytes_from_nibbles_32(const uint8_t* rsi) {
  const __m128i tmp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rsi));
  const __m256i bytes = MM256_SET_M128I(_mm_srli_epi16(tmp, 4), tmp);
  const __m256i lowMask = _mm256_set1_epi8(0xF);
  return _mm256_and_si256(lowMask, bytes);
}

// add int16_t pairwise and return as float vector
static inline __m256 sum_i16_pairs_float(const __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i summed_pairs = _mm256_madd_epi16(ones, x);
  return _mm256_cvtepi32_ps(summed_pairs);
}

static inline __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
#if defined(PAGEDLLM_GGML_VNNI)  // ggml: __AVX512VNNI__ && __AVX512VL__
  const __m256i zero = _mm256_setzero_si256();
  const __m256i summed_pairs = _mm256_dpbusd_epi32(zero, ax, sy);
  return _mm256_cvtepi32_ps(summed_pairs);
#else
  // Perform multiplication and create 16-bit values
  const __m256i dot = _mm256_maddubs_epi16(ax, sy);
  return sum_i16_pairs_float(dot);
#endif
}

// multiply int8_t, add results pairwise twice and return as float vector
static inline __m256 mul_sum_i8_pairs_float(const __m256i x, const __m256i y) {
  // Get absolute values of x vectors
  const __m256i ax = _mm256_sign_epi8(x, x);
  // Sign the values of the y vectors
  const __m256i sy = _mm256_sign_epi8(y, x);
  return mul_sum_us8_pairs_float(ax, sy);
}

// shuffles to pick the required scales in dot products
static inline __m256i get_scale_shuffle_k4(int i) {
  static const uint8_t k_shuffle[256] = {
       0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,
       2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,
       4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,
       6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,
       8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,
      10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
      12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
      14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
  };
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k_shuffle) + i);
}

// The 32 quants of one Q8_0/Q8_1 block, and their sum: x * (127 / max|x|) rounded to
// nearest even (ggml's AVX2 code; its scalar _ref divides by d and rounds half away).
static inline int quantize_block_32(const float* x, ggml_half* d_out, int8_t* qs) {
  __m256 v0 = _mm256_loadu_ps(x);
  __m256 v1 = _mm256_loadu_ps(x + 8);
  __m256 v2 = _mm256_loadu_ps(x + 16);
  __m256 v3 = _mm256_loadu_ps(x + 24);

  // Compute max(abs(e)) for the block
  const __m256 signBit = _mm256_set1_ps(-0.0f);
  __m256 maxAbs = _mm256_andnot_ps(signBit, v0);
  maxAbs = _mm256_max_ps(maxAbs, _mm256_andnot_ps(signBit, v1));
  maxAbs = _mm256_max_ps(maxAbs, _mm256_andnot_ps(signBit, v2));
  maxAbs = _mm256_max_ps(maxAbs, _mm256_andnot_ps(signBit, v3));

  __m128 max4 = _mm_max_ps(_mm256_extractf128_ps(maxAbs, 1), _mm256_castps256_ps128(maxAbs));
  max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
  max4 = _mm_max_ss(max4, _mm_movehdup_ps(max4));
  const float maxScalar = _mm_cvtss_f32(max4);

  // Quantize these floats
  const float d = maxScalar / 127.f;
  *d_out = fp32_to_fp16(d);
  const float id = (maxScalar != 0.0f) ? 127.f / maxScalar : 0.0f;
  const __m256 mul = _mm256_set1_ps(id);

  // Apply the multiplier
  v0 = _mm256_mul_ps(v0, mul);
  v1 = _mm256_mul_ps(v1, mul);
  v2 = _mm256_mul_ps(v2, mul);
  v3 = _mm256_mul_ps(v3, mul);

  // Round to nearest integer
  v0 = _mm256_round_ps(v0, _MM_ROUND_NEAREST);
  v1 = _mm256_round_ps(v1, _MM_ROUND_NEAREST);
  v2 = _mm256_round_ps(v2, _MM_ROUND_NEAREST);
  v3 = _mm256_round_ps(v3, _MM_ROUND_NEAREST);

  // Convert floats to integers
  __m256i i0 = _mm256_cvtps_epi32(v0);
  __m256i i1 = _mm256_cvtps_epi32(v1);
  __m256i i2 = _mm256_cvtps_epi32(v2);
  __m256i i3 = _mm256_cvtps_epi32(v3);

  const int sum = hsum_i32_8(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));

  // Convert int32 to int16, then int16 to int8
  i0 = _mm256_packs_epi32(i0, i1);
  i2 = _mm256_packs_epi32(i2, i3);
  i0 = _mm256_packs_epi16(i0, i2);

  // The AVX2 pack instructions process 16-byte pieces independently: fix the order
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  i0 = _mm256_permutevar8x32_epi32(i0, perm);

  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), i0);
  return sum;
}

static void quantize_row_q8_0(const float* x, void* vy, int64_t k) {
  block_q8_0* y = static_cast<block_q8_0*>(vy);
  for (int64_t i = 0; i < k / QK8_0; i++) quantize_block_32(x + i * QK8_0, &y[i].d, y[i].qs);
}

static void quantize_row_q8_1(const float* x, void* vy, int64_t k) {
  block_q8_1* y = static_cast<block_q8_1*>(vy);
  for (int64_t i = 0; i < k / QK8_1; i++)
    y[i].sum = static_cast<int16_t>(quantize_block_32(x + i * QK8_1, &y[i].d, y[i].qs));
}

static inline int nearest_int(float fval) {
  float val = fval + 12582912.f;
  int i;
  memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

static void quantize_row_q8_K(const float* x, void* vy, int64_t k) {
  block_q8_K* y = static_cast<block_q8_K*>(vy);
  const int64_t nb = k / QK_K;

  for (int64_t i = 0; i < nb; i++) {
    float max = 0;
    float amax = 0;
    for (int j = 0; j < QK_K; ++j) {
      float ax = fabsf(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (!amax) {
      y[i].d = 0;
      memset(y[i].qs, 0, QK_K);
      memset(y[i].bsums, 0, sizeof(y[i].bsums));  // (ggml leaves them: its dot never reads them then)
      x += QK_K;
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK_K; ++j) {
      int v = nearest_int(iscale * x[j]);
      y[i].qs[j] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int j = 0; j < QK_K / 16; ++j) {
      int sum = 0;
      for (int ii = 0; ii < 16; ++ii) sum += y[i].qs[j * 16 + ii];
      y[i].bsums[j] = static_cast<int16_t>(sum);
    }
    y[i].d = 1 / iscale;
    x += QK_K;
  }
}

static float vec_dot_q5_0_q8_0(int n, const void* vx, const void* vy) {
  const int nb = n / QK8_0;
  const block_q5_0* x = static_cast<const block_q5_0*>(vx);
  const block_q8_0* y = static_cast<const block_q8_0*>(vy);

  __m256 acc = _mm256_setzero_ps();
  for (int ib = 0; ib < nb; ++ib) {
    prefetch_weights_ahead(x + ib);
    // Compute combined scale for the block
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(x[ib].d) * fp16_to_fp32(y[ib].d));

    __m256i qx = bytes_from_nibbles_32(x[ib].qs);
    __m256i bxhi = bytes_from_bits_32(x[ib].qh);
    bxhi = _mm256_andnot_si256(bxhi, _mm256_set1_epi8(static_cast<char>(0xF0)));
    qx = _mm256_or_si256(qx, bxhi);

    __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));

    const __m256 q = mul_sum_i8_pairs_float(qx, qy);

    // Multiply q with scale and accumulate
    acc = _mm256_fmadd_ps(d, q, acc);
  }
  return hsum_float_8(acc);
}

static float vec_dot_q8_0_q8_0(int n, const void* vx, const void* vy) {
  const int nb = n / QK8_0;
  const block_q8_0* x = static_cast<const block_q8_0*>(vx);
  const block_q8_0* y = static_cast<const block_q8_0*>(vy);

  __m256 acc = _mm256_setzero_ps();
  for (int ib = 0; ib < nb; ++ib) {
    prefetch_weights_ahead(x + ib);
    // Compute combined scale for the block
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(x[ib].d) * fp16_to_fp32(y[ib].d));
    __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[ib].qs));
    __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));

    const __m256 q = mul_sum_i8_pairs_float(qx, qy);

    // Multiply q with scale and accumulate
    acc = _mm256_fmadd_ps(d, q, acc);
  }
  return hsum_float_8(acc);
}

// The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K block, as bytes: utmp[0..1]
// scales, utmp[2..3] mins.
static inline void unpack_scales_mins_k4(const uint8_t* scales, uint32_t* utmp) {
  static const uint32_t kmask1 = 0x3f3f3f3f;
  static const uint32_t kmask2 = 0x0f0f0f0f;
  static const uint32_t kmask3 = 0x03030303;
  memcpy(utmp, scales, 12);
  utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
  const uint32_t uaux = utmp[1] & kmask1;
  utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
  utmp[2] = uaux;
  utmp[0] &= kmask1;
}

static float vec_dot_q5_K_q8_K(int n, const void* vx, const void* vy) {
  const block_q5_K* x = static_cast<const block_q5_K*>(vx);
  const block_q8_K* y = static_cast<const block_q8_K*>(vy);
  const int nb = n / QK_K;
  uint32_t utmp[4];

  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m128i mzero = _mm_setzero_si128();
  const __m256i mone = _mm256_set1_epi8(1);

  __m256 acc = _mm256_setzero_ps();
  float summs = 0.f;

  for (int i = 0; i < nb; ++i) {
    prefetch_weights_ahead(x + i);
    const uint8_t* q5 = x[i].qs;
    const int8_t* q8 = y[i].qs;

    const float d = y[i].d * fp16_to_fp32(x[i].d);
    const float dmin = -y[i].d * fp16_to_fp32(x[i].dmin);

    unpack_scales_mins_k4(x[i].scales, utmp);

    const __m256i mins_and_scales =
        _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));

    const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums));
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0),
                                       _mm256_extracti128_si256(q8sums, 1));
    const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
    const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
    summs += dmin * _mm_extract_epi32(hsum, 0);

    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    const __m256i scales = MM256_SET_M128I(sc128, sc128);

    const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh));
    __m256i hmask = mone;

    __m256i sumi = _mm256_setzero_si256();

    int bit = 0;

    for (int j = 0; j < QK_K / 64; ++j) {
      const __m256i scale_0 = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 0));
      const __m256i scale_1 = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 1));

      const __m256i q5bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q5));
      q5 += 32;

      const __m256i q5l_0 = _mm256_and_si256(q5bits, m4);
      const __m256i q5h_0 =
          _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
      const __m256i q5_0 = _mm256_add_epi8(q5l_0, q5h_0);
      hmask = _mm256_slli_epi16(hmask, 1);

      const __m256i q5l_1 = _mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4);
      const __m256i q5h_1 =
          _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
      const __m256i q5_1 = _mm256_add_epi8(q5l_1, q5h_1);
      hmask = _mm256_slli_epi16(hmask, 1);

      const __m256i q8_0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      q8 += 32;
      const __m256i q8_1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      q8 += 32;

      __m256i p16_0 = _mm256_maddubs_epi16(q5_0, q8_0);
      __m256i p16_1 = _mm256_maddubs_epi16(q5_1, q8_1);

      p16_0 = _mm256_madd_epi16(scale_0, p16_0);
      p16_1 = _mm256_madd_epi16(scale_1, p16_1);

      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_0, p16_1));
    }

    __m256 vd = _mm256_set1_ps(d);
    acc = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(sumi), acc);
  }

  return hsum_float_8(acc) + summs;
}

#undef MM256_SET_M128I
