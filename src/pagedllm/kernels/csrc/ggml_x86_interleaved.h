// The gemm method of Q4_0, Q4_1, Q4_K and Q6_K: interleaved weight rows, and the one-row
// dots that share their arithmetic (see below). dot_q4_K and dot_q6_K follow ggml v0.20.2's
// ggml_vec_dot_q4_K_q8_K and ggml_vec_dot_q6_K_q8_K (MIT license, notice in
// ggml_x86_quants.h) up to their float steps.
//
// Included by gguf_linear.cpp after ggml_x86_quants.h and ggml_x86_gemm.h, in the same
// namespaces, so no include guard. It ends with the Panel trait that names every type's
// gemm kernel.

// Q4_0, Q4_1, Q4_K and Q6_K, interleaved. A block's scales cost float steps that a 32-value block
// (Q4_0, Q4_1) leaves little integer work to hide, and that K-quants must apply per 32 or 16
// values; so these panels take 16 weight rows (VNNI build; 8 in the AVX2 build) at once with their
// 4-value groups interleaved: lane i of register t holds values 4t..4t+3 of row i, and one vpdpbusd
// (AVX2: vpmaddubsw, the 16-bit sums added over 32 values, then one vpmaddwd) with an activation
// group broadcast to every lane advances every row's dot product. A block's scales are then applied
// once for all the rows. The arithmetic, per output and block in order (the one-row dots below do
// the same, so both methods and both builds give the same bits):
//   Q4_0: S = sum of q_w * q_a - 8 * sum_a (exact int32);  acc = fma(d_w * d_a, S, acc)
//   Q4_1: S = sum of q_w * q_a (exact int32);  acc = fma(d_w * d_a, S, acc);
//         acc = fma(m_w, d_a * sum_a, acc)  (d_a * sum_a is exact in fp32)
//   Q4_K: I = sum over sub-blocks j of sc_j * (sum of q_w * q_a over j), M = sum of m_j * P_j
//         (P_j: the activations' sum over j), both exact in int32;
//         acc = fma(d_w * d_a, I, acc);  acc = fma(dmin_w * d_a, -M, acc)
//   Q6_K: I = sum over the 16 sub-blocks j of sc_j * (sum of q_w * q_a over j), exact in int32
//         (the one-row dot sums u_w * q_a, u_w = q_w + 32, less 32 * sum_j sc_j * P_j; the
//         interleaved panels sum q_w * (q_a + 128), less 128 * C, C = sum_j sc_j * (sum of
//         q_w over j), made with the tile: the same integer);  acc = fma(d_w * d_a, I, acc)

#if !defined(PAGEDLLM_GGUF_Q4_K_INTERLEAVED_MIN_ROWS) || \
    !defined(PAGEDLLM_GGUF_Q6_K_INTERLEAVED_MIN_ROWS)
#error "PAGEDLLM_GGUF_Q4_K/Q6_K_INTERLEAVED_MIN_ROWS must be defined by the build (policy.py)"
#endif

// f(0), .., f(N - 1): unrolled, each index an integral_constant (shifts and offsets made of
// it are then known when compiled), or a plain loop
template <int N, bool unrolled, typename F, int... I>
static inline void for_each_index(F f, std::integer_sequence<int, I...> = {}) {
  if constexpr (!unrolled)
    for (int i = 0; i < N; ++i) f(i);
  else if constexpr (sizeof...(I) < N)
    for_each_index<N, true>(f, std::make_integer_sequence<int, N>{});
  else
    (f(std::integral_constant<int, I>{}), ...);
}

// The sum of an int32 vector's lanes (hsum_i32_8 is ggml's).
static inline int32_t hsum_i32_4(__m128i s) {
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Q4_0's and Q4_1's one-row dot, with InterleavedNibbles' arithmetic (below): Q4_1 adds its
// minimum's step, Q4_0 takes the offset of 8 off the block's integer sum.
template <typename Block>
static float dot_nibbles(int n, const void* vx, const void* vy) {
  const Block* x = static_cast<const Block*>(vx);
  const block_q8_1* y = static_cast<const block_q8_1*>(vy);
  const __m256i ones = _mm256_set1_epi16(1);
  float acc = 0.f;
  for (int b = 0; b < n / 32; ++b) {
    prefetch_weights_ahead(x + b);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs));
    int32_t s = hsum_i32_8(
        _mm256_madd_epi16(_mm256_maddubs_epi16(bytes_from_nibbles_32(x[b].qs), qy), ones));
    if constexpr (!std::is_same_v<Block, block_q4_1>) s -= 8 * y[b].sum;
    const float da = fp16_to_fp32(y[b].d);
    acc = fmaf(fp16_to_fp32(x[b].d) * da, static_cast<float>(s), acc);
    if constexpr (std::is_same_v<Block, block_q4_1>)
      acc = fmaf(fp16_to_fp32(x[b].m), da * static_cast<float>(y[b].sum), acc);
  }
  return acc;
}
constexpr auto dot_q4_0 = dot_nibbles<block_q4_0>;
constexpr auto dot_q4_1 = dot_nibbles<block_q4_1>;

