// Linear layers with int8 activations over weights re-tiled for integer dot products.
//
// The scheme llama.cpp uses for quantized weights, laid out for a batching engine: activations are
// quantized to int8 per block of 32 inputs (one float scale each, round to nearest), weights keep
// their format's integer quants (4, 6 or 8 bits) and per-block scales, and every product of 4
// weight quants with 4 activation quants is one lane of an integer dot-product instruction
// (AVX-512 VNNI vpdpbusd; AVX2 pmaddubsw + pmaddwd; a portable loop elsewhere).
//
// Tiled layout. A weight [N, K] is cut into panels of 16 output rows (the last one padded with
// zero rows). Each panel is one contiguous run of bytes, in groups of 256 inputs (a legacy format's
// last group may hold fewer): a group's quants, then its scale regions, so that a kernel reads a
// panel front to back as one stream (groups start on cache lines: group_stride). With the scales in a
// region of their own after all of a panel's quants, a one-row product read two streams at once: on a
// Zen 4, one thread's one-row Q4_K 9728 x 2560 product took 0.845 ms that way and 0.723 ms in groups,
// Q6_K 1.029 and 0.845 ms (benchmarks/kernel_builds_ab.py; at two threads, run to run, Q4_K 0.99-1.29x
// and Q6_K 1.04-1.16x as fast).
// Within a group of G inputs:
//   quants:  G/8 chunks of 64 bytes for 4-bit formats: byte 4r + j holds, for row r, input 8c + j
//            in its low nibble and input 8c + 4 + j in its high nibble (j < 4); so one 64-byte load
//            gives two [16 rows x 4 inputs] operands after an and / a shift.
//            6-bit (Q6_K): per 16 inputs, two such nibble chunks then a chunk whose byte 4r + j holds
//            the high 2 bits of the 4 [16 x 4] operands (bits 2s, 2s + 1 for operand s).
//            5-bit (Q5_K): per 32 inputs, four nibble chunks as 4-bit, then a chunk whose
//            byte 4r + j holds the high bits of the 8 [16 x 4] operands (bit s for operand s).
//            8-bit: one chunk per 4 inputs, a byte per quant (AVX2 builds: the signed quant, see below).
//   scales:  per block of `flush` inputs (32; 16 for Q6_K), 16 fp16 scales S (one per row);
//   mins:    per block, 16 fp16 offsets O when the format has them (Q4_1, Q4_K, Q5_K, int4 groups);
//            otherwise O = c * S with the format's constant c (Q4_0: -8, Q6_K: -32, 8-bit: -128).
// Sub-scales (the K-quants): the file's integer scales stay integers, as bytes per block and row
// (Q6_K's signed), under one fp16 per 256 inputs and row: S = d * sc, O = dmin * m (dmin stored
// negated). Regions: sc [G/flush][16], m [G/flush][16], d [16], dmin [16]. Q4_K reads 4.625 bits per
// weight so (5 with fp16 scales and mins per block; the file's 4.5), Q6_K 6.625 (7; the file's 6.5625;
// its groups padded to whole cache lines), Q5_K 5.625 (the file's 5.5): decode streams the weights once
// per token, so its time follows these bytes. d * sc is exact in float (an fp16 times a 6-bit integer), so the tiling
// holds the file's weights exactly.
// Signed 8-bit quants (Q8_0 and int8 rows, AVX2 builds): pmaddubsw takes one unsigned operand, and the
// unsigned quant q + 128 times an int8 activation would overflow its int16 pair sums, so the tiling
// keeps the file's int8 quant w (value = S * w, no offset) and the kernel multiplies |w| by the
// activation carrying w's sign: each pair sum stays within 2 x 128 x 127. VNNI's vpdpbusd adds its
// four products in int32, so VNNI builds keep q + 128 (O = -128 S): the same bytes, no sign steps.
// A weight is S * q + O with q the unsigned quant, so a block's contribution to y[m, n] is
//   dx * S * sum(q * xq) + O * dx * sum(xq)
// with dx the activation block's scale: one integer dot product per block, two FMAs to apply it.
// The legacy formats' scales are stored as fp16, exactly (they are the file's).
// MXFP4 keeps its e2m1 codes as the nibbles; the kernel maps each code through a table to the
// unsigned quant 2v + 12 (0..24 for v in -6..6) before the dot product, with S = 2^(e - 128) and
// O = -12 S, so S * q + O = v * 2^(e - 127) exactly. S is kept as an exponent byte per block and
// row, the bits of a float's exponent field (a power of two, as the file's E8M0 byte): 4.25 bits per
// weight as the file, and exact for any normal float S (int8_tiling_exact).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_formats.h"
#include "branches.h"

// Builds with AVX2 but without AVX-512 VNNI multiply in panel_kernel_avx2's 256-bit registers.
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define PAGEDLLM_INT8_AVX2_KERNEL 1
#else
#define PAGEDLLM_INT8_AVX2_KERNEL 0
#endif

