// Paged decode attention for CPUs: each query attends over its sequence's KV blocks, read in
// place through the block table (no gathered copy of the context).
//
// One work item is one sequence: a block's slots hold all KV heads side by side, so walking a
// block four slots at a time and handling every head at once streams the block from memory in
// order (splitting by head instead made each pass skip 2/3 of every row and doubled the DRAM
// traffic), while the next block is prefetched. Only when there are fewer sequences than threads
// (one stream's decode, a long context) is a sequence's set of KV heads split into as many ranges
// as keep every thread busy; each head's arithmetic is the same either way, so the result does not
// depend on the split.
// The query heads that share a KV head (grouped-query attention) are handled together so each
// key/value row is loaded once. HEAD_DIM is a template parameter for the common sizes (32, 64, 96,
// 128, 256) so the compiler unrolls the register loops; other sizes take the generic instance.
//
// The cache's rows may be quantized (kv_formats.h): each key and value row is decoded in registers
// as it is read (16 values per AVX-512 load), in float32 like a float cache's; no float copy of the
// context is made. AVX2 builds (16 registers of 8 values: four rows of 128 would not stay in them)
// decode the four rows in hand into a small float32 buffer instead, which every query head of the
// group then reads from L1. Such rows are rotated: the query heads are rotated once before the walk
// and the output heads once after it.
//
// A sliding window W limits each query to its sequence's last W positions: the walk starts at
// position length - W, so blocks before it are never touched (the block manager may have freed
// them). A soft cap c (Gemma 2) replaces each score s by c * tanh(s / c) before the softmax.
// Attention sinks (GPT-OSS): a logit per query head joins the softmax as one more score after the
// soft cap, in the max and the denominator, with no value (as PagedAttention._attend computes it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_sinks.h"
#include "branches.h"
#include "kv_formats.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(PAGEDLLM_KV_LOAD8)
#include <immintrin.h>
#define PAGEDLLM_AVX2_ROWS 1
#endif

namespace {

template <typename Format>
using kv_t = typename Format::storage_t;

// Rows of this format and head size go through the AVX-512 or AVX2 register loops below.
template <typename Format, int HEAD_DIM>
constexpr bool kVectorRows =
#if defined(__AVX512F__)
    Format::kVector && HEAD_DIM > 0 && HEAD_DIM % 16 == 0;
#elif defined(PAGEDLLM_AVX2_ROWS)
    Format::kVector && HEAD_DIM > 0 && HEAD_DIM % 8 == 0;
#else
    false;
#endif

// The portable loops read a quantized row through a float32 copy of it (`row_buf`, head_dim values).
template <typename Format>
inline const float* float_row(const kv_t<Format>* row, int64_t head_dim, float* row_buf) {
  Format::dequantize(row, head_dim, row_buf);
  return row_buf;
}

// One key row of a KV head against the query heads sharing it: s[j * stride] = q_j . k.
template <typename Format, int HEAD_DIM>
inline void group_dots_portable(const float* __restrict__ q, const kv_t<Format>* __restrict__ k, int64_t head_dim,
                                int64_t group, float* __restrict__ s, int64_t stride, float* row_buf) {
  if constexpr (Format::kQuantized) {
    const float* kf = float_row<Format>(k, head_dim, row_buf);
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * kf[d];
      s[j * stride] = dot;
    }
  } else {
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * static_cast<float>(k[d]);
      s[j * stride] = dot;
    }
  }
}

// acc_j += p[j * stride] * v for the query heads sharing one value row.
template <typename Format, int HEAD_DIM>
inline void group_axpys_portable(const float* __restrict__ p, const kv_t<Format>* __restrict__ v, int64_t head_dim,
                                 int64_t group, float* __restrict__ acc, int64_t stride, float* row_buf) {
  if constexpr (Format::kQuantized) {
    const float* vf = float_row<Format>(v, head_dim, row_buf);
    for (int64_t j = 0; j < group; ++j) {
      const float pj = p[j * stride];
      float* a = acc + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += pj * vf[d];
    }
  } else {
    for (int64_t j = 0; j < group; ++j) {
      const float pj = p[j * stride];
      float* a = acc + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += pj * static_cast<float>(v[d]);
    }
  }
}

