// Which code path of each kernel this build compiled (its instruction-set level is fixed at
// compile time, see pagedllm/kernels/isa.py), and how often each ran since the module loaded:
// `pagedllm env` reports both, and the tests that run at a forced level assert that the branch
// they name is the one that ran.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace pagedllm {

enum class Kernel : int {
  kDecodeAttention,
  kChunkedAttention,
  kPromptAttentionAmx,
  kDenseGemmF32,
  kDenseGemmBf16,
  kDenseGemmBf16Amx,
  kQuantLinear,
  kInt8Dot,
  kInt8Amx,
  kFusedOps,
  kGreedy,
  kCount,
};

inline std::atomic<int64_t>& run_counter(Kernel k) {
  static std::atomic<int64_t> counters[static_cast<int>(Kernel::kCount)];
  return counters[static_cast<int>(k)];
}

// One call of a kernel's entry point (not per thread, not per tile: a relaxed add per call).
inline void count_run(Kernel k) { run_counter(k).fetch_add(1, std::memory_order_relaxed); }

}  // namespace pagedllm

// kernel name -> (the branch this build compiled for it, its calls so far); "none" where this
// build has no such kernel and the callers take another path.
std::map<std::string, std::pair<std::string, int64_t>> kernel_branches();