namespace {

using namespace pagedllm_quant;

constexpr int kPanel = 16;       // output rows per panel (the lanes of one int32 vector)
constexpr int kActBlock = 32;    // activation values per int8 scale
constexpr int kSuper = 256;      // inputs per fp16 scale over integer sub-scales (a K-quant block)
// Inputs per group of a panel (its quants, then their scales): one K-quant block, so that a group holds
// one d and dmin.
constexpr int64_t kGroup = kSuper;

typedef uint8_t u8x64 __attribute__((vector_size(64)));

struct Tiling {
  int bits;        // 4, 5, 6 or 8
  int flush;       // inputs per weight scale block
  bool has_mins;   // offsets stored (else O = min_factor * S)
  float min_factor;
  bool e2m1;       // nibbles are e2m1 codes, mapped to quants by a table (MXFP4)
  bool sub_scales = false;  // integer scales per block under an fp16 per kSuper inputs (else fp16 per block)
  bool signed_sub = false;  // sub-scales are int8 (Q6_K), else uint8
  bool signed_quants = false;  // 8-bit quants stored as int8, value = S * q (AVX2 builds)
  bool e8m0 = false;  // block scales stored as one exponent byte b, S = 2^(b - 127) (0: zero)
};

// A tiling's scale form, fixed per kernel instance so that its loop carries no branch on it: fp16 per
// block, integer sub-scales (uint8 with uint8 mins: Q4_K, Q5_K; int8 without: Q6_K), or an exponent
// byte per block (MXFP4: a power of two, as the file's E8M0 byte, so 4.25 bits per weight as the file).
enum class SubScales { kNone, kUnsignedWithMins, kSigned, kExponent };

Tiling tiling_of(int64_t format) {
  switch (format) {
    case F_Q4_0: return {4, 32, false, -8.f, false};
    case F_Q4_1: case F_I4_G64: case F_I4_G128: return {4, 32, true, 0.f, false};
    case F_Q4_K: return {4, 32, true, 0.f, false, true};
    case F_Q5_K: return {5, 32, true, 0.f, false, true};
    case F_Q6_K: return {6, 16, false, -32.f, false, true, true};
#if PAGEDLLM_INT8_AVX2_KERNEL
    case F_Q8_0: case F_I8_ROW: return {8, 32, false, 0.f, false, false, false, true};
#else
    case F_Q8_0: case F_I8_ROW: return {8, 32, false, -128.f, false};
#endif
    case F_MXFP4: return {4, 32, false, -12.f, true, false, false, false, true};
  }
  TORCH_CHECK(false, "no int8 tiling for quantized weight format ", format);
}

int64_t quant_bytes(const Tiling& t, int64_t k) { return kPanel * k * t.bits / 8; }
// Bytes of `inputs` inputs' quants and scale regions (a group's, or the last, shorter group's).
int64_t group_bytes(const Tiling& t, int64_t inputs) {
  const int64_t per_block = t.sub_scales || t.e8m0 ? 1 : 2;  // an integer sub-scale or exponent, or an fp16
  const int64_t supers = t.sub_scales ? inputs / kSuper : 0;
  return quant_bytes(t, inputs) + ((inputs / t.flush) * per_block + supers * 2) * kPanel * (t.has_mins ? 2 : 1);
}
// A whole group's bytes rounded up to cache lines, so that every group's 64-byte operands lie on lines of
// their own: only Q6_K's 3,360 bytes need it (3,392: 6.625 bits per weight). Unaligned, its odd groups'
// loads each straddled two lines.
int64_t group_stride(const Tiling& t) { return (group_bytes(t, kGroup) + 63) / 64 * 64; }
int64_t panel_bytes(const Tiling& t, int64_t k) { return (k / kGroup) * group_stride(t) + group_bytes(t, k % kGroup); }

// A group's scale regions, after its quants (k: the group's inputs). Without sub-scales: scales, mins as
// fp16 [k/flush][16]. With them: sub, sub_mins [k/flush][16] bytes, then scales, mins as fp16
// [k/super][16]. Exponent bytes: sub [k/flush][16].
struct PanelScales {
  const uint16_t* scales;
  const uint16_t* mins;
  const uint8_t* sub;
  const uint8_t* sub_mins;
};

PanelScales panel_scales(const Tiling& t, const uint8_t* panel, int64_t k) {
  const uint8_t* at = panel + quant_bytes(t, k);
  const int64_t blocks = k / t.flush;
  if (t.e8m0) return {nullptr, nullptr, at, nullptr};
  if (!t.sub_scales) {
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(at);
    return {scales, scales + blocks * kPanel, nullptr, nullptr};
  }
  const uint8_t* sub_mins = at + blocks * kPanel;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(sub_mins + (t.has_mins ? blocks * kPanel : 0));
  return {scales, scales + (k / kSuper) * kPanel, at, sub_mins};
}

inline int64_t panel_groups(int64_t k) { return (k + kGroup - 1) / kGroup; }

// Group g of a panel of k inputs: its quants and scale regions, in which block indices are the group's
// own (0 .. blocks - 1, the panel's first_block .. first_block + blocks - 1).
struct Group {
  const uint8_t* quants;
  PanelScales scales;
  int64_t first_block, blocks;
};

inline Group panel_group(const Tiling& t, const uint8_t* panel, int64_t k, int64_t g) {
  const int64_t inputs = std::min(kGroup, k - g * kGroup);
  const uint8_t* at = panel + g * group_stride(t);
  return {at, panel_scales(t, at, inputs), g * kGroup / t.flush, inputs / t.flush};
}

// ---- Reading one source row as unsigned integer quants and per-block float scale / offset ----

// q[K] unsigned quants; scale[K/flush], offset[K/flush] such that value = scale * q + offset.
void row_quants(int64_t format, const uint8_t* row, int64_t k, const Tiling& t, uint8_t* q, float* scale,
                float* offset) {
  const int64_t bv = block_values(format), bb = block_bytes(format);
  switch (format) {
    case F_Q4_0:
      for (int64_t b = 0; b < k / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk);
        for (int i = 0; i < 16; ++i) {
          q[b * 32 + i] = blk[2 + i] & 0xF;
          q[b * 32 + 16 + i] = blk[2 + i] >> 4;
        }
        scale[b] = d;
        offset[b] = -8.f * d;
      }
      break;
    case F_Q4_1: case F_I4_G64: case F_I4_G128:
      for (int64_t b = 0; b < k / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk), m = half_to_float(blk + 2);
        const int64_t half = bv / 2;
        for (int64_t i = 0; i < half; ++i) {
          q[b * bv + i] = blk[4 + i] & 0xF;
          q[b * bv + half + i] = blk[4 + i] >> 4;
        }
        for (int64_t f = 0; f < bv / t.flush; ++f) {
          scale[b * bv / t.flush + f] = d;
          offset[b * bv / t.flush + f] = m;
        }
      }
      break;
    case F_MXFP4:
      for (int64_t b = 0; b < k / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        for (int i = 0; i < 16; ++i) {
          q[b * 32 + i] = blk[1 + i] & 0xF;
          q[b * 32 + 16 + i] = blk[1 + i] >> 4;
        }
        bool nonzero = false;
        for (int i = 1; i < 17; ++i) nonzero |= (blk[i] & 0x77) != 0;
        // An all-zero block keeps a zero scale whatever its exponent (an fp16 may not hold that one).
        scale[b] = nonzero ? e8m0_scale(blk[0]) * 0.5f : 0.f;
        offset[b] = -12.f * scale[b];
      }
      break;
    case F_Q8_0:
      for (int64_t b = 0; b < k / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk);
        for (int i = 0; i < 32; ++i) q[b * 32 + i] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + i]) + 128);
        scale[b] = d;
        offset[b] = -128.f * d;
      }
      break;
    case F_I8_ROW: {
      float s;
      std::memcpy(&s, row + k, 4);
      for (int64_t i = 0; i < k; ++i) q[i] = static_cast<uint8_t>(static_cast<int8_t>(row[i]) + 128);
      for (int64_t f = 0; f < k / t.flush; ++f) {
        scale[f] = s;
        offset[f] = -128.f * s;
      }
      break;
    }
    case F_Q4_K: case F_Q5_K:
      for (int64_t b = 0; b < k / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        k_scales_mins(blk, scale + b * 8, offset + b * 8);
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (format == F_Q5_K ? 48 : 16);
        uint8_t* out = q + b * 256;
        for (int j = 0; j < 4; ++j) {
          for (int l = 0; l < 32; ++l) {
            uint8_t lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
            if (format == F_Q5_K) {
              lo |= ((qh[l] >> (2 * j)) & 1) << 4;
              hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            out[64 * j + l] = lo;
            out[64 * j + 32 + l] = hi;
          }
        }
      }
      break;
    case F_Q6_K:
      for (int64_t b = 0; b < k / bv; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk + 208);
        for (int s = 0; s < 16; ++s) {
          scale[b * 16 + s] = d * static_cast<int8_t>(blk[192 + s]);
          offset[b * 16 + s] = -32.f * scale[b * 16 + s];
        }
        uint8_t* out = q + b * 256;
        for (int n = 0; n < 2; ++n) {
          const uint8_t* ql = blk + 64 * n;
          const uint8_t* qh = blk + 128 + 32 * n;
          for (int l = 0; l < 32; ++l) {
            out[128 * n + l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            out[128 * n + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            out[128 * n + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            out[128 * n + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          }
        }
      }
      break;
    default:
      TORCH_CHECK(false, "no int8 tiling for quantized weight format ", format);
  }
}

// A K-quant row's integer sub-scales: sub[K/flush] (Q6_K's as int8 bits), sub_min[K/flush], and per 256
// inputs d and -dmin (exact fp16s: the file's), such that S = d * sub, O = -dmin * sub_min.
void row_subscales(int64_t format, const uint8_t* row, int64_t k, uint8_t* sub, uint8_t* sub_min, float* d,
                   float* neg_dmin) {
  const int64_t bb = block_bytes(format);
  for (int64_t b = 0; b < k / 256; ++b) {
    const uint8_t* blk = row + b * bb;
    if (format == F_Q6_K) {
      d[b] = half_to_float(blk + 208);
      std::memcpy(sub + b * 16, blk + 192, 16);
      continue;
    }
    i32x8 sc, m;
    k_subscales(blk, &sc, &m);
    for (int j = 0; j < 8; ++j) {
      sub[b * 8 + j] = static_cast<uint8_t>(sc[j]);
      sub_min[b * 8 + j] = static_cast<uint8_t>(m[j]);
    }
    d[b] = half_to_float(blk);
    neg_dmin[b] = -half_to_float(blk + 2);
  }
}

inline uint16_t to_half_bits(float v) {
#if defined(__F16C__)
  return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
#else
  return c10::Half(v).x;
#endif
}

inline float from_half_bits(uint16_t bits) {
  uint8_t raw[2];
  std::memcpy(raw, &bits, 2);
  return half_to_float(raw);
}

// A power-of-two scale (or zero) as the exponent byte b of the float 2^(b - 127): the float's own
// exponent bits, so b << 23 is the float again (b = 0: zero). Scales below 2^-126 have none.
inline uint8_t exponent_byte(float scale) {
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  return static_cast<uint8_t>(bits >> 23);
}

inline float from_exponent_byte(uint8_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Byte offset, inside a group's quants, of the byte holding (row r, input i of the group); and the bit
// shift.
inline void quant_position(const Tiling& t, int r, int64_t i, int64_t* byte, int* shift, int64_t* high_byte,
                           int* high_shift) {
  const int j = static_cast<int>(i % 4);
  if (t.bits == 8) {
    *byte = (i / 4) * 64 + 4 * r + j;
    *shift = 0;
    return;
  }
  if (t.bits == 4) {
    *byte = (i / 8) * 64 + 4 * r + j;
    *shift = (i % 8) >= 4 ? 4 : 0;
    return;
  }
  if (t.bits == 5) {  // per 32 inputs: four nibble chunks, then the high-bit chunk
    const int64_t group = i / 32, within = i % 32;
    *byte = group * 320 + (within / 8) * 64 + 4 * r + j;
    *shift = (within % 8) >= 4 ? 4 : 0;
    *high_byte = group * 320 + 256 + 4 * r + j;
    *high_shift = static_cast<int>(within / 4);
    return;
  }
  // 6-bit: per 16 inputs, nibble chunks for inputs 0..7 and 8..15, then the high-bit chunk.
  const int64_t group = i / 16, within = i % 16;
  *byte = group * 192 + (within / 8) * 64 + 4 * r + j;
  *shift = (within % 8) >= 4 ? 4 : 0;
  *high_byte = group * 192 + 128 + 4 * r + j;
  *high_shift = 2 * static_cast<int>(within / 4);
}

// Row r's quants q[0 .. inputs) of one group into the group's quants at `dst` (row r's bytes: dst + 4r):
// the placement quant_position describes, written out per layout (it runs for every weight of a model
// at load time).
void place_quants(const Tiling& t, const uint8_t* qr, int64_t inputs, int r, uint8_t* dst) {
  dst += 4 * r;
  if (t.bits == 8) {
    const uint8_t flip = t.signed_quants ? 0x80 : 0;  // q + 128 back to the int8 quant's bits
    for (int64_t i = 0; i < inputs; i += 4, dst += 64)
      for (int j = 0; j < 4; ++j) dst[j] = static_cast<uint8_t>(qr[i + j] ^ flip);
  } else if (t.bits == 4) {
    for (int64_t i = 0; i < inputs; i += 8, dst += 64)
      for (int j = 0; j < 4; ++j) dst[j] = static_cast<uint8_t>(qr[i + j] | (qr[i + 4 + j] << 4));
  } else if (t.bits == 5) {
    for (int64_t i = 0; i < inputs; i += 32, dst += 320) {
      for (int j = 0; j < 4; ++j) {
        uint8_t high = 0;
        for (int s = 0; s < 8; ++s) high |= static_cast<uint8_t>(((qr[i + 4 * s + j] >> 4) & 1) << s);
        for (int c = 0; c < 4; ++c)
          dst[64 * c + j] = static_cast<uint8_t>((qr[i + 8 * c + j] & 0xF) | ((qr[i + 8 * c + 4 + j] & 0xF) << 4));
        dst[256 + j] = high;
      }
    }
  } else {
    for (int64_t i = 0; i < inputs; i += 16, dst += 192) {
      for (int j = 0; j < 4; ++j) {
        const uint8_t* g = qr + i + j;
        dst[j] = static_cast<uint8_t>((g[0] & 0xF) | ((g[4] & 0xF) << 4));
        dst[64 + j] = static_cast<uint8_t>((g[8] & 0xF) | ((g[12] & 0xF) << 4));
        dst[128 + j] = static_cast<uint8_t>((g[0] >> 4) | ((g[4] >> 4) << 2) | ((g[8] >> 4) << 4) | ((g[12] >> 4) << 6));
      }
    }
  }
}

void tile_panel(int64_t format, const Tiling& t, const uint8_t* w, int64_t rb, int64_t n_rows, int64_t p, int64_t k,
                uint8_t* out) {
  std::memset(out, 0, panel_bytes(t, k));
  std::vector<uint8_t> q(k), sub(k / t.flush), sub_min(k / t.flush);
  std::vector<float> scale(k / t.flush), offset(k / t.flush);
  const int64_t supers = t.sub_scales ? k / kSuper : 0;
  std::vector<float> d(supers), neg_dmin(supers);
  for (int r = 0; r < kPanel; ++r) {
    const int64_t n = p * kPanel + r;
    if (n >= n_rows) break;  // padding rows stay zero: zero scales, zero quants
    row_quants(format, w + n * rb, k, t, q.data(), scale.data(), offset.data());
    if (t.sub_scales) row_subscales(format, w + n * rb, k, sub.data(), sub_min.data(), d.data(), neg_dmin.data());
    for (int64_t g = 0; g < panel_groups(k); ++g) {
      const Group group = panel_group(t, out, k, g);
      uint8_t* quants = const_cast<uint8_t*>(group.quants);
      place_quants(t, q.data() + g * kGroup, group.blocks * t.flush, r, quants);
      const PanelScales& ps = group.scales;
      uint16_t* scales = const_cast<uint16_t*>(ps.scales);
      uint16_t* mins = const_cast<uint16_t*>(ps.mins);
      uint8_t* sub_out = const_cast<uint8_t*>(ps.sub);
      uint8_t* sub_min_out = const_cast<uint8_t*>(ps.sub_mins);
      for (int64_t fl = 0; fl < group.blocks; ++fl) {
        const int64_t f = group.first_block + fl;
        if (t.e8m0) {
          sub_out[fl * kPanel + r] = exponent_byte(scale[f]);
        } else if (!t.sub_scales) {
          scales[fl * kPanel + r] = to_half_bits(scale[f]);
          if (t.has_mins) mins[fl * kPanel + r] = to_half_bits(offset[f]);
        } else {
          sub_out[fl * kPanel + r] = sub[f];
          if (t.has_mins) sub_min_out[fl * kPanel + r] = sub_min[f];
        }
      }
      if (t.sub_scales) {  // a group is one K-quant block: its d and -dmin
        scales[r] = to_half_bits(d[g]);
        if (t.has_mins) mins[r] = to_half_bits(neg_dmin[g]);
      }
    }
  }
}

// Row r's scale S and offset O for block f of a panel (value = S * q + O).
inline void block_scale(const Tiling& t, const PanelScales& ps, int64_t f, int r, float* scale, float* offset) {
  if (t.e8m0) {
    *scale = from_exponent_byte(ps.sub[f * kPanel + r]);
    *offset = *scale * t.min_factor;
    return;
  }
  if (!t.sub_scales) {
    *scale = from_half_bits(ps.scales[f * kPanel + r]);
    *offset = t.has_mins ? from_half_bits(ps.mins[f * kPanel + r]) : *scale * t.min_factor;
    return;
  }
  const int64_t b = f * t.flush / kSuper;
  const uint8_t sub = ps.sub[f * kPanel + r];
  const float sc = t.signed_sub ? static_cast<float>(static_cast<int8_t>(sub)) : static_cast<float>(sub);
  *scale = sc * from_half_bits(ps.scales[b * kPanel + r]);
  *offset = t.has_mins ? static_cast<float>(ps.sub_mins[f * kPanel + r]) * from_half_bits(ps.mins[b * kPanel + r])
                       : *scale * t.min_factor;
}

inline vec16 load_half16(const uint16_t* p);

// 16 bytes as 16 floats (Signed: int8 values) or, Exponent, as the floats whose exponent fields they are.
template <bool Signed, bool Exponent = false>
inline vec16 bytes_to_floats(const uint8_t* p) {
  vec16 out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i wide = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  const __m512 v = Exponent ? _mm512_castsi512_ps(_mm512_slli_epi32(wide, 23)) : _mm512_cvtepi32_ps(wide);
  std::memcpy(&out, &v, 64);
#else
  for (int i = 0; i < 16; ++i) {
    if constexpr (Exponent) {
      out[i] = from_exponent_byte(p[i]);
    } else {
      out[i] = Signed ? static_cast<float>(static_cast<int8_t>(p[i])) : static_cast<float>(p[i]);
    }
  }
#endif
  return out;
}

// Rows 0..15's scales S and offsets O of block f of a panel (value = S * q + O), in the scale form Sub,
// with block_scale's float arithmetic lane by lane (d * sc is exact in float: an fp16 times a 6-bit
// integer), so every kernel reading them gives the same products.
template <SubScales Sub>
inline void block_scales16(const Tiling& t, const PanelScales& ps, int64_t f, vec16* scale, vec16* offset) {
  if constexpr (Sub == SubScales::kNone) {
    *scale = load_half16(ps.scales + f * kPanel);
    *offset = t.has_mins ? load_half16(ps.mins + f * kPanel) : *scale * t.min_factor;
  } else if constexpr (Sub == SubScales::kExponent) {
    *scale = bytes_to_floats<false, true>(ps.sub + f * kPanel);
    *offset = *scale * t.min_factor;
  } else {
    const int64_t b = f * t.flush / kSuper;
    *scale = bytes_to_floats<Sub == SubScales::kSigned>(ps.sub + f * kPanel) * load_half16(ps.scales + b * kPanel);
    if constexpr (Sub == SubScales::kUnsignedWithMins) {
      *offset = bytes_to_floats<false>(ps.sub_mins + f * kPanel) * load_half16(ps.mins + b * kPanel);
    } else {
      *offset = *scale * t.min_factor;
    }
  }
}

// The panel after the one being multiplied (null: none), streamed into L2 beside its arithmetic, an
// equal share of its bytes per scale block (the last block takes the rest). A prefetch of the whole
// next panel at once stalled the kernels on EPYCs: on a Zen 4 a third of a one-row Q4_K product's
// samples sat in that prefetch loop, at half the read bandwidth. Into L2 (prefetcht1) rather than L1,
// the lines leave L1's miss buffers to the kernel's own loads: on the Zen 4, one-row Q4_K 9728 x 2560
// went from 0.61 to 0.51 ms in the VNNI kernel and from 0.83 to 0.60 ms in the AVX2 one
// (benchmarks/kernel_builds_ab.py).
struct NextPanel {
  const uint8_t* next;
  int64_t bytes, blocks;

  inline void block(int64_t f) const {
    if (next == nullptr) return;
    const int64_t share = bytes / blocks;
    const int64_t from = (f * share) & ~int64_t{63}, to = f + 1 == blocks ? bytes : (f + 1) * share;
    for (int64_t line = from; line < to; line += 64) __builtin_prefetch(next + line, 0, 2);
  }
};

// ---- The integer dot-product step: acc[lane] += sum_j w[4 lane + j] * x[j] ----

typedef int32_t i32v __attribute__((vector_size(64)));

inline u8x64 load_u8x64(const uint8_t* p) {
  u8x64 v;
  std::memcpy(&v, p, 64);
  return v;
}

// w: 64 unsigned quants ([16 rows x 4 inputs]); x4: 4 signed activation quants as one int32.
// Builds without AVX-512 VNNI but with AVX2 take panel_kernel_avx2 instead.
inline i32v dot4(i32v acc, u8x64 w, int32_t x4) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (i32v)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#else
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  for (int lane = 0; lane < 16; ++lane)
    for (int j = 0; j < 4; ++j) acc[lane] += static_cast<int32_t>(w[4 * lane + j]) * x[j];
  return acc;
#endif
}

inline vec16 load_half16(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vec16 out;
  std::memcpy(&out, &v, 64);
  return out;
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vec16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  vec16 out;
  for (int i = 0; i < 16; ++i) out[i] = from_half_bits(p[i]);
  return out;
#endif
}

// a * b + c, each lane rounded once, as an explicit fused multiply-add. Written as plain vector
// arithmetic under -ffast-math, the compiler contracted and reassociated panel_kernel's
// accumulation differently in its instances for 1, 2, 4 and 8 activation rows (the AVX2 build did),
// so a row's result depended on how many rows shared its step.
inline vec16 fma16(vec16 a, vec16 b, vec16 c) {
#if defined(__AVX512F__)
  __m512 av, bv, cv;
  std::memcpy(&av, &a, 64);
  std::memcpy(&bv, &b, 64);
  std::memcpy(&cv, &c, 64);
  const __m512 r = _mm512_fmadd_ps(av, bv, cv);
  vec16 out;
  std::memcpy(&out, &r, 64);
  return out;
#elif defined(__FMA__)
  __m256 av[2], bv[2], cv[2];
  std::memcpy(av, &a, 64);
  std::memcpy(bv, &b, 64);
  std::memcpy(cv, &c, 64);
  const __m256 r[2] = {_mm256_fmadd_ps(av[0], bv[0], cv[0]), _mm256_fmadd_ps(av[1], bv[1], cv[1])};
  vec16 out;
  std::memcpy(&out, r, 64);
  return out;
#else
  return a * b + c;  // the scalar build has no int8 dot product: its callers never run there
#endif
}

// Quantized activations: xq [M, K] int8, dx [M, K/32] scales, sums [M, K/flush] = dx * sum(xq).
struct Activations {
  const int8_t* q;
  const float* scale;
  const float* sums;
  int64_t k, sums_per_row;
};

inline int32_t x4_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// e2m1 codes (0..15 per byte) -> the unsigned quants 2v + 12, one byte-table lookup per byte.
constexpr uint8_t kE2M1Quants[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

inline u8x64 e2m1_quants(u8x64 codes) {
#if defined(__AVX512BW__)
  __m512i c;
  std::memcpy(&c, &codes, 64);
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Quants)));
  const __m512i q = _mm512_shuffle_epi8(table, c);
  u8x64 out;
  std::memcpy(&out, &q, 64);
  return out;
#elif defined(__AVX2__)
  __m256i c[2];
  std::memcpy(c, &codes, 64);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Quants)));
  const __m256i q[2] = {_mm256_shuffle_epi8(table, c[0]), _mm256_shuffle_epi8(table, c[1])};
  u8x64 out;
  std::memcpy(&out, q, 64);
  return out;
