// Several activation rows at once (the "gemm" method). Q5_K, Q8_0 and Q5_0: one
// weight row times R (1..kRowsPerDot) rows of activation blocks, each weight block loaded
// and unpacked once for all R rows (its nibbles, high bits and scales), where
// ggml_x86_quants.h's dot products unpack it once per row. Each row's
// arithmetic is the one-row function's, step for step (the same int32 sums, the same fp32
// lanes summed in the same order), so the outputs equal the one-row kernels' bit for bit;
// only the loop over rows moved inside the loop over blocks.
//
// Q4_0, Q4_1, Q4_K and Q6_K: interleaved weight rows with an arithmetic of their own, which their
// one-row dots share (ggml_x86_interleaved.h, included after this file).
//
// Included by gguf_linear.cpp right after ggml_x86_quants.h, in the same namespaces (AVX2,
// and AVX-512 VNNI where mul_sum_us8_pairs_float uses `dpbusd`), so no include guard.
// Derived from ggml v0.20.2's ggml_vec_dot_* (MIT license, notice in ggml_x86_quants.h).

// Activation rows per pass over a tile of weight rows. The 256-bit kernels below take them
// 4 at a time (R rows' accumulators and the unpacked block fit in the 16 vector registers of
// AVX2), each weight row while it is in L1.
static constexpr int kRowsAtOnce = 8;
static constexpr int kRowsPerDot = 4;

template <typename Block>
struct ActivationRows {
  const uint8_t* first;
  int64_t stride;  // bytes from one row's blocks to the next's
  const Block* operator[](int r) const { return reinterpret_cast<const Block*>(first + r * stride); }
};

struct RowsQ5K {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_K> ys, float* out,
                  int64_t out_stride) {
    const block_q5_K* x = static_cast<const block_q5_K*>(vx);
    const int nb = n / QK_K;
    uint32_t utmp[4];
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m128i mzero = _mm_setzero_si128();
    const __m256i mone = _mm256_set1_epi8(1);
    __m256 acc[R];
    float summs[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), summs[r] = 0.f;

    for (int i = 0; i < nb; ++i) {
      const float xd = fp16_to_fp32(x[i].d), xdmin = fp16_to_fp32(x[i].dmin);
      unpack_scales_mins_k4(x[i].scales, utmp);
      const __m256i mins_and_scales =
          _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
      const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
      for (int r = 0; r < R; ++r) {
        const block_q8_K& y = ys[r][i];
        const float dmin = -y.d * xdmin;
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0),
                                           _mm256_extracti128_si256(q8sums, 1));
        const __m128i prod = _mm_madd_epi16(mins, q8s);
        const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
        summs[r] += dmin * _mm_extract_epi32(hsum, 0);
      }
      const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
      const __m256i scales = _mm256_set_m128i(sc128, sc128);
      const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh));
      __m256i hmask = mone;

      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      int bit = 0;
      for (int j = 0; j < QK_K / 64; ++j) {
        const __m256i scale_0 = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 0));
        const __m256i scale_1 = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 1));
        const __m256i q5bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs) + j);
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
        for (int r = 0; r < R; ++r) {
          const __m256i* q8 = reinterpret_cast<const __m256i*>(ys[r][i].qs) + 2 * j;
          const __m256i p16_0 = _mm256_madd_epi16(
              scale_0, _mm256_maddubs_epi16(q5_0, _mm256_loadu_si256(q8)));
          const __m256i p16_1 = _mm256_madd_epi16(
              scale_1, _mm256_maddubs_epi16(q5_1, _mm256_loadu_si256(q8 + 1)));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16_0, p16_1));
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ys[r][i].d * xd), _mm256_cvtepi32_ps(sumi[r]),
                                 acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum_float_8(acc[r]) + summs[r];
  }
};

