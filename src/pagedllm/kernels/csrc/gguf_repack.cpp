// Q4_0, Q4_1 and Q4_K weights into the interleaved layout of gguf_interleaved_layout.h, and
// back (for dequantizing and for tests):
//
//   gguf_interleave(blocks, ggml_type, inverse=False, release_source=False) -> blocks
//
// blocks: uint8 [rows, bytes per row], rows a multiple of 16; the result is a new tensor
// [rows / 16, 16, bytes per row], the shape by which gguf_linear knows the layout (inverse:
// from that shape back to the file's). With release_source, the pages wholly inside the
// source are handed back to the kernel afterwards (madvise MADV_PAGEOUT): a tensor read
// through the file's memory map then stops counting in the process's resident memory, so
// interleaving a model at load does not hold it twice. The advice never changes the
// memory's contents (anonymous pages without swap simply stay), so it is safe on any source.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <string.h>
#include <sys/mman.h>
#include <torch/library.h>
#include <unistd.h>

#include <cstdint>

#include "gguf_interleaved_layout.h"

namespace pagedllm {
namespace {

const InterleavedLayout& layout_of(int64_t ggml_type) {
  for (const InterleavedLayout& l : kInterleavedLayouts)
    if (l.ggml_type == ggml_type) return l;
  TORCH_CHECK_VALUE(false, "GGML type ", ggml_type,
                    " has no interleaved layout (Q4_0=2, Q4_1=3, Q4_K=12)");
}

void release_pages(const uint8_t* data, int64_t bytes) {
#ifdef MADV_PAGEOUT
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_PAGEOUT);
#else
  (void)data, (void)bytes;
#endif
}

}  // namespace

at::Tensor gguf_interleave(const at::Tensor& blocks, int64_t ggml_type, bool inverse,
                           bool release_source) {
  const InterleavedLayout& l = layout_of(ggml_type);
  constexpr int64_t G = kInterleavedGroupRows;
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                        (inverse ? blocks.dim() == 3 && blocks.size(1) == G : blocks.dim() == 2),
                    "blocks must be a contiguous uint8 ",
                    inverse ? "[groups, 16, bytes per row]" : "[rows, bytes per row]", " tensor");
  const int64_t rows = inverse ? blocks.size(0) * G : blocks.size(0), row_bytes = blocks.size(-1);
  TORCH_CHECK_VALUE(rows % G == 0, "interleaving takes rows in groups of ", G, "; got ", rows);
  TORCH_CHECK_VALUE(row_bytes % l.block_bytes == 0, "a row of ", row_bytes,
                    " bytes is not a whole number of ", l.block_bytes, "-byte blocks");
  at::Tensor out = inverse ? at::empty({rows, row_bytes}, blocks.options())
                           : at::empty({rows / G, G, row_bytes}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t nb = row_bytes / l.block_bytes, group_bytes = G * row_bytes;
  at::parallel_for(0, rows / G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t group_block = g * group_bytes + b * G * l.block_bytes;
        for (int64_t i = 0; i < G; ++i) {
          const int64_t file_block = (g * G + i) * row_bytes + b * l.block_bytes;
          for (int f = 0; f < l.num_fields; ++f) {
            const InterleavedField& field = l.fields[f];
            for (int u = 0; u < field.count; ++u) {
              const int64_t in_file = file_block + field.from + u * field.unit;
              const int64_t in_group = group_block + field.to + (u * G + i) * field.unit;
              if (inverse)
                memcpy(dst + in_file, src + in_group, field.unit);
              else
                memcpy(dst + in_group, src + in_file, field.unit);
            }
          }
        }
      }
  });
  if (release_source) release_pages(src, rows * row_bytes);
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "gguf_interleave(Tensor blocks, int ggml_type, bool inverse=False, "
      "bool release_source=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("gguf_interleave", &pagedllm::gguf_interleave);
}
