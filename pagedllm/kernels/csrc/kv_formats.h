// The KV cache's row formats as the attention kernels read and write them. A row is one token's
// state for one KV head: head_dim values in the model's float type, or quantized values followed
// by the scales that decode them (pagedllm/attention/kv_quant.py defines the layouts; the cache
// tensor's dtype names its format):
//   int8      head_dim int8 q, float16 s           x = q * s, s = max|x| / 127
//   fp8_e4m3  head_dim float8 e4m3 q, float16 s    x = q * s, s = max|x| / 448
//   fp8_e5m2  head_dim float8 e5m2 q, float16 s    x = q * s, s = max|x| / 57344
//   int4      head_dim / 2 bytes, then per group of 32 values float16 d and m: x = q * d + m, q in
//             0..15; a group's byte j holds value j (low nibble) and value j + 16 (high nibble)
// Quantized rows hold each head rotated by a Walsh-Hadamard transform H (entries +-1, in blocks of the
// largest power of two dividing head_dim, H H = block I): an outlier channel of a key is spread over
// every value of its row, so one scale per row fits them all. The kernels work in the rotated basis:
// they rotate each query head once (q . k = (H q) . (H k) / block) and each output head once at the
// end (sum p H v = H sum p v); writes are scaled by 2^-write_shift and reads by 2^-read_shift, with
// write_shift + read_shift = log2(block), all exact in float (see kv_quant.rotation_shifts).
// Each format gives the kernels:
//   storage_t                    the cache's element type (a row is row_elems(head_dim) of them)
//   dequantize(row, D, out)      the row as D float32 values (the portable path, and scratch copies)
//   load16(row, D, r)            values 16r .. 16r + 15 as float32 in one AVX-512 register
//                                (formats with kVector), decoded in registers
//   load8(row, D, r)             values 8r .. 8r + 7 as float32 in one AVX2 register (the same,
//                                for builds with AVX2 and F16C)
//   quantize(x, D, row)          D float32 values into a row, with the same float32 operations in the
//                                same order as kv_quant.quantize_rows, so both write the same bytes
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
// The 8-wide loads need AVX2's integer widening and F16C's float16 conversion.
#if defined(__AVX2__) && defined(__F16C__)
#define PAGEDLLM_KV_LOAD8 1
#endif
#if defined(__AVX512F__)
#include "vec_math.h"
#endif

namespace pagedllm::kv {

constexpr int64_t kInt4Group = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction where c10's portable conversion takes a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The value as computed, hidden from the optimiser: under -ffast-math it would fold
// 1 / (top * (1 / 127)) into 127 / top, which rounds differently from the reference's two steps
// (and so would quantize some values one step apart from kv_quant.quantize_rows).
inline float opaque(float v) {
#if defined(__GNUC__)
  __asm__ volatile("" : "+m"(v));
#endif
  return v;
}

inline int64_t hadamard_block(int64_t head_dim) { return head_dim & -head_dim; }

inline int write_shift(int64_t head_dim) {
  int k = 0;
  while ((int64_t{1} << (k + 1)) <= hadamard_block(head_dim)) ++k;
  return k / 2;
}

inline int read_shift(int64_t head_dim) {
  int k = 0;
  while ((int64_t{1} << (k + 1)) <= hadamard_block(head_dim)) ++k;
  return k - k / 2;
}

// x <- H x * 2^-shift in place: butterflies (a + b, a - b) in the order kv_quant.hadamard runs them,
// so the bytes written match the reference's.
inline void hadamard(float* x, int64_t head_dim, int shift) {
  const int64_t block = hadamard_block(head_dim);
  for (int64_t base = 0; base < head_dim; base += block) {
    float* y = x + base;
    for (int64_t half = 1; half < block; half *= 2) {
      for (int64_t j = 0; j < block; j += 2 * half) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = y[j + i], b = y[j + i + half];
          y[j + i] = a + b;
          y[j + i + half] = a - b;
        }
      }
    }
  }
  const float factor = std::ldexp(1.f, -shift);
  for (int64_t d = 0; d < head_dim; ++d) x[d] *= factor;
}

// Rows of plain float values: in the model's float type, or in a 16-bit type (bfloat16, float16)
// under a wider model type (a "bfloat16" / "float16" cache: values rounded to it as written).
template <typename T>
struct Plain {
  using storage_t = T;
  static constexpr bool kQuantized = false;
  static constexpr bool kVector =
      std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
  static int64_t row_elems(int64_t head_dim) { return head_dim; }
  static void dequantize(const T* row, int64_t head_dim, float* out) {
    for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(row[d]);
  }
  static void quantize(const float* x, int64_t head_dim, T* row) {
    for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<T>(x[d]);
  }
#if defined(__AVX512F__)
  static __m512 load16(const T* row, int64_t, int64_t r) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_loadu_ps(row + 16 * r);
    } else if constexpr (std::is_same_v<T, c10::Half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * r)));
    } else {
      return pagedllm::load16(reinterpret_cast<const uint16_t*>(row) + 16 * r);
    }
  }