struct RowsQ8_0 {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_0> ys, float* out,
                  int64_t out_stride) {
    const block_q8_0* x = static_cast<const block_q8_0*>(vx);
    const int nb = n / QK8_0;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int ib = 0; ib < nb; ++ib) {
      const float xd = fp16_to_fp32(x[ib].d);
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[ib].qs));
      const __m256i ax = _mm256_sign_epi8(qx, qx);  // |x|, and y takes x's signs
      for (int r = 0; r < R; ++r) {
        const block_q8_0& y = ys[r][ib];
        const __m256 d = _mm256_set1_ps(xd * fp16_to_fp32(y.d));
        const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs));
        const __m256 q = mul_sum_us8_pairs_float(ax, _mm256_sign_epi8(qy, qx));
        acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum_float_8(acc[r]);
  }
};

// Q5_0 (times Q8_0): the signed quants of one block, and their magnitudes,
// made once; each row takes the weights' signs (mul_sum_i8_pairs_float split in two).
template <typename Unpack>
struct RowsSigned32 {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_0> ys, float* out,
                  int64_t out_stride) {
    using WeightBlock = typename Unpack::Block;
    const WeightBlock* x = static_cast<const WeightBlock*>(vx);
    const int nb = n / QK8_0;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int ib = 0; ib < nb; ++ib) {
      const float xd = fp16_to_fp32(x[ib].d);
      const __m256i qx = Unpack::quants(x[ib]);
      const __m256i ax = _mm256_sign_epi8(qx, qx);
      for (int r = 0; r < R; ++r) {
        const block_q8_0& y = ys[r][ib];
        const __m256 d = _mm256_set1_ps(xd * fp16_to_fp32(y.d));
        const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs));
        const __m256 q = mul_sum_us8_pairs_float(ax, _mm256_sign_epi8(qy, qx));
        acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum_float_8(acc[r]);
  }
};

// The 32 quants of a Q5_0 block in [-16, 15], as vec_dot_q5_0_q8_0 makes them.
struct UnpackQ5_0 {
  using Block = block_q5_0;
  static __m256i quants(const block_q5_0& b) {
    const __m256i bxhi = bytes_from_bits_32(b.qh);
    return _mm256_or_si256(bytes_from_nibbles_32(b.qs),
                           _mm256_andnot_si256(bxhi, _mm256_set1_epi8(static_cast<char>(0xF0))));
  }
};

using RowsQ5_0 = RowsSigned32<UnpackQ5_0>;

// out[r * out_stride] = weight row . activation row r, for r < rows (1..kRowsPerDot).
template <typename Kernel, typename Block>
static void rows_dot(int n, const void* weight_row, ActivationRows<Block> ys, int rows,
                     float* out, int64_t out_stride) {
  static_assert(kRowsPerDot == 4, "one case per row count");
  switch (rows) {
    case 4: return Kernel::template run<4>(n, weight_row, ys, out, out_stride);
    case 3: return Kernel::template run<3>(n, weight_row, ys, out, out_stride);
    case 2: return Kernel::template run<2>(n, weight_row, ys, out, out_stride);
    default: return Kernel::template run<1>(n, weight_row, ys, out, out_stride);
  }
}

// Bytes of weight rows one tile of rows_panel holds: read from memory once, then from the
// L2 cache by every group of activation rows.
constexpr int64_t kWeightTileBytes = 128 * 1024;

// A panel: `count` weight rows (row_bytes apart) times `rows` activation rows;
// out[r * out_stride + j] = weight row j . activation row r. Per tile of weight rows,
// groups of kRowsAtOnce activation rows pass over its rows in turn, each weight row used
// by a group's rows while it is in L1.
template <typename Kernel, typename Block>
static void rows_panel(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                       const uint8_t* activations, int64_t activation_stride, int rows,
                       float* out, int64_t out_stride) {
  const int64_t tile = std::max<int64_t>(1, kWeightTileBytes / row_bytes);
  for (int64_t j0 = 0; j0 < count; j0 += tile)
    for (int g = 0; g < rows; g += kRowsAtOnce) {
      const int group = std::min(kRowsAtOnce, rows - g);
      for (int64_t j = j0; j < std::min(count, j0 + tile); ++j)
        for (int r = g; r < g + group; r += kRowsPerDot) {
          const ActivationRows<Block> ys{activations + r * activation_stride,
                                         activation_stride};
          rows_dot<Kernel>(n, weights + j * row_bytes, ys, std::min(kRowsPerDot, g + group - r),
                           out + r * out_stride + j, out_stride);
        }
    }
}
