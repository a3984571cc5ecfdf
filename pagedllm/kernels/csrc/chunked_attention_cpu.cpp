// Paged attention for mixed batches on CPUs: decodes (one query token) and prompt chunks (many
// query tokens after a cached context) in one call. Every query token attends causally to all
// earlier tokens of its sequence and to itself, reading keys and values in place through the
// block table: the step's own keys and values were written into the cache before the call, so
// a chunk's tokens and its earlier context are read alike, with no gathered copy.
//
// A work item is a tile of up to TILE consecutive query tokens of one sequence. For each KV head,
// the tile walks its context KC keys at a time with an online softmax (flash attention's running
// max and sum), so nothing grows with the context. The chunk's keys for that head are gathered
// through the block table and transposed into a small buffer (head_dim x KC), so that the scores
// of LG (query row, query head) lanes against the chunk are LG x KC independent vector FMA chains
// over head_dim (a register tile, no horizontal sums): the chunk serves every query token of the
// tile and every query head sharing the KV head (grouped-query attention). Values are read in
// place, row by row. Softmax and accumulation are in float32 whatever the cache's type.
//
// A quantized cache (kv_formats.h) is read the same way: each key row is decoded as it is gathered
// into the transposed buffer, and each value row of the chunk once into a small float32 buffer that
// every lane of the tile then reads (the chunk's rows only, never the context); the rows are rotated,
// so each lane's query is rotated before the walk and its output after it.
//
// A sliding window W lets the query at position p see keys p - W + 1 .. p only: the tile's walk
// starts at its first row's first key, so keys before it (blocks the block manager may have
// released) are never touched. A soft cap c (Gemma 2) replaces each score s by c * tanh(s / c)
// before the softmax. Attention sinks (GPT-OSS): each lane's online softmax starts from its query
// head's sink logit as a score already seen (running max the sink, running sum exp(0) = 1) with no
// value, so the sink sits in the max and the denominator as PagedAttention._attend puts it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "work_order.h"
#include "attention_sinks.h"
#include "branches.h"
#include "kv_formats.h"

