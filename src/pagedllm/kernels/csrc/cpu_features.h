// Which instruction sets the kernels use on this CPU: AVX-512 VNNI where the CPU has it,
// unless PAGEDLLM_NO_VNNI is set (then the AVX2 code everywhere, as on a CPU without it).
#pragma once

#include <cstdlib>

namespace pagedllm {

inline bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
}

// PAGEDLLM_NO_VNNI=1 takes the AVX2 paths anyway (read once: the choice of a process).
inline bool has_vnni() {
  static const bool yes = cpu_has_vnni() && std::getenv("PAGEDLLM_NO_VNNI") == nullptr;
  return yes;
}

}  // namespace pagedllm