#else
  u8x64 out;
  for (int i = 0; i < 64; ++i) out[i] = kE2M1Quants[codes[i] & 0xF];
  return out;
#endif
}

// The unsigned quants of scale block f of a panel as [16 rows x 4 inputs] operands: ops[s] holds
// inputs f * Flush + 4s .. + 3. E2M1: the nibbles are MXFP4 codes, mapped to quants.
template <int Bits, int Flush, bool E2M1 = false>
inline void block_operands(const uint8_t* quants, int64_t f, u8x64 (&ops)[Flush / 4]) {
  const u8x64 low = (u8x64){} + 0xF;
  if constexpr (Bits == 4) {
    for (int c = 0; c < Flush / 8; ++c) {
      const u8x64 v = load_u8x64(quants + (f * Flush / 8 + c) * 64);
      ops[2 * c] = v & low;
      ops[2 * c + 1] = (v >> 4) & low;
      if constexpr (E2M1) {
        ops[2 * c] = e2m1_quants(ops[2 * c]);
        ops[2 * c + 1] = e2m1_quants(ops[2 * c + 1]);
      }
    }
  } else if constexpr (Bits == 5) {
    static_assert(Flush == 32, "5-bit panels hold 32-input groups");
    const uint8_t* g = quants + f * 320;
    const u8x64 h = load_u8x64(g + 256), bit = (u8x64){} + 1;
    for (int c = 0; c < 4; ++c) {
      const u8x64 v = load_u8x64(g + 64 * c);
      ops[2 * c] = (v & low) | (((h >> (2 * c)) & bit) << 4);
      ops[2 * c + 1] = ((v >> 4) & low) | (((h >> (2 * c + 1)) & bit) << 4);
    }
  } else if constexpr (Bits == 6) {
    static_assert(Flush == 16, "6-bit panels hold 16-input groups");
    const uint8_t* g = quants + f * 192;
    const u8x64 n0 = load_u8x64(g), n1 = load_u8x64(g + 64), h = load_u8x64(g + 128);
    const u8x64 three = (u8x64){} + 0x30;
    ops[0] = (n0 & low) | ((h << 4) & three);
    ops[1] = ((n0 >> 4) & low) | ((h << 2) & three);
    ops[2] = (n1 & low) | (h & three);
    ops[3] = ((n1 >> 4) & low) | ((h >> 2) & three);
  } else {
    for (int s = 0; s < Flush / 4; ++s) ops[s] = load_u8x64(quants + (f * Flush / 4 + s) * 64);
  }
}

