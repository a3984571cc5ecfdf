// Vector math shared by the CPU kernels (AVX-512, 16 float32 values at a time).
#pragma once

#include <cmath>

// glibc declares its vector math (libmvec) only under -ffast-math, which the kernels are not built
// with: they rely on infinities and NaN (-INFINITY sentinels, NaN kept a NaN). Declared here, the
// `#pragma omp simd` loops that call std::exp, std::tanh and std::erf still call libmvec's vector
// forms (which handle infinities and NaN) instead of one scalar call per value.
#if defined(__x86_64__) && defined(__GLIBC__) && defined(_OPENMP) && !defined(__FAST_MATH__)
extern "C" {
#pragma omp declare simd notinbranch
float expf(float) noexcept;
#pragma omp declare simd notinbranch
float tanhf(float) noexcept;
#pragma omp declare simd notinbranch
float erff(float) noexcept;
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace pagedllm {

// 16 values as float32: float32 as they are, bfloat16 widened by a 16-bit shift (its bits are
// float32's top half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(y) for 16 values: 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error ~2e-7, about one float32 ulp, as libm's), 2^n applied by scalef (which
// saturates to inf / 0 as exp does). The compiler's libmvec call per 16 values cost ~3x this.
inline __m512 exp16(__m512 y) {
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), y);  // ln 2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);     // ln 2, low part
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) = g / (1 + exp(-g)) for 16 values.
inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

}  // namespace pagedllm
#endif
