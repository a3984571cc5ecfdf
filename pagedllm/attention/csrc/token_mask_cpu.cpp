// Structured outputs: forbid, in place, the tokens a row's grammar bitmask leaves out.
//
// bitmask[r, w] bit b (xgrammar's layout) allows token 32 w + b. Grammar masks are mostly zero
// words (a JSON grammar allows a few tokens at a time), so a zero word fills its 32 logits with
// -inf in one go, an all-ones word is skipped, and only mixed words are read bit by bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

void apply_token_bitmask_cpu(torch::Tensor logits, torch::Tensor bitmask, std::vector<int64_t> rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(),
              "logits must be a contiguous CPU float32 [rows, vocab] tensor");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == torch::kInt && bitmask.dim() == 2 &&
                  bitmask.is_contiguous() && bitmask.size(0) == logits.size(0),
              "bitmask must be a contiguous CPU int32 [rows, words] tensor, a row per logits row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "bitmask has ", words * 32, " bits for ", vocab, " tokens");
  float* out = logits.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < logits.size(0), "row ", r, " out of range");
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rows[i];
      float* row = out + r * vocab;
      const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + r * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = m[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
        if (word == 0) {
          std::fill_n(row + first, count, neg_inf);
          continue;
        }
        for (int64_t b = 0; b < count; ++b) {
          if (!((word >> b) & 1u)) row[first + b] = neg_inf;
        }
      }
    }
  });
}