// Q4_K for a few rows (below GGUF_Q4_K_INTERLEAVED_MIN_ROWS): each weight block unpacked
// once for R activation rows, with the interleaved method's arithmetic; R = 1 is the
// one-row dot.
struct RowsQ4K {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_K> ys, float* out,
                  int64_t out_stride) {
    const block_q4_K* x = static_cast<const block_q4_K*>(vx);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    uint32_t utmp[4];
    float acc[R] = {};
    for (int b = 0; b < n / QK_K; ++b) {
      prefetch_weights_ahead(x + b);
      unpack_scales_mins_k4(x[b].scales, utmp);
      const __m256i mins_and_scales =
          _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
      const __m128i sc128 = _mm256_castsi256_si128(mins_and_scales);
      const __m256i scales = _mm256_set_m128i(sc128, sc128);
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      for (int c = 0; c < QK_K / 64; ++c) {
        const __m256i q4bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs) + c);
        const __m256i q4l = _mm256_and_si256(q4bits, m4);
        const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
        const __m256i scale_l = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c));
        const __m256i scale_h = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c + 1));
        for (int r = 0; r < R; ++r) {
          const __m256i* q8 = reinterpret_cast<const __m256i*>(ys[r][b].qs) + 2 * c;
          const __m256i p16l =
              _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, _mm256_loadu_si256(q8)));
          const __m256i p16h =
              _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, _mm256_loadu_si256(q8 + 1)));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p16l, p16h));
        }
      }
      const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
      const float xd = fp16_to_fp32(x[b].d), xdmin = fp16_to_fp32(x[b].dmin);
      for (int r = 0; r < R; ++r) {
        const block_q8_K& y = ys[r][b];
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
        const __m128i q8s = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums),
                                           _mm256_extracti128_si256(q8sums, 1));
        const int32_t m = hsum_i32_4(_mm_madd_epi16(mins, q8s));
        acc[r] = fmaf(xd * y.d, static_cast<float>(hsum_i32_8(sumi[r])), acc[r]);
        acc[r] = fmaf(xdmin * y.d, static_cast<float>(-m), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = acc[r];
  }
};

static float dot_q4_K(int n, const void* vx, const void* vy) {
  float out;
  RowsQ4K::run<1>(n, vx, {static_cast<const uint8_t*>(vy), 0}, &out, 0);
  return out;
}

// Values 32g..32g+31 of a Q6_K block as unsigned 6-bit bytes (q + 32): the low 4 bits
// from ql (bytes 64h + 32(c%2).., low or high nibble by c/2), the high 2 from qh (bytes
// 32h.., bits 2c and 2c+1), for g = 4h + c, as ggml lays them out. g is known when
// compiled, so each shift is an immediate; the high bits take one 16-bit shift to bits 4-5
// (what it carries across a byte boundary is masked off).
template <typename G>
static inline __m256i q6_values_32(const block_q6_K& x, G g) {
  constexpr int h = G::value / 4, c = G::value % 4;
  const __m256i ql =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.ql + 64 * h + 32 * (c % 2)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qh + 32 * h));
  const __m256i nibbles = c < 2 ? ql : _mm256_srli_epi16(ql, 4);
  const __m256i high = c < 2   ? _mm256_slli_epi16(qh, 4 - 2 * c)
                       : c > 2 ? _mm256_srli_epi16(qh, 2)
                               : qh;
  return _mm256_or_si256(_mm256_and_si256(nibbles, _mm256_set1_epi8(15)),
                         _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}

// Q6_K for a few rows (below GGUF_Q6_K_INTERLEAVED_MIN_ROWS, where interleaving 16 weight
// rows costs more than it saves): each weight block unpacked once for R activation rows,
// with the interleaved method's arithmetic; R = 1 is the one-row dot.
struct RowsQ6K {
  template <int R>
  static void run(int n, const void* vx, ActivationRows<block_q8_K> ys, float* out,
                  int64_t out_stride) {
    const block_q6_K* x = static_cast<const block_q6_K*>(vx);
    float acc[R] = {};
    for (int b = 0; b < n / QK_K; ++b) {
      prefetch_weights_ahead(x + b);
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].scales));
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
      // sub-blocks 0-7's scales in both halves, then 8-15's: one in-lane byte shuffle then
      // gives a group's two scales, each over its 8 pair sums
      const __m256i scale_halves[2] = {_mm256_permute2x128_si256(scales_16, scales_16, 0x00),
                                       _mm256_permute2x128_si256(scales_16, scales_16, 0x11)};
      for_each_index<QK_K / 32, true>([&](auto g) {
        const __m256i q6 = q6_values_32(x[b], g);
        constexpr char lo = 2 * (2 * g % 8), hi = 2 * ((2 * g + 1) % 8);
        const __m256i scale = _mm256_shuffle_epi8(
            scale_halves[g / 4],
            _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
                             lo, lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                             hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1));
        for (int r = 0; r < R; ++r) {
          const __m256i q8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ys[r][b].qs) + g);
          sumi[r] =
              _mm256_add_epi32(sumi[r], _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q6, q8)));
        }
      });
      const float xd = fp16_to_fp32(x[b].d);
      for (int r = 0; r < R; ++r) {  // the offset's 32 * sum_j sc_j * P_j taken off before one sum
        const block_q8_K& y = ys[r][b];
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
        const int32_t sum = hsum_i32_8(_mm256_sub_epi32(sumi[r], offset));
        acc[r] = fmaf(xd * y.d, static_cast<float>(sum), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = acc[r];
  }
};

static float dot_q6_K(int n, const void* vx, const void* vy) {
  float out;
  RowsQ6K::run<1>(n, vx, {static_cast<const uint8_t*>(vy), 0}, &out, 0);
  return out;
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

// 32 values of each row (values(i): row i's, 32 bytes) interleaved into tile[8][16].
template <typename Values>
static inline void interleave_values(Values values, int32_t* tile) {
  __m512i z[8], t[8];
  for (int p = 0; p < 8; ++p)
    z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(values(2 * p)), values(2 * p + 1), 1);
  transpose_16x8(z, t);
  for (int d = 0; d < 8; ++d) _mm512_storeu_si512(tile + 16 * d, t[d]);
}
#else
constexpr int kInterleavedRows = 8;

