// Paged attention on the CPU: reads K/V through the block table while it computes.
//
// One call first stores the step's new K/V rows into their slots of the caches (rounded to
// a half-precision cache's type as torch's conversion rounds: to nearest, ties to even),
// then covers a layer's whole flat batch: decode rows and chunked-prefill rows
// (causal inside the chunk, full over the cached context). It follows a work list built
// once per step in Python (attention/cpu.py, from the rules of kernels/policy.py): a work
// item is one sequence, a range of KV heads, a tile of query rows and a range of keys; the
// query heads that share a KV head are processed together, so each K/V row is read once
// for all of them. Keys are visited in chunks of up to 16, with an online softmax and fp32
// accumulators. A prompt tile gathers one KV head's rows through the block table into a
// small fp32 tile (converting half-precision caches on load); a single query row (a
// decode) reads its chunk token by token, all its heads side by side, in the pool's own
// order. Decode rows the list split along their context are merged by log-sum-exp.
// Threads come from torch's own pool (at::parallel_for).
//
// A layer with an attention window W (window > 0) lets the query at position p see the
// keys at positions (p - W, p] only: an item starts at its first row's window, so whole
// chunks behind the window are never read, and each row masks the keys of a chunk that
// fall before its own window. window = 0: full causal attention, as before.
//
// Requires AVX2, FMA and F16C; head_dim must be a multiple of 8.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"
#include "layer_kernels.h"

namespace {

constexpr int kKeyChunk = 16;  // keys per inner step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kKeyChunk == 16, "score rows are handled as two 8-float vectors");

using pagedllm::exp8;
using pagedllm::hmax;
using pagedllm::hsum;
using pagedllm::load8;

inline float dot(const float* a, const float* b, int d) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    s0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), s0);
    s1 = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), s1);
  }
  if (i < d) s0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), s0);
  return hsum(_mm256_add_ps(s0, s1));
}

// ------------------------------------------------------------------ the problem
struct Problem {
  const float* query;  // [T, H, D], rows and heads at any stride (views of a fused QKV)
  int64_t q_stride_t, q_stride_h;
  float* out;          // [T, H, D]
  const void* k_cache;  // [num_blocks, block_size, KVH, D]
  const void* v_cache;
  const int64_t* block_tables;  // [B, max_blocks]
  const int64_t* query_start;   // [B + 1]
  const int64_t* context_lens;  // [B]
  int64_t max_blocks;
  int block_size;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  float scale;
  int64_t window;  // attention window in tokens; 0: none
};

// One unit of work: sequence b, KV heads [g0, g1), query rows [row0, row0 + rows), keys
// [key_begin, key_end); a row of the work list tensor, in this order. `partial` >= 0 marks
// one split of a decode row: its unnormalised result goes to the partial buffers instead
// of `out`.
constexpr int kItemFields = 8;
struct WorkItem {
  int64_t b;
  int g0, g1;
  int64_t row0;
  int rows;
  int64_t key_begin;
  int64_t key_end;
  int64_t partial;
};

// Per-thread scratch, query vectors ordered (head, row, head of the group).
struct Scratch {
  std::vector<float> q;     // [M, D] queries, times the scale
  std::vector<float> acc;   // [M, D]
  std::vector<float> m, l;  // [M] running max and sum
  std::vector<float> s;     // [M, kKeyChunk] scores, then probabilities
  std::vector<float> k, v;  // [kKeyChunk, D] rows converted from a half-precision cache
  std::vector<float> kt;    // [D, kKeyChunk] transposed keys (large tiles)
  std::vector<int64_t> head_offset;  // [M] a decode row's vectors' heads, as offsets
  void reserve(int max_m, int d) {
    head_offset.resize(max_m);
    q.resize(max_m * d);
    acc.resize(max_m * d);
    m.resize(max_m);
    l.resize(max_m);
    s.resize(max_m * kKeyChunk);
    k.resize(kKeyChunk * d);
    v.resize(kKeyChunk * d);
    kt.resize(d * kKeyChunk);
  }
};

