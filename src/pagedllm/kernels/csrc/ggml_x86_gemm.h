// Several activation rows at once: one weight row of Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0 or
// Q4_1 blocks times R (1..kRowsAtOnce) rows of activation blocks, each weight block loaded
// and unpacked once for all R rows (its nibbles, high bits and scales), where ggml_x86_quants.h's dot
// products unpack it once per row.
//
// Each row's arithmetic is the one-row function's, step for step (the same int32 sums, the
// same fp32 lanes summed in the same order), so the outputs equal the one-row kernels' bit
// for bit; only the loop over rows moved inside the loop over blocks.
//
// Included by gguf_linear.cpp right after ggml_x86_quants.h, in the same namespaces (AVX2,
// and AVX-512 VNNI where mul_sum_us8_pairs_float uses `dpbusd`), so no include guard.
// Derived from ggml v0.20.2's ggml_vec_dot_* (MIT license, notice in ggml_x86_quants.h).

// Activation rows per pass over a tile of weight rows. The 256-bit kernels below take them
// 4 at a time (R rows' accumulators and the unpacked block fit in the 16 vector registers of
// AVX2), each weight row while it is in L1; the VNNI build's Q4_K panel takes all 8 at once.
static constexpr int kRowsAtOnce = 8;
static constexpr int kRowsPerDot = 4;

template <typename Block>
struct ActivationRows {
  const uint8_t* first;
  int64_t stride;  // bytes from one row's blocks to the next's
  const Block* operator[](int r) const { return reinterpret_cast<const Block*>(first + r * stride); }
};

struct RowsQ4K {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_K> ys, float* out,
                  int64_t out_stride) {
    const block_q4_K* x = static_cast<const block_q4_K*>(vx);
    const int nb = n / QK_K;
    uint32_t utmp[4];
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[R];
    __m128 acc_m[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), acc_m[r] = _mm_setzero_ps();

    for (int i = 0; i < nb; ++i) {
      const float xd = fp16_to_fp32(x[i].d), xdmin = fp16_to_fp32(x[i].dmin);
      unpack_scales_mins_k4(x[i].scales, utmp);
      const __m256i mins_and_scales =
          _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
      const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
      for (int r = 0; r < R; ++r) {
        const block_q8_K& y = ys[r][i];
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0),
                                           _mm256_extracti128_si256(q8sums, 1));
        const __m128i prod = _mm_madd_epi16(mins, q8s);
        acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(-y.d * xdmin), _mm_cvtepi32_ps(prod), acc_m[r]);
      }
      const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
      const __m256i scales = _mm256_set_m128i(sc128, sc128);

      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int j = 0; j < QK_K / 64; ++j) {
        const __m256i scale_l = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 0));
        const __m256i scale_h = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 1));
        const __m256i q4bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs) + j);
        const __m256i q4l = _mm256_and_si256(q4bits, m4);
        const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
        for (int r = 0; r < R; ++r) {
          const __m256i* q8 = reinterpret_cast<const __m256i*>(ys[r][i].qs) + 2 * j;
          const __m256i p16l = _mm256_madd_epi16(
              scale_l, _mm256_maddubs_epi16(q4l, _mm256_loadu_si256(q8)));
          const __m256i p16h = _mm256_madd_epi16(
              scale_h, _mm256_maddubs_epi16(q4h, _mm256_loadu_si256(q8 + 1)));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16l, p16h));
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ys[r][i].d * xd), _mm256_cvtepi32_ps(sumi[r]),
                                 acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      __m128 m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
      m = _mm_add_ss(m, _mm_movehdup_ps(m));
      out[r * out_stride] = hsum_float_8(acc[r]) + _mm_cvtss_f32(m);
    }
  }
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