// 32 values of each row (values(i): row i's, 32 bytes) interleaved into tile[8][8]: the
// classic 8x8 transpose of dwords.
template <typename Values>
static inline void interleave_values(Values values, int32_t* tile) {
  __m256i r[8], u[8], v[8];
  for (int i = 0; i < 8; ++i) r[i] = values(i);
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
#endif
constexpr int kW = kInterleavedRows;

// The sums of 32 products of R activation rows with H sources of kW interleaved weight rows
// each (w(h, t): source h's dword t, t < 8; q[r]: the row's 32 activation values), one
// int32 lane per weight row: s[h][r].
#ifdef PAGEDLLM_GGML_VNNI
using LanesI = __m512i;
using LanesF = __m512;
template <int R, int H, typename W>
static inline void sums_32(W w, const int8_t* const* q, LanesI (*s)[R]) {
  static_assert(H == 1, "a source holds a whole group of rows in this build");
  if constexpr (R >= 8) {  // R chains hide vpdpbusd's latency without a second set
    for (int r = 0; r < R; ++r) s[0][r] = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      const __m512i wt = w(0, t);
      for (int r = 0; r < R; ++r) {
        const int32_t* a = reinterpret_cast<const int32_t*>(q[r]);
        s[0][r] = _mm512_dpbusd_epi32(s[0][r], wt, _mm512_set1_epi32(a[t]));
      }
    }
    return;
  }
  __m512i s1[R];
  for (int r = 0; r < R; ++r) s[0][r] = _mm512_setzero_si512(), s1[r] = _mm512_setzero_si512();
  for (int t = 0; t < 8; t += 2) {
    const __m512i w0 = w(0, t), w1 = w(0, t + 1);
    for (int r = 0; r < R; ++r) {
      const int32_t* a = reinterpret_cast<const int32_t*>(q[r]);
      s[0][r] = _mm512_dpbusd_epi32(s[0][r], w0, _mm512_set1_epi32(a[t]));
      s1[r] = _mm512_dpbusd_epi32(s1[r], w1, _mm512_set1_epi32(a[t + 1]));
    }
  }
  for (int r = 0; r < R; ++r) s[0][r] = _mm512_add_epi32(s[0][r], s1[r]);
}
// acc[0][r] += sc(0) * (sums_32 of activation row r); sc(0): each weight row's scale
template <int R, int H, typename W, typename S>
static inline void add_scaled_32(W w, const int8_t* const* q, S sc, __m512i (*acc)[R]) {
  __m512i s[H][R];
  sums_32<R, H>(w, q, s);
  const __m512i scale = sc(0);
  for (int r = 0; r < R; ++r)
    acc[0][r] = _mm512_add_epi32(acc[0][r], _mm512_mullo_epi32(s[0][r], scale));
}
// acc[r] += sc * (the sum of 16 products of activation row r, q[r], unsigned, with the
// interleaved rows' signed dwords w(0..3)); sc: each row's scale (lane_scales_low/high)
template <int R, typename W>
static inline void add_scaled_16(W w, const uint8_t* const* q, __m512i sc, __m512i* acc) {
  __m512i v[4];
  for (int t = 0; t < 4; ++t) v[t] = w(t);
  for (int r = 0; r < R; ++r) {
    const int32_t* a = reinterpret_cast<const int32_t*>(q[r]);
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(a[0]), v[0]);
    for (int t = 1; t < 4; ++t) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(a[t]), v[t]);
    acc[r] = _mm512_add_epi32(acc[r], _mm512_mullo_epi32(s, sc));
  }
}
// The scale in each lane's low or high 16 bits as add_scaled_16 takes it: the int32
static inline __m512i lane_scales_low(__m512i pairs) {
  return _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16);
}
static inline __m512i lane_scales_high(__m512i pairs) { return _mm512_srai_epi32(pairs, 16); }
static inline LanesI lanes_madd16(LanesI acc, LanesI a, int32_t b) {
  return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(b));
}
static inline LanesI lanes_zero_i() { return _mm512_setzero_si512(); }
static inline LanesI lanes_neg(LanesI a) { return _mm512_sub_epi32(_mm512_setzero_si512(), a); }
static inline LanesI lanes_sub(LanesI a, LanesI b) { return _mm512_sub_epi32(a, b); }
static inline LanesI lanes_load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
static inline void lanes_store_i(int32_t* p, LanesI v) { _mm512_storeu_si512(p, v); }
static inline LanesF lanes_zero_f() { return _mm512_setzero_ps(); }
static inline LanesF lanes_load_f(const float* p) { return _mm512_loadu_ps(p); }
// acc + (d * da) * s, with s converted from int32
static inline LanesF lanes_step(LanesF acc, LanesF d, float da, LanesI s) {
  return _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(da)), _mm512_cvtepi32_ps(s), acc);
}
static inline LanesF lanes_fma(LanesF acc, LanesF m, float x) {
  return _mm512_fmadd_ps(m, _mm512_set1_ps(x), acc);
}
static inline void lanes_store(float* out, LanesF v, int here) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << here) - 1), v);
}
// kW fp16 values at p, as floats
static inline LanesF load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
using LanesI = __m256i;
using LanesF = __m256;
// The sums as 16-bit pairs, each lane's two halves adding to its sum (8 x 2 x 15 x 128 fits).
// Each row's sum is two chains, the even and the odd dwords', added at the end: one chain
// of 8 dependent additions ran slower, and GCC's own tree of them held all 32 products of
// 4 rows at once and spilled them; the empty asm keeps the two chains as written
// (docs/kernels.md, "Two chains per row"). Integer additions: the same sums. Each activation
// value is broadcast once for all H sources.
template <int R, int H, typename W>
static inline void pair_sums_32(W w, const int8_t* const* q, __m256i (*p)[R]) {
  __m256i half[2][H][R];
  for (int c = 0; c < 2; ++c)
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) half[c][h][r] = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) {
    __m256i wt[H];
    for (int h = 0; h < H; ++h) wt[h] = w(h, t);
    for (int r = 0; r < R; ++r) {
      const __m256i at = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(q[r])[t]);
      for (int h = 0; h < H; ++h) {
        __m256i& c = half[t % 2][h][r];
        c = _mm256_add_epi16(c, _mm256_maddubs_epi16(wt[h], at));
        asm("" : "+x"(c));
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) p[h][r] = _mm256_add_epi16(half[0][h][r], half[1][h][r]);
}
template <int R, int H, typename W>
static inline void sums_32(W w, const int8_t* const* q, LanesI (*s)[R]) {
  __m256i p[H][R];
  pair_sums_32<R, H>(w, q, p);
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) s[h][r] = _mm256_madd_epi16(p[h][r], _mm256_set1_epi16(1));
}
// acc[h][r] += sc(h) * (sums_32 of activation row r); sc(h): each weight row's scale (0..63),
// made after the sums, so that it holds no register while they are. For several rows the
// scale is made a 16-bit pair once, so that one vpmaddwd per row both adds its pair sums and
// scales them (30720 x 63 x 2 fits), in place of a vpmaddwd and a vpmulld.
template <int R, int H, typename W, typename S>
static inline void add_scaled_32(W w, const int8_t* const* q, S sc, __m256i (*acc)[R]) {
  __m256i p[H][R];
  pair_sums_32<R, H>(w, q, p);
  for (int h = 0; h < H; ++h) {
    const __m256i scale = sc(h);
    if constexpr (R == 1) {
      const __m256i s = _mm256_madd_epi16(p[h][0], _mm256_set1_epi16(1));
      acc[h][0] = _mm256_add_epi32(acc[h][0], _mm256_mullo_epi32(s, scale));
    } else {
      const __m256i pair = _mm256_or_si256(scale, _mm256_slli_epi32(scale, 16));
      for (int r = 0; r < R; ++r)
        acc[h][r] = _mm256_add_epi32(acc[h][r], _mm256_madd_epi16(p[h][r], pair));
    }
  }
}
// acc[r] += sc * (the sum of 16 products of activation row r, q[r], unsigned, with the
// interleaved rows' signed dwords w(0..3)); sc: each row's scale (lane_scales_low/high) in
// both 16-bit halves, so that one vpmaddwd both adds a lane's two 16-bit sums and scales
// them (each sums 4 products, at most 4 x 255 x 32 = 32640 in size: it fits;
// tests/test_gguf_q6_k_bounds.py)
template <int R, typename W>
static inline void add_scaled_16(W w, const uint8_t* const* q, __m256i sc, __m256i* acc) {
  __m256i v[4];
  for (int t = 0; t < 4; ++t) v[t] = w(t);
  for (int r = 0; r < R; ++r) {
    const int32_t* a = reinterpret_cast<const int32_t*>(q[r]);
    __m256i p[2];
    for (int h = 0; h < 2; ++h)
      p[h] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(a[2 * h]), v[2 * h]),
                              _mm256_maddubs_epi16(_mm256_set1_epi32(a[2 * h + 1]), v[2 * h + 1]));
    acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(p[0], sc),
                                                       _mm256_madd_epi16(p[1], sc)));
  }
}
// The scale in each lane's low or high 16 bits as add_scaled_16 takes it: in both halves
static inline __m256i lane_scales_low(__m256i pairs) {
  return _mm256_blend_epi16(pairs, _mm256_slli_epi32(pairs, 16), 0xAA);
}
static inline __m256i lane_scales_high(__m256i pairs) {
  return _mm256_blend_epi16(pairs, _mm256_srli_epi32(pairs, 16), 0x55);
}
static inline LanesI lanes_madd16(LanesI acc, LanesI a, int32_t b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(b)));
}
static inline LanesI lanes_zero_i() { return _mm256_setzero_si256(); }
static inline LanesI lanes_neg(LanesI a) { return _mm256_sub_epi32(_mm256_setzero_si256(), a); }
static inline LanesI lanes_sub(LanesI a, LanesI b) { return _mm256_sub_epi32(a, b); }
static inline LanesI lanes_load_i(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
static inline void lanes_store_i(int32_t* p, LanesI v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}
static inline LanesF lanes_zero_f() { return _mm256_setzero_ps(); }
static inline LanesF lanes_load_f(const float* p) { return _mm256_loadu_ps(p); }
static inline LanesF lanes_step(LanesF acc, LanesF d, float da, LanesI s) {
  return _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(da)), _mm256_cvtepi32_ps(s), acc);
}
static inline LanesF lanes_fma(LanesF acc, LanesF m, float x) {
  return _mm256_fmadd_ps(m, _mm256_set1_ps(x), acc);
}
static inline void lanes_store(float* out, LanesF v, int here) {
  alignas(32) float o[8];
  _mm256_store_ps(o, v);
  for (int i = 0; i < here; ++i) out[i] = o[i];
}
static inline LanesF load_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// {f(0), .., f(N - 1)}
template <int N, typename F, int... I>
static inline auto array_of(F f, std::integer_sequence<int, I...> = {}) {
  if constexpr (sizeof...(I) < N)
    return array_of<N>(f, std::make_integer_sequence<int, N>{});
  else
    return std::array<decltype(f(0)), N>{f(I)...};
}

