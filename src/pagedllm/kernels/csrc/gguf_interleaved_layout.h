// The interleaved layout of Q4_0, Q4_1 and Q4_K weights: the file's blocks of 16 weight rows
// rearranged at load (gguf_repack.cpp) so that the interleaved kernels load every operand
// as one vector, with no per-call shuffling (ggml_x86_interleaved.h, each kind's FromGroup).
//
// 16 rows form a group: the group's bytes are the 16 rows' bytes (16 * row_bytes, so the
// tensor keeps its size), block b of all 16 rows at b * 16 * block_bytes. Within it each
// field of the block is cut into units of a few bytes, and unit u of row i lands at
// dst + (u * 16 + i) * unit: one load of 16 * unit bytes (8 * unit for the 8 rows of an
// AVX2 pass) gives that unit of every row, lane i from row i.
//
//   Q4_1 (20-byte blocks): d, m (fp16); qs in 4-byte units (values 4t..4t+3 in the low
//        nibbles, 16+4t.. in the high).
//   Q4_0 (18): d (fp16); qs as Q4_1's.
//   Q4_K (144): d, dmin (fp16); the 12 bytes of 6-bit scales and mins as three 4-byte
//        units; qs in 4-byte units (unit 8k + t: sub-block 2k's values 4t.. in the low
//        nibbles, 2k+1's in the high).
#pragma once

#include <cstdint>

namespace pagedllm {

constexpr int kInterleavedGroupRows = 16;

// A block field: `count` units of `unit` bytes from byte `from` of the file's block, to
// byte `to` of the group's block.
struct InterleavedField {
  int from, unit, count, to;
};

struct InterleavedLayout {
  int64_t ggml_type;
  int block_bytes;
  int num_fields;
  InterleavedField fields[4];
};

constexpr InterleavedLayout kInterleavedLayouts[] = {
    {3, 20, 3, {{0, 2, 1, 0}, {2, 2, 1, 32}, {4, 4, 4, 64}}},
    {12, 144, 4, {{0, 2, 1, 0}, {2, 2, 1, 32}, {4, 4, 3, 64}, {16, 4, 32, 256}}},
    {2, 18, 2, {{0, 2, 1, 0}, {2, 4, 4, 32}}},
};

// Where each field of a group's block starts, for the kernels: the `to`s above.
namespace interleaved {
constexpr const InterleavedField* kQ4_1 = kInterleavedLayouts[0].fields;
constexpr const InterleavedField* kQ4K = kInterleavedLayouts[1].fields;
constexpr const InterleavedField* kQ4_0 = kInterleavedLayouts[2].fields;
static_assert(kInterleavedLayouts[0].ggml_type == 3 && kInterleavedLayouts[1].ggml_type == 12 &&
                  kInterleavedLayouts[2].ggml_type == 2,
              "Q4_1's layout first, then Q4_K's, then Q4_0's");
constexpr int kQ4_1D = kQ4_1[0].to, kQ4_1M = kQ4_1[1].to, kQ4_1Qs = kQ4_1[2].to;
constexpr int kQ4_0D = kQ4_0[0].to, kQ4_0Qs = kQ4_0[1].to;
constexpr int kQ4KD = kQ4K[0].to, kQ4KDmin = kQ4K[1].to, kQ4KScales = kQ4K[2].to,
              kQ4KQs = kQ4K[3].to;
}  // namespace interleaved

}  // namespace pagedllm
