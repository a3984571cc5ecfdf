// Packed weight formats for the CPU kernels: ids, block geometry, and decoding a row's blocks to
// float32 in vector registers (visit_row). The ids match pagedllm/quantization/formats.py.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedllm_quant {

// Format ids shared with pagedllm/quantization/formats.py.
enum Format : int64_t {
  F_Q4_0 = 2,
  F_Q4_1 = 3,
  F_Q8_0 = 8,
  F_Q4_K = 12,
  F_Q5_K = 13,
  F_Q6_K = 14,
  F_I4_G64 = 1064,   // int4 groups of 64: fp16 scale, fp16 min, 32 bytes of nibbles (Q4_1's layout, wider)
  F_I4_G128 = 1128,  // the same with groups of 128
  F_I8_ROW = 1008,   // int8 per output channel: K int8 then one float32 scale at the row's end
  F_MXFP4 = 39,      // OCP microscaling FP4: an e8m0 exponent byte, then 16 bytes of e2m1 codes (low nibbles first)
};

// e2m1 code -> value: bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
constexpr float kE2M1Values[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                   -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline int64_t block_values(int64_t format) {
  switch (format) {
    case F_Q4_0: case F_Q4_1: case F_Q8_0: case F_MXFP4: return 32;
    case F_Q4_K: case F_Q5_K: case F_Q6_K: return 256;
    case F_I4_G64: return 64;
    case F_I4_G128: return 128;
    case F_I8_ROW: return 16;  // no blocks; 16 keeps chunks vector-sized
  }
  TORCH_CHECK(false, "unknown quantized weight format ", format);
}

inline int64_t block_bytes(int64_t format) {
  switch (format) {
    case F_Q4_0: return 18;
    case F_Q4_1: return 20;
    case F_Q8_0: return 34;
    case F_Q4_K: return 144;
    case F_Q5_K: return 176;
    case F_Q6_K: return 210;
    case F_I4_G64: return 36;
    case F_I4_G128: return 68;
    case F_I8_ROW: return 16;
    case F_MXFP4: return 17;
  }
  TORCH_CHECK(false, "unknown quantized weight format ", format);
}

// An MXFP4 block's scale 2^(e - 127): exact in float32 for every exponent byte but 255 (NaN in
// the OCP format; infinity here, as the torch reference's ldexp gives).
inline float e8m0_scale(uint8_t e) { return std::ldexp(1.f, static_cast<int>(e) - 127); }

inline int64_t row_bytes(int64_t format, int64_t k) {
  if (format == F_I8_ROW) return k + 4;
  return k / block_values(format) * block_bytes(format);
}

typedef float vec16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef int32_t i32x16 __attribute__((vector_size(64)));

// 16 bytes -> 16 int32 lanes, zero- or sign-extended (vpmovzxbd / vpmovsxbd with a memory operand).
template <bool Signed>
inline i32x16 widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i v = Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
#elif defined(__AVX2__)
  const __m128i b0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  struct { __m256i a, b; } v{Signed ? _mm256_cvtepi8_epi32(b0) : _mm256_cvtepu8_epi32(b0),
                             Signed ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1)};
#else
  i32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = Signed ? static_cast<int8_t>(p[i]) : p[i];
#endif
  i32x16 out;
  std::memcpy(&out, &v, 64);
  return out;
}

inline i32x16 widen_u8(const uint8_t* p) { return widen<false>(p); }
inline i32x16 widen_i8(const uint8_t* p) { return widen<true>(p); }

inline vec16 to_float(i32x16 v) { return __builtin_convertvector(v, vec16); }

// 16 e2m1 codes (0..15 in int32 lanes) -> their float values, one table lookup per lane.
inline vec16 e2m1_values(i32x16 codes) {
#if defined(__AVX512F__)
  __m512i idx;
  std::memcpy(&idx, &codes, 64);
  const __m512 v = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(kE2M1Values));
  vec16 out;
  std::memcpy(&out, &v, 64);
  return out;
#elif defined(__AVX2__)
  // Eight magnitudes per 8-lane table lookup; the sign (code bit 3) goes to the float's sign bit.
  __m256i c[2];
  std::memcpy(c, &codes, 64);
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1Values);
  __m256 v[2];
  for (int h = 0; h < 2; ++h) {
    const __m256 m = _mm256_permutevar8x32_ps(magnitudes, c[h]);  // uses the low 3 bits of each lane
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c[h], _mm256_set1_epi32(8)), 28);
    v[h] = _mm256_or_ps(m, _mm256_castsi256_ps(sign));
  }
  vec16 out;
  std::memcpy(&out, v, 64);
  return out;
