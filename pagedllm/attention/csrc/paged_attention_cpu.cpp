// Paged decode attention for CPUs: each query attends over its sequence's KV blocks, read in
// place through the block table (no gathered copy of the context), with one pass for scores
// and one for values. Work is split over (sequence, KV head) pairs; the query heads that share a
// KV head (grouped-query attention) are handled together so each key/value row is loaded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
void decode_kernel(const scalar_t* __restrict__ q,        // [B, Hq, D]
                   const scalar_t* __restrict__ k_cache,  // [N, bs, Hkv, D]
                   const scalar_t* __restrict__ v_cache,  // [N, bs, Hkv, D]
                   const int64_t* __restrict__ block_tables,  // [B, max_blocks]
                   const int64_t* __restrict__ context_lens,  // [B]
                   scalar_t* __restrict__ out,            // [B, Hq, D]
                   int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // between consecutive slots
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(group * head_dim);
    std::vector<float> acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads;
      const int64_t kv_head = item % num_kv_heads;
      const int64_t length = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.assign(group * length, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + (b * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qrow[d]) * scale;
      }
      for (int64_t t = 0; t < length; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const scalar_t* krow = k_cache + slot * row_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(krow[d]);
          scores[g * length + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * length;
        float max_score = *std::max_element(s, s + length);
        float sum = 0.f;
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - max_score);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < length; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const scalar_t* vrow = v_cache + slot * row_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(vrow[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = out + (b * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [N, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_tables and context_lens must be int64");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), batch, num_heads, num_kv_heads, head_dim, block_size,
                            block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
