// The Python module of our CPU kernels (built by pagedllm/attention/cpu_kernels.py).
#include <torch/extension.h>

#include <tuple>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(torch::Tensor logits);
torch::Tensor dequantize_rows(torch::Tensor qweight, int64_t format, int64_t k, c10::optional<torch::Tensor> rows);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, int64_t format, int64_t k,
                           c10::optional<torch::Tensor> bias, int64_t small_m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("greedy_pick", &greedy_pick, "Per-row argmax and its log-probability (CPU, float32)");
  m.def("dequantize_rows", &dequantize_rows, "Packed weight rows (all, or the given ones) as float32 (CPU)");
  m.def("quant_linear", &quant_linear, "x @ W^T + bias over a packed weight, activations float32 (CPU)");
}