template <typename T>
inline const float* row_as_float(const T* src, float* dst, int d) {
  for (int i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  return dst;
}
inline const float* row_as_float(const float* src, float*, int) { return src; }

// The sums of eight vectors, as one vector: [sum(a[0]), ..., sum(a[7])].
inline __m256 sum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// Scores s[m, j] = q_m . k_j for M query vectors and n keys.
inline void scores(const float* q, const float* const* krow, int M, int n, int d, float* s,
                   float* kt) {
  if (M < 8) {  // a short tile: eight keys at a time per query vector, one reduction
    for (int j0 = 0; j0 < n; j0 += 8) {
      const float* k8[8];  // past the last key, any valid row (its scores are masked)
      for (int jj = 0; jj < 8; ++jj) k8[jj] = krow[j0 + jj < n ? j0 + jj : 0];
      for (int m = 0; m < M; ++m) {
        __m256 acc[8];
        for (int jj = 0; jj < 8; ++jj) acc[jj] = _mm256_setzero_ps();
        for (int c = 0; c < d; c += 8) {
          const __m256 qv = _mm256_loadu_ps(q + m * d + c);
          for (int jj = 0; jj < 8; ++jj)
            acc[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k8[jj] + c), acc[jj]);
        }
        _mm256_storeu_ps(s + m * kKeyChunk + j0, sum8(acc));
      }
    }
    return;
  }
  // Larger tiles: transpose the keys once, then 4 queries x 16 keys per register block.
  for (int j = 0; j < kKeyChunk; ++j)
    for (int i = 0; i < d; ++i) kt[i * kKeyChunk + j] = j < n ? krow[j][i] : 0.0f;
  int m = 0;
  for (; m + 4 <= M; m += 4) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    const float* qm = q + m * d;
    for (int i = 0; i < d; ++i) {
      const __m256 k0 = _mm256_loadu_ps(kt + i * kKeyChunk);
      const __m256 k1 = _mm256_loadu_ps(kt + i * kKeyChunk + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 qv = _mm256_broadcast_ss(qm + r * d + i);
        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_ps(s + (m + r) * kKeyChunk, a[r][0]);
      _mm256_storeu_ps(s + (m + r) * kKeyChunk + 8, a[r][1]);
    }
  }
  for (; m < M; ++m)
    for (int j = 0; j < n; ++j) s[m * kKeyChunk + j] = dot(q + m * d, krow[j], d);
}

// acc[c:c+8W] += sum_j p[j] * v_j[c:c+8W], the W accumulators held in registers (W is a
// compile-time constant so that the compiler can keep them there).
template <int W>
inline void accumulate_span(float* acc, const float* p, const float* const* vrow, int n, int c) {
  __m256 a[W];
  for (int i = 0; i < W; ++i) a[i] = _mm256_loadu_ps(acc + c + 8 * i);
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = vrow[j] + c;
    for (int i = 0; i < W; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(acc + c + 8 * i, a[i]);
}

// acc += sum_j p[j] * v_j over the head dimension: 64 dims at a time, then the rest.
inline void accumulate(float* acc, const float* p, const float* const* vrow, int n, int d) {
  int c = 0;
  for (; c + 64 <= d; c += 64) accumulate_span<8>(acc, p, vrow, n, c);
  for (; c < d; c += 8) accumulate_span<1>(acc, p, vrow, n, c);
}

// The online-softmax update of query vector m with this chunk's scores `sm` (visible
// keys first, the rest masked): sm becomes p, acc and the sum are rescaled, then
// acc += p . V. Keys before `hidden` (behind the row's window) are masked too; their p is 0.
inline void softmax_step(Scratch& sc, int m, float* sm, int visible, const float* const* vrow,
                         int d, int hidden) {
  for (int j = 0; j < hidden; ++j) sm[j] = kNegInf;
  for (int j = visible; j < kKeyChunk; ++j) sm[j] = kNegInf;
  const float chunk_max = std::max(hmax(_mm256_loadu_ps(sm)), hmax(_mm256_loadu_ps(sm + 8)));
  const float m_new = std::max(sc.m[m], chunk_max);
  const __m256 mv = _mm256_set1_ps(m_new);
  const __m256 p0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(sm), mv));
  const __m256 p1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(sm + 8), mv));
  _mm256_storeu_ps(sm, p0);
  _mm256_storeu_ps(sm + 8, p1);
  float* am = sc.acc.data() + m * d;
  if (m_new != sc.m[m]) {
    const float alpha = sc.m[m] == kNegInf ? 0.0f : std::exp(sc.m[m] - m_new);
    const __m256 av = _mm256_set1_ps(alpha);
    for (int x = 0; x < d; x += 8) _mm256_storeu_ps(am + x, _mm256_mul_ps(av, _mm256_loadu_ps(am + x)));
    sc.l[m] *= alpha;
    sc.m[m] = m_new;
  }
  sc.l[m] += hsum(_mm256_add_ps(p0, p1));
  accumulate(am, sm, vrow, visible, d);
}

