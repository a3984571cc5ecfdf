// Linear layers over weights kept in their quantized blocks (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K /
// Q6_K, and the group-wise int4 and per-channel int8 formats that load-time quantization writes).
//
// y[M, N] = x[M, K] @ W[N, K]^T + bias, W given as rows of packed bytes [N, row_bytes].
//
// Activations stay float32: every weight is decoded to the exact float its format defines
// (scale * quant (+ min)) and multiplied in float, so the result equals F.linear over the
// dequantized weight up to summation order. Two shapes, two loops:
// - few rows (decode steps, M <= small_m): a tile of 4 weight rows is decoded, one K-chunk at a
//   time, into a small float buffer that stays in L1, and every activation row is multiplied
//   against it. Memory traffic is the packed bytes once per step; the decode runs in vector
//   registers (GCC vector extensions: AVX-512, AVX2 or plain SSE by the -march of the build).
// - many rows (prefill): a panel of weight rows is decoded to float32 once and handed to at::mm,
//   whose GEMM is compute-bound at these sizes; the decode is amortised over the M rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

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
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

int64_t block_values(int64_t format) {
  switch (format) {
    case F_Q4_0: case F_Q4_1: case F_Q8_0: return 32;
    case F_Q4_K: case F_Q5_K: case F_Q6_K: return 256;
    case F_I4_G64: return 64;
    case F_I4_G128: return 128;
    case F_I8_ROW: return 16;  // no blocks; 16 keeps chunks vector-sized
  }
  TORCH_CHECK(false, "unknown quantized weight format ", format);
}

int64_t block_bytes(int64_t format) {
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
  }
  TORCH_CHECK(false, "unknown quantized weight format ", format);
}

int64_t row_bytes(int64_t format, int64_t k) {
  if (format == F_I8_ROW) return k + 4;
  return k / block_values(format) * block_bytes(format);
}

typedef float vec16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

inline u8x16 load_u8x16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, 16);
  return v;
}

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Bytes -> floats. GCC lowers __builtin_convertvector(u8x16 -> float x16) element by element,
// so the widening is spelled out: one vpmovzxbd / vpmovsxbd and one vcvtdq2ps per 16 values.
inline vec16 to_float(u8x16 q) {
#if defined(__AVX512F__)
  __m128i v;
  std::memcpy(&v, &q, 16);
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
  vec16 out;
  std::memcpy(&out, &f, 64);
  return out;
#elif defined(__AVX2__)
  __m128i v;
  std::memcpy(&v, &q, 16);
  __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
  vec16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  return __builtin_convertvector(q, vec16);
#endif
}

