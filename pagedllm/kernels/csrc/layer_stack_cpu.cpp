// A step through a stack of Llama-style decoder layers in one call.
//
// The Python layers run ~25 Python-level operations per layer around their kernels (module calls,
// views, splits, dispatch checks): on the default model's 30 layers that was 4-5 ms of a 37 ms
// bfloat16 decode step, and as much of a short prompt's step. This loop calls the same kernels
// with the same arguments in the same order, so its results are bit for bit the Python layers'
// (models/layer_stack.py decides when a model and a step qualify; tests compare the two paths).
//
// Per layer, 5 tensors in `layer_tensors`: input_norm_weight, post_norm_weight, k_cache, v_cache and
// the key offset a quantized cache subtracts (attention/key_offset.py; empty: none).
// Per layer, 4 linear layers in order (qkv, o, gate_up, down), each described in `linear_specs` as
// its number of row segments, then per segment (kind, format, rows); each segment takes 2 tensors
// of `linear_tensors`, its weight and its bias (an empty tensor: no bias). A layer's output is its
// segments' outputs side by side. A gate/up layer that is one gated panel segment applies
// act(gate) * up in its epilogue; otherwise `activation` runs after it.
// Attention follows the step's plan (PagedAttention.cpu_plan), the same for every layer: parts of
// the batch, each rows [begin, end) through one kernel (0 decode, 1 chunked, 2 AMX prompt) with its
// own block_tables, query_start_loc and context_lens (3 tensors per part in `part_tensors`).
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kLayerTensors = 5;
constexpr int64_t kLinearsPerLayer = 4;
constexpr int64_t kPartTensors = 3;
using namespace stack_codes;