inline void prefetch_rows(const char* first, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(first + off, _MM_HINT_T1);
}

// dst = acc / sum: a query vector's output once all its keys are in (0 without any).
inline void store_normalized(float* dst, const float* acc, float sum, int d) {
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int x = 0; x < d; ++x) dst[x] = acc[x] * inv;
}

// A tile of several query rows (a prompt chunk); never a split (splits are decode rows).
template <typename T>
void run_item(const Problem& pb, const WorkItem& it, Scratch& sc) {
  const int d = pb.head_dim;
  const int group = pb.num_heads / pb.num_kv_heads;
  const int per_head = it.rows * group;  // query vectors of one KV head
  const int M = per_head * (it.g1 - it.g0);
  const int64_t q0 = pb.query_start[it.b];
  const int64_t q_len = pb.query_start[it.b + 1] - q0;
  const int64_t first_pos = pb.context_lens[it.b] - q_len;  // position of query row 0
  const T* kc = static_cast<const T*>(pb.k_cache);
  const T* vc = static_cast<const T*>(pb.v_cache);
  const int64_t* table = pb.block_tables + it.b * pb.max_blocks;
  const int64_t token_stride = static_cast<int64_t>(pb.num_kv_heads) * d;
  const int64_t block_stride = token_stride * pb.block_size;

  // Vector (head g, row r, i): query[q0 + row0 + r, g * group + i], times the scale.
  for (int g = it.g0; g < it.g1; ++g)
    for (int r = 0; r < it.rows; ++r)
      for (int i = 0; i < group; ++i) {
        const float* src = pb.query + (q0 + it.row0 + r) * pb.q_stride_t + (g * group + i) * pb.q_stride_h;
        float* dst = sc.q.data() + ((g - it.g0) * per_head + r * group + i) * d;
        for (int x = 0; x < d; ++x) dst[x] = src[x] * pb.scale;
      }
  std::fill(sc.acc.begin(), sc.acc.begin() + M * d, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + M, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + M, 0.0f);

  // Causal: row r (position first_pos + row0 + r) sees keys up to its own position.
  const int64_t key_end = std::min(it.key_end, first_pos + it.row0 + it.rows);
  const int64_t heads_bytes = static_cast<int64_t>(it.g1 - it.g0) * d * sizeof(T);
  const float* krow[kKeyChunk];
  const float* vrow[kKeyChunk];
  int64_t k0 = it.key_begin;
  // With a window, nothing before the first row's window start is read.
  if (pb.window > 0) k0 = std::max(k0, first_pos + it.row0 - pb.window + 1);
  while (k0 < key_end) {
    // A chunk never crosses a block boundary: its rows sit at one stride in one block.
    const int64_t in_block = k0 % pb.block_size;
    const int n = static_cast<int>(
        std::min<int64_t>({kKeyChunk, key_end - k0, pb.block_size - in_block}));
    const int64_t base = table[k0 / pb.block_size] * block_stride + in_block * token_stride;
    const int64_t next = k0 + n;
    if (next < key_end) {  // the next chunk may sit anywhere in the pool: fetch it early
      const int64_t nb = table[next / pb.block_size] * block_stride +
                         (next % pb.block_size) * token_stride + it.g0 * d;
      const int nn = static_cast<int>(std::min<int64_t>(kKeyChunk, pb.block_size - next % pb.block_size));
      for (int j = 0; j < nn; ++j) {
        prefetch_rows(reinterpret_cast<const char*>(kc + nb + j * token_stride), heads_bytes);
        prefetch_rows(reinterpret_cast<const char*>(vc + nb + j * token_stride), heads_bytes);
      }
    }
    for (int g = it.g0; g < it.g1; ++g) {
      const int64_t head_base = base + g * d;
      for (int j = 0; j < n; ++j) {
        krow[j] = row_as_float(kc + head_base + j * token_stride, sc.k.data() + j * d, d);
        vrow[j] = row_as_float(vc + head_base + j * token_stride, sc.v.data() + j * d, d);
      }
      const int mg = (g - it.g0) * per_head;
      float* s = sc.s.data() + mg * kKeyChunk;
      scores(sc.q.data() + mg * d, krow, per_head, n, d, s, sc.kt.data());
      for (int r = 0; r < it.rows; ++r) {
        const int64_t pos = first_pos + it.row0 + r;
        const int64_t visible = std::min<int64_t>(n, pos + 1 - k0);
        if (visible <= 0) continue;  // the row's position is before this chunk
        // Keys of this chunk behind the row's window (later rows' windows start later).
        const int64_t hidden = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1 - k0) : 0;
        if (hidden >= visible) continue;  // the whole chunk is behind the row's window
        for (int i = 0; i < group; ++i) {
          const int m = mg + r * group + i;
          float* sm = sc.s.data() + m * kKeyChunk;
          softmax_step(sc, m, sm, static_cast<int>(visible), vrow, d, static_cast<int>(hidden));
        }
      }
    }
    k0 = next;
  }

  for (int g = it.g0; g < it.g1; ++g)
    for (int r = 0; r < it.rows; ++r)
      for (int i = 0; i < group; ++i) {
        const int m = (g - it.g0) * per_head + r * group + i;
        float* dst = pb.out + ((q0 + it.row0 + r) * pb.num_heads + g * group + i) * d;
        store_normalized(dst, sc.acc.data() + m * d, sc.l[m], d);
      }
}

