// The decoder's elementwise chains fused for CPUs: RMSNorm (alone, or with the residual add before
// it), the gated MLP's act(gate) * up, and rotary embedding in place on the q and k heads.
//
// On a CPU torch runs each of these as several ops (RMSNorm alone is pow, mean, add, rsqrt, mul
// and a second mul), each one a pass over memory and a dispatch: at decode sizes (1-64 rows of a
// few hundred to a few thousand values) the dispatches cost more than the arithmetic. Here a row
// is read once into L1 and finished there.
//
// float32 and bfloat16 tensors; the math is float32 throughout. For bfloat16 the results are
// rounded where transformers' modules round (a bfloat16 tensor op rounds its result), so the
// values are those of the reference modules, not only close to them:
//   RMSNorm:        weight * bf16(x * rsqrt(mean(x^2) + eps))   (Gemma: bf16(x * inv * (1 + weight)))
//   residual add:   bf16(x + residual)
//   act(gate) * up: bf16(bf16(act(gate)) * up)
//   rotary:         bf16(bf16(x1 * cos) - bf16(x2 * sin)), bf16(bf16(x2 * cos) + bf16(x1 * sin))
//
// Loops are written for `#pragma omp simd`; exp, tanh and erf become glibc's vector versions
// (libmvec, declared in vec_math.h). Rows are split over threads only when a call has enough of them
// to pay for waking the pool (see kParallelElements).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"
#include "branches.h"

namespace {

// Calls with fewer values than this run on the calling thread. Between the layers' GEMMs the pool
// is still spinning, so a fork-join costs ~1-2 us, while a bfloat16 norm of 32 rows x 576 takes
// ~8-12 us on one core of a 2-core AMX machine: from ~16k values two threads win.
constexpr int64_t kParallelElements = 1 << 14;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(width, 1)); }

// Element access: float32 as is; bfloat16 as its 16 bits, widened to float32 by a shift and
// narrowed with round-to-nearest-even (NaN kept a NaN), in forms the vectoriser handles.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using raw = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};

template <>
struct Elem<at::BFloat16> {
  using raw = uint16_t;
  static inline float load(uint16_t v) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    // An integer test: it vectorises with the rounding, and holds under any floating-point flags.
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    return nan ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  static inline float round(float v) { return load(store(v)); }
};

template <typename T>
typename Elem<T>::raw* raw_ptr(const at::Tensor& t) {
  return reinterpret_cast<typename Elem<T>::raw*>(t.data_ptr<T>());
}

#if defined(__AVX512F__)
// The same element access 16 values at a time, for loops the vectoriser left scalar or peeled
// badly at these widths (a 32-wide rotary half, a 576-wide norm row): bfloat16 widens by a shift
// and narrows with round-to-nearest-even, NaN kept a NaN, bit for bit as Elem does.
using pagedllm::load16;
inline __m256i narrow_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  // One instruction, the same rounding (a NaN stays a quiet NaN, keeping its sign and top payload
  // bits where the emulation below writes 0x7fc0). The emulation costs ~10 instructions per 16
  // values, the bulk of a bfloat16 norm or rotary pass, which round up to six times per value.
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void vstore(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(v)); }
// The value rounded to the element type (what a bfloat16 tensor op's result holds).
inline __m512 vround(__m512 v, const float*) { return v; }
inline __m512 vround(__m512 v, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow_bf16(v)), 16));
}
constexpr int64_t kVec = 16;
#else
constexpr int64_t kVec = 0;  // no explicit vector loops: every loop below is the scalar one
#endif