struct RowsQ6K {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_K> ys, float* out,
                  int64_t out_stride) {
    const block_q6_K* x = static_cast<const block_q6_K*>(vx);
    const int nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();

    for (int i = 0; i < nb; ++i) {
      const float xd = fp16_to_fp32(x[i].d);
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales));
      const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();

      for (int j = 0; j < QK_K / 128; ++j) {
        const __m256i* q4 = reinterpret_cast<const __m256i*>(x[i].ql) + 2 * j;
        const __m256i q4bits1 = _mm256_loadu_si256(q4);
        const __m256i q4bits2 = _mm256_loadu_si256(q4 + 1);
        const __m256i q4bitsH =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh) + j);

        const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
        const __m256i q4h_1 =
            _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
        const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
        const __m256i q4h_3 =
            _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
        const __m256i q6[4] = {
            _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0),
            _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3),
        };
        __m256i scale[4];
        for (int s = 0; s < 4; ++s)
          scale[s] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(4 * j + s)));
        for (int r = 0; r < R; ++r) {
          const __m256i* q8 = reinterpret_cast<const __m256i*>(ys[r][i].qs) + 4 * j;
          __m256i p16[4];
          for (int s = 0; s < 4; ++s)
            p16[s] = _mm256_madd_epi16(
                scale[s], _mm256_maddubs_epi16(q6[s], _mm256_loadu_si256(q8 + s)));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16[0], p16[1]));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16[2], p16[3]));
        }
      }
      for (int r = 0; r < R; ++r) {
        const block_q8_K& y = ys[r][i];
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
        const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
        const float d = y.d * xd;
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[r], q8sclsub)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum_float_8(acc[r]);
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

// Q4_0 and Q5_0 (both times Q8_0): the signed quants of one block, and their magnitudes,
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

// The 32 quants of a Q4_0 block in [-8, 7], as vec_dot_q4_0_q8_0 makes them.
struct UnpackQ4_0 {
  using Block = block_q4_0;
  static __m256i quants(const block_q4_0& b) {
    return _mm256_sub_epi8(bytes_from_nibbles_32(b.qs), _mm256_set1_epi8(8));
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

using RowsQ4_0 = RowsSigned32<UnpackQ4_0>;
using RowsQ5_0 = RowsSigned32<UnpackQ5_0>;

struct RowsQ4_1 {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_1> ys, float* out,
                  int64_t out_stride) {
    const block_q4_1* x = static_cast<const block_q4_1*>(vx);
    const int nb = n / QK8_1;
    __m256 acc[R];
    float summs[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), summs[r] = 0;
    for (int ib = 0; ib < nb; ++ib) {
      const float d0 = fp16_to_fp32(x[ib].d), m = fp16_to_fp32(x[ib].m);
      const __m256i qx = bytes_from_nibbles_32(x[ib].qs);
      for (int r = 0; r < R; ++r) {
        const block_q8_1& y = ys[r][ib];
        const float d1 = fp16_to_fp32(y.d);
        summs[r] += m * (d1 * y.sum);  // exact in fp32, as in vec_dot_q4_1_q8_1
        const __m256 d0d1 = _mm256_mul_ps(_mm256_set1_ps(d0), _mm256_set1_ps(d1));
        const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs));
        acc[r] = _mm256_fmadd_ps(d0d1, mul_sum_us8_pairs_float(qx, qy), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum_float_8(acc[r]) + summs[r];
  }
};

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

// A panel: `count` weight rows (row_bytes apart) times `rows` activation rows;
// out[r * out_stride + j] = weight row j . activation row r. Groups of kRowsAtOnce
// activation rows pass over the weight rows in turn, each weight row used by a group's
// rows while it is in L1.
template <typename Kernel, typename Block>
static void rows_panel(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                       const uint8_t* activations, int64_t activation_stride, int rows,
                       float* out, int64_t out_stride) {
  for (int g = 0; g < rows; g += kRowsAtOnce) {
    const int group = std::min(kRowsAtOnce, rows - g);
    for (int64_t j = 0; j < count; ++j)
      for (int r = g; r < g + group; r += kRowsPerDot) {
        const ActivationRows<Block> ys{activations + r * activation_stride, activation_stride};
        rows_dot<Kernel>(n, weights + j * row_bytes, ys, std::min(kRowsPerDot, g + group - r),
                         out + r * out_stride + j, out_stride);
      }
  }
}

// Q4_K's integer sums of one block for R activation rows, as RowsQ4K's sumi lanes (each
// sub-block's int32 pair sums times its scale). The VNNI build holds 64 values a register:
// a 32-byte chunk's low nibbles (sub-block 2c) in its low half and its high nibbles (2c+1)
// in its high half, which is how the activations lie, and vpdpwssd adds the scaled pairs;
// folding the halves gives the same int32s.
template <int R>
static inline void q4k_block_sums(const block_q4_K& x, __m256i scales,
                                  ActivationRows<block_q8_K> ys, int i, __m256i* sumi) {
#ifdef PAGEDLLM_GGML_VNNI
  const __m512i m4 = _mm512_set1_epi8(0xF);
  const __m512i nibble_shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
  __m512i sumz[R];
  for (int r = 0; r < R; ++r) sumz[r] = _mm512_setzero_si512();
  for (int c = 0; c < QK_K / 64; ++c) {
    const __m512i scale = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c))),
        _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c + 1)), 1);
    const __m512i q4bits =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs) + c));
    const __m512i q4 = _mm512_and_si512(_mm512_srlv_epi64(q4bits, nibble_shift), m4);
    for (int r = 0; r < R; ++r) {
      const __m512i q8 = _mm512_loadu_si512(ys[r][i].qs + 64 * c);
      sumz[r] = _mm512_dpwssd_epi32(sumz[r], scale, _mm512_maddubs_epi16(q4, q8));
    }
  }
  for (int r = 0; r < R; ++r)
    sumi[r] = _mm256_add_epi32(_mm512_castsi512_si256(sumz[r]),
                               _mm512_extracti64x4_epi64(sumz[r], 1));
