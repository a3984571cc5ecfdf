// A step through a stack of Llama-style decoder layers in one call.
//
// The Python layers run ~25 Python-level operations per layer around their kernels (module calls,
// views, splits, dispatch checks): on the default model's 30 layers that was 4-5 ms of a 37 ms
// bfloat16 decode step, and as much of a short prompt's step. This loop calls the same kernels
// with the same arguments in the same order, so its results are bit for bit the Python layers'
// (models/layer_stack.py decides when a model and a step qualify; tests compare the two paths).
//
// Per layer, 12 tensors in `layer_tensors` (an empty tensor: no bias):
//   input_norm_weight, qkv_packed, qkv_bias, o_packed, o_bias, post_norm_weight,
//   gate_up_packed (gated panels: silu(gate) * up), gate_up_bias, down_packed, down_bias, k_cache, v_cache
// Attention follows the step's plan (PagedAttention.cpu_plan), the same for every layer: parts of
// the batch, each rows [begin, end) through one kernel (0 decode, 1 chunked, 2 AMX prompt) with its
// own block_tables, query_start_loc and context_lens (3 tensors per part in `part_tensors`).
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kLayerTensors = 12;
constexpr int64_t kPartTensors = 3;
enum Kernel : int64_t { kDecode = 0, kChunked = 1, kAmx = 2 };

c10::optional<torch::Tensor> bias_or_none(const torch::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

struct Part {
  int64_t kernel, begin, end;
  const torch::Tensor* tensors;  // block_tables, query_start_loc, context_lens
};

torch::Tensor attend(const Part& part, const torch::Tensor& query, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, double scale, int64_t window) {
  const torch::Tensor* t = part.tensors;
  switch (part.kernel) {
    case kDecode: return paged_decode_attention(query, k_cache, v_cache, t[0], t[2], scale, window, 0.0);
    case kAmx: return prompt_attention_amx(query, k_cache, v_cache, t[0], t[1], t[2], scale);
    default: return paged_chunked_attention(query, k_cache, v_cache, t[0], t[1], t[2], scale, window, 0.0);
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> run_layer_stack(
    torch::Tensor hidden, std::vector<torch::Tensor> layer_tensors, std::vector<int64_t> sliding_windows,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping, std::vector<int64_t> part_kernels,
    std::vector<int64_t> part_rows, std::vector<torch::Tensor> part_tensors, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps, double scale) {
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
  std::vector<Part> parts;
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t begin = part_rows[2 * p], end = part_rows[2 * p + 1];
    TORCH_CHECK(0 <= begin && begin <= end && end <= tokens, "attention part rows [", begin, ", ", end,
                ") outside the step's ", tokens, " tokens");
    parts.push_back({part_kernels[p], begin, end, part_tensors.data() + kPartTensors * p});
  }
  const bool whole = num_parts == 1 && parts[0].begin == 0 && parts[0].end == tokens;
  torch::Tensor residual;
  for (int64_t i = 0; i < num_layers; ++i) {
    const torch::Tensor* t = layer_tensors.data() + i * kLayerTensors;
    if (!residual.defined()) {
      residual = hidden;
      hidden = rms_norm(hidden, t[0], eps, false);
    } else {
      fused_add_rms_norm(hidden, residual, t[0], eps, false);
    }
    auto qkv = dense_linear(hidden, t[1], bias_or_none(t[2]), q_size + 2 * kv_size, hidden_size, false);
    // q and k rotated in one go: they are adjacent in the fused output.
    rotary_embedding_inplace(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim}),
                             cos, sin);
    auto query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    auto key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    auto value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    write_kv_cache(key, value, t[10], t[11], slot_mapping);
    torch::Tensor attended;
    if (whole) {
      attended = attend(parts[0], query, t[10], t[11], scale, sliding_windows[i]);
    } else {
      attended = torch::empty({tokens, num_heads, head_dim}, query.options());
      for (const Part& part : parts) {
        attended.narrow(0, part.begin, part.end - part.begin)
            .copy_(attend(part, query.narrow(0, part.begin, part.end - part.begin), t[10], t[11], scale,
                          sliding_windows[i]));
      }
    }
    auto h = dense_linear(attended.reshape({tokens, q_size}), t[3], bias_or_none(t[4]), hidden_size, q_size, false);
    fused_add_rms_norm(h, residual, t[5], eps, false);
    auto activated = dense_linear(h, t[6], bias_or_none(t[7]), 2 * intermediate_size, hidden_size, true);
    hidden = dense_linear(activated, t[8], bias_or_none(t[9]), hidden_size, intermediate_size, false);
  }
  return {hidden, residual};
}