void check_floating(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have contiguous rows");
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

// out = norm(row) * weight, from float32 values already summed into sum_sq.
template <typename T>
inline void scale_row(const typename Elem<T>::raw* __restrict__ row, const typename Elem<T>::raw* __restrict__ w,
                      typename Elem<T>::raw* __restrict__ out, int64_t n, float inv, bool gemma) {
  using E = Elem<T>;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
  for (; i + kVec <= n; i += kVec) {
    const __m512 x = _mm512_mul_ps(load16(row + i), vinv);
    vstore(out + i, gemma ? _mm512_mul_ps(x, _mm512_add_ps(one, load16(w + i))) : _mm512_mul_ps(load16(w + i), vround(x, row)));
  }
#endif
  if (gemma) {
    for (; i < n; ++i) out[i] = E::store(E::load(row[i]) * inv * (1.f + E::load(w[i])));
  } else {
    for (; i < n; ++i) out[i] = E::store(E::load(w[i]) * E::round(E::load(row[i]) * inv));
  }
}

template <typename T>
inline float sum_of_squares(const typename Elem<T>::raw* __restrict__ row, int64_t n) {
  using E = Elem<T>;
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + kVec <= n; i += kVec) {
    const __m512 v = load16(row + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    const float v = E::load(row[i]);
    sum += v * v;
  }
  return sum;
}

// x viewed as [outer, inner, n] (strides so, si, 1) -> a new contiguous tensor of x's shape.
template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, int64_t outer,
                     int64_t inner, int64_t so, int64_t si, float eps, bool gemma) {
  const int64_t n = x.size(-1);
  const auto* xp = raw_ptr<T>(x);
  const auto* wp = raw_ptr<T>(weight);
  auto* op = raw_ptr<T>(out);
  at::parallel_for(0, outer * inner, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* row = xp + (r / inner) * so + (r % inner) * si;
      const float inv = 1.f / std::sqrt(sum_of_squares<T>(row, n) / float(n) + eps);
      scale_row<T>(row, wp, op + r * n, n, inv, gemma);
    }
  });
}

template <typename T>
void fused_add_rms_norm_kernel(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps,
                               bool gemma) {
  using E = Elem<T>;
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  auto* xp = raw_ptr<T>(x);
  auto* rp = raw_ptr<T>(residual);
  const auto* wp = raw_ptr<T>(weight);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      auto* __restrict__ xr = xp + r * sx;
      auto* __restrict__ rr = rp + r * sr;
      float sum = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + kVec <= n; i += kVec) {
        const __m512 v = vround(_mm512_add_ps(load16(xr + i), load16(rr + i)), rr);
        vstore(rr + i, v);  // exact: v is already a value of the element type
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      sum = _mm512_reduce_add_ps(acc);
#endif
      for (; i < n; ++i) {
        const auto s = E::store(E::load(xr[i]) + E::load(rr[i]));
        rr[i] = s;
        const float v = E::load(s);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / float(n) + eps);
      scale_row<T>(rr, wp, xr, n, inv, gemma);
    }
  });
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& weight) {
  check_floating(weight, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [", x.size(-1), "], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have the input's dtype");
}

// ---------------------------------------------------------------------------------------------
// act(gate) * up

enum class Act { silu, gelu_tanh, gelu };

template <Act A>
inline float activate(float g) {
  if constexpr (A == Act::silu) {
    return g / (1.f + std::exp(-g));
  } else if constexpr (A == Act::gelu_tanh) {
    constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + std::tanh(kAlpha * (g + 0.044715f * g * g * g)));
  } else {
    return 0.5f * g * (1.f + std::erf(g * 0.7071067811865476f));
  }
}

template <typename T, Act A>
void act_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  using E = Elem<T>;
  const int64_t rows = out.size(0), width = out.size(1), sx = x.stride(0);
  const auto* xp = raw_ptr<T>(x);
  auto* op = raw_ptr<T>(out);
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* __restrict__ gate = xp + r * sx;
      const auto* __restrict__ up = gate + width;
      auto* __restrict__ o = op + r * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (A == Act::silu) {
        for (; i + kVec <= width; i += kVec)
          vstore(o + i, _mm512_mul_ps(vround(pagedllm::silu16(load16(gate + i)), gate), load16(up + i)));
      }
#endif
#pragma omp simd
      for (int64_t j = i; j < width; ++j) {
        o[j] = E::store(E::round(activate<A>(E::load(gate[j]))) * E::load(up[j]));
      }
    }
  });
}

