// Linear layers for CPUs with AVX-512, y = x W^T (+ bias), over weights packed once at load time,
// float32 and bfloat16.
//
// Why not oneDNN: serving's GEMMs are short and wide (a decode batch of 1-64 rows against a
// 576 x 3072 weight). There the work is streaming each weight from memory once per call; oneDNN's
// bfloat16 kernels read weights at 9-10 GB/s at 1-64 rows on a 2-core AMX machine that reads
// 16 GB/s (benchmarks/dense_gemm.py). Here each thread reads one contiguous run of the weight per
// call, and every row of x is done while a panel is in cache.
//
// Packed layout, panel p holding output features 32p .. 32p + 31 (zero past N):
//   float32   [P, K, 32]           row k: the panel's weights for input k
//   bfloat16  [P, ceil(K/2), 32, 2] row k/2: for each output, the weights of inputs k and k+1 side by
//                                   side: the operand order of vdpbf16ps, and of AMX's B tiles
// The micro-kernel keeps up to 12 rows x 32 outputs in 24 registers and walks the inputs: one
// broadcast of x and two loads of the panel per step. Each output is one sequential sum over k in
// float32 (bias added last, bfloat16 rounded once), whatever the row count or the thread split: a
// float32 row's result never depends on the batch it is in.
//
// bfloat16 on AMX: every row goes through tile multiplies on the same packed weight (a panel's 16
// pair-rows x 16 outputs are a B tile at a 128-byte stride), in blocks of 32 rows, the last block
// zero-padded; without AMX through vdpbf16ps. On AMX the sums come out in another order than on
// the vector path, so there a bfloat16 row's last bits may depend on its block.
//
// A gated MLP's gate and up weights can be packed as one, each panel 16 gate rows then the 16 up
// rows of the same outputs: the epilogue then writes silu(gate) * up directly (rounded as the
// unfused layers round in bfloat16), and the [rows, 2I] intermediate never reaches memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "kernels.h"
#include "vec_math.h"
#include "branches.h"

