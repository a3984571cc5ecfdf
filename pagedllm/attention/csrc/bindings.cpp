// The Python module of our CPU kernels (built by pagedllm/attention/cpu_kernels.py).
#include <torch/extension.h>

#include <tuple>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(torch::Tensor logits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("greedy_pick", &greedy_pick, "Per-row argmax and its log-probability (CPU, float32)");
}