template <Act A>
at::Tensor act_and_mul(at::Tensor x) {
  check_floating(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [tokens, 2 * width], got ", x.sizes());
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  pagedllm::count_run(pagedllm::Kernel::kFusedOps);
  if (x.scalar_type() == at::kFloat)
    act_and_mul_kernel<float, A>(x, out);
  else
    act_and_mul_kernel<at::BFloat16, A>(x, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding (rotate-half layout): per head, channel i < half pairs with i + half.

template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  using E = Elem<T>;
  const int64_t tokens = x.size(0), heads = x.size(1), half = cos.size(1);
  const int64_t st = x.stride(0), sh = x.stride(1), sc = cos.stride(0), ss = sin.stride(0);
  auto* xp = raw_ptr<T>(x);
  const auto* cp = raw_ptr<T>(cos);
  const auto* sp = raw_ptr<T>(sin);
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto* __restrict__ c = cp + t * sc;
      const auto* __restrict__ s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        auto* __restrict__ x1 = xp + t * st + h * sh;
        auto* __restrict__ x2 = x1 + half;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + kVec <= half; i += kVec) {
          const __m512 a = load16(x1 + i), b = load16(x2 + i), cv = load16(c + i), sv = load16(s + i);
          vstore(x1 + i, _mm512_sub_ps(vround(_mm512_mul_ps(a, cv), x1), vround(_mm512_mul_ps(b, sv), x1)));
          vstore(x2 + i, _mm512_add_ps(vround(_mm512_mul_ps(b, cv), x1), vround(_mm512_mul_ps(a, sv), x1)));
        }
#endif
        for (; i < half; ++i) {
          const float a = E::load(x1[i]), b = E::load(x2[i]);
          const float cv = E::load(c[i]), sv = E::load(s[i]);
          x1[i] = E::store(E::round(a * cv) - E::round(b * sv));
          x2[i] = E::store(E::round(b * cv) + E::round(a * sv));
        }
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool gemma) {
  check_floating(x, "x");
  check_norm_weight(x, weight);
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [rows, width] or [rows, heads, width], got ", x.sizes());
  const int64_t outer = x.size(0), inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t so = x.stride(0), si = x.dim() == 3 ? x.stride(1) : 0;
  auto out = at::empty(x.sizes(), x.options());
  pagedllm::count_run(pagedllm::Kernel::kFusedOps);
  if (x.scalar_type() == at::kFloat)
    rms_norm_kernel<float>(x, weight, out, outer, inner, so, si, float(eps), gemma);
  else
    rms_norm_kernel<at::BFloat16>(x, weight, out, outer, inner, so, si, float(eps), gemma);
  return out;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool gemma) {
  check_floating(x, "x");
  check_floating(residual, "residual");
  check_norm_weight(x, weight);
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must both be [rows, width], got ",
              x.sizes(), " and ", residual.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual must have x's dtype");
  TORCH_CHECK(x.size(0) < 2 || (x.stride(0) >= x.size(1) && residual.stride(0) >= x.size(1)),
              "x and residual must not have overlapping rows");
  pagedllm::count_run(pagedllm::Kernel::kFusedOps);
  if (x.scalar_type() == at::kFloat)
    fused_add_rms_norm_kernel<float>(x, residual, weight, float(eps), gemma);
  else
    fused_add_rms_norm_kernel<at::BFloat16>(x, residual, weight, float(eps), gemma);
}

at::Tensor silu_and_mul(at::Tensor x) { return act_and_mul<Act::silu>(x); }
at::Tensor gelu_tanh_and_mul(at::Tensor x) { return act_and_mul<Act::gelu_tanh>(x); }
at::Tensor gelu_and_mul(at::Tensor x) { return act_and_mul<Act::gelu>(x); }

void rotary_embedding_inplace(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_floating(x, "x");
  check_floating(cos, "cos");
  check_floating(sin, "sin");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim], got ", x.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0),
              "cos and sin must be [tokens, rotary_dim / 2], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(2 * cos.size(1) <= x.size(2), "rotary width ", 2 * cos.size(1), " exceeds head_dim ", x.size(2));
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must have x's dtype");
  // Rotated in place: no two heads may share memory.
  TORCH_CHECK((x.size(1) < 2 || x.stride(1) >= x.size(2)) && (x.size(0) < 2 || x.stride(0) >= x.size(1) * x.stride(1)),
              "x must not have overlapping heads");
  pagedllm::count_run(pagedllm::Kernel::kFusedOps);
  if (x.scalar_type() == at::kFloat)
    rotary_kernel<float>(x, cos, sin);
  else
    rotary_kernel<at::BFloat16>(x, cos, sin);
}