namespace {

constexpr int64_t kPanel = 32;  // output features per panel: two registers of 16
constexpr int kTile = 12;       // rows per register tile: 24 accumulators

// Rows of x are taken in blocks of about kRowBlockBytes, each block against all of a thread's
// panels: the block stays in the core's near caches while the panels stream past. Over all rows
// at once, a prompt's x (1,000 rows at K = 1536 is 3 MB in bfloat16) was re-read from memory for
// every panel; on a 2-core AMX machine, blocks of 64 KB made 256-2,048-row products 20-30% faster
// and did not slow 64 rows.
constexpr int64_t kRowBlockBytes = 64 * 1024;

// A decode batch, up to kWholeRows rows, stays one block while it fits kWholeBlockBytes (the
// core's L2 holds it beside the panel being read): split into blocks of 64 KB it read every
// panel from memory once per block, and a weight too large for the cache (an LM head) then cost
// that many times its memory time. On a 2-core AMX machine, the default model's float32 LM head
// (49152 x 576) took 24-31 ms at 32 rows and 36-48 at 64 split, 17-20 and 25-37 whole.
constexpr int64_t kWholeRows = 64;
constexpr int64_t kWholeBlockBytes = 1024 * 1024;

// How far ahead of the micro-kernel a panel is prefetched, in panel rows (4 KB of float32, or of
// bfloat16 input pairs). The hardware prefetcher alone left the weight loads stalling between the
// FMAs: a float32 call took about its memory time plus its arithmetic time instead of the larger
// of the two (1-64 rows 15-24% faster with this prefetch on a 2-core AMX machine). At a panel's
// end it runs on into the next panel, which the same thread takes next (past the last panel it
// names memory the kernel never reads: a prefetch is a hint and cannot fault).
constexpr int64_t kPrefetchRows = 32;

// In products of up to kWholeRows rows (decode batches), which wait on the weights' stream, a
// second prefetch, into L2 and kL2PrefetchRows panel rows (32 KB) ahead, keeps more of the stream
// in flight than the near one alone can (each core has few L1 fill buffers): on a 2-core AMX
// machine, the default model's float32 layers took 18 ms instead of 22-23 at 8 rows and 20
// instead of 23 at 12, the same at 1 and at 16-24 rows. Prompts, bound by arithmetic, go without
// it and without the chunks below: with both, 480 rows took 5-10% longer.
constexpr int64_t kL2PrefetchRows = 256;

// The prefetches ahead of w, in a panel of rows of row_bytes (128: 32 float32 or 32 bfloat16 pairs);
// the L2 one only where FAR. Only the AVX-512 micro-kernels below call it, and _mm_prefetch is x86's
// (immintrin.h, from vec_math.h there): the builds below AVX-512, aarch64's scalar one too, go without.
#if defined(__AVX512F__)
template <bool FAR>
inline void prefetch_panel(const void* w, int64_t row_bytes) {
  const char* p = static_cast<const char*>(w);
  _mm_prefetch(p + kPrefetchRows * row_bytes, _MM_HINT_T0);
  _mm_prefetch(p + kPrefetchRows * row_bytes + 64, _MM_HINT_T0);
  if constexpr (FAR) {
    _mm_prefetch(p + kL2PrefetchRows * row_bytes, _MM_HINT_T1);
    _mm_prefetch(p + kL2PrefetchRows * row_bytes + 64, _MM_HINT_T1);
  }
}
#endif

// In a decode-sized product, the register tiles of a block of rows take a panel kChunkInputs
// inputs at a time, each tile's sums carried from chunk to chunk in a buffer: every tile then reads
// a chunk the first tile has just brought into L1, while the prefetches run on ahead. Taking the
// whole panel tile by tile, the first tile waited on memory while the others multiplied with
// memory idle (19 rows: 26.5 -> 23.3 ms for the default model's float32 layers with the L2
// prefetch above).
constexpr int64_t kChunkInputs = 64;  // even: a chunk holds whole bfloat16 input pairs

// Rows per block for rows of row_bytes: a multiple of `unit` (the micro-kernel's rows), at least one.
inline int64_t row_block_rows(int64_t row_bytes, int64_t unit) {
  const int64_t by_bytes = kRowBlockBytes / row_bytes / unit * unit;
  const int64_t whole = std::min(kWholeRows, kWholeBlockBytes / row_bytes);
  return std::max({unit, by_bytes, (whole + unit - 1) / unit * unit});
}

#if defined(__AVX512F__)

// A register tile's sums, ROWS x 32, into out[ROWS][32].
template <int ROWS>
inline void store_sums(const __m512 (&acc)[ROWS][2], float* __restrict__ out) {
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_ps(out + m * kPanel, acc[m][0]);
    _mm512_storeu_ps(out + m * kPanel + 16, acc[m][1]);
  }
}

// A register tile's sums carried on from out[ROWS][32] (resume), or zero.
template <int ROWS>
inline void load_sums(__m512 (&acc)[ROWS][2], const float* __restrict__ out, bool resume) {
  for (int m = 0; m < ROWS; ++m) {
    acc[m][0] = resume ? _mm512_loadu_ps(out + m * kPanel) : _mm512_setzero_ps();
    acc[m][1] = resume ? _mm512_loadu_ps(out + m * kPanel + 16) : _mm512_setzero_ps();
  }
}

// Rows [0, ROWS) of x against inputs [k_begin, k_end) of one float32 panel: the 32 sums of each
// row into out[ROWS][32], added to the sums already there when `resume`.
template <int ROWS, bool FAR>
inline void tile_f32(const float* __restrict__ x, int64_t ldx, const float* __restrict__ panel, int64_t k_begin,
                     int64_t k_end, bool resume, float* __restrict__ out) {
  __m512 acc[ROWS][2];
  load_sums<ROWS>(acc, out, resume);
  const float* w = panel + k_begin * kPanel;
  for (int64_t k = k_begin; k < k_end; ++k, w += kPanel) {
    prefetch_panel<FAR>(w, kPanel * sizeof(float));
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(a, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, w1, acc[m][1]);
    }
  }
  store_sums<ROWS>(acc, out);
}