#endif
#if defined(PAGEDLLM_KV_LOAD8)
  static __m256 load8(const T* row, int64_t, int64_t r) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm256_loadu_ps(row + 8 * r);
    } else {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * r));
      if constexpr (std::is_same_v<T, c10::Half>) {
        return _mm256_cvtph_ps(bits);
      } else {  // bfloat16: float32's top half
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      }
    }
  }
#endif
};

// One byte per value and a float16 scale after them: int8 and both float8 types. The values are
// quantized against the scale as stored (rounded to float16), so decoding is exact to it.
template <typename Derived>
struct ScaledBytes {
  using storage_t = uint8_t;
  static constexpr bool kQuantized = true;
  static constexpr bool kVector = true;
  static int64_t row_elems(int64_t head_dim) { return head_dim + 2; }
  static float scale(const uint8_t* row, int64_t head_dim) { return half_to_float(row + head_dim); }
  static void dequantize(const uint8_t* row, int64_t head_dim, float* out) {
    const float s = scale(row, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) out[d] = Derived::value(row[d]) * s;
  }
  static void quantize(const float* x, int64_t head_dim, uint8_t* row) {
    float top = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) top = std::max(top, std::fabs(x[d]));
    const c10::Half stored(std::min(top * Derived::kInvMax, 65504.f));
    const float s = opaque(static_cast<float>(stored));
    const float inv = s > 0.f ? 1.f / s : 0.f;  // an all-zero row stores zeros, not nan
    for (int64_t d = 0; d < head_dim; ++d) {
      row[d] = Derived::encode(std::min(std::max(x[d] * inv, -Derived::kMax), Derived::kMax));
    }
    std::memcpy(row + head_dim, &stored.x, 2);
  }
#if defined(__AVX512F__)
  static __m512 load16(const uint8_t* row, int64_t head_dim, int64_t r) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * r));
    return _mm512_mul_ps(Derived::decode16(bytes), _mm512_set1_ps(scale(row, head_dim) * Derived::kDecodeFactor));
  }
#endif
#if defined(PAGEDLLM_KV_LOAD8)
  static __m256 load8(const uint8_t* row, int64_t head_dim, int64_t r) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * r));
    return _mm256_mul_ps(Derived::decode8(bytes), _mm256_set1_ps(scale(row, head_dim) * Derived::kDecodeFactor));
  }
#endif
};

struct Int8 : ScaledBytes<Int8> {
  static constexpr float kMax = 127.f;
  static constexpr float kInvMax = 1.f / 127.f;
  static constexpr float kDecodeFactor = 1.f;
  static float value(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }
  static uint8_t encode(float v) { return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v))); }
#if defined(__AVX512F__)
  static __m512 decode16(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
#endif
#if defined(PAGEDLLM_KV_LOAD8)
  static __m256 decode8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
#endif
};

// Every float8 byte as float32, for the portable path (a table lookup instead of the bit
// manipulation per value).
template <typename F8>
inline const std::array<float, 256>& float8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(F8(static_cast<uint8_t>(b), F8::from_bits()));
    return t;
  }();
  return table;
}

struct Fp8E4M3 : ScaledBytes<Fp8E4M3> {
  static constexpr float kMax = 448.f;
  static constexpr float kInvMax = 1.f / 448.f;
  // decode16 reads e4m3 as float16 with the exponent bias 15 instead of 7: 2^-8 of the value, for
  // normal and subnormal numbers alike; the scale puts the 2^8 back.
  static constexpr float kDecodeFactor = 256.f;
  static float value(uint8_t b) { return float8_table<c10::Float8_e4m3fn>()[b]; }
  static uint8_t encode(float v) { return c10::Float8_e4m3fn(v).x; }
#if defined(__AVX512F__)
  static __m512 decode16(__m128i bytes) {
    const __m256i b = _mm256_cvtepu8_epi16(bytes);
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
  }
#endif
#if defined(PAGEDLLM_KV_LOAD8)
  static __m256 decode8(__m128i bytes) {  // as decode16, eight at a time
    const __m128i b = _mm_cvtepu8_epi16(bytes);
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(magnitude, sign));
  }
#endif
};

struct Fp8E5M2 : ScaledBytes<Fp8E5M2> {
  static constexpr float kMax = 57344.f;
  static constexpr float kInvMax = 1.f / 57344.f;
  static constexpr float kDecodeFactor = 1.f;  // e5m2 is float16's top byte
  static float value(uint8_t b) { return float8_table<c10::Float8_e5m2>()[b]; }
  static uint8_t encode(float v) { return c10::Float8_e5m2(v).x; }
#if defined(__AVX512F__)
  static __m512 decode16(__m128i bytes) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8)); }
#endif
#if defined(PAGEDLLM_KV_LOAD8)
  static __m256 decode8(__m128i bytes) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8)); }
#endif
};

