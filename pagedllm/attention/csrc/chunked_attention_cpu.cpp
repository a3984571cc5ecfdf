// Paged attention for mixed batches on CPUs: decodes (one query token) and prompt chunks (many
// query tokens after a cached context) in one call. Every query token attends causally to all
// earlier tokens of its sequence and to itself, reading keys and values in place through the
// block table: the step's own keys and values were written into the cache before the call, so
// a chunk's tokens and its earlier context are read alike, with no gathered copy.
//
// A work item is a tile of up to TILE consecutive query tokens of one sequence. Walking the
// tile's context block by block, slot by slot, each key/value row (all KV heads side by side) is
// loaded once and used by every query token of the tile and every query head of its group
// (grouped-query attention), so a long chunk streams its context from memory once per tile
// rather than once per token. Query token j of a tile sees keys [0, first_pos + j]; softmax is
// exact (scores kept per tile, then normalised), in float32 whatever the cache's type.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 8;

struct WorkItem {
  int64_t seq;        // index into block_tables / context_lens
  int64_t first_row;  // first query row of the tile in the batch
  int64_t num_rows;   // query rows in the tile (<= TILE)
  int64_t first_pos;  // absolute position of the first row
};

template <typename scalar_t, int HEAD_DIM>
void chunk_kernel(const scalar_t* __restrict__ q,            // [T, Hq, D]
                  const scalar_t* __restrict__ k_cache,      // [N, bs, Hkv, D]
                  const scalar_t* __restrict__ v_cache,      // [N, bs, Hkv, D]
                  const int64_t* __restrict__ block_tables,  // [B, max_blocks]
                  scalar_t* __restrict__ out,                // [T, Hq, D]
                  const std::vector<WorkItem>& items, int64_t num_heads, int64_t num_kv_heads,
                  int64_t runtime_head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // one slot: every KV head of one token
  const int64_t q_stride = num_heads * head_dim;       // one query token: every query head
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [rows, Hq, length]
    std::vector<float> qf(TILE * q_stride);
    std::vector<float> acc(TILE * q_stride);
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& item = items[w];
      const int64_t rows = item.num_rows;
      const int64_t length = item.first_pos + rows;  // keys seen by the tile's last row
      const int64_t* table = block_tables + item.seq * max_blocks;
      scores.resize(rows * num_heads * length);
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* qrow = q + (item.first_row + r) * q_stride;
        for (int64_t i = 0; i < q_stride; ++i) qf[r * q_stride + i] = static_cast<float>(qrow[i]) * scale;
      }
      // Scores: row r sees keys [0, first_pos + r]; later keys of the tile are masked below.
      for (int64_t start = 0; start < length; start += block_size) {
        const int64_t n = std::min(block_size, length - start);
        const scalar_t* kblock = k_cache + table[start / block_size] * block_size * row_stride;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = start + i;
          const scalar_t* krow = kblock + i * row_stride;
          // The first row that sees this key: every row when the key is in the cached context.
          const int64_t first_r = std::max<int64_t>(0, pos - item.first_pos);
          for (int64_t r = first_r; r < rows; ++r) {
            for (int64_t h = 0; h < num_heads; ++h) {
              const scalar_t* kh = krow + (h / group) * head_dim;
              const float* qh = qf.data() + r * q_stride + h * head_dim;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * static_cast<float>(kh[d]);
              scores[(r * num_heads + h) * length + pos] = dot;
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t seen = item.first_pos + r + 1;
        for (int64_t h = 0; h < num_heads; ++h) {
          float* s = scores.data() + (r * num_heads + h) * length;
          const float max_score = *std::max_element(s, s + seen);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < seen; ++t) {
            s[t] = std::exp(s[t] - max_score);
            sum += s[t];
          }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < seen; ++t) s[t] *= inv;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * q_stride, 0.f);
      for (int64_t start = 0; start < length; start += block_size) {
        const int64_t n = std::min(block_size, length - start);
        const scalar_t* vblock = v_cache + table[start / block_size] * block_size * row_stride;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = start + i;
          const scalar_t* vrow = vblock + i * row_stride;
          const int64_t first_r = std::max<int64_t>(0, pos - item.first_pos);
          for (int64_t r = first_r; r < rows; ++r) {
            for (int64_t h = 0; h < num_heads; ++h) {
              const scalar_t* vh = vrow + (h / group) * head_dim;
              const float p = scores[(r * num_heads + h) * length + pos];
              float* a = acc.data() + r * q_stride + h * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(vh[d]);
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* orow = out + (item.first_row + r) * q_stride;
        for (int64_t i = 0; i < q_stride; ++i) orow[i] = static_cast<scalar_t>(acc[r * q_stride + i]);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, torch::Tensor& out, const std::vector<WorkItem>& items,
                       float scale) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  auto run = [&](auto head_dim_constant) {
    chunk_kernel<scalar_t, decltype(head_dim_constant)::value>(
        query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), items, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.size(1), scale);
  };
  switch (head_dim) {
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

torch::Tensor paged_chunked_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [N, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong &&
                  query_start_loc.scalar_type() == torch::kLong,
              "block_tables, query_start_loc and context_lens must be int64");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes must match");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t batch = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == batch + 1 && block_tables.size(0) == batch,
              "query_start_loc must be [B + 1] and block_tables [B, max_blocks]");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t* starts = query_start_loc.contiguous().data_ptr<int64_t>();
  const int64_t* lens = context_lens.contiguous().data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t num_rows = starts[b + 1] - starts[b];
    const int64_t cached = lens[b] - num_rows;
    TORCH_CHECK(num_rows >= 0 && cached >= 0, "context_lens must cover each sequence's query tokens");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= block_tables.size(1), "block table too short");
    for (int64_t r = 0; r < num_rows; r += TILE) {
      items.push_back({b, starts[b] + r, std::min(TILE, num_rows - r), cached + r});
    }
  }
  // The parallel loop hands each thread a contiguous range of items, and a tile's cost grows
  // with its position. Ordered light, heavy, light, heavy... (cheapest with dearest), every
  // contiguous range holds about the same work.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.first_pos < b.first_pos; });
  std::vector<WorkItem> balanced;
  balanced.reserve(items.size());
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    balanced.push_back(items[lo++]);
    if (lo < hi) balanced.push_back(items[--hi]);
  }
  items.swap(balanced);
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_chunked_attention", [&] {
    dispatch_head_dim<scalar_t>(query, k_cache, v_cache, block_tables, out, items, static_cast<float>(scale));
  });
  return out;
}
