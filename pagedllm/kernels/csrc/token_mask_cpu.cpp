// Structured outputs on the CPU: grammar bitmasks applied to logits.
//
// bitmask[r, w] bit b (xgrammar's layout) allows token 32 w + b. Grammar masks are mostly zero
// words (a JSON grammar allows a few tokens at a time), so both kernels work word by word: a zero
// word is handled in one go, an all-ones word too, and only mixed words are read bit by bit.
//
// - apply_token_bitmask: sets the forbidden logits to -inf, in place (every sampling path);
// - greedy_pick_masked: greedy choice under the masks without writing anything: per row the
//   first maximum among the allowed tokens and its log-probability over them, equal to
//   greedy_pick of the masked logits. It reads only the allowed logits, and never feeds -inf to
//   exp (the vectorised exp takes a scalar slow path per -inf lane, which made masked greedy
//   choice slower than the masking itself).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace {

constexpr uint32_t kAllOnes = 0xFFFFFFFFu;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_bitmask_args(const at::Tensor& logits, const at::Tensor& bitmask, c10::IntArrayRef rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(),
              "logits must be a contiguous CPU float32 [rows, vocab] tensor");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                  bitmask.is_contiguous() && bitmask.size(0) == logits.size(0),
              "bitmask must be a contiguous CPU int32 [rows, words] tensor, a row per logits row");
  TORCH_CHECK(bitmask.size(1) * 32 >= logits.size(1), "bitmask has ", bitmask.size(1) * 32, " bits for ",
              logits.size(1), " tokens");
  for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < logits.size(0), "row ", r, " out of range");
}

// The bits of word w that name tokens of the vocabulary (the last word may run past its end).
inline uint32_t vocab_bits(int64_t first, int64_t vocab) {
  const int64_t count = std::min<int64_t>(32, vocab - first);
  return count == 32 ? kAllOnes : (1u << count) - 1u;
}

// Calls span(first, count) for each run of consecutive allowed tokens made of whole allowed words
// (an unconstrained row, mask == nullptr, is one span) and bits(first, word) for each mixed word.
template <typename Span, typename Bits>
inline void for_each_allowed(const uint32_t* mask, int64_t vocab, Span span, Bits bits) {
  if (mask == nullptr) {
    span(0, vocab);
    return;
  }
  int64_t run_start = -1;
  for (int64_t first = 0; first < vocab; first += 32) {
    const uint32_t valid = vocab_bits(first, vocab);
    const uint32_t word = mask[first / 32] & valid;
    if (word == valid) {
      if (run_start < 0) run_start = first;
      continue;
    }
    if (run_start >= 0) {
      span(run_start, first - run_start);
      run_start = -1;
    }
    if (word != 0) bits(first, word);
  }
  if (run_start >= 0) span(run_start, vocab - run_start);
}

// One row's greedy choice among its allowed tokens: (token, log-probability); (-1, -inf) when the
// mask allows no token.
std::pair<int64_t, float> greedy_pick_row(const float* row, const uint32_t* mask, int64_t vocab) {
  float best = kNegInf;
  int64_t arg = -1;
  // Strictly greater, words in order, bits in order: the first of equal maxima, as torch.argmax.
  for_each_allowed(
      mask, vocab,
      [&](int64_t first, int64_t count) {
        const float* x = row + first;
        float span_max = x[0];
#pragma omp simd reduction(max : span_max)
        for (int64_t i = 0; i < count; ++i) span_max = std::max(span_max, x[i]);
        if (arg >= 0 && !(span_max > best)) return;
        int64_t i = 0;  // bounded: a NaN span has no element equal to its max
        while (i < count - 1 && x[i] != span_max) ++i;
        best = span_max;
        arg = first + i;
      },
      [&](int64_t first, uint32_t word) {
        for (; word != 0; word &= word - 1) {
          const int64_t token = first + __builtin_ctz(word);
          if (arg < 0 || row[token] > best) {
            best = row[token];
            arg = token;
          }
        }
      });
  if (arg < 0) return {-1, kNegInf};
  // A double total: mixed words add their terms one at a time, thousands of them in a row whose
  // grammar allows much of the vocabulary, which a float total would round off.
  double sum = 0.0;
  for_each_allowed(
      mask, vocab,
      [&](int64_t first, int64_t count) {
        const float* x = row + first;
        float span_sum = 0.f;
#pragma omp simd reduction(+ : span_sum)
        for (int64_t i = 0; i < count; ++i) span_sum += std::exp(x[i] - best);
        sum += span_sum;
      },
      [&](int64_t first, uint32_t word) {
        for (; word != 0; word &= word - 1) sum += std::exp(row[first + __builtin_ctz(word)] - best);
      });
  return {arg, static_cast<float>(-std::log(sum))};
}

}  // namespace

void apply_token_bitmask_cpu(at::Tensor logits, at::Tensor bitmask, std::vector<int64_t> rows) {
  check_bitmask_args(logits, bitmask, rows);
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  float* out = logits.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rows[i];
      float* row = out + r * vocab;
      const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + r * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = m[w];
        if (word == kAllOnes) continue;
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
        if (word == 0) {
          std::fill_n(row + first, count, kNegInf);
          continue;
        }
        for (int64_t b = 0; b < count; ++b) {
          if (!((word >> b) & 1u)) row[first + b] = kNegInf;
        }
      }
    }
  });
}

// Per row of logits: the greedy token among those its bitmask row allows and that token's
// log-probability over the allowed tokens; rows not listed in `rows` are unconstrained. A row
// whose mask allows nothing gets token -1 (callers finish such rows before sampling).
std::tuple<at::Tensor, at::Tensor> greedy_pick_masked_cpu(const at::Tensor& logits, const at::Tensor& bitmask,
                                                                 c10::IntArrayRef rows) {
  check_bitmask_args(logits, bitmask, rows);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(vocab > 0, "logits must have at least one column");
  std::vector<const uint32_t*> masks(num_rows, nullptr);
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  for (int64_t r : rows) masks[r] = mask + r * words;
  auto token_ids = at::empty({num_rows}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({num_rows}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* ids = token_ids.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::tie(ids[r], lp[r]) = greedy_pick_row(x + r * vocab, masks[r], vocab);
  });
  return {token_ids, logprobs};
}

// A torch operator of this extension (its namespace is the build's name, so two builds in one
// process never collide): torch.ops.<extension name>.greedy_pick_masked.
TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("greedy_pick_masked(Tensor logits, Tensor bitmask, int[] rows) -> (Tensor, Tensor)");
  m.impl("greedy_pick_masked", c10::DispatchKey::CPU, TORCH_FN(greedy_pick_masked_cpu));
}