#if defined(__AVX512BF16__)
// The same over a bfloat16 panel: one vdpbf16ps multiplies a pair of inputs into each output.
// k_begin is even; an odd k_end is the last input, alone.
template <int ROWS, bool FAR>
inline void tile_bf16(const uint16_t* __restrict__ x, int64_t ldx, const uint16_t* __restrict__ panel,
                      int64_t k_begin, int64_t k_end, bool resume, float* __restrict__ out) {
  __m512 acc[ROWS][2];
  load_sums<ROWS>(acc, out, resume);
  const uint16_t* w = panel + k_begin * kPanel;
  for (int64_t kp = k_begin / 2; kp < k_end / 2; ++kp, w += 2 * kPanel) {
    prefetch_panel<FAR>(w, 2 * kPanel * sizeof(uint16_t));
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int m = 0; m < ROWS; ++m) {
      int32_t both;
      std::memcpy(&both, x + m * ldx + 2 * kp, sizeof(both));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(both);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, w1);
    }
  }
  if (k_end & 1) {  // the last input alone: its partner in the packed pair is zero
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[m * ldx + k_end - 1]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, (__m512bh)_mm512_loadu_si512(w));
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, (__m512bh)_mm512_loadu_si512(w + 32));
    }
  }
  store_sums<ROWS>(acc, out);
}
#endif

template <typename T>
struct Panel;

template <>
struct Panel<float> {
  using raw = float;
  static int64_t stride(int64_t k_dim) { return k_dim * kPanel; }
  template <int ROWS, bool FAR>
  static void tile(const raw* x, int64_t ldx, const raw* panel, int64_t k_begin, int64_t k_end, bool resume,
                   float* out) {
    tile_f32<ROWS, FAR>(x, ldx, panel, k_begin, k_end, resume, out);
  }
  static void store(const float* sums, const float* bias, raw* y, __mmask16 mask0, __mmask16 mask1) {
    __m512 s0 = _mm512_loadu_ps(sums), s1 = _mm512_loadu_ps(sums + 16);
    if (bias != nullptr) {
      s0 = _mm512_add_ps(s0, _mm512_maskz_loadu_ps(mask0, bias));
      s1 = _mm512_add_ps(s1, _mm512_maskz_loadu_ps(mask1, bias + 16));
    }
    _mm512_mask_storeu_ps(y, mask0, s0);
    _mm512_mask_storeu_ps(y + 16, mask1, s1);
  }
  // A gated panel: 16 gate sums, then the 16 up sums of the same outputs -> silu(gate) * up.
  static void store_gated(const float* sums, const float* bias, raw* y) {
    __m512 gate = _mm512_loadu_ps(sums), up = _mm512_loadu_ps(sums + 16);
    if (bias != nullptr) {
      gate = _mm512_add_ps(gate, _mm512_loadu_ps(bias));
      up = _mm512_add_ps(up, _mm512_loadu_ps(bias + 16));
    }
    _mm512_storeu_ps(y, _mm512_mul_ps(pagedllm::silu16(gate), up));
  }
};

#if defined(__AVX512BF16__)
inline __m512 widen_bf16(__mmask16 mask, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

inline __m512 round_bf16(__m512 v) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <>
struct Panel<at::BFloat16> {
  using raw = uint16_t;
  static int64_t stride(int64_t k_dim) { return (k_dim + 1) / 2 * 2 * kPanel; }
  template <int ROWS, bool FAR>
  static void tile(const raw* x, int64_t ldx, const raw* panel, int64_t k_begin, int64_t k_end, bool resume,
                   float* out) {
    tile_bf16<ROWS, FAR>(x, ldx, panel, k_begin, k_end, resume, out);
  }
  static void store(const float* sums, const uint16_t* bias, raw* y, __mmask16 mask0, __mmask16 mask1) {
    __m512 s0 = _mm512_loadu_ps(sums), s1 = _mm512_loadu_ps(sums + 16);
    if (bias != nullptr) {
      s0 = _mm512_add_ps(s0, widen_bf16(mask0, bias));
      s1 = _mm512_add_ps(s1, widen_bf16(mask1, bias + 16));
    }
    _mm256_mask_storeu_epi16(y, mask0, (__m256i)_mm512_cvtneps_pbh(s0));
    _mm256_mask_storeu_epi16(y + 16, mask1, (__m256i)_mm512_cvtneps_pbh(s1));
  }
  // Rounded where the unfused layers round: the GEMM's outputs, silu's, and the product.
  static void store_gated(const float* sums, const uint16_t* bias, raw* y) {
    __m512 gate = _mm512_loadu_ps(sums), up = _mm512_loadu_ps(sums + 16);
    if (bias != nullptr) {
      gate = _mm512_add_ps(gate, widen_bf16(0xffff, bias));
      up = _mm512_add_ps(up, widen_bf16(0xffff, bias + 16));
    }
    const __m512 act = round_bf16(pagedllm::silu16(round_bf16(gate)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, round_bf16(up))));
  }
};
#endif