#if defined(__AVX512F__)
// float32 / bfloat16 / float16 / quantized rows of 32 to 256: the row is loaded (and decoded) into registers
// once for the whole group and each dot product is a chain of FMAs with one horizontal sum (the
// compiler's simd reduction left a generic loop that cost ~4x more per score, and did not vectorise
// bfloat16's conversion).
template <typename Format, int HEAD_DIM>
inline void group_dots_avx512(const float* __restrict__ q, const kv_t<Format>* __restrict__ k, int64_t group,
                              float* __restrict__ s, int64_t stride) {
  constexpr int R = HEAD_DIM / 16;
  __m512 kr[R];
  for (int r = 0; r < R; ++r) kr[r] = Format::load16(k, HEAD_DIM, r);
  for (int64_t j = 0; j < group; ++j) {
    const float* qj = q + j * HEAD_DIM;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), kr[0]);
    for (int r = 1; r < R; ++r) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * r), kr[r], acc);
    s[j * stride] = _mm512_reduce_add_ps(acc);
  }
}

template <typename Format, int HEAD_DIM>
inline void group_axpys_avx512(const float* __restrict__ p, const kv_t<Format>* __restrict__ v, int64_t group,
                               float* __restrict__ acc, int64_t stride) {
  constexpr int R = HEAD_DIM / 16;
  __m512 vr[R];
  for (int r = 0; r < R; ++r) vr[r] = Format::load16(v, HEAD_DIM, r);
  for (int64_t j = 0; j < group; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j * stride]);
    float* a = acc + j * HEAD_DIM;
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(a + 16 * r, _mm512_fmadd_ps(pj, vr[r], _mm512_loadu_ps(a + 16 * r)));
  }
}

// The four sums of a, b, c and d in one register: 13 instructions where four separate horizontal
// sums take about 32.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same of c, d.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per lane: [a, b, c, d] partial sums.
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Four consecutive rows (row_stride apart) as float32: rows[t][r] holds values 16r .. 16r + 15 of row t.
template <typename Format, int HEAD_DIM>
inline void load_rows4(const kv_t<Format>* __restrict__ p, int64_t row_stride, __m512 (&rows)[4][HEAD_DIM / 16]) {
  for (int t = 0; t < 4; ++t) {
    for (int r = 0; r < HEAD_DIM / 16; ++r) rows[t][r] = Format::load16(p + t * row_stride, HEAD_DIM, r);
  }
}

// Four key rows are loaded once for the group; per query head, four dot products end in one sum4.
// Four rows of R registers each fit the 32 registers up to heads of 128; wider heads (256: Gemma)
// take the rows one at a time.
template <typename Format, int HEAD_DIM>
inline void group_dots4_avx512(const float* __restrict__ q, const kv_t<Format>* __restrict__ k, int64_t row_stride,
                               int64_t group, float* __restrict__ s, int64_t stride) {
  if constexpr (HEAD_DIM > 128) {
    for (int t = 0; t < 4; ++t) group_dots_avx512<Format, HEAD_DIM>(q, k + t * row_stride, group, s + t, stride);
    return;
  }
  constexpr int R = HEAD_DIM / 16;
  __m512 kr[4][R];
  load_rows4<Format, HEAD_DIM>(k, row_stride, kr);
  for (int64_t j = 0; j < group; ++j) {
    const float* qj = q + j * HEAD_DIM;
    __m512 acc[4];
    const __m512 q0 = _mm512_loadu_ps(qj);
    for (int t = 0; t < 4; ++t) acc[t] = _mm512_mul_ps(q0, kr[t][0]);
    for (int r = 1; r < R; ++r) {
      const __m512 qr = _mm512_loadu_ps(qj + 16 * r);
      for (int t = 0; t < 4; ++t) acc[t] = _mm512_fmadd_ps(qr, kr[t][r], acc[t]);
    }
    _mm_storeu_ps(s + j * stride, sum4(acc[0], acc[1], acc[2], acc[3]));
  }
}

