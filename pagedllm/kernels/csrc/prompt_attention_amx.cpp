// Prompt attention on AMX tiles, bfloat16: each prompt chunk's queries attend causally to their
// sequence's cached context and to themselves, every key and value read through the block table
// (the step's own keys and values were written into the cache before the call).
//
// Why: torch's fused CPU SDPA runs a 448-token bfloat16 prompt at ~2 ms per layer on a 2-core AMX
// machine (its causal mask saves little there, and it has fixed costs per call); here ~1.1 ms, and
// a chunk after a cached context needs no gathered copy (benchmarks/prompt_attention.py). At
// 2,048 x 2,048 (query, key) pairs the two are level; past that the backend keeps SDPA.
//
// Per call, each (sequence, KV head) first has its keys and values copied out of the blocks into
// the layouts tiles multiply (the cost of one pass over them; every query head of the group and
// every row block then reuses them):
//   keys    [L/16][D/2][16] 32-bit words: for 16 keys, word w (dimensions 2w, 2w + 1) of each,
//           side by side: the B operand of S = Q K^T, 32 dimensions x 16 keys per tile
//   values  [L/2][D][2]: for each key pair, dimension d of both keys side by side: the B operand
//           of O = P V, 32 keys x 16 dimensions per tile
// (L rounded up to 64, the padding zero). A quantized cache (kv_formats.h) is decoded to bfloat16 as
// it is packed, so the tiles multiply the same values the decode kernels read; its rows are rotated,
// so each query row is rotated as it is loaded and each output row as it is stored. A work item is 16 query rows of every query head that
// shares one KV head: it walks its keys 64 at a time up to its last row's position, S on tiles
// (float32 sums), then per row a running max and sum in float32 (flash attention's online
// softmax), P rounded to bfloat16 into two A tiles, P V on tiles, added to the float32
// accumulator rescaled by the change of the row's max. Keys past a row's position get P = 0
// exactly. Head sizes: multiples of 64 (four output tiles of 16 per pass). Attention sinks
// (GPT-OSS): each row's online softmax starts from its query head's sink logit as a score already
// seen (running max the sink, running sum 1) with no value, the sink in the max and the denominator
// as PagedAttention._attend puts it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"
#include "work_order.h"
#include "attention_sinks.h"
#include "branches.h"
#include "kv_formats.h"

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kRows = 16;  // query rows per work item: one A tile
constexpr int64_t kKeys = 64;  // keys per softmax step: two P tiles (16 rows x 32 keys each)
constexpr int64_t kMaxHeadDim = 256;
constexpr float kMasked = -1e30f;

struct Item {
  int64_t seq;
  int64_t kv_head;    // the item covers every query head sharing it
  int64_t first_row;  // first row of the item in the batch
  int64_t num_rows;   // <= kRows
  int64_t first_pos;  // position of its first row
};

// One cached row as bfloat16 bits: a bfloat16 row as it is, any other (quantized, float16) decoded into `buf`.
template <typename Format>
const uint16_t* bf16_row(const typename Format::storage_t* row, int64_t head_dim, float* decoded, uint16_t* buf) {
  if constexpr (!std::is_same_v<typename Format::storage_t, c10::BFloat16>) {
    Format::dequantize(row, head_dim, decoded);
    for (int64_t d = 0; d < head_dim; ++d) buf[d] = c10::BFloat16(decoded[d]).x;
    return buf;
  } else {
    return reinterpret_cast<const uint16_t*>(row);
  }
}

// Keys and values of one (sequence, KV head) in tile layouts, read through the block table.
template <typename Format>
void pack_head(const typename Format::storage_t* k_cache, const typename Format::storage_t* v_cache,
               const int64_t* table, int64_t length, int64_t padded, int64_t block_size, int64_t num_kv_heads,
               int64_t head_dim, int64_t g, uint32_t* keys, uint16_t* values) {
  const int64_t words = head_dim / 2;
  const int64_t head_row = Format::row_elems(head_dim);
  std::memset(keys, 0, padded * head_dim * sizeof(uint16_t));
  std::memset(values, 0, padded * head_dim * sizeof(uint16_t));
  float decoded[kMaxHeadDim];
  alignas(4) uint16_t key_buf[kMaxHeadDim], value_buf[kMaxHeadDim];
  for (int64_t k = 0; k < length; ++k) {
    const int64_t slot = table[k / block_size] * block_size + k % block_size;
    const int64_t offset = (slot * num_kv_heads + g) * head_row;
    const uint16_t* kbits = bf16_row<Format>(k_cache + offset, head_dim, decoded, key_buf);
    uint32_t krow[kMaxHeadDim / 2];
    std::memcpy(krow, kbits, head_dim * sizeof(uint16_t));
    uint32_t* kdst = keys + (k / 16) * words * 16 + k % 16;
    for (int64_t w = 0; w < words; ++w) kdst[w * 16] = krow[w];
    const uint16_t* vrow = bf16_row<Format>(v_cache + offset, head_dim, decoded, value_buf);
    uint16_t* vdst = values + (k / 2) * head_dim * 2 + k % 2;
    for (int64_t d = 0; d < head_dim; ++d) vdst[2 * d] = vrow[d];
  }
}

inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// A thread's working memory for one item, per query head of the group.
struct Scratch {
  std::vector<uint16_t> q;      // [group][16][D] the rows' queries (zero past the item's rows)
  std::vector<float> scores;    // [group][16][64] one step's scores
  std::vector<uint16_t> probs;  // [group][16][64] one step's probabilities, bfloat16
  std::vector<float> pv;        // [group][16][D] one step's P V
  std::vector<float> acc;       // [group][16][D] the running sums of P V
  std::vector<float> row_max;   // [group][16]
  std::vector<float> new_max;   // [group][16]
  std::vector<float> correction;  // [group][16]
  std::vector<__m512> row_sum;  // [group][16] 16 partial sums per row, added up at the end

  Scratch(int64_t group, int64_t head_dim)
      : q(group * kRows * head_dim), scores(group * kRows * kKeys), probs(group * kRows * kKeys),
        pv(group * kRows * head_dim), acc(group * kRows * head_dim), row_max(group * kRows),
        new_max(group * kRows), correction(group * kRows), row_sum(group * kRows) {}
};

// S = Q K^T for 16 rows x 64 keys into scores[16][64]: tmm0-3 hold 16 keys each; tmm4 the
// queries' 32 dimensions of a step, tmm5 the keys'.
inline void tile_scores(const uint16_t* q, const uint32_t* kb, int64_t head_dim, float* scores) {
  const int64_t words = head_dim / 2;
  zero_sums();
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    _tile_loadd(4, q + d0, head_dim * 2);
    const uint32_t* kd = kb + (d0 / 2) * 16;
    _tile_loadd(5, kd, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, kd + words * 16, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, kd + 2 * words * 16, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, kd + 3 * words * 16, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, scores, kKeys * 4);
  _tile_stored(1, scores + 16, kKeys * 4);
  _tile_stored(2, scores + 32, kKeys * 4);
  _tile_stored(3, scores + 48, kKeys * 4);
}

// P V for 16 rows x 64 keys into pv[16][D]: tmm4-5 P's keys in two steps of 32, tmm6-7 the
// values' tiles, tmm0-3 the sums of four tiles of 16 dimensions.
inline void tile_values(const uint16_t* probs, const uint16_t* vb, int64_t head_dim, float* pv) {
  _tile_loadd(4, probs, kKeys * 2);
  _tile_loadd(5, probs + 32, kKeys * 2);
  const int64_t v_stride = head_dim * 4, second = 16 * head_dim * 2;  // bytes per key pair; elements to key 32
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    zero_sums();
    const uint16_t* vd = vb + d0 * 2;
    // Written out: the tile intrinsics take their register numbers as literals.
    _tile_loadd(6, vd, v_stride);
    _tile_loadd(7, vd + second, v_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 7);
    _tile_loadd(6, vd + 32, v_stride);
    _tile_loadd(7, vd + 32 + second, v_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, vd + 64, v_stride);
    _tile_loadd(7, vd + 64 + second, v_stride);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(2, 5, 7);
    _tile_loadd(6, vd + 96, v_stride);
    _tile_loadd(7, vd + 96 + second, v_stride);
    _tile_dpbf16ps(3, 4, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, pv + d0, head_dim * 4);
    _tile_stored(1, pv + d0 + 16, head_dim * 4);
    _tile_stored(2, pv + d0 + 32, head_dim * 4);
    _tile_stored(3, pv + d0 + 48, head_dim * 4);
  }
}

// One work item: rows [first_row, first_row + num_rows) of every query head sharing KV head
// `kv_head`. Each step runs a phase for all heads before the next phase (scores, softmax, P V,
// sums): a tile load does not take data from the store buffer, so a phase's tile loads wait for
// the previous phase's vector stores to reach the cache, and the other heads' work fills that wait.
// A query row into the rows' rotated basis (a quantized cache, kv_formats.h), rounded to bfloat16.
void rotate_query(const uint16_t* q, int64_t head_dim, uint16_t* out) {
  float x[kMaxHeadDim];
  for (int64_t d = 0; d < head_dim; ++d) x[d] = static_cast<float>(c10::BFloat16(q[d], c10::BFloat16::from_bits()));
  pagedllm::kv::hadamard(x, head_dim, pagedllm::kv::read_shift(head_dim));
  for (int64_t d = 0; d < head_dim; ++d) out[d] = c10::BFloat16(x[d]).x;
}