// ------------------------------------------------------------ one query row (decode)
// A row's keys and values are read in the pool's order, token by token with the item's
// heads side by side, so the hardware streams each block instead of gathering one head's
// rows at a stride of a whole token. Its query vectors sit eight to a register for the
// online softmax; each vector's arithmetic is the same whichever lane it takes, so cutting
// a row into ranges of heads leaves its bits unchanged.

// span = W * 8 dims starting at c: acc[m] += p_m * v over the `group` query vectors that
// share this KV head.
template <int W, typename T>
inline void accumulate_group(float* acc, const float* p, const T* v, int group, int d, int c) {
  __m256 vv[W];
  for (int i = 0; i < W; ++i) vv[i] = load8(v + c + 8 * i);
  for (int g = 0; g < group; ++g) {
    const __m256 pg = _mm256_set1_ps(p[g]);
    float* a = acc + g * d + c;
    for (int i = 0; i < W; ++i)
      _mm256_storeu_ps(a + 8 * i, _mm256_fmadd_ps(pg, vv[i], _mm256_loadu_ps(a + 8 * i)));
  }
}

template <typename T>
void run_decode_item(const Problem& pb, const WorkItem& it, Scratch& sc, float* partial_acc,
                     float* partial_ml) {
  const int d = pb.head_dim;
  const int group = pb.num_heads / pb.num_kv_heads;
  const int M = (it.g1 - it.g0) * group;  // query vectors, (head, vector of its group)
  const int padded = (M + 7) / 8 * 8;
  const int64_t q0 = pb.query_start[it.b];
  const int64_t row = q0 + it.row0;
  const int64_t pos = pb.context_lens[it.b] - (pb.query_start[it.b + 1] - q0) + it.row0;
  const T* kc = static_cast<const T*>(pb.k_cache);
  const T* vc = static_cast<const T*>(pb.v_cache);
  const int64_t* table = pb.block_tables + it.b * pb.max_blocks;
  const int64_t token_stride = static_cast<int64_t>(pb.num_kv_heads) * d;
  const int64_t block_stride = token_stride * pb.block_size;

  float* q = sc.q.data();
  for (int m = 0; m < M; ++m) {
    const float* src = pb.query + row * pb.q_stride_t + (it.g0 * group + m) * pb.q_stride_h;
    for (int x = 0; x < d; ++x) q[m * d + x] = src[x] * pb.scale;
  }
  std::fill(q + M * d, q + padded * d, 0.0f);  // padding lanes score 0 and are dropped
  int64_t* head_offset = sc.head_offset.data();  // vector m's KV head, in the token's row
  for (int m = 0; m < padded; ++m)
    head_offset[m] = static_cast<int64_t>(std::min(m, M - 1) / group) * d;
  float* acc = sc.acc.data();
  float* mx = sc.m.data();
  float* sum = sc.l.data();
  float* p = sc.s.data();  // [kKeyChunk, padded] scores, then probabilities
  std::fill(acc, acc + M * d, 0.0f);
  std::fill(mx, mx + padded, kNegInf);
  std::fill(sum, sum + padded, 0.0f);

  // Causal, and with a window only the keys (pos - W, pos]: the row's own window start.
  const int64_t key_end = std::min(it.key_end, pos + 1);
  int64_t k0 = it.key_begin;
  if (pb.window > 0) k0 = std::max(k0, pos - pb.window + 1);
  const int64_t heads_offset = static_cast<int64_t>(it.g0) * d;
  while (k0 < key_end) {
    const int64_t in_block = k0 % pb.block_size;
    const int n = static_cast<int>(
        std::min<int64_t>({kKeyChunk, key_end - k0, pb.block_size - in_block}));
    const int64_t base =
        table[k0 / pb.block_size] * block_stride + in_block * token_stride + heads_offset;
    // Scores, key by key: eight query vectors' dot products summed in one reduction.
    for (int j = 0; j < n; ++j) {
      const T* kj = kc + base + j * token_stride;
      for (int m0 = 0; m0 < padded; m0 += 8) {
        const T* k[8];
        __m256 a[8];
        for (int i = 0; i < 8; ++i) {
          k[i] = kj + head_offset[m0 + i];
          a[i] = _mm256_setzero_ps();
        }
        const float* qm = q + m0 * d;
        for (int c = 0; c < d; c += 8)
          for (int i = 0; i < 8; ++i)
            a[i] = _mm256_fmadd_ps(load8(qm + i * d + c), load8(k[i] + c), a[i]);
        _mm256_storeu_ps(p + j * padded + m0, sum8(a));
      }
    }
    // The online softmax for eight vectors at once.
    for (int m0 = 0; m0 < padded; m0 += 8) {
      __m256 chunk_max = _mm256_loadu_ps(p + m0);
      for (int j = 1; j < n; ++j)
        chunk_max = _mm256_max_ps(chunk_max, _mm256_loadu_ps(p + j * padded + m0));
      const __m256 old_max = _mm256_loadu_ps(mx + m0);
      const __m256 new_max = _mm256_max_ps(old_max, chunk_max);
      const __m256 alpha = exp8(_mm256_sub_ps(old_max, new_max));  // 0 from -inf
      __m256 chunk_sum = _mm256_setzero_ps();
      for (int j = 0; j < n; ++j) {
        const __m256 pj = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j * padded + m0), new_max));
        _mm256_storeu_ps(p + j * padded + m0, pj);
        chunk_sum = _mm256_add_ps(chunk_sum, pj);
      }
      _mm256_storeu_ps(sum + m0, _mm256_fmadd_ps(_mm256_loadu_ps(sum + m0), alpha, chunk_sum));
      _mm256_storeu_ps(mx + m0, new_max);
      alignas(32) float scale[8];
      _mm256_store_ps(scale, alpha);
      for (int i = 0; i < 8 && m0 + i < M; ++i) {
        if (scale[i] == 1.0f) continue;
        const __m256 s = _mm256_set1_ps(scale[i]);
        float* am = acc + (m0 + i) * d;
        for (int x = 0; x < d; x += 8)
          _mm256_storeu_ps(am + x, _mm256_mul_ps(s, _mm256_loadu_ps(am + x)));
      }
    }
    // acc += p . V, value by value.
    for (int j = 0; j < n; ++j) {
      const T* vj = vc + base + j * token_stride;
      const float* pj = p + j * padded;
      for (int h = 0; h < it.g1 - it.g0; ++h) {
        int c = 0;
        for (; c + 32 <= d; c += 32)
          accumulate_group<4>(acc + h * group * d, pj + h * group, vj + h * d, group, d, c);
        for (; c < d; c += 8)
          accumulate_group<1>(acc + h * group * d, pj + h * group, vj + h * d, group, d, c);
      }
    }
    k0 += n;
  }

  for (int m = 0; m < M; ++m) {
    const float* am = acc + m * d;
    if (it.partial >= 0) {  // a split: keep max, sum and the unnormalised accumulator
      std::copy(am, am + d, partial_acc + (it.partial * M + m) * d);
      partial_ml[(it.partial * M + m) * 2] = mx[m];
      partial_ml[(it.partial * M + m) * 2 + 1] = sum[m];
      continue;
    }
    store_normalized(pb.out + (row * pb.num_heads + it.g0 * group + m) * d, am, sum[m], d);
  }
}