// Four value rows are loaded once for the group; each query head's accumulator is read and written
// once per four rows instead of once per row.
template <typename Format, int HEAD_DIM>
inline void group_axpys4_avx512(const float* __restrict__ p, const kv_t<Format>* __restrict__ v, int64_t row_stride,
                                int64_t group, float* __restrict__ acc, int64_t stride) {
  if constexpr (HEAD_DIM > 128) {
    for (int t = 0; t < 4; ++t) group_axpys_avx512<Format, HEAD_DIM>(p + t, v + t * row_stride, group, acc, stride);
    return;
  }
  constexpr int R = HEAD_DIM / 16;
  __m512 vr[4][R];
  load_rows4<Format, HEAD_DIM>(v, row_stride, vr);
  for (int64_t j = 0; j < group; ++j) {
    const float* pj = p + j * stride;
    float* a = acc + j * HEAD_DIM;
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_loadu_ps(a + 16 * r);
      for (int t = 0; t < 4; ++t) sum = _mm512_fmadd_ps(_mm512_set1_ps(pj[t]), vr[t][r], sum);
      _mm512_storeu_ps(a + 16 * r, sum);
    }
  }
}


// One head's scores -> exp(score - max) in place; returns their sum. exp16 instead of the
// compiler's libmvec call: with bfloat16 caches the kernel is bound by arithmetic, and the
// exponentials were a large share of it. `sink` (-inf: none) is one more score in the max and the
// sum, its exponential stored nowhere; exp(-inf) adds an exact 0.
inline float exp_and_sum(float* __restrict__ s, int64_t length, float sink) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= length; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  float max_score = std::max(_mm512_reduce_max_ps(top), sink);
  for (; t < length; ++t) max_score = std::max(max_score, s[t]);
  const __m512 shift = _mm512_set1_ps(max_score);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= length; t += 16) {
    const __m512 e = pagedllm::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < length) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (length - t)) - 1u);
    const __m512 e = pagedllm::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, s + t), shift));
    _mm512_mask_storeu_ps(s + t, rest, e);
    sum = _mm512_mask_add_ps(sum, rest, sum, e);
  }
  return _mm512_reduce_add_ps(sum) + std::exp(sink - max_score);
}
#endif

#if defined(PAGEDLLM_AVX2_ROWS)
// N rows (row_stride apart) as float32 rows HEAD_DIM apart: a float32 cache's rows where they lie,
// other formats' decoded into `buf` (N * HEAD_DIM values).
template <typename Format, int HEAD_DIM, int N>
inline const float* float_rows_avx2(const kv_t<Format>* __restrict__ p, int64_t row_stride, float* __restrict__ buf,
                                    int64_t& float_stride) {
  if constexpr (std::is_same_v<kv_t<Format>, float>) {
    float_stride = row_stride;
    return p;
  } else {
    for (int t = 0; t < N; ++t) {
      for (int r = 0; r < HEAD_DIM / 8; ++r) {
        _mm256_storeu_ps(buf + t * HEAD_DIM + 8 * r, Format::load8(p + t * row_stride, HEAD_DIM, r));
      }
    }
    float_stride = HEAD_DIM;
    return buf;
  }
}