// Writes one panel's sums of a row: plain (32 outputs, the last panel masked to N), or gated
// (16 outputs, silu(gate) * up, into a row of N / 2).
template <typename T>
struct Epilogue {
  using raw = typename Panel<T>::raw;
  const raw* bias;
  raw* y;
  int64_t ldy, n_dim;
  bool gated;

  void operator()(const float* sums, int64_t row, int64_t panel) const {
    const int64_t n0 = panel * kPanel;
    const raw* panel_bias = bias == nullptr ? nullptr : bias + n0;
    if (gated) {
      Panel<T>::store_gated(sums, panel_bias, y + row * ldy + panel * (kPanel / 2));
      return;
    }
    const int64_t valid = std::min<int64_t>(kPanel, n_dim - n0);
    const __mmask16 mask0 = static_cast<__mmask16>((1u << std::min<int64_t>(valid, 16)) - 1u);
    const __mmask16 mask1 = static_cast<__mmask16>((1u << std::max<int64_t>(valid - 16, 0)) - 1u);
    Panel<T>::store(sums, panel_bias, y + row * ldy + n0, mask0, mask1);
  }
};

template <typename T, bool FAR>
void tile_rows(int rows, const typename Panel<T>::raw* x, int64_t ldx, const typename Panel<T>::raw* panel,
               int64_t k_begin, int64_t k_end, bool resume, float* out) {
  switch (rows) {
    case 1: Panel<T>::template tile<1, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 2: Panel<T>::template tile<2, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 3: Panel<T>::template tile<3, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 4: Panel<T>::template tile<4, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 5: Panel<T>::template tile<5, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 6: Panel<T>::template tile<6, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 7: Panel<T>::template tile<7, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 8: Panel<T>::template tile<8, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 9: Panel<T>::template tile<9, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 10: Panel<T>::template tile<10, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    case 11: Panel<T>::template tile<11, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
    default: Panel<T>::template tile<12, FAR>(x, ldx, panel, k_begin, k_end, resume, out); break;
  }
}

#if defined(__AMX_BF16__)
using pagedllm::amx_ready;

// Tiles (pagedllm::configure_full_tiles): tmm0-3 the sums of 32 rows x 32 outputs (two rows of
// tiles by two); tmm4-5 16 rows x 32 inputs of x each; tmm6-7 16 input pairs x 16 outputs of the panel each.