void attend_item(const Item& item, int64_t group, const uint16_t* query, int64_t q_stride, const uint32_t* keys,
                 const uint16_t* values, int64_t head_dim, float scale, const float* sinks, bool rotated,
                 uint16_t* out, Scratch& s) {
  const int64_t tile_elems = kRows * head_dim;
  std::fill(s.q.begin(), s.q.end(), 0);
  for (int64_t h = 0; h < group; ++h) {
    const int64_t head = item.kv_head * group + h;
    for (int64_t r = 0; r < item.num_rows; ++r) {
      const uint16_t* src = query + (item.first_row + r) * q_stride + head * head_dim;
      uint16_t* dst = s.q.data() + h * tile_elems + r * head_dim;
      if (rotated) {
        rotate_query(src, head_dim, dst);
      } else {
        std::memcpy(dst, src, head_dim * sizeof(uint16_t));
      }
    }
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  if (sinks != nullptr) {
    // The sink's exp(0) in the first of each row's 16 partial sums.
    const __m512 one = _mm512_maskz_mov_ps(__mmask16(1), _mm512_set1_ps(1.f));
    for (int64_t h = 0; h < group; ++h) {
      std::fill_n(s.row_max.begin() + h * kRows, kRows, sinks[item.kv_head * group + h]);
      std::fill_n(s.row_sum.begin() + h * kRows, kRows, one);
    }
  } else {
    std::fill(s.row_max.begin(), s.row_max.end(), kMasked);
    std::fill(s.row_sum.begin(), s.row_sum.end(), _mm512_setzero_ps());
  }
  const int64_t last_pos = item.first_pos + item.num_rows - 1;
  const int64_t words = head_dim / 2;
  const __m512 scale_v = _mm512_set1_ps(scale), masked = _mm512_set1_ps(kMasked);
  for (int64_t k0 = 0; k0 <= last_pos; k0 += kKeys) {
    for (int64_t h = 0; h < group; ++h) {
      tile_scores(s.q.data() + h * tile_elems, keys + (k0 / 16) * words * 16, head_dim,
                  s.scores.data() + h * kRows * kKeys);
    }
    // Which of this step's keys each row sees: causal, so the same for every head.
    __mmask16 seen_mask[kRows][4];
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t seen = r < item.num_rows ? std::min<int64_t>(kKeys, item.first_pos + r + 1 - k0) : 0;
      for (int v = 0; v < 4; ++v) {
        const int64_t n = std::clamp<int64_t>(seen - 16 * v, 0, 16);
        seen_mask[r][v] = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      float* scores = s.scores.data() + h * kRows * kKeys;
      float* row_max = s.row_max.data() + h * kRows;
      float* new_max = s.new_max.data() + h * kRows;
      // Scaled and masked scores and each row's new max; then the rows' corrections in one vector
      // (a row that has seen nothing keeps kMasked: exp(0) times its zero sums).
      for (int64_t r = 0; r < kRows; ++r) {
        __m512 x[4];
        for (int v = 0; v < 4; ++v) {
          float* sv = scores + r * kKeys + 16 * v;
          x[v] = _mm512_mask_mul_ps(masked, seen_mask[r][v], _mm512_loadu_ps(sv), scale_v);
          _mm512_storeu_ps(sv, x[v]);
        }
        const __m512 top = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
        new_max[r] = std::max(row_max[r], _mm512_reduce_max_ps(top));
      }
      const __m512 old_v = _mm512_loadu_ps(row_max), new_v = _mm512_loadu_ps(new_max);
      float* correction = s.correction.data() + h * kRows;
      _mm512_storeu_ps(correction, pagedllm::exp16(_mm512_sub_ps(old_v, new_v)));
      _mm512_storeu_ps(row_max, new_v);
      uint16_t* probs = s.probs.data() + h * kRows * kKeys;
      __m512* row_sum = s.row_sum.data() + h * kRows;
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 m = _mm512_set1_ps(new_max[r]);
        __m512 p[4];
        for (int v = 0; v < 4; ++v) {
          const __m512 x = _mm512_loadu_ps(scores + r * kKeys + 16 * v);
          p[v] = _mm512_maskz_mov_ps(seen_mask[r][v], pagedllm::exp16(_mm512_sub_ps(x, m)));
        }
        row_sum[r] = _mm512_fmadd_ps(row_sum[r], _mm512_set1_ps(correction[r]),
                                     _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
        _mm512_storeu_si512(probs + r * kKeys, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        _mm512_storeu_si512(probs + r * kKeys + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
      }
    }
    const uint16_t* vb = values + (k0 / 2) * head_dim * 2;
    for (int64_t h = 0; h < group; ++h) {
      tile_values(s.probs.data() + h * kRows * kKeys, vb, head_dim, s.pv.data() + h * tile_elems);
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* correction = s.correction.data() + h * kRows;
      float* acc = s.acc.data() + h * tile_elems;
      const float* pv = s.pv.data() + h * tile_elems;
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 c = _mm512_set1_ps(correction[r]);
        for (int64_t i = r * head_dim; i < (r + 1) * head_dim; i += 16) {
          _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(_mm512_loadu_ps(acc + i), c, _mm512_loadu_ps(pv + i)));
        }
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const int64_t head = item.kv_head * group + h;
    for (int64_t r = 0; r < item.num_rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(s.row_sum[h * kRows + r]));
      float* acc = s.acc.data() + h * tile_elems + r * head_dim;
      if (rotated) pagedllm::kv::hadamard(acc, head_dim, pagedllm::kv::read_shift(head_dim));  // back from it
      uint16_t* o = out + (item.first_row + r) * q_stride + head * head_dim;
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), (__m256i)packed);
      }
    }
  }
}

}  // namespace
#endif

