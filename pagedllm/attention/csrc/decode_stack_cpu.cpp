// A decode step through a stack of Llama-style decoder layers in one call.
//
// The Python layers run ~25 Python-level operations per layer around their kernels (module calls,
// views, splits, dispatch checks): on the default model's 30 layers that was 4-5 ms of a 37 ms
// bfloat16 decode step. This loop calls the same kernels with the same arguments in the same
// order, so its results are bit for bit the Python layers' (models/decode_stack.py decides when
// a model and a step qualify, and tests compare the two paths).
//
// Per layer, 12 tensors in `layer_tensors` (an empty tensor: no bias):
//   input_norm_weight, qkv_packed, qkv_bias, o_packed, o_bias, post_norm_weight,
//   gate_up_packed (gated panels: silu(gate) * up), gate_up_bias, down_packed, down_bias, k_cache, v_cache
#include <torch/extension.h>

#include <tuple>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double logits_soft_cap);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool gemma);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool gemma);
void rotary_embedding_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n_dim,
                           int64_t k_dim, bool silu_and_mul);

namespace {

constexpr int64_t kLayerTensors = 12;

c10::optional<torch::Tensor> bias_or_none(const torch::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor hidden, c10::optional<torch::Tensor> residual_in, std::vector<torch::Tensor> layer_tensors,
    std::vector<int64_t> sliding_windows, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate_size, double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(sliding_windows.size());
  TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == num_layers * kLayerTensors, "expected ",
              kLayerTensors, " tensors per layer for ", num_layers, " layers, got ", layer_tensors.size());
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [tokens, hidden_size], got ", hidden.sizes());
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor residual;
  if (residual_in.has_value()) residual = *residual_in;
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
    auto attended = paged_decode_attention(query, t[10], t[11], block_tables, context_lens, scale, sliding_windows[i],
                                           0.0);
    auto h = dense_linear(attended.reshape({tokens, q_size}), t[3], bias_or_none(t[4]), hidden_size, q_size, false);
    fused_add_rms_norm(h, residual, t[5], eps, false);
    auto activated = dense_linear(h, t[6], bias_or_none(t[7]), 2 * intermediate_size, hidden_size, true);
    hidden = dense_linear(activated, t[8], bias_or_none(t[9]), hidden_size, intermediate_size, false);
  }
  return {hidden, residual};
}