// A split decode row: its sequence, its first partial slot and how many splits it has.
struct Merge {
  int64_t b;
  int64_t first;
  int64_t parts;
};

template <typename T>
void run(const Problem& pb, const std::vector<WorkItem>& items, const std::vector<Merge>& merges) {
  const int group = pb.num_heads / pb.num_kv_heads;
  const int d = pb.head_dim;
  const int M = pb.num_heads;  // query vectors of a decode row
  int64_t num_partials = 0;
  for (const Merge& mg : merges) num_partials += mg.parts;
  std::vector<float> partial_acc(num_partials * M * d), partial_ml(num_partials * M * 2);
  int max_m = 1;
  for (const WorkItem& w : items) max_m = std::max(max_m, w.rows * (w.g1 - w.g0) * group);
  // Items are handed out one at a time in the list's order (costliest first).
  std::atomic<int64_t> next_item{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    sc.reserve((max_m + 7) / 8 * 8, d);  // decode rows pad their vectors to 8
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next_item++; i < num_items; i = next_item++)
        if (items[i].rows == 1)
          run_decode_item<T>(pb, items[i], sc, partial_acc.data(), partial_ml.data());
        else
          run_item<T>(pb, items[i], sc);
  });
  // Merge the splits of each decode row by log-sum-exp.
  for (const Merge& mg : merges) {
    const int64_t row = pb.query_start[mg.b];
    for (int m = 0; m < M; ++m) {  // query head m of the row
      auto ml = [&](int64_t p, int k) { return partial_ml[((mg.first + p) * M + m) * 2 + k]; };
      float m_all = kNegInf;
      for (int64_t p = 0; p < mg.parts; ++p) m_all = std::max(m_all, ml(p, 0));
      float* dst = pb.out + (row * pb.num_heads + m) * d;
      std::fill(dst, dst + d, 0.0f);
      float l_all = 0.0f;
      for (int64_t p = 0; p < mg.parts; ++p) {
        if (ml(p, 0) == kNegInf) continue;
        const float w = std::exp(ml(p, 0) - m_all);
        l_all += w * ml(p, 1);
        const float* src = partial_acc.data() + ((mg.first + p) * M + m) * d;
        for (int x = 0; x < d; ++x) dst[x] += w * src[x];
      }
      store_normalized(dst, dst, l_all, d);
    }
  }
}