// The four sums of a, b, c and d in one register.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  // [a, b, c, d] partial sums in each 128-bit half after three pairwise adds.
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float sum8(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// s[j * stride + t] = q_j . row_t for N (1 or 4) float32 rows: per query head, N chains of FMAs (two
// for a single row, to overlap their latency) and one horizontal sum.
template <int HEAD_DIM, int N>
inline void group_dots_avx2(const float* __restrict__ q, const float* __restrict__ rows, int64_t row_stride,
                            int64_t group, float* __restrict__ s, int64_t stride) {
  constexpr int R = HEAD_DIM / 8;
  for (int64_t j = 0; j < group; ++j) {
    const float* qj = q + j * HEAD_DIM;
    if constexpr (N == 4) {
      __m256 acc[4];
      const __m256 q0 = _mm256_loadu_ps(qj);
      for (int t = 0; t < 4; ++t) acc[t] = _mm256_mul_ps(q0, _mm256_loadu_ps(rows + t * row_stride));
      for (int r = 1; r < R; ++r) {
        const __m256 qr = _mm256_loadu_ps(qj + 8 * r);
        for (int t = 0; t < 4; ++t) {
          acc[t] = _mm256_fmadd_ps(qr, _mm256_loadu_ps(rows + t * row_stride + 8 * r), acc[t]);
        }
      }
      _mm_storeu_ps(s + j * stride, sum4(acc[0], acc[1], acc[2], acc[3]));
    } else {
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int r = 0; r < R; ++r) {
        acc[r & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8 * r), _mm256_loadu_ps(rows + 8 * r), acc[r & 1]);
      }
      s[j * stride] = sum8(_mm256_add_ps(acc[0], acc[1]));
    }
  }
}

// acc_j += sum_t p[j * stride + t] * row_t for N float32 rows: each accumulator is read and written
// once per N rows.
template <int HEAD_DIM, int N>
inline void group_axpys_avx2(const float* __restrict__ p, const float* __restrict__ rows, int64_t row_stride,
                             int64_t group, float* __restrict__ acc, int64_t stride) {
  constexpr int R = HEAD_DIM / 8;
  for (int64_t j = 0; j < group; ++j) {
    __m256 pj[N];
    for (int t = 0; t < N; ++t) pj[t] = _mm256_set1_ps(p[j * stride + t]);
    float* a = acc + j * HEAD_DIM;
    for (int r = 0; r < R; ++r) {
      __m256 sum = _mm256_loadu_ps(a + 8 * r);
      for (int t = 0; t < N; ++t) sum = _mm256_fmadd_ps(pj[t], _mm256_loadu_ps(rows + t * row_stride + 8 * r), sum);
      _mm256_storeu_ps(a + 8 * r, sum);
    }
  }
}
#endif

// The group operations the kernel calls: the AVX-512 or AVX2 register loops where they apply, else
// the portable ones. The *4 forms take four consecutive rows (row_stride apart). `row_buf` holds
// four rows of head_dim float32 values.
template <typename Format, int HEAD_DIM>
inline void group_dots(const float* q, const kv_t<Format>* k, int64_t head_dim, int64_t group, float* s,
                       int64_t stride, float* row_buf) {
#if defined(__AVX512F__)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    group_dots_avx512<Format, HEAD_DIM>(q, k, group, s, stride);
    return;
  }
#elif defined(PAGEDLLM_AVX2_ROWS)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    int64_t rows_stride;
    const float* rows = float_rows_avx2<Format, HEAD_DIM, 1>(k, 0, row_buf, rows_stride);
    group_dots_avx2<HEAD_DIM, 1>(q, rows, rows_stride, group, s, stride);
    return;
  }
#endif
  group_dots_portable<Format, HEAD_DIM>(q, k, head_dim, group, s, stride, row_buf);
}

template <typename Format, int HEAD_DIM>
inline void group_axpys(const float* p, const kv_t<Format>* v, int64_t head_dim, int64_t group, float* acc,
                        int64_t stride, float* row_buf) {
#if defined(__AVX512F__)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    group_axpys_avx512<Format, HEAD_DIM>(p, v, group, acc, stride);
    return;
  }
#elif defined(PAGEDLLM_AVX2_ROWS)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    int64_t rows_stride;
    const float* rows = float_rows_avx2<Format, HEAD_DIM, 1>(v, 0, row_buf, rows_stride);
    group_axpys_avx2<HEAD_DIM, 1>(p, rows, rows_stride, group, acc, stride);
    return;
  }
#endif
  group_axpys_portable<Format, HEAD_DIM>(p, v, head_dim, group, acc, stride, row_buf);
}