// The interleaved layout's units (gguf_interleaved_layout.h) as kW int32 lanes, lane i from
// row i: plain vectors, so that shifts and masks read as arithmetic in both builds.
using LaneInts = int32_t __attribute__((vector_size(4 * kW)));
static inline LaneInts load_lanes(const uint8_t* p) {
  LaneInts v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline LanesI as_lanes(LaneInts v) { return reinterpret_cast<LanesI>(v); }
static inline LaneInts as_lane_ints(LanesI v) { return reinterpret_cast<LaneInts>(v); }
constexpr int32_t kLowNibbles = 0x0F0F0F0F;
// unit u of a group's field (`unit` bytes each), `rows` being the field's start advanced to
// the first row read: with u known when compiled, an address is a register and a constant
static inline const uint8_t* unit_at(const uint8_t* rows, int u, int unit) {
  return rows + static_cast<ptrdiff_t>(u) * kInterleavedGroupRows * unit;
}

// Each kind reads a block of kW weight rows through a source: FromTile, a Tile the panel
// interleaved from the file's rows for this call, or (Q4_0, Q4_1, Q4_K) FromGroup, the rows
// lo..lo+kW-1 of a group's block in the interleaved layout (p: the block), read in place.
// add_block's arithmetic is the same for both, so are the bits. add_block<R, H> takes H
// sources (H > 1: the halves of a group's block, one activation row) and their
// accumulators acc[h][r].
// Q4_0 and Q4_1: 32 four-bit quants q and a fp16 scale d per block. Q4_1 adds a minimum m
// (value d * q + m); Q4_0 offsets its quants by 8 (value d * (q - 8)), which comes off the
// integer sum exactly (S - 8 * sum_a) before the one float step.
template <typename Block>
struct InterleavedNibbles {
  static constexpr bool kMin = std::is_same_v<Block, block_q4_1>;
  static constexpr int kBlock = 32;
  // Activation rows per pass of a weight tile. Q4_1's float steps per 32 values leave
  // nothing to gain from 8 (measured: scripts/int8_mac_ceiling.py).
  static constexpr int kPassRows = 4;
  using Weight = Block;
  using Activation = block_q8_1;
  struct Act {
    float d, d_sum;  // d_a, d_a * sum_a (Q4_1's minimum)
    int32_t offset;  // 8 * sum_a (Q4_0's quants), else 0
  };
  struct Tile {
    int32_t q[8][kW];
    float d[kW], m[kW];
  };
  static Act act(const block_q8_1& y) {
    const float d = fp16_to_fp32(y.d);
    return {d, d * static_cast<float>(y.sum), kMin ? 0 : 8 * y.sum};
  }
  static void interleave(const Block* const* x, int b, Tile& t) {
    static const Block kZero = {};
    interleave_values([&](int i) { return bytes_from_nibbles_32((x[i] ? x[i][b] : kZero).qs); },
                      &t.q[0][0]);
    for (int i = 0; i < kW; ++i) {
      t.d[i] = x[i] ? fp16_to_fp32(x[i][b].d) : 0.f;
      if constexpr (kMin) t.m[i] = x[i] ? fp16_to_fp32(x[i][b].m) : 0.f;
    }
  }
  struct FromTile {
    const Tile& t;
    LanesI q(int u) const { return lanes_load_i(t.q[u]); }  // values 4u..4u+3
    LanesF d() const { return lanes_load_f(t.d); }
    LanesF m() const { return lanes_load_f(t.m); }
  };
  struct FromGroup {
    static constexpr int kD = kMin ? interleaved::kQ4_1D : interleaved::kQ4_0D;
    static constexpr int kQs = kMin ? interleaved::kQ4_1Qs : interleaved::kQ4_0Qs;
    const uint8_t *rows2, *rows4;  // the block advanced by the first row's 2- and 4-byte units
    FromGroup(const uint8_t* block, int first)
        : rows2(block + 2 * first), rows4(block + 4 * first) {}
    LanesI q(int u) const {
      const LaneInts v = load_lanes(unit_at(rows4 + kQs, u % 4, 4));
      return as_lanes((v >> 4 * (u / 4)) & kLowNibbles);
    }
    LanesF d() const { return load_halves(rows2 + kD); }
    LanesF m() const { return load_halves(rows2 + interleaved::kQ4_1M); }
  };
  static void fill(const FromGroup& w, Tile& t) {
    for (int u = 0; u < 8; ++u) lanes_store_i(t.q[u], w.q(u));
    lanes_store(t.d, w.d(), kW);
    if constexpr (kMin) lanes_store(t.m, w.m(), kW);
  }
  // acc[h][r] += activation row r's block b (ys[r][b], a[r][b]) times source h's rows
  template <int R, int H, typename W>
  static void add_block(const W* w, const Activation* const* ys, const Act* const* a, int b,
                        LanesF (*acc)[R]) {
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = ys[r][b].qs;
    LanesI s[H][R];
    sums_32<R, H>([&](int h, int u) { return w[h].q(u); }, q, s);
    for (int h = 0; h < H; ++h) {
      const LanesF d = w[h].d();
      LanesF m{};
      if constexpr (kMin) m = w[h].m();
      for (int r = 0; r < R; ++r) {
        if constexpr (kMin) {
          acc[h][r] = lanes_step(acc[h][r], d, a[r][b].d, s[h][r]);
          acc[h][r] = lanes_fma(acc[h][r], m, a[r][b].d_sum);
        } else {
          const LanesI offset_sum = as_lanes(as_lane_ints(s[h][r]) - a[r][b].offset);
          acc[h][r] = lanes_step(acc[h][r], d, a[r][b].d, offset_sum);
        }
      }
    }
  }
};
using InterleavedQ4_0 = InterleavedNibbles<block_q4_0>;
using InterleavedQ4_1 = InterleavedNibbles<block_q4_1>;

struct InterleavedQ4K {
  static constexpr int kBlock = QK_K;
  // 8 activation rows per pass in the VNNI build: each weight load then feeds 8 vpdpbusd,
  // not 4, and the rows' 8 accumulators hide its latency (1.25-1.6x the products per
  // second of 4 rows, scripts/int8_mac_ceiling.py); the AVX2 build's 16 registers hold 4.
  static constexpr int kPassRows = kW == 16 ? 8 : 4;
  using Weight = block_q4_K;
  using Activation = block_q8_K;
  struct Act {
    float d;
    int32_t sums[4];  // P_2k and P_2k+1, the sums over sub-blocks, as 16-bit pairs
  };
  struct Tile {
    int32_t q[8][8][kW];  // per sub-block
    int32_t scales[8][kW];
    int32_t mins[4][kW];  // m_2k and m_2k+1 as 16-bit pairs
    float d[kW], dmin[kW];
  };
  static Act act(const block_q8_K& y) {
    Act a;
    a.d = y.d;
    const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.sums),
                     _mm_hadd_epi16(_mm256_castsi256_si128(q8sums),
                                    _mm256_extracti128_si256(q8sums, 1)));
    return a;
  }
  static void interleave(const block_q4_K* const* x, int b, Tile& t) {
    static const block_q4_K kZero = {};
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int j = 0; j < 8; ++j) {
      const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
      interleave_values(
          [&](int i) {
            const uint8_t* qs = (x[i] ? x[i][b] : kZero).qs + 32 * (j / 2);
            return _mm256_and_si256(
                _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)), shift),
                m4);
          },
          &t.q[j][0][0]);
    }
    uint32_t utmp[4];
    for (int i = 0; i < kW; ++i) {
      const block_q4_K& w = x[i] ? x[i][b] : kZero;
      unpack_scales_mins_k4(w.scales, utmp);
      const uint8_t* u = reinterpret_cast<const uint8_t*>(utmp);  // 8 scales, then 8 minimums
      for (int j = 0; j < 8; ++j) t.scales[j][i] = u[j];
      for (int k = 0; k < 4; ++k) t.mins[k][i] = u[8 + 2 * k] | (u[9 + 2 * k] << 16);
      t.d[i] = fp16_to_fp32(w.d);
      t.dmin[i] = fp16_to_fp32(w.dmin);
    }
  }
  struct FromTile {
    const Tile& t;
    LanesI q(int j, int u) const { return lanes_load_i(t.q[j][u]); }  // sub-block j, dword u
    LanesI scale(int j) const { return lanes_load_i(t.scales[j]); }
    LanesI mins(int k) const { return lanes_load_i(t.mins[k]); }
    LanesF d() const { return lanes_load_f(t.d); }
    LanesF dmin() const { return lanes_load_f(t.dmin); }
  };
  // The 6-bit scales and minimums unpacked as ggml's get_scale_min_k4 does, for all the
  // rows at once, from the three dwords of each row's 12 bytes.
  struct FromGroup {
    const uint8_t *rows2, *rows4;  // the block advanced by the first row's 2- and 4-byte units
    LaneInts d0, d1, d2;
    FromGroup(const uint8_t* block, int first)
        : rows2(block + 2 * first),
          rows4(block + 4 * first),
          d0(load_lanes(unit_at(rows4 + interleaved::kQ4KScales, 0, 4))),
          d1(load_lanes(unit_at(rows4 + interleaved::kQ4KScales, 1, 4))),
          d2(load_lanes(unit_at(rows4 + interleaved::kQ4KScales, 2, 4))) {}
    LanesI q(int j, int u) const {
      const LaneInts v = load_lanes(unit_at(rows4 + interleaved::kQ4KQs, 8 * (j / 2) + u, 4));
      return as_lanes((v >> 4 * (j % 2)) & kLowNibbles);
    }
    LanesI scale(int j) const {
      const int s = 8 * (j % 4);
      return as_lanes(j < 4 ? (d0 >> s) & 63 : ((d2 >> s) & 0xF) | (((d0 >> (s + 6)) & 3) << 4));
    }
    LaneInts min(int j) const {
      const int s = 8 * (j % 4);
      return j < 4 ? (d1 >> s) & 63 : ((d2 >> (s + 4)) & 0xF) | (((d1 >> (s + 6)) & 3) << 4);
    }
    LanesI mins(int k) const { return as_lanes(min(2 * k) | (min(2 * k + 1) << 16)); }
    LanesF d() const { return load_halves(rows2 + interleaved::kQ4KD); }
    LanesF dmin() const { return load_halves(rows2 + interleaved::kQ4KDmin); }
  };
  static void fill(const FromGroup& w, Tile& t) {
    for (int j = 0; j < 8; ++j) {
      for (int u = 0; u < 8; ++u) lanes_store_i(t.q[j][u], w.q(j, u));
      lanes_store_i(t.scales[j], w.scale(j));
    }
    for (int k = 0; k < 4; ++k) lanes_store_i(t.mins[k], w.mins(k));
    lanes_store(t.d, w.d(), kW);
    lanes_store(t.dmin, w.dmin(), kW);
  }
  template <int R, int H, typename W>
  static void add_block(const W* w, const Activation* const* ys, const Act* const* a, int b,
                        LanesF (*acc)[R]) {
    LanesI sums[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) sums[h][r] = lanes_zero_i();
    // Sub-block j known when compiled, its nibble shift and scale field constants (faster at
    // 1-4 activation rows, docs/kernels.md "Sub-blocks known when compiled"); the VNNI
    // build's 8-row passes keep a loop, unrolled they ran a few percent slower.
    for_each_index<8, (R < 8)>([&](auto j) {
      const int8_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = ys[r][b].qs + 32 * j;
      add_scaled_32<R, H>([&](int h, int u) { return w[h].q(j, u); }, q,
                          [&](int h) { return w[h].scale(j); }, sums);
    });
    for (int h = 0; h < H; ++h) {
      const LanesF d = w[h].d(), dmin = w[h].dmin();
      for (int r = 0; r < R; ++r) {
        LanesI m = lanes_zero_i();
        for (int k = 0; k < 4; ++k) m = lanes_madd16(m, w[h].mins(k), a[r][b].sums[k]);
        acc[h][r] = lanes_step(acc[h][r], d, a[r][b].d, sums[h][r]);
        acc[h][r] = lanes_step(acc[h][r], dmin, a[r][b].d, lanes_neg(m));
      }
    }
  }
};