#else
  vec16 out;
  for (int i = 0; i < 16; ++i) out[i] = kE2M1Values[codes[i] & 0xF];
  return out;
#endif
}

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float vec8 __attribute__((vector_size(32)));

// The 8 sub-block scales (d * sc) and offsets (-dmin * m) of a Q4_K / Q5_K block, unpacked from
// their 12 bytes s of 6-bit fields in a few vector operations. ggml's rule: for j < 4,
// sc = s[j] & 63, m = s[j + 4] & 63; else sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4 and
// m = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
// The 8 six-bit scales sc and mins m of a Q4_K / Q5_K block: sub-block j's values are
// d * sc[j] * q - dmin * m[j].
inline void k_subscales(const uint8_t* blk, i32x8* sc, i32x8* m) {
  const i32x16 s = widen_u8(blk + 4);  // bytes 0..11 are the fields; 12..15 (the next field) unused
  const i32x8 p = __builtin_shufflevector(s, s, 0, 1, 2, 3, 0, 1, 2, 3);
  const i32x8 q = __builtin_shufflevector(s, s, 4, 5, 6, 7, 4, 5, 6, 7);
  const i32x8 r = __builtin_shufflevector(s, s, 8, 9, 10, 11, 8, 9, 10, 11);
  const i32x8 first = {-1, -1, -1, -1, 0, 0, 0, 0};  // j < 4
  *sc = (first & (p & 63)) | (~first & ((r & 0xF) | ((p >> 6) << 4)));
  *m = (first & (q & 63)) | (~first & ((r >> 4) | ((q >> 6) << 4)));
}

inline void k_scales_mins(const uint8_t* blk, float* scale, float* offset) {
  i32x8 sc, m;
  k_subscales(blk, &sc, &m);
  const vec8 scales = __builtin_convertvector(sc, vec8) * half_to_float(blk);
  const vec8 offsets = __builtin_convertvector(m, vec8) * -half_to_float(blk + 2);
  std::memcpy(scale, &scales, 32);
  std::memcpy(offset, &offsets, 32);
}

// Walks values [k0, k1) of one packed row (k0, k1 on block boundaries), 16 at a time, calling
// emit(offset from k0, the 16 float values, slot): slot is a std::integral_constant 0..3 that
// differs between the call sites of one loop body, so a caller can keep independent
// accumulators per slot. Inlined into its callers: decode_row stores the
// values, the few-row GEMV multiplies them straight into its accumulators. Nibbles are split
// after widening bytes to int32 lanes (and / shift on dwords; x86 has no byte shifts), and each
// value is one FMA of its integer (scale * q + offset).
template <int S>
using Slot = std::integral_constant<int, S>;