#else
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
  for (int c = 0; c < QK_K / 64; ++c) {
    const __m256i scale_l = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c + 0));
    const __m256i scale_h = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c + 1));
    const __m256i q4bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs) + c);
    const __m256i q4l = _mm256_and_si256(q4bits, m4);
    const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
    for (int r = 0; r < R; ++r) {
      const __m256i* q8 = reinterpret_cast<const __m256i*>(ys[r][i].qs) + 2 * c;
      const __m256i p16l =
          _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, _mm256_loadu_si256(q8)));
      const __m256i p16h =
          _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, _mm256_loadu_si256(q8 + 1)));
      sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16l, p16h));
    }
  }
#endif
}

// Q4_K, a panel of weight rows times up to 8 activation rows. What only the activations
// decide is made once per panel instead of once per weight row: each row's pair sums of
// bsums (as _mm_hadd_epi16 makes them for the minimums), two rows to a register, and its
// scale. Every int32 lane and every fp32 operation are RowsQ4K's, so the outputs are the
// same bits.
struct PanelQ4K {
  template <int R>
  static void run(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                  ActivationRows<block_q8_K> ys, float* out, int64_t out_stride) {
    constexpr int G = (R + 1) / 2;  // registers of the minimums' pair sums, 2 rows each
    // Per block: G * 16 pair sums, G * 8 negated scales (each row's over its 4 lanes; a
    // row past R zero), then R scales.
    constexpr int kPerBlock = G * 16 * 2 + G * 8 * 4 + R * 4;
    const int nb = n / QK_K;
    std::vector<uint8_t> made(static_cast<size_t>(nb) * kPerBlock);
    for (int i = 0; i < nb; ++i) {
      int16_t* sums = reinterpret_cast<int16_t*>(made.data() + static_cast<size_t>(i) * kPerBlock);
      float* nd = reinterpret_cast<float*>(sums + G * 16);
      float* d = nd + G * 8;
      for (int r = 0; r < 2 * G; ++r) {
        const block_q8_K* y = r < R ? &ys[r][i] : nullptr;
        const __m256i q8sums =
            y ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y->bsums))
              : _mm256_setzero_si256();
        _mm_storeu_si128(reinterpret_cast<__m128i*>(sums + 8 * r),
                         _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0),
                                        _mm256_extracti128_si256(q8sums, 1)));
        for (int l = 0; l < 4; ++l) nd[4 * r + l] = y ? -y->d : 0.f;
        if (y) d[r] = y->d;
      }
    }
    uint32_t utmp[4];
    for (int64_t j = 0; j < count; ++j) {
      const block_q4_K* x = reinterpret_cast<const block_q4_K*>(weights + j * row_bytes);
      __m256 acc[R];
      __m256 acc_m[G];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int g = 0; g < G; ++g) acc_m[g] = _mm256_setzero_ps();
      for (int i = 0; i < nb; ++i) {
        const float xd = fp16_to_fp32(x[i].d), xdmin = fp16_to_fp32(x[i].dmin);
        unpack_scales_mins_k4(x[i].scales, utmp);
        const __m256i mins_and_scales =
            _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
        const __m256i mins = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(mins_and_scales, 1));
        const __m256 dmin = _mm256_set1_ps(xdmin);
        const int16_t* sums =
            reinterpret_cast<const int16_t*>(made.data() + static_cast<size_t>(i) * kPerBlock);
        const float* nd = reinterpret_cast<const float*>(sums + G * 16);
        const float* di = nd + G * 8;
        for (int g = 0; g < G; ++g) {
          const __m256i prod = _mm256_madd_epi16(
              mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 16 * g)));
          acc_m[g] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(nd + 8 * g), dmin),
                                     _mm256_cvtepi32_ps(prod), acc_m[g]);
        }
        const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        __m256i sumi[R];
        q4k_block_sums<R>(x[i], _mm256_set_m128i(sc128, sc128), ys, i, sumi);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(di[r] * xd), _mm256_cvtepi32_ps(sumi[r]),
                                   acc[r]);
      }
      alignas(32) float m_lanes[G * 8];
      for (int g = 0; g < G; ++g) _mm256_store_ps(m_lanes + 8 * g, acc_m[g]);
      for (int r = 0; r < R; ++r) {
        const __m128 am = _mm_load_ps(m_lanes + 4 * r);
        __m128 m = _mm_add_ps(am, _mm_movehl_ps(am, am));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r * out_stride + j] = hsum_float_8(acc[r]) + _mm_cvtss_f32(m);
      }
    }
  }
};