struct InterleavedQ6K {
  static constexpr int kBlock = QK_K;
  static constexpr int kPassRows = kW == 16 ? 8 : 4;  // as Q4_K's
  using Weight = block_q6_K;
  using Activation = block_q8_K;
  struct Act {
    uint8_t qs[QK_K];  // q_a + 128, unsigned: the weights' C then stands for the offset
    float d;
  };
  struct Tile {
    int32_t q[8][8][kW];  // q_w, signed; per 32 values: dwords 0-3 sub-block 2g, 4-7 2g+1
    int32_t scales[16][kW];  // sc_j as add_scaled_16 takes it (lane_scales_low/high)
    int32_t offsets[kW];     // 128 * C
    float d[kW];
  };
  static Act act(const block_q8_K& y) {
    Act a;
    for (int g = 0; g < QK_K / 32; ++g) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs) + g);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.qs) + g,
                          _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))));
    }
    a.d = y.d;
    return a;
  }
  static void interleave(const block_q6_K* const* x, int b, Tile& t) {
    static const block_q6_K kZero = {};
    const block_q6_K* w[kW];
    for (int i = 0; i < kW; ++i) {
      w[i] = x[i] ? x[i] + b : &kZero;
      prefetch_weights_ahead(w[i]);
    }
    for_each_index<8, true>([&](auto g) {
      interleave_values(
          [&](int i) { return _mm256_sub_epi8(q6_values_32(*w[i], g), _mm256_set1_epi8(32)); },
          &t.q[g][0][0]);
    });
    // a row's 16 scales as 16-bit values are its 8 pairs of them
    alignas(64) int32_t pairs[8][kW];
    interleave_values(
        [&](int i) {
          const auto* scales = reinterpret_cast<const __m128i*>(w[i]->scales);
          return _mm256_cvtepi8_epi16(_mm_loadu_si128(scales));
        },
        &pairs[0][0]);
    for (int k = 0; k < 8; ++k) {
      const LanesI pair = lanes_load_i(pairs[k]);
      lanes_store_i(t.scales[2 * k], lane_scales_low(pair));
      lanes_store_i(t.scales[2 * k + 1], lane_scales_high(pair));
    }
    // C: the block's I for activations that are all 1
    static const uint8_t kOnes[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const uint8_t* const ones[1] = {kOnes};
    const FromTile from{t};
    LanesI c = lanes_zero_i();
    for (int j = 0; j < 16; ++j)
      add_scaled_16<1>([&](int u) { return from.q16(j, u); }, ones, from.scale(j), &c);
    lanes_store_i(t.offsets, c);
    for (int i = 0; i < kW; ++i) {
      t.offsets[i] *= 128;
      t.d[i] = fp16_to_fp32(w[i]->d);
    }
  }
  struct FromTile {
    const Tile& t;
    LanesI q16(int j, int u) const { return lanes_load_i(t.q[0][0] + (4 * j + u) * kW); }
    LanesI scale(int j) const { return lanes_load_i(t.scales[j]); }
    LanesI offsets() const { return lanes_load_i(t.offsets); }
    LanesF d() const { return lanes_load_f(t.d); }
  };
  template <int R, int H, typename W>
  static void add_block(const W* w, const Activation* const*, const Act* const* a, int b,
                        LanesF (*acc)[R]) {
    static_assert(H == 1, "Q6_K's panels are tiles, one source at a time");
    LanesI sums[R];
    for (int r = 0; r < R; ++r) sums[r] = lanes_zero_i();
    for (int j = 0; j < 16; ++j) {
      const uint8_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = a[r][b].qs + 16 * j;
      add_scaled_16<R>([&](int u) { return w->q16(j, u); }, q, w->scale(j), sums);
    }
    const LanesF d = w->d();
    const LanesI offsets = w->offsets();
    for (int r = 0; r < R; ++r)
      acc[0][r] = lanes_step(acc[0][r], d, a[r][b].d, lanes_sub(sums[r], offsets));
  }
};