// ROW_TILES x 16 rows of x against one panel: sums into out[16 * ROW_TILES][32]. k_dim % 32 == 0.
// `next_panel` null: the panel comes from memory, prefetched two steps ahead. Otherwise the panel is
// in cache (an earlier block of rows read it) and the same step's part of the next panel is
// prefetched into L2 instead, so that memory keeps streaming while these multiplies run.
template <int ROW_TILES>
inline void amx_block(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t k_dim, float* out,
                      const uint16_t* next_panel) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (ROW_TILES == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * 2;
  constexpr int64_t w_stride = 2 * kPanel * 2;  // bytes per pair-row of the panel
  for (int64_t k = 0; k < k_dim; k += 32) {
    const uint16_t* w = panel + k * kPanel;  // 16 pair-rows of the panel
    if (next_panel == nullptr) {
      // Tiles are not renamed: the next step's weight loads wait for this step's multiplies, so
      // they must not also wait for memory. Two steps ahead, into the next panel at the end.
      for (int line = 0; line < 32; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(w + 2 * 32 * kPanel) + 64 * line, _MM_HINT_T0);
      }
    } else {
      for (int line = 0; line < 32; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(next_panel + k * kPanel) + 64 * line, _MM_HINT_T1);
      }
    }
    _tile_loadd(6, w, w_stride);
    _tile_loadd(7, w + 32, w_stride);
    _tile_loadd(4, x + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (ROW_TILES == 2) {
      _tile_loadd(5, x + 16 * ldx + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t row_bytes = kPanel * 4;
  _tile_stored(0, out, row_bytes);
  _tile_stored(1, out + 16, row_bytes);
  if constexpr (ROW_TILES == 2) {
    _tile_stored(2, out + 16 * kPanel, row_bytes);
    _tile_stored(3, out + 16 * kPanel + 16, row_bytes);
  }
}

// The rows of x as the tiles take them: blocks of 32 up to full_rows, then the rest copied into
// `tail`, zero-padded to rest_tiles (one or two) tiles of 16 rows.
struct AmxRows {
  const uint16_t* x;
  int64_t ldx, rows, full_rows;
  int rest_tiles;
  std::vector<uint16_t> tail;

  AmxRows(const uint16_t* x_, int64_t ldx_, int64_t rows_, int64_t k_dim)
      : x(x_), ldx(ldx_), rows(rows_), full_rows(rows_ / 32 * 32) {
    const int64_t rest = rows - full_rows;
    rest_tiles = rest == 0 ? 0 : (rest <= 16 ? 1 : 2);
    tail.assign(rest_tiles * 16 * k_dim, 0);
    for (int64_t r = 0; r < rest; ++r) std::memcpy(tail.data() + r * k_dim, x + (full_rows + r) * ldx, k_dim * 2);
  }
};

// Rows [m0, m1) against one panel, the tail too when m1 is the last row. The first tile reads the
// panel from memory; the later ones prefetch `next` (the thread's next panel; null: none).
template <typename T>
inline void amx_panel_rows(const AmxRows& x, int64_t m0, int64_t m1, const uint16_t* panel, int64_t k_dim,
                           const uint16_t* next, float* sums, const Epilogue<T>& write, int64_t p) {
  const uint16_t* ahead = nullptr;
  for (int64_t m = m0; m < std::min(m1, x.full_rows); m += 32, ahead = next) {
    amx_block<2>(x.x + m * x.ldx, x.ldx, panel, k_dim, sums, ahead);
    for (int64_t r = 0; r < 32; ++r) write(sums + r * kPanel, m + r, p);
  }
  if (m1 == x.rows && x.rest_tiles > 0) {
    if (x.rest_tiles == 1) {
      amx_block<1>(x.tail.data(), k_dim, panel, k_dim, sums, ahead);
    } else {
      amx_block<2>(x.tail.data(), k_dim, panel, k_dim, sums, ahead);
    }
    for (int64_t r = 0; r < x.rows - x.full_rows; ++r) write(sums + r * kPanel, x.full_rows + r, p);
  }
}

// All rows through AMX: each panel taken once per block of rows for all of that block's tiles
// (the tail included).
void amx_gemm(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* packed, int64_t k_dim, int64_t n_dim,
              const Epilogue<at::BFloat16>& write) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t panel_stride = Panel<at::BFloat16>::stride(k_dim);
  const AmxRows tiles(x, ldx, rows, k_dim);
  const int64_t row_block = row_block_rows(k_dim * 2, 32);
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    alignas(64) float sums[32 * kPanel];
    pagedllm::configure_full_tiles();
    for (int64_t m0 = 0; m0 < rows; m0 += row_block) {
      const int64_t m1 = std::min(rows, m0 + row_block);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const uint16_t* panel = packed + p * panel_stride;
        const uint16_t* next = p + 1 < p_end ? panel + panel_stride : nullptr;
        amx_panel_rows(tiles, m0, m1, panel, k_dim, next, sums, write, p);
      }
    }
    _tile_release();
  });
}