#if PAGEDLLM_INT8_AVX2_KERNEL
// The same product in native 256-bit registers, for builds without AVX-512 VNNI. panel_kernel's
// 64-byte vector types, split into register pairs by the compiler, spilled to the stack on every
// step at this width (its 4-row form needs ~32 ymm registers: 8 operands, 4 integer and 4 float
// accumulators, two registers each), which held it to ~25 GOPS at every row count. Here a panel is
// taken as two halves of 8 rows (a 64-byte chunk's first 32 bytes hold rows 0-7, the rest rows 8-15)
// and a block's inputs 8 at a time, so MR rows keep 2 MR accumulators plus two operands live; the
// pmaddubsw pair sums of several operands are added in int16 before one pmaddwd (kInt16Group).
// Each lane's float arithmetic is panel_kernel's, in its order (dx * S * sum(q * xq) + O * sx per
// block, explicit FMAs), so both give the same bits and a row's result never depends on MR.

// Bit s of every byte of h, moved to bit 4 (a 5-bit quant's high bit). 16-bit shifts stand in for byte
// shifts: the bits they carry across a byte boundary fall outside the mask.
inline __m256i high_bit(__m256i h, int s) {
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  if (s <= 4) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - s), bit4);
  return _mm256_and_si256(_mm256_srli_epi16(h, s - 4), bit4);
}