// A panel of `Panel` (PanelQ4K, PanelQ6K): groups of up to kRowsAtOnce activation rows.
template <typename Panel>
static void panel_of(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                     const uint8_t* activations, int64_t activation_stride, int rows,
                     float* out, int64_t out_stride) {
  static_assert(kRowsAtOnce == 8, "one case per row count");
  for (int g = 0; g < rows; g += kRowsAtOnce) {
    const ActivationRows<block_q8_K> ys{activations + g * activation_stride, activation_stride};
    float* o = out + g * out_stride;
    switch (std::min(kRowsAtOnce, rows - g)) {
      case 8: Panel::template run<8>(n, weights, row_bytes, count, ys, o, out_stride); break;
      case 7: Panel::template run<7>(n, weights, row_bytes, count, ys, o, out_stride); break;
      case 6: Panel::template run<6>(n, weights, row_bytes, count, ys, o, out_stride); break;
      case 5: Panel::template run<5>(n, weights, row_bytes, count, ys, o, out_stride); break;
      case 4: Panel::template run<4>(n, weights, row_bytes, count, ys, o, out_stride); break;
      case 3: Panel::template run<3>(n, weights, row_bytes, count, ys, o, out_stride); break;
      case 2: Panel::template run<2>(n, weights, row_bytes, count, ys, o, out_stride); break;
      default: Panel::template run<1>(n, weights, row_bytes, count, ys, o, out_stride);
    }
  }
}