template <typename Format, int HEAD_DIM>
inline void group_dots4(const float* q, const kv_t<Format>* k, int64_t row_stride, int64_t head_dim, int64_t group,
                        float* s, int64_t stride, float* row_buf) {
#if defined(__AVX512F__)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    group_dots4_avx512<Format, HEAD_DIM>(q, k, row_stride, group, s, stride);
    return;
  }
#elif defined(PAGEDLLM_AVX2_ROWS)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    int64_t rows_stride;
    const float* rows = float_rows_avx2<Format, HEAD_DIM, 4>(k, row_stride, row_buf, rows_stride);
    group_dots_avx2<HEAD_DIM, 4>(q, rows, rows_stride, group, s, stride);
    return;
  }
#endif
  for (int r = 0; r < 4; ++r) {
    group_dots_portable<Format, HEAD_DIM>(q, k + r * row_stride, head_dim, group, s + r, stride, row_buf);
  }
}

template <typename Format, int HEAD_DIM>
inline void group_axpys4(const float* p, const kv_t<Format>* v, int64_t row_stride, int64_t head_dim, int64_t group,
                         float* acc, int64_t stride, float* row_buf) {
#if defined(__AVX512F__)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    group_axpys4_avx512<Format, HEAD_DIM>(p, v, row_stride, group, acc, stride);
    return;
  }
#elif defined(PAGEDLLM_AVX2_ROWS)
  if constexpr (kVectorRows<Format, HEAD_DIM>) {
    int64_t rows_stride;
    const float* rows = float_rows_avx2<Format, HEAD_DIM, 4>(v, row_stride, row_buf, rows_stride);
    group_axpys_avx2<HEAD_DIM, 4>(p, rows, rows_stride, group, acc, stride);
    return;
  }
#endif
  for (int r = 0; r < 4; ++r) {
    group_axpys_portable<Format, HEAD_DIM>(p + r, v + r * row_stride, head_dim, group, acc, stride, row_buf);
  }
}