c10::optional<at::Tensor> bias_or_none(const at::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

struct Part {
  int64_t kernel, begin, end;
  const at::Tensor* tensors;  // block_tables, query_start_loc, context_lens
};

struct Segment {
  int64_t kind, format, rows;
  const at::Tensor* tensors;  // weight, bias
};

struct Linear {
  std::vector<Segment> segments;
  int64_t in_features;
  bool gated() const { return segments.size() == 1 && segments[0].kind == kGatedPanel; }
};

// Row counts at which the quantized kernels change method (quant_linear's small_m, int8_linear's
// amx_min_rows; small_m < 0 and amx_min_rows 0: one method at every row count).
struct RowThresholds {
  int64_t small_m, int8_amx;
};

at::Tensor segment_product(const Segment& s, const at::Tensor& x, int64_t k, const RowThresholds& rows) {
  const at::Tensor& weight = s.tensors[0];
  auto bias = bias_or_none(s.tensors[1]);
  switch (s.kind) {
    case kPanel: return dense_linear(x, weight, bias, s.rows, k, false);
    case kGatedPanel: return dense_linear(x, weight, bias, s.rows, k, true);
    case kFloatRows: return at::linear(x, weight.to(x.scalar_type()), bias);
    default: break;
  }
  // The quantized kernels take and give float32 activations.
  const bool is_float = x.scalar_type() == at::kFloat;
  auto x32 = is_float ? x : x.to(at::kFloat);
  auto y = s.kind == kInt8Tiled ? int8_linear(x32, weight, s.format, s.rows, k, bias, rows.int8_amx)
                                : quant_linear(x32, weight, s.format, k, bias, rows.small_m);
  return is_float ? y : y.to(x.scalar_type());
}

at::Tensor project(const Linear& linear, const at::Tensor& x, const RowThresholds& rows) {
  if (linear.segments.size() == 1) return segment_product(linear.segments[0], x, linear.in_features, rows);
  std::vector<at::Tensor> outputs;
  for (const Segment& s : linear.segments) outputs.push_back(segment_product(s, x, linear.in_features, rows));
  return at::cat(outputs, -1);
}

at::Tensor activate(int64_t activation, const at::Tensor& gate_up) {
  switch (activation) {
    case kGelu: return gelu_and_mul(gate_up);
    case kGeluTanh: return gelu_tanh_and_mul(gate_up);
    default: return silu_and_mul(gate_up);
  }
}

// The 4 * num_layers linear layers of `specs` / `tensors`, checked against the shapes they must have.
std::vector<Linear> read_linears(const std::vector<int64_t>& specs, const std::vector<at::Tensor>& tensors,
                                 int64_t num_layers, const int64_t (&in_features)[kLinearsPerLayer],
                                 const int64_t (&out_features)[kLinearsPerLayer]) {
  std::vector<Linear> linears;
  size_t at = 0, tensor_at = 0;
  for (int64_t i = 0; i < num_layers * kLinearsPerLayer; ++i) {
    TORCH_CHECK(at < specs.size(), "linear_specs ends before linear layer ", i);
    const int64_t count = specs[at++];
    TORCH_CHECK(count >= 1 && at + 3 * count <= specs.size() && tensor_at + 2 * count <= tensors.size(),
                "linear layer ", i, ": ", count, " segments do not fit linear_specs / linear_tensors");
    Linear linear{{}, in_features[i % kLinearsPerLayer]};
    int64_t rows = 0;
    for (int64_t s = 0; s < count; ++s) {
      const Segment segment{specs[at], specs[at + 1], specs[at + 2], tensors.data() + tensor_at};
      TORCH_CHECK(segment.kind >= kPanel && segment.kind <= kFloatRows, "linear layer ", i, ": unknown kind ",
                  segment.kind);
      linear.segments.push_back(segment);
      rows += segment.rows;
      at += 3;
      tensor_at += 2;
    }
    TORCH_CHECK(rows == out_features[i % kLinearsPerLayer], "linear layer ", i, " has ", rows, " output rows, expected ",
                out_features[i % kLinearsPerLayer]);
    linears.push_back(std::move(linear));
  }
  TORCH_CHECK(at == specs.size() && tensor_at == tensors.size(), "linear_specs / linear_tensors longer than ",
              num_layers, " layers");
  return linears;
}

at::Tensor attend(const Part& part, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, double scale, int64_t window) {
  const at::Tensor* t = part.tensors;
  switch (part.kernel) {
    case kDecode: return paged_decode_attention(query, k_cache, v_cache, t[0], t[2], scale, window, 0.0);
    case kAmx: return prompt_attention_amx(query, k_cache, v_cache, t[0], t[1], t[2], scale);
    default: return paged_chunked_attention(query, k_cache, v_cache, t[0], t[1], t[2], scale, window, 0.0);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> run_layer_stack(
    at::Tensor hidden, std::vector<at::Tensor> layer_tensors, std::vector<int64_t> linear_specs,
    std::vector<at::Tensor> linear_tensors, std::vector<int64_t> sliding_windows, at::Tensor cos,
    at::Tensor sin, at::Tensor slot_mapping, std::vector<int64_t> part_kernels, std::vector<int64_t> part_rows,
    std::vector<at::Tensor> part_tensors, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate_size, int64_t activation, int64_t small_m, int64_t int8_amx_min_rows, double eps,
    double scale) {
  const RowThresholds thresholds{small_m, int8_amx_min_rows};
  const int64_t num_layers = static_cast<int64_t>(sliding_windows.size());
  const int64_t num_parts = static_cast<int64_t>(part_kernels.size());
  TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == num_layers * kLayerTensors, "expected ",
              kLayerTensors, " tensors per layer for ", num_layers, " layers, got ", layer_tensors.size());
  TORCH_CHECK(num_parts >= 1 && static_cast<int64_t>(part_rows.size()) == 2 * num_parts &&
                  static_cast<int64_t>(part_tensors.size()) == kPartTensors * num_parts,
              "each attention part needs a kernel, its rows [begin, end) and ", kPartTensors, " tensors");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [tokens, hidden_size], got ", hidden.sizes());
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t in_features[kLinearsPerLayer] = {hidden_size, q_size, hidden_size, intermediate_size};
  const int64_t out_features[kLinearsPerLayer] = {q_size + 2 * kv_size, hidden_size, 2 * intermediate_size,
                                                  hidden_size};
  const std::vector<Linear> linears = read_linears(linear_specs, linear_tensors, num_layers, in_features, out_features);
  std::vector<Part> parts;
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t begin = part_rows[2 * p], end = part_rows[2 * p + 1];
    TORCH_CHECK(0 <= begin && begin <= end && end <= tokens, "attention part rows [", begin, ", ", end,
                ") outside the step's ", tokens, " tokens");
    parts.push_back({part_kernels[p], begin, end, part_tensors.data() + kPartTensors * p});
  }
  const bool whole = num_parts == 1 && parts[0].begin == 0 && parts[0].end == tokens;
  at::Tensor residual;
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* t = layer_tensors.data() + i * kLayerTensors;
    const at::Tensor &k_cache = t[2], &v_cache = t[3];
    const Linear* linear = linears.data() + i * kLinearsPerLayer;  // qkv, o, gate_up, down
    if (!residual.defined()) {
      residual = hidden;
      hidden = rms_norm(hidden, t[0], eps, false);
    } else {
      fused_add_rms_norm(hidden, residual, t[0], eps, false);
    }
    auto qkv = project(linear[0], hidden, thresholds);
    // q and k rotated in one go: they are adjacent in the fused output.
    rotary_embedding_inplace(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim}),
                             cos, sin);
    auto query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    auto key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    auto value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping,
                   t[4].numel() ? c10::optional<at::Tensor>(t[4]) : c10::nullopt);
    at::Tensor attended;
    if (whole) {
      attended = attend(parts[0], query, k_cache, v_cache, scale, sliding_windows[i]);
    } else {
      attended = at::empty({tokens, num_heads, head_dim}, query.options());
      for (const Part& part : parts) {
        attended.narrow(0, part.begin, part.end - part.begin)
            .copy_(attend(part, query.narrow(0, part.begin, part.end - part.begin), k_cache, v_cache, scale,
                          sliding_windows[i]));
      }
    }
    auto h = project(linear[1], attended.reshape({tokens, q_size}), thresholds);
    fused_add_rms_norm(h, residual, t[1], eps, false);
    auto activated = project(linear[2], h, thresholds);
    if (!linear[2].gated()) activated = activate(activation, activated);
    hidden = project(linear[3], activated, thresholds);
  }
  return {hidden, residual};
}