#ifdef PAGEDLLM_GGML_VNNI
// Q6_K in the VNNI build, as PanelQ4K: a register holds two of RowsQ6K's 32-value chunks
// (s = 0, 1 or 2, 3 of a 128-value half), each with its own scales and high bits, as the
// activations lie.
struct PanelQ6K {
template <int R>
static void run(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                ActivationRows<block_q8_K> ys, float* out, int64_t out_stride) {
  const int nb = n / QK_K;
  const __m512i m15 = _mm512_set1_epi8(15);
  // Chunks 0 and 1 take the high bits 0-1 and 2-3 of qh, moved to bits 4-5; chunks 2 and 3
  // take bits 4-5 (in place) and 6-7 (moved down 2).
  const __m512i high_01 = _mm512_inserti64x4(_mm512_set1_epi8(3), _mm256_set1_epi8(12), 1);
  const __m512i shift_01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i high_23 =
      _mm512_inserti64x4(_mm512_set1_epi8(48), _mm256_set1_epi8(-64), 1);
  const __m512i shift_23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  for (int64_t j = 0; j < count; ++j) {
    const block_q6_K* x = reinterpret_cast<const block_q6_K*>(weights + j * row_bytes);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
      const float xd = fp16_to_fp32(x[i].d);
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales));
      const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
      __m512i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
      for (int h = 0; h < QK_K / 128; ++h) {
        const __m512i ql = _mm512_loadu_si512(x[i].ql + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh) + h));
        const __m512i q6_01 = _mm512_or_si512(
            _mm512_and_si512(ql, m15),
            _mm512_sllv_epi16(_mm512_and_si512(qh, high_01), shift_01));
        const __m512i q6_23 = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16(ql, 4), m15),
            _mm512_srlv_epi16(_mm512_and_si512(qh, high_23), shift_23));
        __m256i scale[4];
        for (int c = 0; c < 4; ++c)
          scale[c] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(4 * h + c)));
        const __m512i scale_01 =
            _mm512_inserti64x4(_mm512_castsi256_si512(scale[0]), scale[1], 1);
        const __m512i scale_23 =
            _mm512_inserti64x4(_mm512_castsi256_si512(scale[2]), scale[3], 1);
        for (int r = 0; r < R; ++r) {
          const int8_t* q8 = ys[r][i].qs + 128 * h;
          sumi[r] = _mm512_dpwssd_epi32(
              sumi[r], scale_01, _mm512_maddubs_epi16(q6_01, _mm512_loadu_si512(q8)));
          sumi[r] = _mm512_dpwssd_epi32(
              sumi[r], scale_23, _mm512_maddubs_epi16(q6_23, _mm512_loadu_si512(q8 + 64)));
        }
      }
      for (int r = 0; r < R; ++r) {
        const block_q8_K& y = ys[r][i];
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
        const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
        const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]),
                                           _mm512_extracti64x4_epi64(sumi[r], 1));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y.d * xd),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(s, q8sclsub)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + j] = hsum_float_8(acc[r]);
  }
}
};

#endif

// Q4_1. A 32-value block leaves little integer work per float step, so the panel takes 16
// weight rows (VNNI build; 8 in the AVX2 build) at once with their 4-value groups
// interleaved: lane i of register t holds values 4t..4t+3 of row i, and one vpdpbusd (AVX2:
// vpmaddubsw, the 16-bit sums added over the block, then one vpmaddwd) with an activation
// group broadcast to every lane advances every row's dot product. Each block then costs
// one float step for all the rows. The arithmetic, per output and block b in order (the
// one-row dot does the same in scalar code, so both methods and both builds give the same
// bits):
//   S = sum of q_w * q_a (exact int32);  acc = fma(d_w * d_a, S, acc);
//   acc = fma(m_w, d_a * sum_a, acc)     (d_a * sum_a is exact in fp32)
static inline int32_t q4_1_block_sum(const block_q4_1& x, const block_q8_1& y) {
  const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs));
  const __m256i qx = bytes_from_nibbles_32(x.qs);
#ifdef PAGEDLLM_GGML_VNNI
  const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qx, qy);
#else
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), _mm256_set1_epi16(1));
#endif
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

