// The branch each kernel compiled to, from the same macros that select it in the kernel's own file.
#include "branches.h"
#include "kernels.h"

namespace {

// greedy_cpu.cpp: explicit AVX-512 loops, or scalar ones.
const char* avx512_or_scalar() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "scalar";
#endif
}

// paged_attention_cpu.cpp: AVX-512 register loops, AVX2 ones (with FMA and F16C), or scalar ones.
const char* decode_attention_branch() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "scalar";
#endif
}

const char* prompt_attention_branch() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return "amx";
#else
  return "none";
#endif
}

const char* dense_f32_branch() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "none";
#endif
}

const char* dense_bf16_branch() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512_bf16";
#else
  return "none";
#endif
}

const char* amx_branch() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return "amx";
#else
  return "none";
#endif
}

// quant_formats.h's widen(): how packed blocks are decoded.
const char* quant_linear_branch() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// fused_ops_cpu.cpp: explicit 16-wide loops, bfloat16 narrowed in one instruction or emulated.
const char* fused_ops_branch() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "scalar";
#endif
}

}  // namespace

std::map<std::string, std::pair<std::string, int64_t>> kernel_branches() {
  using pagedllm::Kernel;
  const std::string int8_dot = int8_dot_isa();
  const auto entry = [](const char* branch, Kernel k) {
    return std::make_pair(std::string(branch), pagedllm::run_counter(k).load(std::memory_order_relaxed));
  };
  return {
      {"paged_decode_attention", entry(decode_attention_branch(), Kernel::kDecodeAttention)},
      // One loop, vectorised by the compiler at the build's level.
      {"paged_chunked_attention", entry("compiler", Kernel::kChunkedAttention)},
      {"prompt_attention_amx", entry(prompt_attention_branch(), Kernel::kPromptAttentionAmx)},
      {"dense_gemm_f32", entry(dense_f32_branch(), Kernel::kDenseGemmF32)},
      {"dense_gemm_bf16", entry(dense_bf16_branch(), Kernel::kDenseGemmBf16)},
      {"dense_gemm_bf16_amx", entry(amx_branch(), Kernel::kDenseGemmBf16Amx)},
      {"quant_linear", entry(quant_linear_branch(), Kernel::kQuantLinear)},
      // quant_int8_cpu.cpp's dot4(), as int8_dot_isa() names it ("portable": the build has none).
      {"int8_linear_dot", entry(int8_dot == "portable" ? "none" : int8_dot.c_str(), Kernel::kInt8Dot)},
      {"int8_linear_amx", entry(amx_branch(), Kernel::kInt8Amx)},
      {"fused_ops", entry(fused_ops_branch(), Kernel::kFusedOps)},
      {"greedy_pick", entry(avx512_or_scalar(), Kernel::kGreedy)},
  };
}