// Loads one slot row (every KV head of one token) of the sequence's next block into the cache.
// A sequence's blocks lie anywhere in the pool, so the hardware prefetcher, which follows
// addresses, stalls at every block boundary; row i of the next block is requested while row i of
// this one is used, one block ahead (float32 contexts of 300-500 tokens ~18% faster per call on a
// 2-core AMX machine; 128 tokens level).
// `rows` slot rows from `row` on, row_stride apart: of each, the `bytes` a work item reads.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* row, int64_t rows, int64_t row_stride, int64_t bytes) {
  for (int64_t t = 0; t < rows; ++t) {
    const char* p = reinterpret_cast<const char*>(row + t * row_stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
}

// The first slot of the block after the one holding position pos + n, or nullptr past the context.
template <typename scalar_t>
inline const scalar_t* next_block(const scalar_t* cache, const int64_t* table, int64_t next_pos, int64_t context,
                                  int64_t block_size, int64_t row_stride) {
  return next_pos < context ? cache + table[next_pos / block_size] * block_size * row_stride : nullptr;
}

template <typename scalar_t, typename Format, int HEAD_DIM>
void decode_kernel(const scalar_t* __restrict__ q,              // [B, Hq, D]
                   const kv_t<Format>* __restrict__ k_cache,    // [N, bs, Hkv, row]
                   const kv_t<Format>* __restrict__ v_cache,    // [N, bs, Hkv, row]
                   const int64_t* __restrict__ block_tables,  // [B, max_blocks]
                   const int64_t* __restrict__ context_lens,  // [B]
                   const float* __restrict__ sinks,           // [Hq] sink logits, or nullptr: none
                   scalar_t* __restrict__ out,                // [B, Hq, D]
                   int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t runtime_head_dim,
                   int64_t block_size, int64_t max_blocks, float scale, int64_t sliding_window,
                   float soft_cap) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_row = Format::row_elems(head_dim);  // one KV head of one token, scales included
  const int64_t row_stride = num_kv_heads * head_row;   // one slot: every KV head of one token
  const int read_shift = pagedllm::kv::read_shift(head_dim);
  const int64_t threads = at::get_num_threads();
  const int64_t splits = batch == 0 || batch >= threads ? 1 : std::min(num_kv_heads, (threads + batch - 1) / batch);
  const int64_t kv_per_split = (num_kv_heads + splits - 1) / splits;
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row_buf(4 * head_dim);  // four rows as float32 (group_dots4 / group_axpys4)
    std::vector<float> scores;  // [Hq, length]
    std::vector<float> qf(num_heads * head_dim);
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> inv_sum(num_heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits;
      // This item's KV heads [g_begin, g_end) and their query heads [h_begin, h_end).
      const int64_t g_begin = item % splits * kv_per_split, g_end = std::min(num_kv_heads, g_begin + kv_per_split);
      if (g_begin >= g_end) continue;
      const int64_t h_begin = g_begin * group, h_end = g_end * group;
      const int64_t part_offset = g_begin * head_row;  // where its heads start in a slot row
      const int64_t part_bytes = (g_end - g_begin) * head_row * static_cast<int64_t>(sizeof(kv_t<Format>));
      const int64_t context = context_lens[b];
      // Positions [first, context) are attended; score t belongs to position first + t.
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, context - sliding_window) : 0;
      const int64_t length = context - first;
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(num_heads * length);
      const scalar_t* qrow = q + b * num_heads * head_dim;
      const float q_scale = soft_cap > 0.f ? scale / soft_cap : scale;
      for (int64_t i = h_begin * head_dim; i < h_end * head_dim; ++i) qf[i] = static_cast<float>(qrow[i]) * q_scale;
      if constexpr (Format::kQuantized) {  // into the rows' rotated basis
        for (int64_t h = h_begin; h < h_end; ++h) pagedllm::kv::hadamard(qf.data() + h * head_dim, head_dim, read_shift);
      }
      // Scores: walk the block table block by block (no division per token).
      for (int64_t pos = first; pos < context;) {
        const int64_t offset = pos % block_size;
        const int64_t n = std::min(block_size - offset, context - pos);
        const kv_t<Format>* kblock = k_cache + (table[pos / block_size] * block_size + offset) * row_stride;
        const kv_t<Format>* knext = next_block(k_cache, table, pos + n, context, block_size, row_stride);
        // Four rows at a time, then one by one.
        for (int64_t i = 0; i < n;) {
          const int64_t rows = n - i >= 4 ? 4 : 1;
          const kv_t<Format>* krow = kblock + i * row_stride;
          if (knext != nullptr) prefetch_rows(knext + i * row_stride + part_offset, rows, row_stride, part_bytes);
          float* srow = scores.data() + pos - first + i;
          // KV head outer, its query heads inner: no division per row, one key row per group.
          for (int64_t g = g_begin; g < g_end; ++g) {
            const float* qg = qf.data() + g * group * head_dim;
            float* sg = srow + g * group * length;
            if (rows == 4) {
              group_dots4<Format, HEAD_DIM>(qg, krow + g * head_row, row_stride, head_dim, group, sg, length,
                                            row_buf.data());
            } else {
              group_dots<Format, HEAD_DIM>(qg, krow + g * head_row, head_dim, group, sg, length, row_buf.data());
            }
          }
          i += rows;
        }
        pos += n;
      }
      if (soft_cap > 0.f) {
        for (int64_t t = h_begin * length; t < h_end * length; ++t) scores[t] = soft_cap * std::tanh(scores[t]);
      }
      // Softmax numerators in place; 1 / sum is applied to the output (one multiply per value, not
      // per score).
      for (int64_t h = h_begin; h < h_end; ++h) {
        float* s = scores.data() + h * length;
        const float sink = sinks != nullptr ? sinks[h] : -INFINITY;
#if defined(__AVX512F__)
        inv_sum[h] = 1.f / exp_and_sum(s, length, sink);
#else
        const float max_score = std::max(*std::max_element(s, s + length), sink);
        float sum = 0.f;
        // simd: lets the compiler use libmvec's vector exp instead of one expf per token.
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - max_score);
          sum += s[t];
        }
        inv_sum[h] = 1.f / (sum + std::exp(sink - max_score));
