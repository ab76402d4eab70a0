// The gemm method of Q4_1 and Q4_K: interleaved weight rows, and the one-row dots that
// share their arithmetic (see below). dot_q4_K follows ggml v0.20.2's ggml_vec_dot_q4_K_q8_K
// (MIT license, notice in ggml_x86_quants.h) up to its float steps.
//
// Included by gguf_linear.cpp after ggml_x86_quants.h and before ggml_x86_gemm.h (whose
// Panel trait names these kernels), in the same namespaces, so no include guard.

// Q4_1 and Q4_K, interleaved. A block's scales cost float steps that a 32-value block
// (Q4_1) leaves little integer work to hide, and that K-quants must apply per 32 values; so
// these panels take 16 weight rows (VNNI build; 8 in the AVX2 build) at once with their
// 4-value groups interleaved: lane i of register t holds values 4t..4t+3 of row i, and one
// vpdpbusd (AVX2: vpmaddubsw, the 16-bit sums added over 32 values, then one vpmaddwd) with
// an activation group broadcast to every lane advances every row's dot product. A block's
// scales are then applied once for all the rows. The arithmetic, per output and block in
// order (the one-row dots below do the same, so both methods and both builds give the same
// bits):
//   Q4_1: S = sum of q_w * q_a (exact int32);  acc = fma(d_w * d_a, S, acc);
//         acc = fma(m_w, d_a * sum_a, acc)  (d_a * sum_a is exact in fp32)
//   Q4_K: I = sum over sub-blocks j of sc_j * (sum of q_w * q_a over j), M = sum of m_j * P_j
//         (P_j: the activations' sum over j), both exact in int32;
//         acc = fma(d_w * d_a, I, acc);  acc = fma(dmin_w * d_a, -M, acc)

// The sum of an int32 vector's lanes (hsum_i32_8 is ggml's).
static inline int32_t hsum_i32_4(__m128i s) {
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

static float dot_q4_1(int n, const void* vx, const void* vy) {
  const block_q4_1* x = static_cast<const block_q4_1*>(vx);
  const block_q8_1* y = static_cast<const block_q8_1*>(vy);
  const __m256i ones = _mm256_set1_epi16(1);
  float acc = 0.f;
  for (int b = 0; b < n / QK4_1; ++b) {
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs));
    const int32_t s = hsum_i32_8(
        _mm256_madd_epi16(_mm256_maddubs_epi16(bytes_from_nibbles_32(x[b].qs), qy), ones));
    const float da = fp16_to_fp32(y[b].d);
    acc = fmaf(fp16_to_fp32(x[b].d) * da, static_cast<float>(s), acc);
    acc = fmaf(fp16_to_fp32(x[b].m), da * static_cast<float>(y[b].sum), acc);
  }
  return acc;
}

static float dot_q4_K(int n, const void* vx, const void* vy) {
  const block_q4_K* x = static_cast<const block_q4_K*>(vx);
  const block_q8_K* y = static_cast<const block_q8_K*>(vy);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  uint32_t utmp[4];
  float acc = 0.f;
  for (int b = 0; b < n / QK_K; ++b) {
    unpack_scales_mins_k4(x[b].scales, utmp);
    const __m256i mins_and_scales =
        _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
    const __m128i sc128 = _mm256_castsi256_si128(mins_and_scales);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    __m256i sumi = _mm256_setzero_si256();
    for (int c = 0; c < QK_K / 64; ++c) {
      const __m256i q4bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[b].qs) + c);
      const __m256i* q8 = reinterpret_cast<const __m256i*>(y[b].qs) + 2 * c;
      const __m256i p16l = _mm256_madd_epi16(
          _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c)),
          _mm256_maddubs_epi16(_mm256_and_si256(q4bits, m4), _mm256_loadu_si256(q8)));
      const __m256i p16h = _mm256_madd_epi16(
          _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * c + 1)),
          _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4),
                               _mm256_loadu_si256(q8 + 1)));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
    }
    const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].bsums));
    const __m128i q8s = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums),
                                       _mm256_extracti128_si256(q8sums, 1));
    const int32_t m = hsum_i32_4(_mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s));
    acc = fmaf(fp16_to_fp32(x[b].d) * y[b].d, static_cast<float>(hsum_i32_8(sumi)), acc);
    acc = fmaf(fp16_to_fp32(x[b].dmin) * y[b].d, static_cast<float>(-m), acc);
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