// All rows through AMX over panels that `decode` writes into a buffer of the thread, one at a time:
// each panel is decoded once and multiplied by every row while it is in cache.
void amx_gemm_decoded(const uint16_t* x, int64_t rows, int64_t k_dim, int64_t n_dim, const PanelDecoder& decode,
                      const Epilogue<float>& write) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t panel_stride = Panel<at::BFloat16>::stride(k_dim);
  const AmxRows tiles(x, k_dim, rows, k_dim);
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    alignas(64) float sums[32 * kPanel];
    std::vector<uint16_t> buffer(panel_stride + 32);  // 64-byte aligned view below
    uint16_t* panel = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    pagedllm::configure_full_tiles();
    for (int64_t p = p_begin; p < p_end; ++p) {
      decode(p, panel);
      amx_panel_rows(tiles, 0, rows, panel, k_dim, nullptr, sums, write, p);
    }
    _tile_release();
  });
}
#endif

template <typename T>
void gemm(const typename Panel<T>::raw* x, int64_t ldx, int64_t rows, const typename Panel<T>::raw* packed,
          int64_t k_dim, int64_t n_dim, const Epilogue<T>& write) {
#if defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (k_dim % 32 == 0 && amx_ready()) {
      pagedllm::count_run(pagedllm::Kernel::kDenseGemmBf16Amx);
      return amx_gemm(x, ldx, rows, packed, k_dim, n_dim, write);
    }
  }
#endif
  pagedllm::count_run(std::is_same_v<T, float> ? pagedllm::Kernel::kDenseGemmF32 : pagedllm::Kernel::kDenseGemmBf16);
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t panel_stride = Panel<T>::stride(k_dim);
  const int64_t row_block = row_block_rows(k_dim * sizeof(typename Panel<T>::raw), kTile);
  const bool decode_sized = rows <= kWholeRows;
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    alignas(64) float sums[kWholeRows * kPanel];
    for (int64_t m0 = 0; m0 < rows; m0 += row_block) {
      const int64_t m1 = std::min(rows, m0 + row_block);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const auto* panel = packed + p * panel_stride;
        if (!decode_sized) {  // tile by tile, each over the whole panel
          for (int64_t m = m0; m < m1; m += kTile) {
            const int tile = static_cast<int>(std::min<int64_t>(kTile, m1 - m));
            tile_rows<T, false>(tile, x + m * ldx, ldx, panel, 0, k_dim, false, sums);
            for (int r = 0; r < tile; ++r) write(sums + r * kPanel, m + r, p);
          }
          continue;
        }
        // The block's (at most kWholeRows) rows, every tile over each chunk of the panel in turn.
        const int64_t k_step = m1 - m0 > kTile ? kChunkInputs : k_dim;
        for (int64_t k0 = 0; k0 < k_dim; k0 += k_step) {
          const int64_t k1 = std::min(k_dim, k0 + k_step);
          for (int64_t m = m0; m < m1; m += kTile) {
            const int tile = static_cast<int>(std::min<int64_t>(kTile, m1 - m));
            tile_rows<T, true>(tile, x + m * ldx, ldx, panel, k0, k1, k0 > 0, sums + (m - m0) * kPanel);
          }
        }
        for (int64_t r = m0; r < m1; ++r) write(sums + (r - m0) * kPanel, r, p);
      }
    }
  });
}
#endif  // __AVX512F__

bool dtype_supported(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return __builtin_cpu_supports("avx512f");
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return __builtin_cpu_supports("avx512bf16");
#endif
#endif
  (void)dtype;
  return false;
}

}  // namespace

bool dense_gemm_supported(at::Tensor weight) { return dtype_supported(weight.scalar_type()); }