#endif
      }
      std::fill(acc.begin() + h_begin * head_dim, acc.begin() + h_end * head_dim, 0.f);
      for (int64_t pos = first; pos < context;) {
        const int64_t offset = pos % block_size;
        const int64_t n = std::min(block_size - offset, context - pos);
        const kv_t<Format>* vblock = v_cache + (table[pos / block_size] * block_size + offset) * row_stride;
        const kv_t<Format>* vnext = next_block(v_cache, table, pos + n, context, block_size, row_stride);
        for (int64_t i = 0; i < n;) {
          const int64_t rows = n - i >= 4 ? 4 : 1;
          const kv_t<Format>* vrow = vblock + i * row_stride;
          if (vnext != nullptr) prefetch_rows(vnext + i * row_stride + part_offset, rows, row_stride, part_bytes);
          const float* prow = scores.data() + pos - first + i;
          for (int64_t g = g_begin; g < g_end; ++g) {
            const float* pg = prow + g * group * length;
            float* ag = acc.data() + g * group * head_dim;
            if (rows == 4) {
              group_axpys4<Format, HEAD_DIM>(pg, vrow + g * head_row, row_stride, head_dim, group, ag, length,
                                             row_buf.data());
            } else {
              group_axpys<Format, HEAD_DIM>(pg, vrow + g * head_row, head_dim, group, ag, length, row_buf.data());
            }
          }
          i += rows;
        }
        pos += n;
      }
      if constexpr (Format::kQuantized) {  // back from the rotated basis
        for (int64_t h = h_begin; h < h_end; ++h) pagedllm::kv::hadamard(acc.data() + h * head_dim, head_dim, read_shift);
      }
      scalar_t* orow = out + b * num_heads * head_dim;
      for (int64_t h = h_begin; h < h_end; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          orow[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv_sum[h]);
        }
      }
    }
  });
}

template <typename scalar_t, typename Format>
void dispatch_head_dim(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, const float* sinks,
                       at::Tensor& out, float scale, int64_t sliding_window, float soft_cap) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  auto run = [&](auto head_dim_constant) {
    decode_kernel<scalar_t, Format, decltype(head_dim_constant)::value>(
        query.data_ptr<scalar_t>(), pagedllm::kv::rows_of<Format>(k_cache), pagedllm::kv::rows_of<Format>(v_cache),
        block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), sinks, out.data_ptr<scalar_t>(), batch,
        num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1), scale, sliding_window, soft_cap);
  };
  switch (head_dim) {
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 96: run(std::integral_constant<int, 96>{}); break;  // Phi-3
    case 128: run(std::integral_constant<int, 128>{}); break;
    case 256: run(std::integral_constant<int, 256>{}); break;  // Gemma 2 / 3
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens, double scale,
                                     int64_t sliding_window, double logits_soft_cap, at::Tensor sinks) {
  TORCH_CHECK(query.dim() == 3, "query must be [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [N, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "the key and value caches must have one dtype and shape");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0, "sliding_window and logits_soft_cap must be >= 0");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const float* sink_logits = pagedllm::sink_logits(sinks, query.size(1));
  auto out = at::empty_like(query);
  pagedllm::count_run(pagedllm::Kernel::kDecodeAttention);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode_attention", [&] {
    pagedllm::kv::dispatch_format<scalar_t>(k_cache, query.size(2), "paged_decode_attention", [&](auto format) {
      dispatch_head_dim<scalar_t, decltype(format)>(query, k_cache, v_cache, block_tables, context_lens,
                                                    sink_logits, out, static_cast<float>(scale), sliding_window,
                                                    static_cast<float>(logits_soft_cap));
    });
  });
  return out;
}