bool prompt_attention_amx_supported(int64_t head_dim) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return head_dim % 64 == 0 && head_dim <= kMaxHeadDim && pagedllm::amx_ready();
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor prompt_attention_amx(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor query_start_loc,
                                   at::Tensor context_lens, double scale, at::Tensor sinks) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "query must be [T, Hq, D], the caches [N, block_size, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16, "prompt_attention_amx takes bfloat16 queries");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "the key and value caches must have one dtype and shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block_tables, query_start_loc and context_lens must be int64");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(prompt_attention_amx_supported(head_dim), "prompt_attention_amx is not supported here (needs AMX "
              "and a head_dim that is a multiple of 64, at most 256)");
  const int64_t batch = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == batch + 1 && block_tables.size(0) == batch,
              "query_start_loc must be [B + 1] and block_tables [B, max_blocks]");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  auto out = at::empty_like(query);
  pagedllm::count_run(pagedllm::Kernel::kPromptAttentionAmx);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  const float* sink_logits = pagedllm::sink_logits(sinks, num_heads);
  const int64_t* starts = query_start_loc.contiguous().data_ptr<int64_t>();
  const int64_t* lens = context_lens.contiguous().data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int64_t group = num_heads / num_kv_heads;
  // Packed keys and values per (sequence, KV head), lengths rounded up to kKeys.
  std::vector<int64_t> offsets(batch + 1, 0);
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t num_rows = starts[b + 1] - starts[b];
    const int64_t cached = lens[b] - num_rows;
    TORCH_CHECK(num_rows >= 0 && cached >= 0, "context_lens must cover each sequence's query tokens");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= max_blocks, "block table too short");
    offsets[b + 1] = offsets[b] + (lens[b] + kKeys - 1) / kKeys * kKeys * head_dim * num_kv_heads;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      for (int64_t r = 0; r < num_rows; r += kRows) {
        items.push_back({b, g, starts[b] + r, std::min(kRows, num_rows - r), cached + r});
      }
    }
  }
  // Uninitialised: pack_head writes every element, padding included.
  std::unique_ptr<uint16_t[]> keys(new uint16_t[offsets[batch]]), values(new uint16_t[offsets[batch]]);
  bool rotated = false;  // a quantized cache's rows are rotated (kv_formats.h): queries and outputs follow
  pagedllm::kv::dispatch_format<at::BFloat16>(k_cache, head_dim, "prompt_attention_amx", [&](auto format) {
    using Format = decltype(format);
    rotated = Format::kQuantized;
    const auto* k_data = pagedllm::kv::rows_of<Format>(k_cache);
    const auto* v_data = pagedllm::kv::rows_of<Format>(v_cache);
    at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / num_kv_heads, g = i % num_kv_heads;
        const int64_t padded = (lens[b] + kKeys - 1) / kKeys * kKeys;
        const int64_t offset = offsets[b] + g * padded * head_dim;
        pack_head<Format>(k_data, v_data, tables + b * max_blocks, lens[b], padded, block_size, num_kv_heads,
                          head_dim, g, reinterpret_cast<uint32_t*>(keys.get() + offset), values.get() + offset);
      }
    });
  });
  pagedllm::interleave_by_position(items);  // an item's cost grows with its position
  const uint16_t* q_data = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  uint16_t* o_data = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t q_stride = num_heads * head_dim;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    pagedllm::configure_full_tiles();
    Scratch scratch(group, head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      const int64_t padded = (lens[item.seq] + kKeys - 1) / kKeys * kKeys;
      const int64_t offset = offsets[item.seq] + item.kv_head * padded * head_dim;
      attend_item(item, group, q_data, q_stride, reinterpret_cast<const uint32_t*>(keys.get() + offset),
                  values.get() + offset, head_dim, static_cast<float>(scale), sink_logits, rotated, o_data, scratch);
    }
    _tile_release();
  });
#endif
  return out;
}