// The unsigned quants of inputs 8c .. 8c + 7 of block f, rows 8 half .. + 7: lo holds inputs
// 8c + 0..3, hi inputs 8c + 4..7 (6-bit blocks: c in 0..1 over the block's 16 inputs).
template <int Bits, bool E2M1>
inline void half_operands(const uint8_t* quants, int64_t f, int c, int half, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (Bits == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + (f * 4 + c) * 64 + 32 * half));
    lo = _mm256_and_si256(v, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (E2M1) {
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Quants)));
      lo = _mm256_shuffle_epi8(table, lo);
      hi = _mm256_shuffle_epi8(table, hi);
    }
  } else if constexpr (Bits == 5) {
    const uint8_t* g = quants + f * 320 + 32 * half;
    const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 64 * c));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 256));
    lo = _mm256_or_si256(_mm256_and_si256(n, low), high_bit(h, 2 * c));
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n, 4), low), high_bit(h, 2 * c + 1));
  } else if constexpr (Bits == 8) {
    const uint8_t* g = quants + (f * 8 + 2 * c) * 64 + 32 * half;
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 64));
  } else {
    const uint8_t* g = quants + f * 192 + 32 * half;
    const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 64 * c));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 128));
    const __m256i three = _mm256_set1_epi8(0x30);
    // 16-bit shifts stand in for byte shifts: the bits they carry across a byte boundary fall outside
    // the masks.
    const __m256i h_lo = c == 0 ? _mm256_slli_epi16(h, 4) : h;
    const __m256i h_hi = c == 0 ? _mm256_slli_epi16(h, 2) : _mm256_srli_epi16(h, 2);
    lo = _mm256_or_si256(_mm256_and_si256(n, low), _mm256_and_si256(h_lo, three));
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n, 4), low), _mm256_and_si256(h_hi, three));
  }
}

// Per row, the int16 sums of lo * x[0..3] + hi * x[4..7] over each 2 adjacent inputs (pmaddubsw).
inline __m256i pair_sums(__m256i lo, __m256i hi, const int8_t* x) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4_at(x))),
                          _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4_at(x + 4))));
}

// Operands of 4 inputs whose pair sums are added in int16 before one pmaddwd widens them: each pair sum
// is at most 2 x q x 127 for quants q, so a group stays below 2^15 (4-bit 15: 8; MXFP4 24 and 5-bit
// 31: 4; Q6_K 63: 2). The integer sum is exact in any grouping.
template <int Bits, bool E2M1>
constexpr int kInt16Group = Bits == 4 && !E2M1 ? 8 : Bits == 6 ? 2 : 4;

inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One scale block fl of a group of one half of a panel for MR rows: acc[m] += its contribution to rows
// 8 half .. + 7.
template <int Bits, int Flush, int MR, bool E2M1, SubScales Sub>
__attribute__((always_inline)) inline void half_block_step(const Tiling& t, const Group& group, const Activations& a,
                            const int8_t* const* xrow, int64_t m0, int64_t fl, int half, __m256* acc) {
  const uint8_t* panel = group.quants;
  const PanelScales& ps = group.scales;
  const int64_t k = a.k, f = group.first_block + fl, k0 = f * Flush;
  constexpr int kGroup = kInt16Group<Bits, E2M1>;
  __m256i iacc[MR];
  if constexpr (Bits == 8) {
    // Signed quants: |w| times x with w's sign, each pmaddubsw widened at once (its pair sums reach 2^15).
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < Flush / 8; ++c) {
      __m256i lo, hi;
      half_operands<Bits, E2M1>(panel, fl, c, half, lo, hi);
      const __m256i abs_lo = _mm256_sign_epi8(lo, lo), abs_hi = _mm256_sign_epi8(hi, hi);
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = xrow[m] + k0 + 8 * c;
        const __m256i p_lo = _mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(_mm256_set1_epi32(x4_at(x)), lo));
        const __m256i p_hi = _mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(_mm256_set1_epi32(x4_at(x + 4)), hi));
        const __m256i sums32 = _mm256_add_epi32(_mm256_madd_epi16(p_lo, ones), _mm256_madd_epi16(p_hi, ones));
        iacc[m] = c == 0 ? sums32 : _mm256_add_epi32(iacc[m], sums32);
      }
    }
    const __m256 sc = half8(ps.scales + fl * kPanel + 8 * half);
    for (int m = 0; m < MR; ++m) {
      const __m256 dx = _mm256_set1_ps(a.scale[(m0 + m) * (k / kActBlock) + k0 / kActBlock]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m]), _mm256_mul_ps(sc, dx), acc[m]);
    }
    return;
  }
  for (int g = 0; g < Flush / 4 / kGroup; ++g) {
    __m256i sums16[MR];
    for (int c = g * kGroup / 2; c < (g + 1) * kGroup / 2; ++c) {
      __m256i lo, hi;
      half_operands<Bits, E2M1>(panel, fl, c, half, lo, hi);
      for (int m = 0; m < MR; ++m) {
        const __m256i pairs = pair_sums(lo, hi, xrow[m] + k0 + 8 * c);
        sums16[m] = c == g * kGroup / 2 ? pairs : _mm256_add_epi16(sums16[m], pairs);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i sums32 = _mm256_madd_epi16(sums16[m], _mm256_set1_epi16(1));
      iacc[m] = g == 0 ? sums32 : _mm256_add_epi32(iacc[m], sums32);
    }
  }
  __m256 sc, mn;
  if constexpr (Sub == SubScales::kNone) {
    sc = half8(ps.scales + fl * kPanel + 8 * half);
    mn = t.has_mins ? half8(ps.mins + fl * kPanel + 8 * half) : _mm256_mul_ps(sc, _mm256_set1_ps(t.min_factor));
  } else if constexpr (Sub == SubScales::kExponent) {
    // The exponent bytes shifted into a float's exponent field: 2^(b - 127), or zero.
    const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps.sub + fl * kPanel + 8 * half));
    sc = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(b8), 23));
    mn = _mm256_mul_ps(sc, _mm256_set1_ps(t.min_factor));
  } else {
    // S = d * sc and O = -dmin * m, exact in float (an fp16 times a 6-bit integer): block_scale's.
    const int64_t b = fl * Flush / kSuper;
    const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps.sub + fl * kPanel + 8 * half));
    const __m256i sub32 = Sub == SubScales::kSigned ? _mm256_cvtepi8_epi32(sub) : _mm256_cvtepu8_epi32(sub);
    sc = _mm256_mul_ps(_mm256_cvtepi32_ps(sub32), half8(ps.scales + b * kPanel + 8 * half));
    if constexpr (Sub == SubScales::kUnsignedWithMins) {
      const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps.sub_mins + fl * kPanel + 8 * half));
      mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)), half8(ps.mins + b * kPanel + 8 * half));
    } else {
      mn = _mm256_mul_ps(sc, _mm256_set1_ps(t.min_factor));
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256 dx = _mm256_set1_ps(a.scale[(m0 + m) * (k / kActBlock) + k0 / kActBlock]);
    const __m256 sx = _mm256_set1_ps(a.sums[(m0 + m) * a.sums_per_row + f]);
    acc[m] = _mm256_fmadd_ps(mn, sx, _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m]), _mm256_mul_ps(sc, dx), acc[m]));
  }
}

template <int Bits, int Flush, int MR, bool E2M1, SubScales Sub>
void panel_kernel_avx2(const Tiling& t, const uint8_t* panel, const Activations& a, int64_t m0, vec16* out,
                       const uint8_t* next) {
  const int64_t k = a.k, blocks = k / Flush;
  const int8_t* xrow[MR];
  for (int m = 0; m < MR; ++m) xrow[m] = a.q + (m0 + m) * k;
  const NextPanel prefetch{next, panel_bytes(t, k), blocks};
  if constexpr (MR <= 2) {
    // Few rows leave registers for both halves at once, so a block's activation broadcasts serve 16
    // rows and the panel streams in one pass. One row's product was bound by instructions, not by
    // memory, on a 2-core AVX2 EPYC: this took Q4_K 9728 x 2560 from 0.73 to 0.55 ms
    // (benchmarks/kernel_builds_ab.py).
    __m256 acc[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < panel_groups(k); ++g) {
      const Group group = panel_group(t, panel, k, g);
      for (int64_t fl = 0; fl < group.blocks; ++fl) {
        prefetch.block(group.first_block + fl);
        half_block_step<Bits, Flush, MR, E2M1, Sub>(t, group, a, xrow, m0, fl, 0, acc[0]);
        half_block_step<Bits, Flush, MR, E2M1, Sub>(t, group, a, xrow, m0, fl, 1, acc[1]);
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MR; ++m) _mm256_storeu_ps(reinterpret_cast<float*>(&out[m]) + 8 * h, acc[h][m]);
    return;
  }
  for (int half = 0; half < 2; ++half) {
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < panel_groups(k); ++g) {
      const Group group = panel_group(t, panel, k, g);
      for (int64_t fl = 0; fl < group.blocks; ++fl) {
        if (half == 0) prefetch.block(group.first_block + fl);
        half_block_step<Bits, Flush, MR, E2M1, Sub>(t, group, a, xrow, m0, fl, half, acc);
      }
    }
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(reinterpret_cast<float*>(&out[m]) + 8 * half, acc[m]);
  }
}
#endif

