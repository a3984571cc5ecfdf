// Linear layers over weights kept in their quantized blocks (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K /
// Q6_K, and the group-wise int4 and per-channel int8 formats that load-time quantization writes).
//
// y[M, N] = x[M, K] @ W[N, K]^T + bias, W given as rows of packed bytes [N, row_bytes].
//
// Activations stay float32: every weight is decoded to the exact float its format defines
// (scale * quant (+ min)) and multiplied in float, so the result equals F.linear over the
// dequantized weight up to summation order. Two shapes, two loops:
// - 1..4 rows (one to four decoding streams): every weight row is decoded in vector registers and
//   multiplied into per-row accumulators at once (memory traffic: the packed bytes, once).
// - up to small_m rows (decode steps of a batch): a tile of 4 weight rows is decoded, one K-chunk
//   at a time, into a small float buffer that stays in L1, and every activation row is multiplied
//   against it, 4 x 4 accumulators at a time.
// Vector code throughout (GCC vector extensions: AVX-512, AVX2 or SSE by the -march of the build).
// - many rows (prefill): a panel of weight rows is decoded to float32 once and handed to at::mm,
//   whose GEMM is compute-bound at these sizes; the decode is amortised over the M rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_formats.h"
#include "branches.h"

namespace {

using namespace pagedllm_quant;

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

// Decode-step shapes (1..4 activation rows): each weight row's blocks are decoded in registers and
// multiplied straight into one accumulator per activation row; nothing is stored in between.
template <int MB>
void gemv_rows(const float* x, int64_t k, const uint8_t* w, int64_t n_rows, int64_t format, const float* bias,
               float* y) {
  const int64_t rb = row_bytes(format, k);
  at::parallel_for(0, n_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      // The rows stream from memory once per step: ask for the row after next while this one is
      // decoded, so the loads overlap the arithmetic instead of stalling it.
      if (n + 2 < end) {
        const uint8_t* ahead = w + (n + 2) * rb;
        for (int64_t line = 0; line < rb; line += 64) __builtin_prefetch(ahead + line, 0, 3);
      }
      // Each call site of the decoder feeds its own accumulator set (the slot): one chain of
      // dependent FMAs would wait out the FMA latency every 16 values.
      vec16 acc[4][MB] = {};
      visit_row(format, w + n * rb, k, 0, k, [&](int64_t at, vec16 v, auto slot) {
        for (int i = 0; i < MB; ++i) acc[decltype(slot)::value][i] += v * load16(x + i * k + at);
      });
      for (int i = 0; i < MB; ++i) {
        y[i * n_rows + n] = hsum((acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i])) + (bias != nullptr ? bias[n] : 0.f);
      }
    }
  });
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

at::Tensor dequantize_rows(at::Tensor qweight, int64_t format, int64_t k, c10::optional<at::Tensor> rows) {
  check_weight(qweight, format, k);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const int64_t rb = qweight.size(1);
  at::Tensor index;
  if (rows.has_value()) {
    index = rows->to(at::kLong).contiguous().view({-1});
  }
  const int64_t n = rows.has_value() ? index.numel() : qweight.size(0);
  const int64_t* idx = rows.has_value() ? index.data_ptr<int64_t>() : nullptr;
  auto out = at::empty({n, k}, at::dtype(at::kFloat));
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

at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, int64_t format, int64_t k,
                           c10::optional<at::Tensor> bias, int64_t small_m) {
  check_weight(qweight, format, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == k, "x must be float32 [..., ", k, "]");
  TORCH_CHECK(k % 16 == 0, "in_features must be a multiple of 16");
  pagedllm::count_run(pagedllm::Kernel::kQuantLinear);
  auto shape = x.sizes().vec();
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0), n = qweight.size(0);
  shape.back() = n;
  at::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_c.numel() == n, "bias must have ", n, " elements");
  }
  const float* bias_p = bias.has_value() ? bias_c.data_ptr<float>() : nullptr;
  // small_m < 0: every row count through gemm_small_m, whose per-row sums (one accumulator per
  // activation row and weight row, inputs in order) do not depend on how many rows there are;
  // the kernels below differ from it and from each other in summation order.
  if (small_m < 0) {
    auto y = at::empty({m, n}, x2.options());
    if (m > 0) gemm_small_m(x2.data_ptr<float>(), m, qweight.data_ptr<uint8_t>(), n, k, format, bias_p, y.data_ptr<float>());
    return y.view(shape);
  }
  if (m <= 4) {
    auto y = at::empty({m, n}, x2.options());
    const float* xp = x2.data_ptr<float>();
    const uint8_t* wp = qweight.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    switch (m) {
      case 1: gemv_rows<1>(xp, k, wp, n, format, bias_p, yp); break;
      case 2: gemv_rows<2>(xp, k, wp, n, format, bias_p, yp); break;
      case 3: gemv_rows<3>(xp, k, wp, n, format, bias_p, yp); break;
      default: gemv_rows<4>(xp, k, wp, n, format, bias_p, yp); break;
    }
    return y.view(shape);
  }
  if (m <= small_m) {
    auto y = at::empty({m, n}, x2.options());
    gemm_small_m(x2.data_ptr<float>(), m, qweight.data_ptr<uint8_t>(), n, k, format,
                 bias.has_value() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>());
    return y.view(shape);
  }
  // Many rows: decode panels of weight rows (about 2 MiB of float32 each, so they stay in cache
  // for the GEMM) and let at::mm multiply.
  auto y = at::empty({m, n}, x2.options());
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