// R activation rows through H x kW weight rows (source(b, h): block b's source for rows
// h * kW..); the first `here` outputs of each stored at out[r]. Flattened: in this large
// file GCC left add_block and its per-sub-block lambdas as calls, their vectors passed
// through memory (the AVX2 build's 64-row products at 0.4x their speed).
template <typename Kind, int R, int H, typename Source>
__attribute__((flatten)) static void interleaved_rows(int nb, Source source,
                                                      const typename Kind::Activation* const* ys,
                                                      const typename Kind::Act* const* a,
                                                      float* const* out, int here) {
  LanesF acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = lanes_zero_f();
  // One activation row takes a block's H sources at once, each activation value broadcast
  // once for all of them; more rows take one at a time, their sums filling the registers.
  constexpr int at_once = R == 1 ? H : 1;
  for (int b = 0; b < nb; ++b)
    for (int h = 0; h < H; h += at_once) {
      const auto w = array_of<at_once>([&](int i) { return source(b, h + i); });
      Kind::template add_block<R, at_once>(w.data(), ys, a, b, acc + h);
    }
  for (int h = 0; h < H && h * kW < here; ++h)
    for (int r = 0; r < R; ++r)
      lanes_store(out[r] + h * kW, acc[h][r], std::min(kW, here - h * kW));
}