template <class Emit>
inline void visit_row(int64_t format, const uint8_t* row, int64_t k, int64_t k0, int64_t k1, Emit&& emit) {
  const int64_t bv = block_values(format), bb = block_bytes(format);
  const int64_t b0 = k0 / bv, b1 = k1 / bv;
  switch (format) {
    case F_I8_ROW: {
      float scale;
      std::memcpy(&scale, row + k, 4);
      for (int64_t j = k0; j < k1; j += 32) {
        emit(j - k0, to_float(widen_i8(row + j)) * scale, Slot<0>{});
        emit(j - k0 + 16, to_float(widen_i8(row + j + 16)) * scale, Slot<1>{});
      }
      break;
    }
    case F_Q4_0:
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk), o = -8.f * d;
        const i32x16 v = widen_u8(blk + 2);
        const int64_t at = b * bv - k0;
        emit(at, to_float(v & 0xF) * d + o, Slot<0>{});
        emit(at + 16, to_float(v >> 4) * d + o, Slot<1>{});
      }
      break;
    case F_Q4_1: case F_I4_G64: case F_I4_G128:
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk), o = half_to_float(blk + 2);
        const int64_t at = b * bv - k0, half = bv / 2;
        for (int64_t c = 0; c < half; c += 16) {
          const i32x16 v = widen_u8(blk + 4 + c);
          emit(at + c, to_float(v & 0xF) * d + o, Slot<0>{});
          emit(at + half + c, to_float(v >> 4) * d + o, Slot<1>{});
        }
      }
      break;
    case F_MXFP4:
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = e8m0_scale(blk[0]);
        const i32x16 v = widen_u8(blk + 1);
        const int64_t at = b * bv - k0;
        emit(at, e2m1_values(v & 0xF) * d, Slot<0>{});
        emit(at + 16, e2m1_values(v >> 4) * d, Slot<1>{});
      }
      break;
    case F_Q8_0:
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = row + b * bb;
        const float d = half_to_float(blk);
        const int64_t at = b * bv - k0;
        emit(at, to_float(widen_i8(blk + 2)) * d, Slot<0>{});
        emit(at + 16, to_float(widen_i8(blk + 18)) * d, Slot<1>{});
      }
      break;
    case F_Q4_K: case F_Q5_K:
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = row + b * bb;
        float scale[8], offset[8];
        k_scales_mins(blk, scale, offset);
        const uint8_t* qh = blk + 16;  // Q5_K only
        const uint8_t* qs = blk + (format == F_Q5_K ? 48 : 16);
        const int64_t at = b * bv - k0;
        for (int j = 0; j < 4; ++j) {
          for (int c = 0; c < 32; c += 16) {
            const i32x16 q = widen_u8(qs + 32 * j + c);
            i32x16 lo = q & 0xF, hi = q >> 4;
            if (format == F_Q5_K) {
              const i32x16 h = widen_u8(qh + c);
              lo |= ((h >> (2 * j)) & 1) << 4;
              hi |= ((h >> (2 * j + 1)) & 1) << 4;
            }
            emit(at + 64 * j + c, to_float(lo) * scale[2 * j] + offset[2 * j], Slot<0>{});
            emit(at + 64 * j + 32 + c, to_float(hi) * scale[2 * j + 1] + offset[2 * j + 1], Slot<1>{});
          }
        }
      }
      break;
    case F_Q6_K:
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = row + b * bb;
        // The block's 16 scales times d, in one vector pass; each 16 values then take one of them.
        float scale[16];
        store16(scale, to_float(widen_i8(blk + 192)) * half_to_float(blk + 208));
        const int64_t at = b * bv - k0;
        for (int n = 0; n < 2; ++n) {
          const uint8_t* l6 = blk + 64 * n;
          const uint8_t* h6 = blk + 128 + 32 * n;
          const float* s6 = scale + 8 * n;
          for (int c = 0; c < 2; ++c) {  // 16 values share a scale
            const i32x16 a = widen_u8(l6 + 16 * c), a2 = widen_u8(l6 + 32 + 16 * c), h = widen_u8(h6 + 16 * c);
            const i32x16 q1 = ((a & 0xF) | ((h & 3) << 4)) - 32;
            const i32x16 q2 = ((a2 & 0xF) | (((h >> 2) & 3) << 4)) - 32;
            const i32x16 q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32;
            const i32x16 q4 = ((a2 >> 4) | (((h >> 6) & 3) << 4)) - 32;
            const int64_t y = at + 128 * n + 16 * c;
            emit(y, to_float(q1) * s6[c], Slot<0>{});
            emit(y + 32, to_float(q2) * s6[c + 2], Slot<1>{});
            emit(y + 64, to_float(q3) * s6[c + 4], Slot<2>{});
            emit(y + 96, to_float(q4) * s6[c + 6], Slot<3>{});
          }
        }
      }
      break;
    default:
      TORCH_CHECK(false, "unknown quantized weight format ", format);
  }
}

inline void decode_row(int64_t format, const uint8_t* row, int64_t k, int64_t k0, int64_t k1, float* out) {
  visit_row(format, row, k, k0, k1, [out](int64_t at, vec16 v, auto) { store16(out + at, v); });
}

inline void check_weight(const at::Tensor& qweight, int64_t format, int64_t k) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 2,
              "packed weight must be a CPU uint8 [N, row_bytes] tensor");
  TORCH_CHECK(k % block_values(format) == 0, "in_features ", k, " is not a multiple of the format's block of ",
              block_values(format));
  TORCH_CHECK(qweight.size(1) == row_bytes(format, k), "packed rows hold ", qweight.size(1), " bytes; ",
              row_bytes(format, k), " expected for ", k, " inputs");
  TORCH_CHECK(qweight.is_contiguous(), "packed weight must be contiguous");
}

}  // namespace pagedllm_quant