// The sums of 32 products of R activation rows with the interleaved rows of tile[8][kW]
// (q[r]: the row's 32 activation values), one int32 lane per weight row.
#ifdef PAGEDLLM_GGML_VNNI
using LanesI = __m512i;
using LanesF = __m512;
template <int R>
static inline void sums_32(const int32_t* tile, const int8_t* const* q, LanesI* s) {
  __m512i s1[R];
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512(), s1[r] = _mm512_setzero_si512();
  for (int t = 0; t < 8; t += 2) {
    const __m512i w0 = _mm512_loadu_si512(tile + kW * t), w1 = _mm512_loadu_si512(tile + kW * (t + 1));
    for (int r = 0; r < R; ++r) {
      const int32_t* a = reinterpret_cast<const int32_t*>(q[r]);
      s[r] = _mm512_dpbusd_epi32(s[r], w0, _mm512_set1_epi32(a[t]));
      s1[r] = _mm512_dpbusd_epi32(s1[r], w1, _mm512_set1_epi32(a[t + 1]));
    }
  }
  for (int r = 0; r < R; ++r) s[r] = _mm512_add_epi32(s[r], s1[r]);
}
static inline LanesI lanes_add(LanesI a, LanesI b) { return _mm512_add_epi32(a, b); }
static inline LanesI lanes_mullo(LanesI a, LanesI b) { return _mm512_mullo_epi32(a, b); }
static inline LanesI lanes_madd16(LanesI acc, LanesI a, int32_t b) {
  return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(b));
}
static inline LanesI lanes_zero_i() { return _mm512_setzero_si512(); }
static inline LanesI lanes_neg(LanesI a) { return _mm512_sub_epi32(_mm512_setzero_si512(), a); }
static inline LanesI lanes_load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
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
#else
using LanesI = __m256i;
using LanesF = __m256;
template <int R>
static inline void sums_32(const int32_t* tile, const int8_t* const* q, LanesI* s) {
  __m256i p[R];  // 16-bit pair sums over the 32 values: 8 x 2 x 15 x 128 fits
  for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + kW * t));
    for (int r = 0; r < R; ++r) {
      const int32_t* a = reinterpret_cast<const int32_t*>(q[r]);
      p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(a[t])));
    }
  }
  for (int r = 0; r < R; ++r) s[r] = _mm256_madd_epi16(p[r], _mm256_set1_epi16(1));
}
static inline LanesI lanes_add(LanesI a, LanesI b) { return _mm256_add_epi32(a, b); }
static inline LanesI lanes_mullo(LanesI a, LanesI b) { return _mm256_mullo_epi32(a, b); }
static inline LanesI lanes_madd16(LanesI acc, LanesI a, int32_t b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(b)));
}
static inline LanesI lanes_zero_i() { return _mm256_setzero_si256(); }
static inline LanesI lanes_neg(LanesI a) { return _mm256_sub_epi32(_mm256_setzero_si256(), a); }
static inline LanesI lanes_load_i(const int32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
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
#endif

struct InterleavedQ4_1 {
  static constexpr int kBlock = QK4_1;
  using Weight = block_q4_1;
  using Activation = block_q8_1;
  struct Act {
    float d, d_sum;  // d_a, d_a * sum_a
  };
  struct Tile {
    int32_t q[8][kW];
    float d[kW], m[kW];
  };
  static Act act(const block_q8_1& y) {
    const float d = fp16_to_fp32(y.d);
    return {d, d * static_cast<float>(y.sum)};
  }
  static void interleave(const block_q4_1* const* x, int b, Tile& t) {
    static const block_q4_1 kZero = {};
    interleave_values([&](int i) { return bytes_from_nibbles_32((x[i] ? x[i][b] : kZero).qs); },
                      &t.q[0][0]);
    for (int i = 0; i < kW; ++i) {
      t.d[i] = x[i] ? fp16_to_fp32(x[i][b].d) : 0.f;
      t.m[i] = x[i] ? fp16_to_fp32(x[i][b].m) : 0.f;
    }
  }
  // acc[r] += activation row r's block b (ys[r][b], a[r][b]) times the tile's rows
  template <int R>
  static void add_block(const Tile& t, const Activation* const* ys, const Act* const* a, int b,
                        LanesF* acc) {
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = ys[r][b].qs;
    LanesI s[R];
    sums_32<R>(&t.q[0][0], q, s);
    const LanesF d = lanes_load_f(t.d), m = lanes_load_f(t.m);
    for (int r = 0; r < R; ++r) {
      acc[r] = lanes_step(acc[r], d, a[r][b].d, s[r]);
      acc[r] = lanes_fma(acc[r], m, a[r][b].d_sum);
    }
  }
};

struct InterleavedQ4K {
  static constexpr int kBlock = QK_K;
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
  template <int R>
  static void add_block(const Tile& t, const Activation* const* ys, const Act* const* a, int b,
                        LanesF* acc) {
    LanesI sums[R], s[R];
    for (int r = 0; r < R; ++r) sums[r] = lanes_zero_i();
    for (int j = 0; j < 8; ++j) {
      const int8_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = ys[r][b].qs + 32 * j;
      sums_32<R>(&t.q[j][0][0], q, s);
      const LanesI sc = lanes_load_i(t.scales[j]);
      for (int r = 0; r < R; ++r) sums[r] = lanes_add(sums[r], lanes_mullo(s[r], sc));
    }
    const LanesF d = lanes_load_f(t.d), dmin = lanes_load_f(t.dmin);
    for (int r = 0; r < R; ++r) {
      LanesI m = lanes_zero_i();
      for (int k = 0; k < 4; ++k) m = lanes_madd16(m, lanes_load_i(t.mins[k]), a[r][b].sums[k]);
      acc[r] = lanes_step(acc[r], d, a[r][b].d, sums[r]);
      acc[r] = lanes_step(acc[r], dmin, a[r][b].d, lanes_neg(m));
    }
  }
};

// R activation rows through the interleaved rows of `tile` (one per block); the first
// `here` outputs of each stored at out[r].
template <typename Kind, int R>
static void interleaved_rows(int nb, const typename Kind::Tile* tile,
                             const typename Kind::Activation* const* ys,
                             const typename Kind::Act* const* a, float* const* out, int here) {
  LanesF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = lanes_zero_f();
  for (int b = 0; b < nb; ++b) Kind::template add_block<R>(tile[b], ys, a, b, acc);
  for (int r = 0; r < R; ++r) lanes_store(out[r], acc[r], here);
}

// The interleaved panels' loops: kW weight rows at a time made into Kind::Tile blocks, then
// the activation rows through them 4 at a time. What only the activations decide
// (Kind::Act) is made once for the whole panel. Both buffers are the thread's own, kept
// from call to call (a decode step makes hundreds of these calls).
template <typename Kind>
static void interleaved_panel(int n, const uint8_t* weights, int64_t row_bytes, int64_t count,
                              const uint8_t* activations, int64_t activation_stride, int rows,
                              float* out, int64_t out_stride) {
  using Weight = typename Kind::Weight;
  using Activation = typename Kind::Activation;
  using Act = typename Kind::Act;
  const int nb = n / Kind::kBlock;
  auto activation_row = [&](int r) {
    return reinterpret_cast<const Activation*>(activations + r * activation_stride);
  };
  thread_local std::vector<Act> acts;
  thread_local std::vector<typename Kind::Tile> tile;
  acts.resize(static_cast<size_t>(rows) * nb);
  tile.resize(nb);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < nb; ++b) acts[static_cast<size_t>(r) * nb + b] = Kind::act(activation_row(r)[b]);
  constexpr int kRows = 4;
  for (int64_t p0 = 0; p0 < count; p0 += kW) {
    const int here = static_cast<int>(std::min<int64_t>(kW, count - p0));
    const Weight* x[kW];
    for (int i = 0; i < kW; ++i)
      x[i] = i < here ? reinterpret_cast<const Weight*>(weights + (p0 + i) * row_bytes) : nullptr;
    for (int b = 0; b < nb; ++b) Kind::interleave(x, b, tile[b]);
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
        case 4: interleaved_rows<Kind, 4>(nb, tile.data(), ys, a, o, here); break;
        case 3: interleaved_rows<Kind, 3>(nb, tile.data(), ys, a, o, here); break;
        case 2: interleaved_rows<Kind, 2>(nb, tile.data(), ys, a, o, here); break;
        default: interleaved_rows<Kind, 1>(nb, tile.data(), ys, a, o, here);
      }
    }
  }
}