// y[m, panel rows] for MR activation rows starting at m0, over one panel. next: the panel after this
// one (null if none), which the kernel prefetches as it goes (NextPanel).
template <int Bits, int Flush, int MR, bool E2M1, SubScales Sub>
void panel_kernel(const Tiling& t, const uint8_t* panel, const Activations& a, int64_t m0, vec16* out,
                  const uint8_t* next) {
#if PAGEDLLM_INT8_AVX2_KERNEL
  panel_kernel_avx2<Bits, Flush, MR, E2M1, Sub>(t, panel, a, m0, out, next);
#else
  const int64_t k = a.k;
  const NextPanel prefetch{next, panel_bytes(t, k), k / Flush};
  vec16 acc[MR] = {};
  const int8_t* xrow[MR];
  for (int m = 0; m < MR; ++m) xrow[m] = a.q + (m0 + m) * k;
  for (int64_t g = 0; g < panel_groups(k); ++g) {
    const Group group = panel_group(t, panel, k, g);
    for (int64_t fl = 0; fl < group.blocks; ++fl) {
      const int64_t f = group.first_block + fl, k0 = f * Flush;
      prefetch.block(f);
      i32v iacc[MR] = {};
      u8x64 ops[Flush / 4];
      block_operands<Bits, Flush, E2M1>(group.quants, fl, ops);
      for (int s = 0; s < Flush / 4; ++s)
        for (int m = 0; m < MR; ++m) iacc[m] = dot4(iacc[m], ops[s], x4_at(xrow[m] + k0 + 4 * s));
      vec16 sc, mn;
      block_scales16<Sub>(t, group.scales, fl, &sc, &mn);
      for (int m = 0; m < MR; ++m) {
        const float dx = a.scale[(m0 + m) * (k / kActBlock) + k0 / kActBlock];
        const float sx = a.sums[(m0 + m) * a.sums_per_row + f];
        acc[m] = fma16(mn, vec16{} + sx, fma16(__builtin_convertvector(iacc[m], vec16), sc * dx, acc[m]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = acc[m];
#endif
}

#if defined(__AVX512BF16__)
// Outputs 32p .. 32p + 31 of a tiled weight (its panels 2p and 2p + 1) as bfloat16 weights, scale * q
// + offset rounded to nearest even (as the float weight's .to(bfloat16)), in the packed layout of
// dense_gemm_cpu.cpp: out[k / 2][32][2]. An operand's lane 4r + j (row r, input j) goes to pair-row
// j / 2, output r, slot j % 2: its even 32-bit pairs form one pair-row, its odd pairs the next.
template <int Bits, int Flush, bool E2M1, SubScales Sub>
void decode_dense_panel(const Tiling& t, const uint8_t* w, int64_t n_panels, int64_t k, int64_t p, uint16_t* out) {
  const int64_t pb = panel_bytes(t, k);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i lane_row[4];  // for lanes 16i .. 16i + 15 of an operand: the row 4i + lane / 4
  for (int i = 0; i < 4; ++i) lane_row[i] = _mm512_set_epi32(
      4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 2,
      4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i, 4 * i, 4 * i, 4 * i);
  for (int half = 0; half < 2; ++half) {
    uint16_t* dst = out + 16 * half * 2;
    const int64_t source = 2 * p + half;
    if (source >= n_panels) {  // past the last row: zeros
      for (int64_t kp = 0; kp < k / 2; ++kp) std::memset(dst + kp * 64, 0, 64);
      continue;
    }
    const uint8_t* panel = w + source * pb;
    for (int64_t f = 0; f < k / Flush; ++f) {
      const Group group = panel_group(t, panel, k, f * Flush / kGroup);
      const int64_t fl = f - group.first_block;
      __m512 sc, mn;
      vec16 s16, m16;
      block_scales16<Sub>(t, group.scales, fl, &s16, &m16);
      std::memcpy(&sc, &s16, 64);
      std::memcpy(&mn, &m16, 64);
      __m512 lane_scale[4], lane_offset[4];
      for (int i = 0; i < 4; ++i) {
        lane_scale[i] = _mm512_permutexvar_ps(lane_row[i], sc);
        lane_offset[i] = _mm512_permutexvar_ps(lane_row[i], mn);
      }
      u8x64 ops[Flush / 4];
      block_operands<Bits, Flush, E2M1>(group.quants, fl, ops);
      for (int s = 0; s < Flush / 4; ++s) {
        __m512i v;
        std::memcpy(&v, &ops[s], 64);
        __m512 value[4];
        for (int i = 0; i < 4; ++i) {
          const __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, i));
          value[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), lane_scale[i], lane_offset[i]);
        }
        const __m512i rows0 = (__m512i)_mm512_cvtne2ps_pbh(value[1], value[0]);  // rows 0-7
        const __m512i rows8 = (__m512i)_mm512_cvtne2ps_pbh(value[3], value[2]);  // rows 8-15
        const int64_t kp = (f * Flush + 4 * s) / 2;
        _mm512_store_si512(dst + kp * 64, _mm512_permutex2var_epi32(rows0, even, rows8));
        _mm512_store_si512(dst + (kp + 1) * 64, _mm512_permutex2var_epi32(rows0, odd, rows8));
      }
    }
  }
}

PanelDecoder dense_panel_decoder(const Tiling& t, const uint8_t* w, int64_t n_panels, int64_t k) {
  constexpr SubScales kMins = SubScales::kUnsignedWithMins;
  if (t.e2m1)
    return [=, &t](int64_t p, uint16_t* out) { decode_dense_panel<4, 32, true, SubScales::kExponent>(t, w, n_panels, k, p, out); };
  if (t.sub_scales && t.bits == 4)
    return [=, &t](int64_t p, uint16_t* out) { decode_dense_panel<4, 32, false, kMins>(t, w, n_panels, k, p, out); };
  if (t.sub_scales && t.bits == 5)
    return [=, &t](int64_t p, uint16_t* out) { decode_dense_panel<5, 32, false, kMins>(t, w, n_panels, k, p, out); };
  if (t.sub_scales && t.bits == 6)
    return [=, &t](int64_t p, uint16_t* out) { decode_dense_panel<6, 16, false, SubScales::kSigned>(t, w, n_panels, k, p, out); };
  if (t.bits == 4)
    return [=, &t](int64_t p, uint16_t* out) { decode_dense_panel<4, 32, false, SubScales::kNone>(t, w, n_panels, k, p, out); };
  return [=, &t](int64_t p, uint16_t* out) { decode_dense_panel<8, 32, false, SubScales::kNone>(t, w, n_panels, k, p, out); };
}
#endif

// Activation rows per pass over a panel: each unpacked weight operand is used this many times.
// Their int32 and float accumulators take 2 x 8 of AVX-512's 32 vector registers; with 256-bit
// vectors (16 registers, two per accumulator) 4 rows already fill them.
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif

template <int Bits, int Flush, bool E2M1 = false, SubScales Sub = SubScales::kNone>
void run_panels(const Tiling& t, const uint8_t* w, int64_t n_rows, const Activations& a, int64_t m_rows,
                const float* bias, float* y) {
  const int64_t k = a.k, pb = panel_bytes(t, k);
  const int64_t n_panels = (n_rows + kPanel - 1) / kPanel;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    vec16 out[kMaxRows];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = w + p * pb;
      const uint8_t* next = p + 1 < end ? panel + pb : nullptr;
      const int64_t n0 = p * kPanel;
      const int rows = static_cast<int>(std::min<int64_t>(kPanel, n_rows - n0));
      vec16 b = {};
      if (bias != nullptr) {
        for (int r = 0; r < rows; ++r) b[r] = bias[n0 + r];
      }
      for (int64_t m = 0; m < m_rows;) {
        const int64_t left = m_rows - m;
        int mr;
        if (kMaxRows == 8 && left >= 8) {
          panel_kernel<Bits, Flush, kMaxRows, E2M1, Sub>(t, panel, a, m, out, m == 0 ? next : nullptr);
          mr = kMaxRows;
        } else if (left >= 4) {
          panel_kernel<Bits, Flush, 4, E2M1, Sub>(t, panel, a, m, out, m == 0 ? next : nullptr);
          mr = 4;
        } else if (left == 3) {
          panel_kernel<Bits, Flush, 3, E2M1, Sub>(t, panel, a, m, out, m == 0 ? next : nullptr);
          mr = 3;
        } else if (left == 2) {
          panel_kernel<Bits, Flush, 2, E2M1, Sub>(t, panel, a, m, out, m == 0 ? next : nullptr);
          mr = 2;
        } else {
          panel_kernel<Bits, Flush, 1, E2M1, Sub>(t, panel, a, m, out, m == 0 ? next : nullptr);
          mr = 1;
        }
        for (int i = 0; i < mr; ++i) {
          const vec16 v = out[i] + b;
          float* dst = y + (m + i) * n_rows + n0;
          if (rows == kPanel) {
            store16(dst, v);
          } else {
            for (int r = 0; r < rows; ++r) dst[r] = v[r];
          }
        }
        m += mr;
      }
    }
  });
}

// Round-to-nearest int8 per block of 32 (scale = max|x| / 127), and the per-flush-block sums.
void quantize_activations(const float* x, int64_t m_rows, int64_t k, int flush, int8_t* q, float* scale,
                          float* sums) {
  const int64_t blocks = k / kActBlock, per = kActBlock / flush;
  at::parallel_for(0, m_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * k + b * kActBlock;
        const vec16 v0 = load16(xb), v1 = load16(xb + 16);
        float amax = 0.f;
        for (int i = 0; i < 16; ++i) amax = std::max(amax, std::max(std::fabs(v0[i]), std::fabs(v1[i])));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        scale[m * blocks + b] = d;
        int8_t* qb = q + m * k + b * kActBlock;
        int32_t sum[2] = {0, 0};
        for (int i = 0; i < kActBlock; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
          qb[i] = static_cast<int8_t>(v);
          sum[i / 16] += v;
        }
        if (per == 1) {
          sums[m * blocks + b] = d * static_cast<float>(sum[0] + sum[1]);
        } else {
          sums[(m * blocks + b) * 2] = d * static_cast<float>(sum[0]);
          sums[(m * blocks + b) * 2 + 1] = d * static_cast<float>(sum[1]);
        }
      }
    }
  });
}

}  // namespace

// Which integer dot product this build uses: "avx512_vnni", "avx2" or "portable".
std::string int8_dot_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// Whether `format` can be tiled on this build.
bool int8_tiling_supported(int64_t format) {
  switch (format) {
    case F_Q4_0: case F_Q4_1: case F_I4_G64: case F_I4_G128: case F_Q4_K: case F_Q5_K: case F_Q6_K: case F_MXFP4:
    case F_Q8_0: case F_I8_ROW:
      return true;
  }
  return false;
}