struct Int4 {
  using storage_t = uint8_t;
  static constexpr bool kQuantized = true;
  static constexpr bool kVector = true;
  static int64_t row_elems(int64_t head_dim) { return head_dim / 2 + head_dim / kInt4Group * 4; }
  static const uint8_t* params(const uint8_t* row, int64_t head_dim, int64_t group) {
    return row + head_dim / 2 + 4 * group;
  }
  static void dequantize(const uint8_t* row, int64_t head_dim, float* out) {
    for (int64_t g = 0; g < head_dim / kInt4Group; ++g) {
      const uint8_t* p = params(row, head_dim, g);
      const float d = half_to_float(p), m = half_to_float(p + 2);
      const uint8_t* bytes = row + 16 * g;
      float* o = out + kInt4Group * g;
      for (int64_t j = 0; j < 16; ++j) {
        o[j] = static_cast<float>(bytes[j] & 0xF) * d + m;
        o[j + 16] = static_cast<float>(bytes[j] >> 4) * d + m;
      }
    }
  }
  static void quantize(const float* x, int64_t head_dim, uint8_t* row) {
    for (int64_t g = 0; g < head_dim / kInt4Group; ++g) {
      const float* xg = x + kInt4Group * g;
      float lo = xg[0], hi = xg[0];
      for (int64_t j = 1; j < kInt4Group; ++j) {
        lo = std::min(lo, xg[j]);
        hi = std::max(hi, xg[j]);
      }
      const c10::Half m(std::min(std::max(lo, -65504.f), 65504.f));
      const c10::Half d(std::min((hi - lo) * (1.f / 15.f), 65504.f));
      const float mf = static_cast<float>(m), df = opaque(static_cast<float>(d));
      const float inv = df > 0.f ? 1.f / df : 0.f;
      uint8_t q[kInt4Group];
      for (int64_t j = 0; j < kInt4Group; ++j) {
        q[j] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((xg[j] - mf) * inv), 0.f), 15.f));
      }
      for (int64_t j = 0; j < 16; ++j) row[16 * g + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
      uint8_t* p = row + head_dim / 2 + 4 * g;
      std::memcpy(p, &d.x, 2);
      std::memcpy(p + 2, &m.x, 2);
    }
  }
#if defined(__AVX512F__)
  static __m512 load16(const uint8_t* row, int64_t head_dim, int64_t r) {
    const int64_t g = r / 2;
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
    const __m512i q = (r & 1) ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(0xF));
    const uint8_t* p = params(row, head_dim, g);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(half_to_float(p)), _mm512_set1_ps(half_to_float(p + 2)));
  }
#endif
#if defined(PAGEDLLM_KV_LOAD8)
  // Eighths 0 and 1 of a group are the low nibbles of its bytes 0-7 and 8-15, eighths 2 and 3 their
  // high nibbles.
  static __m256 load8(const uint8_t* row, int64_t head_dim, int64_t r) {
    const int64_t g = r / 4, part = r % 4;
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * g + 8 * (part & 1))));
    const __m256i q = part >= 2 ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(0xF));
    const uint8_t* p = params(row, head_dim, g);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(half_to_float(p)), _mm256_set1_ps(half_to_float(p + 2)));
  }
#endif
};

// Calls f(Format{}) for the format of a cache holding rows for queries of type scalar_t.
template <typename scalar_t, typename F>
void dispatch_format(const at::Tensor& cache, int64_t head_dim, const char* name, F&& f) {
  const auto type = cache.scalar_type();
  auto check_row = [&](int64_t elems) {
    TORCH_CHECK(cache.size(-1) == elems, name, ": a ", type, " cache row for head_dim ", head_dim, " holds ", elems,
                " elements, this cache's hold ", cache.size(-1));
  };
  if (type == c10::CppTypeToScalarType<scalar_t>::value) {
    check_row(head_dim);
    f(Plain<scalar_t>{});
  } else if (type == at::kBFloat16) {
    check_row(head_dim);
    f(Plain<c10::BFloat16>{});
  } else if (type == at::kHalf) {
    check_row(head_dim);
    f(Plain<c10::Half>{});
  } else if (type == at::kChar) {
    check_row(Int8::row_elems(head_dim));
    f(Int8{});
  } else if (type == at::kFloat8_e4m3fn) {
    check_row(Fp8E4M3::row_elems(head_dim));
    f(Fp8E4M3{});
  } else if (type == at::kFloat8_e5m2) {
    check_row(Fp8E5M2::row_elems(head_dim));
    f(Fp8E5M2{});
  } else if (type == at::kByte) {
    TORCH_CHECK(head_dim % kInt4Group == 0, name, ": an int4 cache needs head_dim a multiple of ", kInt4Group);
    check_row(Int4::row_elems(head_dim));
    f(Int4{});
  } else {
    TORCH_CHECK(false, name, ": a ", type, " cache cannot serve ", c10::CppTypeToScalarType<scalar_t>::value,
                " queries (expected the query's dtype, bfloat16 / float16, or int8 / float8_e4m3fn / float8_e5m2 / uint8 (int4) rows)");
  }
}

// The cache's rows as the format's storage type.
template <typename Format>
const typename Format::storage_t* rows_of(const at::Tensor& cache) {
  return reinterpret_cast<const typename Format::storage_t*>(cache.data_ptr());
}

}  // namespace pagedllm::kv