// k_cache[slot_mapping[t]] = key[t] (and v_cache for value), for every new token t; the
// rows may be views of a fused projection (any token and head stride).
template <typename T>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t tokens) {
  const int64_t heads = cache.size(2), d = cache.size(3), capacity = cache.size(0) * cache.size(1);
  const int64_t st = src.stride(0), sh = src.stride(1);
  const float* from = src.data_ptr<float>();
  T* to = static_cast<T*>(cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "slot ", slots[t], " is out of range");
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* row = from + t * st + h * sh;
        T* dst = to + (slots[t] * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(row[i]);
      }
  });
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = slot_mapping.numel();
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  for (const at::Tensor* src : {&key, &value})
    TORCH_CHECK(src->scalar_type() == at::kFloat && src->dim() == 3 && src->stride(2) == 1 &&
                    src->size(0) == tokens && src->size(1) == k_cache.size(2) &&
                    src->size(2) == k_cache.size(3),
                "key and value must be float32 [tokens, kv_heads, head_dim], head vectors contiguous");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto both = [&](auto type) {
    using T = decltype(type);
    write_rows<T>(key, k_cache, slots, tokens);
    write_rows<T>(value, v_cache, slots, tokens);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: both(float{}); break;
    case at::kHalf: both(c10::Half{}); break;
    case at::kBFloat16: both(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

}  // namespace

namespace pagedllm {

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key,
                     const at::Tensor& value, const at::Tensor& slot_mapping, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     const at::Tensor& work_items, const at::Tensor& merges, double scale,
                     int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "query and out must be float32");
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_tables.is_contiguous(),
              "tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "block tables, query_start_loc and context_lens must be int64");
  TORCH_CHECK(k_cache.dim() == 4 && query.dim() == 3, "expected k_cache [N, BS, KVH, D] and query [T, H, D]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must have one shape and dtype");
  write_kv(key, value, k_cache, v_cache, slot_mapping);
  Problem pb;
  pb.query = query.data_ptr<float>();
  pb.q_stride_t = query.stride(0);
  pb.q_stride_h = query.stride(1);
  pb.out = out.data_ptr<float>();
  pb.k_cache = k_cache.data_ptr();
  pb.v_cache = v_cache.data_ptr();
  pb.block_tables = block_tables.data_ptr<int64_t>();
  pb.query_start = query_start_loc.data_ptr<int64_t>();
  pb.context_lens = context_lens.data_ptr<int64_t>();
  pb.max_blocks = block_tables.size(1);
  pb.block_size = static_cast<int>(k_cache.size(1));
  pb.num_kv_heads = static_cast<int>(k_cache.size(2));
  pb.head_dim = static_cast<int>(k_cache.size(3));
  pb.num_heads = static_cast<int>(query.size(1));
  pb.scale = static_cast<float>(scale);
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a positive number of tokens");
  pb.window = window;
  TORCH_CHECK(pb.head_dim % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(pb.num_heads % pb.num_kv_heads == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(work_items.scalar_type() == at::kLong && work_items.is_contiguous() &&
                  work_items.dim() == 2 && work_items.size(1) == kItemFields,
              "work_items must be a contiguous int64 [items, 8] tensor");
  TORCH_CHECK(merges.scalar_type() == at::kLong && merges.is_contiguous() && merges.dim() == 2 &&
                  merges.size(1) == 3,
              "merges must be a contiguous int64 [splits, 3] tensor");
  const int64_t num_seqs = context_lens.size(0);
  const int64_t* w = work_items.data_ptr<int64_t>();
  std::vector<WorkItem> items(work_items.size(0));
  for (size_t i = 0; i < items.size(); ++i, w += kItemFields) {
    items[i] = {w[0], static_cast<int>(w[1]), static_cast<int>(w[2]), w[3],
                static_cast<int>(w[4]), w[5], w[6], w[7]};
    TORCH_CHECK(items[i].b >= 0 && items[i].b < num_seqs && items[i].g0 >= 0 &&
                    items[i].g1 <= pb.num_kv_heads && items[i].g0 < items[i].g1 && items[i].rows >= 1,
                "work item ", i, " is out of range");
    TORCH_CHECK(items[i].partial < 0 || items[i].rows == 1, "work item ", i,
                " splits a tile of several rows: only decode rows are split");
  }
  const int64_t* mp = merges.data_ptr<int64_t>();
  std::vector<Merge> merge_list(merges.size(0));
  for (size_t i = 0; i < merge_list.size(); ++i) merge_list[i] = {mp[3 * i], mp[3 * i + 1], mp[3 * i + 2]};
  switch (k_cache.scalar_type()) {
    case at::kFloat: run<float>(pb, items, merge_list); break;
    case at::kHalf: run<c10::Half>(pb, items, merge_list); break;
    case at::kBFloat16: run<c10::BFloat16>(pb, items, merge_list); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor slot_mapping, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, Tensor work_items, "
      "Tensor merges, float scale, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_attention", &pagedllm::paged_attention); }