static float dot_q4_1(int n, const void* vx, const void* vy) {
  const block_q4_1* x = static_cast<const block_q4_1*>(vx);
  const block_q8_1* y = static_cast<const block_q8_1*>(vy);
  float acc = 0.f;
  for (int b = 0; b < n / QK4_1; ++b) {
    const float da = fp16_to_fp32(y[b].d);
    acc = fmaf(fp16_to_fp32(x[b].d) * da, static_cast<float>(q4_1_block_sum(x[b], y[b])), acc);
    acc = fmaf(fp16_to_fp32(x[b].m), da * static_cast<float>(y[b].sum), acc);
  }
  return acc;
}

#ifdef PAGEDLLM_GGML_VNNI
constexpr int kInterleavedRows = 16;

// 16 rows of 8 dwords (z[p]: rows 2p and 2p+1) into 8 registers of 16 rows (t[d]: dword d
// of every row), in three rounds of two-source permutes.
static inline void transpose_16x8(const __m512i z[8], __m512i t[8]) {
  alignas(64) int32_t idx[6][16];
  for (int e = 0; e < 16; ++e) {
    idx[0][e] = 8 * (e % 4) + e / 4;  // rows 4q..4q+3, dwords 0-3
    idx[1][e] = idx[0][e] + 4;        // dwords 4-7
    idx[2][e] = (e % 8 / 4) * 16 + 4 * (e / 8) + e % 4;  // rows 8o..8o+7, dwords 0-1 (of 4)
    idx[3][e] = idx[2][e] + 8;                           // dwords 2-3
    idx[4][e] = (e / 8) * 16 + e % 8;                    // rows 0-15, the first dword
    idx[5][e] = idx[4][e] + 8;                           // the second
  }
  __m512i ix[6];
  for (int k = 0; k < 6; ++k) ix[k] = _mm512_load_si512(idx[k]);
  __m512i a[8], e[8];
  for (int q = 0; q < 4; ++q) {  // a[2q]: rows 4q..4q+3 dwords 0-3, a[2q+1]: dwords 4-7
    a[2 * q] = _mm512_permutex2var_epi32(z[2 * q], ix[0], z[2 * q + 1]);
    a[2 * q + 1] = _mm512_permutex2var_epi32(z[2 * q], ix[1], z[2 * q + 1]);
  }
  for (int o = 0; o < 2; ++o)      // e[4o + m]: rows 8o..8o+7, dwords 2m and 2m+1
    for (int h = 0; h < 2; ++h) {  // h: dwords 0-3 or 4-7
      const __m512i lo = a[4 * o + h], hi = a[4 * o + 2 + h];
      e[4 * o + 2 * h] = _mm512_permutex2var_epi32(lo, ix[2], hi);
      e[4 * o + 2 * h + 1] = _mm512_permutex2var_epi32(lo, ix[3], hi);
    }
  for (int m = 0; m < 4; ++m) {
    t[2 * m] = _mm512_permutex2var_epi32(e[m], ix[4], e[4 + m]);
    t[2 * m + 1] = _mm512_permutex2var_epi32(e[m], ix[5], e[4 + m]);
  }
}

// 32 values of 16 rows (z[p]: rows 2p and 2p+1) into `tile`: 8 registers' worth of 16
// lanes, lane i of register d holding values 4d..4d+3 of row i.
static inline void store_interleaved(const __m512i z[8], int32_t* tile) {
  __m512i t[8];
  transpose_16x8(z, t);
  for (int d = 0; d < 8; ++d) _mm512_storeu_si512(tile + 16 * d, t[d]);
}