namespace {

constexpr int64_t TILE = 8;  // query rows per work item
constexpr int64_t KC = 32;   // keys per chunk: two 512-bit vectors of scores per lane
constexpr int64_t LG = 8;    // lanes scored together: 8 x 2 accumulators in registers
// Masked scores: exp(kMasked - max) is 0 for any real max, as it would be with -inf (a lane with no
// key in a chunk skips the chunk, so max is always a real score).
constexpr float kMasked = -1e30f;

struct WorkItem {
  int64_t seq;        // index into block_tables / context_lens
  int64_t first_row;  // first query row of the tile in the batch
  int64_t num_rows;   // query rows in the tile (<= TILE)
  int64_t first_pos;  // absolute position of the first row
};

template <typename scalar_t, typename Format, int HEAD_DIM>
void chunk_kernel(const scalar_t* __restrict__ q,            // [T, Hq, D]
                  const typename Format::storage_t* __restrict__ k_cache,  // [N, bs, Hkv, row]
                  const typename Format::storage_t* __restrict__ v_cache,  // [N, bs, Hkv, row]
                  const int64_t* __restrict__ block_tables,  // [B, max_blocks]
                  const float* __restrict__ sinks,           // [Hq] sink logits, or nullptr: none
                  scalar_t* __restrict__ out,                // [T, Hq, D]
                  const std::vector<WorkItem>& items, int64_t num_heads, int64_t num_kv_heads,
                  int64_t runtime_head_dim, int64_t block_size, int64_t max_blocks, float scale,
                  int64_t sliding_window, float soft_cap) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  using kv_t = typename Format::storage_t;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_row = Format::row_elems(head_dim);  // one KV head of one token, scales included
  const int64_t row_stride = num_kv_heads * head_row;   // one slot: every KV head of one token
  const int64_t q_stride = num_heads * head_dim;       // one query token: every query head
  const int read_shift = pagedllm::kv::read_shift(head_dim);
  // With a soft cap, queries are scaled by scale / cap so that tanh takes the dot product as is.
  const float q_scale = soft_cap > 0.f ? scale / soft_cap : scale;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t max_lanes = (TILE * group + LG - 1) / LG * LG;  // (query row, query head) pairs, padded
    std::vector<float> qf(max_lanes * head_dim), acc(max_lanes * head_dim);
    std::vector<float> running_max(max_lanes), running_sum(max_lanes);
    std::vector<float> kt(head_dim * KC);
    const kv_t* vrows[KC];
    // A quantized chunk's keys (one row) and values (KC rows) as float32.
    std::vector<float> key_buf(Format::kQuantized ? head_dim : 0), value_buf(Format::kQuantized ? KC * head_dim : 0);
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& item = items[w];
      const int64_t rows = item.num_rows;
      const int64_t lanes = rows * group;
      const int64_t padded = (lanes + LG - 1) / LG * LG;
      const int64_t length = item.first_pos + rows;  // keys seen by the tile's last row
      // The first key any row of the tile sees (its first row's window start), rounded down to a
      // multiple of KC: a row's keys then fall into the same chunks whichever tile it is in, so its
      // result does not depend on how its prompt was split into chunks.
      const int64_t first_key =
          sliding_window > 0 ? std::max<int64_t>(0, item.first_pos - sliding_window + 1) / KC * KC : 0;
      const int64_t* table = block_tables + item.seq * max_blocks;
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < group; ++i) {
            const scalar_t* qh = q + (item.first_row + r) * q_stride + (g * group + i) * head_dim;
            float* dst = qf.data() + (r * group + i) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(qh[d]) * q_scale;
            if constexpr (Format::kQuantized) pagedllm::kv::hadamard(dst, head_dim, read_shift);  // rotated basis
          }
        }
        std::fill(qf.begin() + lanes * head_dim, qf.begin() + padded * head_dim, 0.f);
        std::fill(acc.begin(), acc.begin() + padded * head_dim, 0.f);
        if (sinks != nullptr) {
          for (int64_t lane = 0; lane < lanes; ++lane) {
            running_max[lane] = sinks[g * group + lane % group];
            running_sum[lane] = 1.f;
          }
        } else {
          std::fill(running_max.begin(), running_max.end(), kMasked);
          std::fill(running_sum.begin(), running_sum.end(), 0.f);
        }
        for (int64_t start = first_key; start < length; start += KC) {
          const int64_t n = std::min(KC, length - start);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t pos = start + j;
            const int64_t offset = (table[pos / block_size] * block_size + pos % block_size) * row_stride + g * head_row;
            const kv_t* krow = k_cache + offset;
            vrows[j] = v_cache + offset;
            if constexpr (Format::kQuantized) {
              Format::dequantize(krow, head_dim, key_buf.data());
              for (int64_t d = 0; d < head_dim; ++d) kt[d * KC + j] = key_buf[d];
              Format::dequantize(vrows[j], head_dim, value_buf.data() + j * head_dim);
            } else {
              for (int64_t d = 0; d < head_dim; ++d) kt[d * KC + j] = static_cast<float>(krow[d]);
            }
          }
          for (int64_t j = n; j < KC; ++j) {
            for (int64_t d = 0; d < head_dim; ++d) kt[d * KC + j] = 0.f;
          }
          for (int64_t lane0 = 0; lane0 < lanes; lane0 += LG) {
            float s[LG][KC] = {};
            const float* __restrict__ qg = qf.data() + lane0 * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) {
              const float* __restrict__ kd = kt.data() + d * KC;
              for (int64_t l = 0; l < LG; ++l) {
                const float qv = qg[l * head_dim + d];
#pragma omp simd
                for (int64_t j = 0; j < KC; ++j) s[l][j] += qv * kd[j];
              }
            }
            for (int64_t l = 0; l < LG && lane0 + l < lanes; ++l) {
              const int64_t lane = lane0 + l;
              // This lane's row sees keys [lo, hi) of the chunk: up to its own position, from its window's start.
              const int64_t pos = item.first_pos + lane / group;
              const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1 - start) : 0;
              const int64_t hi = std::min(n, pos + 1 - start);
              if (hi <= lo) continue;
              float* __restrict__ sl = s[l];
              if (soft_cap > 0.f) {
#pragma omp simd
                for (int64_t j = 0; j < KC; ++j) sl[j] = soft_cap * std::tanh(sl[j]);
              }
              float chunk_max = kMasked;
