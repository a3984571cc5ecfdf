// Greedy choice for CPUs: per row of float32 or bfloat16 logits, the argmax (first of equal maxima,
// as torch.argmax) and its log-probability, log_softmax(x)[argmax] = -log(sum(exp(x - max))), in
// two passes over the row (the second from cache: a row is at most a few hundred KB). torch needs
// argmax + log_softmax + gather for the same: three passes, a [rows, vocab] temporary, and an
// argmax that does not vectorise. bfloat16 logits are read as they are: widening them to float32
// first would be a pass of its own and a copy twice their size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "vec_math.h"
#include "branches.h"

namespace {

inline float load_value(const float* row, int64_t i) { return row[i]; }
inline float load_value(const uint16_t* row, int64_t i) {
  const uint32_t bits = uint32_t(row[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
using pagedllm::load16;
#endif

template <typename T>
void greedy_rows(const T* x, int64_t rows, int64_t vocab, int64_t* ids, float* logprobs) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * vocab;
      float max_value = load_value(row, 0);
      int64_t i = 0;
#if defined(__AVX512F__)
      if (vocab >= 16) {
        __m512 top = load16(row);
        for (i = 16; i + 16 <= vocab; i += 16) top = _mm512_max_ps(top, load16(row + i));
        max_value = _mm512_reduce_max_ps(top);
      }
#endif
      for (; i < vocab; ++i) max_value = std::max(max_value, load_value(row, i));
      // The first maximum; bounded, since a NaN row (a broken model) has no element equal to max.
      int64_t arg = -1;
      // A double sum: without vector lanes (scalar and AVX2 builds) the whole vocabulary is added
      // in order, and a float running sum of 10^4-10^5 terms drifts by about 1e-5.
      double sum = 0.0;
      i = 0;
#if defined(__AVX512F__)
      const __m512 top = _mm512_set1_ps(max_value);
      __m512 sums = _mm512_setzero_ps();
      for (; i + 16 <= vocab; i += 16) {
        const __m512 v = load16(row + i);
        if (arg < 0) {
          const __mmask16 hit = _mm512_cmpeq_ps_mask(v, top);
          if (hit) arg = i + __builtin_ctz(hit);
        }
        sums = _mm512_add_ps(sums, pagedllm::exp16(_mm512_sub_ps(v, top)));
      }
      sum = _mm512_reduce_add_ps(sums);
#endif
      for (; i < vocab; ++i) {
        const float v = load_value(row, i);
        if (arg < 0 && v == max_value) arg = i;
        sum += std::exp(v - max_value);
      }
      ids[r] = arg < 0 ? vocab - 1 : arg;
      logprobs[r] = static_cast<float>(-std::log(sum));
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> greedy_pick(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, vocab]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  pagedllm::count_run(pagedllm::Kernel::kGreedy);
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto token_ids = at::empty({rows}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (logits.scalar_type() == at::kFloat) {
    greedy_rows(logits.data_ptr<float>(), rows, vocab, token_ids.data_ptr<int64_t>(), logprobs.data_ptr<float>());
  } else {
    greedy_rows(reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()), rows, vocab,
                token_ids.data_ptr<int64_t>(), logprobs.data_ptr<float>());
  }
  return {token_ids, logprobs};
}