// Block b of 16 weight rows (x[i]; a null row reads as zeros), interleaved into `tile`.
static inline void interleave_q4_1(const block_q4_1* const* x, int b, int32_t* tile) {
  static const block_q4_1 kZero = {};
  const __m512i m4 = _mm512_set1_epi8(0xF);
  const __m512i nibble_shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
  const __m512i pairs = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
  __m512i z[8];
  for (int p = 0; p < 8; ++p) {
    const block_q4_1& lo = x[2 * p] ? x[2 * p][b] : kZero;
    const block_q4_1& hi = x[2 * p + 1] ? x[2 * p + 1][b] : kZero;
    const __m256i two = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo.qs))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi.qs)), 1);
    // [lo's qs, lo's qs, hi's qs, hi's qs], then low nibbles and high nibbles of each
    const __m512i q = _mm512_permutexvar_epi64(pairs, _mm512_castsi256_si512(two));
    z[p] = _mm512_and_si512(_mm512_srlv_epi64(q, nibble_shift), m4);
  }
  store_interleaved(z, tile);
}

// R activation rows (their blocks ys[r], and per block ad[r] = d_a, as[r] = d_a * sum_a)
// times the interleaved rows of `tile`; the first `here` outputs stored at out[r].
template <int R>
static inline void interleaved_rows_q4_1(int nb, const int32_t* tile, const float* dw,
                                         const float* mw, const block_q8_1* const* ys,
                                         const float* const* ad, const float* const* as,
                                         float* const* out, int here) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m512i w[8];
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(tile + 128 * b + 16 * t);
    __m512i s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = _mm512_setzero_si512(), s1[r] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2)
      for (int r = 0; r < R; ++r) {
        const int32_t* q = reinterpret_cast<const int32_t*>(ys[r][b].qs);
        s0[r] = _mm512_dpbusd_epi32(s0[r], w[t], _mm512_set1_epi32(q[t]));
        s1[r] = _mm512_dpbusd_epi32(s1[r], w[t + 1], _mm512_set1_epi32(q[t + 1]));
      }
    const __m512 d = _mm512_loadu_ps(dw + 16 * b), m = _mm512_loadu_ps(mw + 16 * b);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(ad[r][b])), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(as[r][b]), acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << here) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out[r], mask, acc[r]);
}
#else
constexpr int kInterleavedRows = 8;

// 32 values of 8 rows (r[i]) into `tile`: 8 registers' worth of 8 lanes, lane i of
// register d holding values 4d..4d+3 of row i (the classic 8x8 transpose of dwords).
static inline void store_interleaved(const __m256i r[8], int32_t* tile) {
  __m256i u[8], v[8];
  for (int i = 0; i < 4; ++i) {
    u[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    u[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      v[4 * i + 2 * h] = _mm256_unpacklo_epi64(u[4 * i + h], u[4 * i + 2 + h]);
      v[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(u[4 * i + h], u[4 * i + 2 + h]);
    }
  // v[4i + k] holds dwords k and k + 4 of rows 4i..4i+3 (one per 128-bit half)
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 8 * k),
                        _mm256_permute2x128_si256(v[k], v[4 + k], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 8 * (k + 4)),
                        _mm256_permute2x128_si256(v[k], v[4 + k], 0x31));
  }
}

// Block b of 8 weight rows (x[i]; a null row reads as zeros), interleaved into `tile`.
static inline void interleave_q4_1(const block_q4_1* const* x, int b, int32_t* tile) {
  static const block_q4_1 kZero = {};
  __m256i r[8];
  for (int i = 0; i < 8; ++i) r[i] = bytes_from_nibbles_32((x[i] ? x[i][b] : kZero).qs);
  store_interleaved(r, tile);
}

template <int R>
static inline void interleaved_rows_q4_1(int nb, const int32_t* tile, const float* dw,
                                         const float* mw, const block_q8_1* const* ys,
                                         const float* const* ad, const float* const* as,
                                         float* const* out, int here) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const int32_t* wb = tile + 64 * b;
    __m256i p[R];  // 16-bit pair sums over the block: 8 x 2 x 15 x 128 fits
    for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 8 * t));
      for (int r = 0; r < R; ++r) {
        const int32_t* q = reinterpret_cast<const int32_t*>(ys[r][b].qs);
        p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(q[t])));
      }
    }
    const __m256 d = _mm256_loadu_ps(dw + 8 * b), m = _mm256_loadu_ps(mw + 8 * b);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p[r], ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(ad[r][b])), s, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(as[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float o[8];
    _mm256_store_ps(o, acc[r]);
    for (int i = 0; i < here; ++i) out[r][i] = o[i];
  }
}
#endif

