// The CPU kernels' entry points (each defined in its own .cpp of this folder): the Python
// module's bindings (bindings.cpp) and the layer loop (layer_stack_cpu.cpp) call them.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <functional>
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
                          c10::optional<torch::Tensor> bias, int64_t amx_min_rows);
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
// Writes panel `panel` (outputs 32 panel .. 32 panel + 31, zero past N) of a weight as bfloat16 in
// dense_gemm_cpu.cpp's packed layout, [K / 2][32][2].
using PanelDecoder = std::function<void(int64_t panel, uint16_t* out)>;
// Whether decoded_linear runs here for K inputs (AMX, K a multiple of 32).
bool decoded_gemm_supported(int64_t k_dim);
// float32 y = x W^T (+ bias, float32 [N] or null) with W's bfloat16 panels decoded on demand, each
// once per call, multiplied with x rounded to bfloat16 on AMX tiles.
torch::Tensor decoded_linear(torch::Tensor x, const PanelDecoder& decode, int64_t n_dim, int64_t k_dim,
                             const float* bias);
std::tuple<torch::Tensor, torch::Tensor> run_layer_stack(
    torch::Tensor hidden, std::vector<torch::Tensor> layer_tensors, std::vector<int64_t> linear_specs,
    std::vector<torch::Tensor> linear_tensors, std::vector<int64_t> sliding_windows, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor slot_mapping, std::vector<int64_t> part_kernels, std::vector<int64_t> part_rows,
    std::vector<torch::Tensor> part_tensors, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t intermediate_size, int64_t activation, int64_t small_m, int64_t int8_amx_min_rows, double eps,
    double scale);