inline vec16 to_float(i8x16 q) {
#if defined(__AVX512F__)
  __m128i v;
  std::memcpy(&v, &q, 16);
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
  vec16 out;
  std::memcpy(&out, &f, 64);
  return out;
#elif defined(__AVX2__)
  __m128i v;
  std::memcpy(&v, &q, 16);
  __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
  vec16 out;
  std::memcpy(&out, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  return __builtin_convertvector(q, vec16);
#endif
}

// Nibble groups: value = q * d + offset; low nibbles are the group's first half, high the second.
inline void decode_nibbles(const uint8_t* q, int64_t group, float d, float offset, float* out) {
  const int64_t half = group / 2;
  for (int64_t c = 0; c < half; c += 16) {
    const u8x16 v = load_u8x16(q + c);
    store16(out + c, to_float(v & 0xF) * d + offset);
    store16(out + half + c, to_float(v >> 4) * d + offset);
  }
}

inline void k_scale_min(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Decodes values [k0, k1) of one packed row into out (k0, k1 on block boundaries). Vector code
// throughout: one block is a few loads, shifts, conversions and multiplies.
void decode_row(int64_t format, const uint8_t* row, int64_t k, int64_t k0, int64_t k1, float* out) {
  const int64_t bv = block_values(format), bb = block_bytes(format);
  if (format == F_I8_ROW) {
    float scale;
    std::memcpy(&scale, row + k, 4);
    for (int64_t j = k0; j < k1; j += 16) {
      i8x16 q;
      std::memcpy(&q, row + j, 16);
      store16(out + j - k0, to_float(q) * scale);
    }
    return;
  }
  for (int64_t b = k0 / bv; b < k1 / bv; ++b, out += bv) {
    const uint8_t* blk = row + b * bb;
    switch (format) {
      case F_Q4_0: {
        const float d = half_to_float(blk);
        const u8x16 v = load_u8x16(blk + 2);
        store16(out, (to_float(v & 0xF) - 8.f) * d);
        store16(out + 16, (to_float(v >> 4) - 8.f) * d);
        break;
      }
      case F_Q4_1: case F_I4_G64: case F_I4_G128:
        decode_nibbles(blk + 4, bv, half_to_float(blk), half_to_float(blk + 2), out);
        break;
      case F_Q8_0: {
        const float d = half_to_float(blk);
        i8x16 q0, q1;
        std::memcpy(&q0, blk + 2, 16);
        std::memcpy(&q1, blk + 18, 16);
        store16(out, to_float(q0) * d);
        store16(out + 16, to_float(q1) * d);
        break;
      }
      case F_Q4_K: case F_Q5_K: {
        const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        const uint8_t* scales = blk + 4;
        const uint8_t* qh = blk + 16;  // Q5_K only
        const uint8_t* qs = blk + (format == F_Q5_K ? 48 : 16);
        for (int j = 0; j < 4; ++j) {
          int sc1, m1, sc2, m2;
          k_scale_min(2 * j, scales, &sc1, &m1);
          k_scale_min(2 * j + 1, scales, &sc2, &m2);
          const float d1 = d * sc1, o1 = dmin * m1, d2 = d * sc2, o2 = dmin * m2;
          for (int c = 0; c < 32; c += 16) {
            const u8x16 q = load_u8x16(qs + 32 * j + c);
            u8x16 lo = q & 0xF, hi = q >> 4;
            if (format == F_Q5_K) {
              const u8x16 h = load_u8x16(qh + c);
              lo |= ((h >> (2 * j)) & 1) << 4;
              hi |= ((h >> (2 * j + 1)) & 1) << 4;
            }
            store16(out + 64 * j + c, d1 * to_float(lo) - o1);
            store16(out + 64 * j + 32 + c, d2 * to_float(hi) - o2);
          }
        }
        break;
      }
      case F_Q6_K: {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = half_to_float(blk + 208);
        for (int n = 0; n < 2; ++n) {
          const uint8_t* l6 = blk + 64 * n;
          const uint8_t* h6 = blk + 128 + 32 * n;
          const int8_t* s6 = sc + 8 * n;
          float* y = out + 128 * n;
          for (int c = 0; c < 2; ++c) {  // 16 values share a scale
            const u8x16 a = load_u8x16(l6 + 16 * c), b = load_u8x16(l6 + 32 + 16 * c), h = load_u8x16(h6 + 16 * c);
            const u8x16 q1 = (a & 0xF) | ((h & 3) << 4);
            const u8x16 q2 = (b & 0xF) | (((h >> 2) & 3) << 4);
            const u8x16 q3 = (a >> 4) | (((h >> 4) & 3) << 4);
            const u8x16 q4 = (b >> 4) | (((h >> 6) & 3) << 4);
            store16(y + 16 * c, (d * static_cast<float>(s6[c])) * (to_float(q1) - 32.f));
            store16(y + 32 + 16 * c, (d * static_cast<float>(s6[c + 2])) * (to_float(q2) - 32.f));
            store16(y + 64 + 16 * c, (d * static_cast<float>(s6[c + 4])) * (to_float(q3) - 32.f));
            store16(y + 96 + 16 * c, (d * static_cast<float>(s6[c + 6])) * (to_float(q4) - 32.f));
          }
        }
        break;
      }
      default:
        TORCH_CHECK(false, "unknown quantized weight format ", format);
    }
  }
}

void check_weight(const torch::Tensor& qweight, int64_t format, int64_t k) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == torch::kByte && qweight.dim() == 2,
              "packed weight must be a CPU uint8 [N, row_bytes] tensor");
  TORCH_CHECK(k % block_values(format) == 0, "in_features ", k, " is not a multiple of the format's block of ",
              block_values(format));
  TORCH_CHECK(qweight.size(1) == row_bytes(format, k), "packed rows hold ", qweight.size(1), " bytes; ",
              row_bytes(format, k), " expected for ", k, " inputs");
  TORCH_CHECK(qweight.is_contiguous(), "packed weight must be contiguous");
}