at::Tensor dense_pack_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be an [N, K] matrix");
  TORCH_CHECK(dtype_supported(weight.scalar_type()), "no packed GEMM for ", weight.scalar_type(), " on this CPU");
  const int64_t n_dim = weight.size(0), k_dim = weight.size(1);
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  if (weight.scalar_type() == at::kFloat) {
    auto padded = at::zeros({panels * kPanel, k_dim}, weight.options());
    padded.narrow(0, 0, n_dim).copy_(weight);
    return padded.view({panels, kPanel, k_dim}).transpose(1, 2).contiguous();  // [P, K, 32]
  }
  const int64_t pairs = (k_dim + 1) / 2;
  auto padded = at::zeros({panels * kPanel, pairs * 2}, weight.options());
  padded.narrow(0, 0, n_dim).narrow(1, 0, k_dim).copy_(weight);
  // [P, 32, pairs, 2] -> [P, pairs, 32, 2]
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor dense_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n_dim,
                           int64_t k_dim, bool silu_and_mul) {
  TORCH_CHECK(dtype_supported(packed.scalar_type()), "no packed GEMM for ", packed.scalar_type(), " on this CPU");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x is ", x.scalar_type(), ", the weight ", packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous() && packed.size(0) * kPanel >= n_dim, "not a packed weight of ", n_dim, " rows");
  TORCH_CHECK(x.size(-1) == k_dim, "x has ", x.size(-1), " features, the weight ", k_dim);
  TORCH_CHECK(!silu_and_mul || n_dim % kPanel == 0, "a gated weight has a multiple of ", kPanel, " rows");
  auto sizes = x.sizes().vec();
  auto x2 = x.reshape({-1, k_dim});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t rows = x2.size(0);
  const int64_t out_dim = silu_and_mul ? n_dim / 2 : n_dim;
  sizes.back() = out_dim;
  auto y = at::empty({rows, out_dim}, x.options());
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(x.scalar_type()).contiguous();
    TORCH_CHECK(bias_c.numel() == n_dim, "bias has ", bias_c.numel(), " values, the weight ", n_dim, " rows");
  }
#if defined(__AVX512F__)
  if (rows > 0) {
    if (x.scalar_type() == at::kFloat) {
      const Epilogue<float> write{bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                                  out_dim, n_dim, silu_and_mul};
      gemm<float>(x2.data_ptr<float>(), x2.stride(0), rows, packed.data_ptr<float>(), k_dim, n_dim, write);
    }
#if defined(__AVX512BF16__)
    else {
      using raw = uint16_t;
      const Epilogue<at::BFloat16> write{
          bias_c.defined() ? reinterpret_cast<const raw*>(bias_c.data_ptr()) : nullptr,
          reinterpret_cast<raw*>(y.data_ptr()), out_dim, n_dim, silu_and_mul};
      gemm<at::BFloat16>(reinterpret_cast<const raw*>(x2.data_ptr()), x2.stride(0), rows,
                         reinterpret_cast<const raw*>(packed.data_ptr()), k_dim, n_dim, write);
    }
#endif
  }
#endif
  return y.view(sizes);
}

bool decoded_gemm_supported(int64_t k_dim) {
#if defined(__AMX_BF16__)
  return k_dim % 32 == 0 && amx_ready();
#else
  (void)k_dim;
  return false;
#endif
}

at::Tensor decoded_linear(at::Tensor x, const PanelDecoder& decode, int64_t n_dim, int64_t k_dim,
                             const float* bias) {
  TORCH_CHECK(decoded_gemm_supported(k_dim), "no AMX GEMM over decoded panels of ", k_dim, " inputs on this CPU");
  TORCH_CHECK(x.size(-1) == k_dim, "x has ", x.size(-1), " features, the weight ", k_dim);
  auto sizes = x.sizes().vec();
  sizes.back() = n_dim;
  auto x2 = x.reshape({-1, k_dim}).to(at::kBFloat16).contiguous();
  const int64_t rows = x2.size(0);
  auto y = at::empty({rows, n_dim}, x.options().dtype(at::kFloat));
#if defined(__AMX_BF16__)
  if (rows > 0) {
    const Epilogue<float> write{bias, y.data_ptr<float>(), n_dim, n_dim, false};
    amx_gemm_decoded(reinterpret_cast<const uint16_t*>(x2.data_ptr()), rows, k_dim, n_dim, decode, write);
  }
#else
  (void)decode;
  (void)bias;
#endif
  return y.view(sizes);
}
