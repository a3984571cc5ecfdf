// The CPU kernels' entry points (each defined in its own .cpp of this folder): the Python
// module's bindings (bindings.cpp) and the layer loop (layer_stack_cpu.cpp) call them.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, double logits_soft_cap);
torch::Tensor paged_chunked_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor query_start_loc,
                                      torch::Tensor context_lens, double scale, int64_t sliding_window,
                                      double logits_soft_cap);
bool prompt_attention_amx_supported(int64_t head_dim);
torch::Tensor prompt_attention_amx(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor query_start_loc,
                                   torch::Tensor context_lens, double scale);
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(torch::Tensor logits);
void apply_token_bitmask_cpu(torch::Tensor logits, torch::Tensor bitmask, std::vector<int64_t> rows);
torch::Tensor dequantize_rows(torch::Tensor qweight, int64_t format, int64_t k, c10::optional<torch::Tensor> rows);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, int64_t format, int64_t k,
                           c10::optional<torch::Tensor> bias, int64_t small_m);
std::string int8_dot_isa();
bool int8_tiling_supported(int64_t format);
torch::Tensor int8_tile_weight(torch::Tensor qweight, int64_t format, int64_t k);
torch::Tensor int8_tiled_rows(torch::Tensor tiled, int64_t format, int64_t n_rows, int64_t k, torch::Tensor rows);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor tiled, int64_t format, int64_t n_rows, int64_t k,
                          c10::optional<torch::Tensor> bias);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool gemma);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool gemma);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor gelu_tanh_and_mul(torch::Tensor x);
torch::Tensor gelu_and_mul(torch::Tensor x);
void rotary_embedding_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
bool dense_gemm_supported(torch::Tensor weight);
torch::Tensor dense_pack_weight(torch::Tensor weight);
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n_dim,
                           int64_t k_dim, bool silu_and_mul);
std::tuple<torch::Tensor, torch::Tensor> run_layer_stack(
    torch::Tensor hidden, std::vector<torch::Tensor> layer_tensors, std::vector<int64_t> linear_specs,
    std::vector<torch::Tensor> linear_tensors, std::vector<int64_t> sliding_windows, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor slot_mapping, std::vector<int64_t> part_kernels, std::vector<int64_t> part_rows,
    std::vector<torch::Tensor> part_tensors, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate_size, int64_t activation, int64_t small_m, double eps, double scale);