static void panel_q4_1(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                       const uint8_t* activations, int64_t activation_stride, int rows,
                       float* out, int64_t out_stride) {
  constexpr int W = kInterleavedRows;
  const int nb = n / QK4_1;
  // Each activation row's d_a and d_a * sum_a per block, made once for the whole panel.
  std::vector<float> scales(static_cast<size_t>(rows) * nb * 2);
  for (int r = 0; r < rows; ++r) {
    const block_q8_1* y = reinterpret_cast<const block_q8_1*>(activations + r * activation_stride);
    float* ad = scales.data() + static_cast<size_t>(r) * nb * 2;
    for (int b = 0; b < nb; ++b) {
      ad[b] = fp16_to_fp32(y[b].d);
      ad[nb + b] = ad[b] * static_cast<float>(y[b].sum);
    }
  }
  std::vector<int32_t> tile(static_cast<size_t>(nb) * 8 * W);
  std::vector<float> dw(static_cast<size_t>(nb) * W), mw(static_cast<size_t>(nb) * W);
  for (int64_t p0 = 0; p0 < count; p0 += W) {
    const int here = static_cast<int>(std::min<int64_t>(W, count - p0));
    const block_q4_1* x[W];
    for (int i = 0; i < W; ++i)
      x[i] = i < here ? reinterpret_cast<const block_q4_1*>(weights + (p0 + i) * row_bytes)
                      : nullptr;
    for (int b = 0; b < nb; ++b) {
      interleave_q4_1(x, b, tile.data() + static_cast<size_t>(b) * 8 * W);
      for (int i = 0; i < W; ++i) {
        dw[W * b + i] = x[i] ? fp16_to_fp32(x[i][b].d) : 0.f;
        mw[W * b + i] = x[i] ? fp16_to_fp32(x[i][b].m) : 0.f;
      }
    }
    constexpr int kRows = 4;
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      const int group = std::min(kRows, rows - r0);
      const block_q8_1* ys[kRows];
      const float* ad[kRows];
      const float* as[kRows];
      float* o[kRows];
      for (int r = 0; r < group; ++r) {
        ys[r] = reinterpret_cast<const block_q8_1*>(activations + (r0 + r) * activation_stride);
        ad[r] = scales.data() + static_cast<size_t>(r0 + r) * nb * 2;
        as[r] = ad[r] + nb;
        o[r] = out + (r0 + r) * out_stride + p0;
      }
      const float* w_d = dw.data();
      const float* w_m = mw.data();
      switch (group) {
        case 4: interleaved_rows_q4_1<4>(nb, tile.data(), w_d, w_m, ys, ad, as, o, here); break;
        case 3: interleaved_rows_q4_1<3>(nb, tile.data(), w_d, w_m, ys, ad, as, o, here); break;
        case 2: interleaved_rows_q4_1<2>(nb, tile.data(), w_d, w_m, ys, ad, as, o, here); break;
        default: interleaved_rows_q4_1<1>(nb, tile.data(), w_d, w_m, ys, ad, as, o, here);
      }
    }
  }
}

// The panel each kernel's type takes: rows_panel's loop, unless it has its own.
template <typename Kernel, typename Block>
struct Panel {
  static constexpr auto run = rows_panel<Kernel, Block>;
};
template <>
struct Panel<RowsQ4K, block_q8_K> {
  static constexpr auto run = panel_of<PanelQ4K>;
};
template <>
struct Panel<RowsQ4_1, block_q8_1> {
  static constexpr auto run = panel_q4_1;
};
#ifdef PAGEDLLM_GGML_VNNI
template <>
struct Panel<RowsQ6K, block_q8_K> {
  static constexpr auto run = panel_of<PanelQ6K>;
};
#endif