inline float hsum(vec16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

constexpr int kTileRows = 4;
// Activation rows per register block: 4 x 4 accumulators need 16 vector registers of 16 floats
// (AVX-512 has 32); with 256-bit vectors each accumulator takes two of the 16 registers.
#ifdef __AVX512F__
constexpr int kBlockM = 4;
#else
constexpr int kBlockM = 2;
#endif

// acc[m][r] += dot over [0, len) of x rows m0.. and decoded weight rows r (MB activation rows).
template <int MB>
inline void tile_block(const float* x, int64_t k, const float* buf, int64_t chunk, int64_t len, vec16* acc) {
  vec16 a[MB][kTileRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r) a[i][r] = acc[i * kTileRows + r];
  for (int64_t j = 0; j < len; j += 16) {
    vec16 w[kTileRows];
    for (int r = 0; r < kTileRows; ++r) w[r] = load16(buf + r * chunk + j);
    for (int i = 0; i < MB; ++i) {
      const vec16 xv = load16(x + i * k + j);
      for (int r = 0; r < kTileRows; ++r) a[i][r] += w[r] * xv;
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r) acc[i * kTileRows + r] = a[i][r];
}

// Few activation rows: per tile of 4 weight rows, decode a K-chunk into L1 and multiply every
// activation row against it; vector accumulators per (activation row, weight row).
void gemm_small_m(const float* x, int64_t m_rows, const uint8_t* w, int64_t n_rows, int64_t k, int64_t format,
                  const float* bias, float* y) {
  const int64_t rb = row_bytes(format, k);
  const int64_t bv = block_values(format);
  const int64_t chunk = std::max<int64_t>(bv, 512 / bv * bv);
  const int64_t n_tiles = (n_rows + kTileRows - 1) / kTileRows;
  at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kTileRows * chunk);
    std::vector<vec16> acc(m_rows * kTileRows);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTileRows;
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n_rows - n0));
      std::fill(acc.begin(), acc.end(), vec16{});
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        const int64_t len = std::min(chunk, k - k0);
        for (int r = 0; r < rows; ++r) decode_row(format, w + (n0 + r) * rb, k, k0, k0 + len, buf.data() + r * chunk);
        for (int r = rows; r < kTileRows; ++r) std::fill_n(buf.data() + r * chunk, len, 0.f);
        int64_t m = 0;
        for (; m + kBlockM <= m_rows; m += kBlockM)
          tile_block<kBlockM>(x + m * k + k0, k, buf.data(), chunk, len, acc.data() + m * kTileRows);
        for (; m < m_rows; ++m) tile_block<1>(x + m * k + k0, k, buf.data(), chunk, len, acc.data() + m * kTileRows);
      }
      for (int64_t m = 0; m < m_rows; ++m) {
        for (int r = 0; r < rows; ++r) {
          float v = hsum(acc[m * kTileRows + r]);
          if (bias != nullptr) v += bias[n0 + r];
          y[m * n_rows + n0 + r] = v;
        }
      }
    }
  });
}

}  // namespace

torch::Tensor dequantize_rows(torch::Tensor qweight, int64_t format, int64_t k, c10::optional<torch::Tensor> rows) {
  check_weight(qweight, format, k);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t rb = qweight.size(1);
  torch::Tensor index;
  if (rows.has_value()) {
    index = rows->to(torch::kLong).contiguous().view({-1});
  }
  const int64_t n = rows.has_value() ? index.numel() : qweight.size(0);
  const int64_t* idx = rows.has_value() ? index.data_ptr<int64_t>() : nullptr;
  auto out = torch::empty({n, k}, torch::dtype(torch::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t total = qweight.size(0);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = idx ? idx[i] : i;
      TORCH_CHECK(r >= 0 && r < total, "row index ", r, " out of range [0, ", total, ")");
      decode_row(format, w + r * rb, k, 0, k, o + i * k);
    }
  });
  return out;
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, int64_t format, int64_t k,
                           c10::optional<torch::Tensor> bias, int64_t small_m) {
  check_weight(qweight, format, k);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  TORCH_CHECK(k % 16 == 0, "in_features must be a multiple of 16");
  auto shape = x.sizes().vec();
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0), n = qweight.size(0);
  shape.back() = n;
  torch::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == n, "bias must have ", n, " elements");
  }
  if (m <= small_m) {
    auto y = torch::empty({m, n}, x2.options());
    gemm_small_m(x2.data_ptr<float>(), m, qweight.data_ptr<uint8_t>(), n, k, format,
                 bias.has_value() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>());
    return y.view(shape);
  }
  // Many rows: decode panels of weight rows (about 2 MiB of float32 each, so they stay in cache
  // for the GEMM) and let at::mm multiply.
  auto y = torch::empty({m, n}, x2.options());
  const int64_t panel = std::max<int64_t>(16, std::min<int64_t>(n, (2 << 20) / (4 * k)) / 16 * 16);
  for (int64_t n0 = 0; n0 < n; n0 += panel) {
    const int64_t rows = std::min(panel, n - n0);
    auto w = dequantize_rows(qweight.narrow(0, n0, rows), format, k, c10::nullopt);
    auto part = at::mm(x2, w.t());
    if (bias.has_value()) part.add_(bias_c.narrow(0, n0, rows));
    y.narrow(1, n0, rows).copy_(part);
  }
  return y.view(shape);
}