// The interleaved panels' loops: H x kW weight rows at a time (rows_at(p0, here): a source
// of rows p0.., as interleaved_rows takes it), the activation rows through them
// Kind::kPassRows at a time.
// What only the activations decide (Kind::Act) is made once for the whole panel, in a
// buffer of the thread's own, kept from call to call (a decode step makes hundreds of
// these calls).
template <typename Kind, int H, typename RowsAt>
static void weight_row_passes(int n, int64_t count, const uint8_t* activations,
                              int64_t activation_stride, int rows, float* out,
                              int64_t out_stride, RowsAt rows_at) {
  using Activation = typename Kind::Activation;
  using Act = typename Kind::Act;
  const int nb = n / Kind::kBlock;
  auto activation_row = [&](int r) {
    return reinterpret_cast<const Activation*>(activations + r * activation_stride);
  };
  thread_local std::vector<Act> acts;
  acts.resize(static_cast<size_t>(rows) * nb);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < nb; ++b)
      acts[static_cast<size_t>(r) * nb + b] = Kind::act(activation_row(r)[b]);
  constexpr int kRows = Kind::kPassRows;
  for (int64_t p0 = 0; p0 < count; p0 += H * kW) {
    const int here = static_cast<int>(std::min<int64_t>(H * kW, count - p0));
    const auto source = rows_at(p0, here);
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      const int group = std::min(kRows, rows - r0);
      const Activation* ys[kRows];
      const Act* a[kRows];
      float* o[kRows];
      for (int r = 0; r < group; ++r) {
        ys[r] = activation_row(r0 + r);
        a[r] = acts.data() + static_cast<size_t>(r0 + r) * nb;
        o[r] = out + (r0 + r) * out_stride + p0;
      }
      switch (group) {
        case 8: interleaved_rows<Kind, 8, H>(nb, source, ys, a, o, here); break;
        case 7: interleaved_rows<Kind, 7, H>(nb, source, ys, a, o, here); break;
        case 6: interleaved_rows<Kind, 6, H>(nb, source, ys, a, o, here); break;
        case 5: interleaved_rows<Kind, 5, H>(nb, source, ys, a, o, here); break;
        case 4: interleaved_rows<Kind, 4, H>(nb, source, ys, a, o, here); break;
        case 3: interleaved_rows<Kind, 3, H>(nb, source, ys, a, o, here); break;
        case 2: interleaved_rows<Kind, 2, H>(nb, source, ys, a, o, here); break;
        default: interleaved_rows<Kind, 1, H>(nb, source, ys, a, o, here);
      }
    }
  }
}