// Whether the tiling holds `qweight` exactly: an MXFP4 block's scale 2^(e - 128) must be a normal
// float (e in 2..254), unless all its codes are zeros; every other format's scales are.
bool int8_tiling_exact(at::Tensor qweight, int64_t format, int64_t k) {
  check_weight(qweight, format, k);
  if (format != F_MXFP4) return true;
  const int lowest = 2, highest = 254;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t blocks = qweight.numel() / block_bytes(format);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * block_bytes(format);
    if (blk[0] >= lowest && blk[0] <= highest) continue;
    for (int i = 1; i < 17; ++i)
      if (blk[i] & 0x77) return false;  // a nonzero magnitude in either nibble
  }
  return true;
}

// Bytes of the int8 tiling of an [n, k] weight in `format`: ceil(n / 16) panels.
int64_t int8_tiled_bytes(int64_t format, int64_t n, int64_t k) {
  return (n + kPanel - 1) / kPanel * panel_bytes(tiling_of(format), k);
}

// A packed weight [N, row_bytes] in `format` -> its int8 tiling [ceil(N / 16), panel_bytes], written
// into `out` where given (uint8, contiguous, int8_tiled_bytes of them: a slice of the weight arena).
at::Tensor int8_tile_weight(at::Tensor qweight, int64_t format, int64_t k, c10::optional<at::Tensor> out) {
  check_weight(qweight, format, k);
  TORCH_CHECK(int8_tiling_supported(format), "format ", format, " cannot be tiled for int8 on this CPU");
  TORCH_CHECK(k % kActBlock == 0, "in_features must be a multiple of ", kActBlock);
  const Tiling t = tiling_of(format);
  const int64_t n = qweight.size(0), rb = qweight.size(1), n_panels = (n + kPanel - 1) / kPanel;
  const int64_t pb = panel_bytes(t, k);
  at::Tensor tiled;
  if (out.has_value()) {
    TORCH_CHECK(out->scalar_type() == at::kByte && out->is_contiguous() && out->numel() == n_panels * pb,
                "out must be ", n_panels * pb, " contiguous bytes");
    tiled = out->view({n_panels, pb});
  } else {
    tiled = at::empty({n_panels, pb}, at::dtype(at::kByte));
  }
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  uint8_t* o = tiled.data_ptr<uint8_t>();
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) tile_panel(format, t, w, rb, n, p, k, o + p * pb);
  });
  return tiled;
}

// Rows of a tiled weight as float32 (embedding lookups; tests).
at::Tensor int8_tiled_rows(at::Tensor tiled, int64_t format, int64_t n_rows, int64_t k, at::Tensor rows) {
  const Tiling t = tiling_of(format);
  TORCH_CHECK(tiled.scalar_type() == at::kByte && tiled.is_contiguous() && tiled.dim() == 2 &&
                  tiled.size(1) == panel_bytes(t, k),
              "not an int8-tiled weight of ", k, " inputs");
  auto index = rows.to(at::kLong).contiguous().view({-1});
  const int64_t* idx = index.data_ptr<int64_t>();
  const int64_t count = index.numel(), pb = panel_bytes(t, k);
  auto out = at::empty({count, k}, at::dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = tiled.data_ptr<uint8_t>();
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n = idx[c];
      TORCH_CHECK(n >= 0 && n < n_rows, "row index ", n, " out of range [0, ", n_rows, ")");
      const uint8_t* panel = w + (n / kPanel) * pb;
      const int r = static_cast<int>(n % kPanel);
      for (int64_t i = 0; i < k; ++i) {
        const Group group = panel_group(t, panel, k, i / kGroup);
        const uint8_t* quants = group.quants;
        const int64_t within = i % kGroup;
        int64_t byte = 0, high_byte = 0;
        int shift = 0, high_shift = 0;
        quant_position(t, r, within, &byte, &shift, &high_byte, &high_shift);
        int q = t.bits == 8 ? (t.signed_quants ? static_cast<int8_t>(quants[byte]) : quants[byte])
                            : (quants[byte] >> shift) & 0xF;
        if (t.e2m1) q = kE2M1Quants[q];
        if (t.bits == 6) q |= ((quants[high_byte] >> high_shift) & 3) << 4;
        if (t.bits == 5) q |= ((quants[high_byte] >> high_shift) & 1) << 4;
        float s = 0.f, mn = 0.f;
        block_scale(t, group.scales, within / t.flush, r, &s, &mn);
        o[c * k + i] = s * static_cast<float>(q) + mn;
      }
    }
  });
  return out;
}

// y = quantize_int8(x) @ W^T + bias for an int8-tiled W [n_rows, k]; from amx_min_rows rows of x on
// (0: never), where AMX runs, y = bfloat16(x) @ bfloat16(W)^T + bias instead: a prompt's many rows
// share each weight panel, so the product is bound by arithmetic, which AMX's bfloat16 tiles do
// several times faster than integer dot products in vector registers; decoding a panel to bfloat16
// once per call costs little beside it.
at::Tensor int8_linear(at::Tensor x, at::Tensor tiled, int64_t format, int64_t n_rows, int64_t k,
                          c10::optional<at::Tensor> bias, int64_t amx_min_rows) {
  const Tiling t = tiling_of(format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  TORCH_CHECK(tiled.scalar_type() == at::kByte && tiled.is_contiguous() && tiled.dim() == 2 &&
                  tiled.size(1) == panel_bytes(t, k) && tiled.size(0) == (n_rows + kPanel - 1) / kPanel,
              "not an int8-tiled weight of ", n_rows, " x ", k);
  auto shape = x.sizes().vec();
  shape.back() = n_rows;
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == n_rows, "bias must have ", n_rows, " elements");
  }
#if defined(__AVX512BF16__)
  if (amx_min_rows > 0 && m >= amx_min_rows && decoded_gemm_supported(k)) {
    auto y = decoded_linear(x2, dense_panel_decoder(t, tiled.data_ptr<uint8_t>(), tiled.size(0), k), n_rows, k,
                            bias.has_value() ? bias_c.data_ptr<float>() : nullptr);
    pagedllm::count_run(pagedllm::Kernel::kInt8Amx);
    return y.view(shape);
  }
#endif
  pagedllm::count_run(pagedllm::Kernel::kInt8Dot);
  auto xq = at::empty({m, k}, at::dtype(at::kChar));
  auto dx = at::empty({m, k / kActBlock}, at::dtype(at::kFloat));
  auto sums = at::empty({m, k / t.flush}, at::dtype(at::kFloat));
  quantize_activations(x2.data_ptr<float>(), m, k, t.flush, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                       sums.data_ptr<float>());
  const Activations a{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sums.data_ptr<float>(), k, k / t.flush};
  auto y = at::empty({m, n_rows}, x2.options());
  const float* b = bias.has_value() ? bias_c.data_ptr<float>() : nullptr;
  const uint8_t* w = tiled.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (t.e2m1) {
    run_panels<4, 32, true, SubScales::kExponent>(t, w, n_rows, a, m, b, yp);
  } else if (t.sub_scales && t.bits == 4) {
    run_panels<4, 32, false, SubScales::kUnsignedWithMins>(t, w, n_rows, a, m, b, yp);
  } else if (t.sub_scales && t.bits == 5) {
    run_panels<5, 32, false, SubScales::kUnsignedWithMins>(t, w, n_rows, a, m, b, yp);
  } else if (t.sub_scales && t.bits == 6) {
    run_panels<6, 16, false, SubScales::kSigned>(t, w, n_rows, a, m, b, yp);
  } else if (t.bits == 4) {
    run_panels<4, 32>(t, w, n_rows, a, m, b, yp);
  } else {
    run_panels<8, 32>(t, w, n_rows, a, m, b, yp);
  }
  return y.view(shape);
}