#pragma omp simd reduction(max : chunk_max)
              for (int64_t j = 0; j < KC; ++j) {
                sl[j] = (j >= lo && j < hi) ? sl[j] : kMasked;
                chunk_max = std::max(chunk_max, sl[j]);
              }
              const float new_max = std::max(running_max[lane], chunk_max);
              const float correction = std::exp(running_max[lane] - new_max);
              float sum = 0.f;
#pragma omp simd reduction(+ : sum)
              for (int64_t j = 0; j < KC; ++j) {
                sl[j] = std::exp(sl[j] - new_max);  // masked keys: exp(-1e30) = 0
                sum += sl[j];
              }
              running_sum[lane] = running_sum[lane] * correction + sum;
              running_max[lane] = new_max;
              float* __restrict__ a = acc.data() + lane * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
              for (int64_t j = lo; j < hi; ++j) {
                const float p = sl[j];
                if constexpr (Format::kQuantized) {
                  const float* __restrict__ vrow = value_buf.data() + j * head_dim;
#pragma omp simd
                  for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vrow[d];
                } else {
                  const kv_t* __restrict__ vrow = vrows[j];
#pragma omp simd
                  for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(vrow[d]);
                }
              }
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < group; ++i) {
            const int64_t lane = r * group + i;
            const float inv = 1.f / running_sum[lane];
            float* a = acc.data() + lane * head_dim;
            if constexpr (Format::kQuantized) pagedllm::kv::hadamard(a, head_dim, read_shift);  // back from it
            scalar_t* o = out + (item.first_row + r) * q_stride + (g * group + i) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(a[d] * inv);
          }
        }
      }
    }
  });
}

template <typename scalar_t, typename Format>
void dispatch_head_dim(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const float* sinks, at::Tensor& out,
                       const std::vector<WorkItem>& items, float scale, int64_t sliding_window, float soft_cap) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  auto run = [&](auto head_dim_constant) {
    chunk_kernel<scalar_t, Format, decltype(head_dim_constant)::value>(
        query.data_ptr<scalar_t>(), pagedllm::kv::rows_of<Format>(k_cache), pagedllm::kv::rows_of<Format>(v_cache),
        block_tables.data_ptr<int64_t>(), sinks, out.data_ptr<scalar_t>(), items, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.size(1), scale, sliding_window, soft_cap);
  };
  switch (head_dim) {
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 96: run(std::integral_constant<int, 96>{}); break;    // Phi-3
    case 128: run(std::integral_constant<int, 128>{}); break;
    case 256: run(std::integral_constant<int, 256>{}); break;  // Gemma 2 / 3
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

at::Tensor paged_chunked_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_tables, at::Tensor query_start_loc,
                                      at::Tensor context_lens, double scale, int64_t sliding_window,
                                      double logits_soft_cap, at::Tensor sinks) {
  TORCH_CHECK(query.dim() == 3, "query must be [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [N, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block_tables, query_start_loc and context_lens must be int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "the key and value caches must have one dtype and shape");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0, "sliding_window and logits_soft_cap must be >= 0");
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
  pagedllm::interleave_by_position(items);  // a tile's cost grows with its position
  const float* sink_logits = pagedllm::sink_logits(sinks, query.size(1));
  auto out = at::empty_like(query);
  pagedllm::count_run(pagedllm::Kernel::kChunkedAttention);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_chunked_attention", [&] {
    pagedllm::kv::dispatch_format<scalar_t>(k_cache, query.size(2), "paged_chunked_attention", [&](auto format) {
      dispatch_head_dim<scalar_t, decltype(format)>(query, k_cache, v_cache, block_tables, sink_logits, out, items,
                                                    static_cast<float>(scale), sliding_window,
                                                    static_cast<float>(logits_soft_cap));
    });
  });
  return out;
}