// The weight rows as the file stores them, interleaved into a Tile per block for each pass
// (the thread's own buffer, kept from call to call).
template <typename Kind>
static void interleaved_panel(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                              const uint8_t* activations, int64_t activation_stride, int rows,
                              float* out, int64_t out_stride) {
  using Weight = typename Kind::Weight;
  using Tile = typename Kind::Tile;
  const int nb = n / Kind::kBlock;
  thread_local std::vector<Tile> tile;
  tile.resize(nb);
  auto rows_at = [&](int64_t p0, int here) {
    const Weight* x[kW];
    for (int i = 0; i < kW; ++i)
      x[i] = i < here ? reinterpret_cast<const Weight*>(weights + (p0 + i) * row_bytes) : nullptr;
    for (int b = 0; b < nb; ++b) Kind::interleave(x, b, tile[b]);
    const Tile* t = tile.data();
    return [t](int b, int) { return typename Kind::FromTile{t[b]}; };
  };
  weight_row_passes<Kind, 1>(n, count, activations, activation_stride, rows, out, out_stride,
                             rows_at);
}

// The weight rows in the interleaved layout (gguf_interleaved_layout.h); `weights` starts a
// group and `count` is a whole number of groups. Up to `in_place_rows` activation rows
// they are read in place, a whole group's block at a time (the AVX2 build's two passes of
// 8 rows read it block by block together, so each cache line is used up while it is held;
// a pass of 8 rows over the whole group, then the other 8, streamed Q4_K weights at about
// two thirds of the speed); above, each pass unpacks them into a Tile once for its passes
// of activation rows.
template <typename Kind, int in_place_rows>
static void grouped_panel(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                          const uint8_t* activations, int64_t activation_stride, int rows,
                          float* out, int64_t out_stride) {
  using Tile = typename Kind::Tile;
  using FromGroup = typename Kind::FromGroup;
  constexpr int64_t G = kInterleavedGroupRows;
  constexpr int64_t block_bytes = G * sizeof(typename Kind::Weight);
  const int nb = n / Kind::kBlock;
  auto group_of = [&](int64_t p0) { return weights + p0 / G * G * row_bytes; };
  if (rows <= in_place_rows) {
    auto in_place = [&](int64_t p0, int) {
      const uint8_t* group = group_of(p0);
      return [group](int b, int h) { return FromGroup{group + b * block_bytes, h * kW}; };
    };
    weight_row_passes<Kind, G / kW>(n, count, activations, activation_stride, rows, out,
                                    out_stride, in_place);
    return;
  }
  thread_local std::vector<Tile> tile;
  tile.resize(nb);
  auto unpacked = [&](int64_t p0, int) {
    const uint8_t* group = group_of(p0);
    const int lo = static_cast<int>(p0 % G);
    for (int b = 0; b < nb; ++b) Kind::fill(FromGroup{group + b * block_bytes, lo}, tile[b]);
    const Tile* t = tile.data();
    return [t](int b, int) { return typename Kind::FromTile{t[b]}; };
  };
  weight_row_passes<Kind, 1>(n, count, activations, activation_stride, rows, out, out_stride,
                             unpacked);
}

// Below `min_rows` activation rows, Few's rows kernel (rows_panel's loop); from it on, the
// interleaved panel of Kind. Both give the same bits.
template <typename Few, typename Kind, int min_rows>
static void few_or_interleaved(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                               const uint8_t* activations, int64_t activation_stride, int rows,
                               float* out, int64_t out_stride) {
  (rows < min_rows ? rows_panel<Few, typename Kind::Activation> : interleaved_panel<Kind>)(
      n, weights, row_bytes, count, activations, activation_stride, rows, out, out_stride);
}

// The panel each kernel's type takes: rows_panel's loop, unless it has its own.
template <typename Kernel, typename Block>
struct Panel {
  static constexpr auto run = rows_panel<Kernel, Block>;
};
template <>
struct Panel<RowsQ4K, block_q8_K> {
  static constexpr auto run = few_or_interleaved<RowsQ4K, InterleavedQ4K,
                                                 PAGEDLLM_GGUF_Q4_K_INTERLEAVED_MIN_ROWS>;
};
template <>
struct Panel<InterleavedQ4_1, block_q8_1> {
  static constexpr auto run = interleaved_panel<InterleavedQ4_1>;
};
template <>
struct Panel<InterleavedQ4_0, block_q8_1> {
  static constexpr auto run = interleaved_panel<InterleavedQ4_0>;
};
template <>
struct Panel<RowsQ6K, block_q8_K> {
  static constexpr auto run = few_or_interleaved<RowsQ6K, InterleavedQ6K,
                                                 PAGEDLLM_GGUF_Q6_K_INTERLEAVED_MIN_ROWS>;
};

