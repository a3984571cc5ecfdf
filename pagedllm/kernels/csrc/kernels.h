// The CPU kernels' entry points (each defined in its own .cpp of this folder): the Python
// module's bindings (bindings.cpp) and the layer loop (layer_stack_cpu.cpp) call them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

// The integer codes run_layer_stack takes. bindings.cpp exports them as the module's CODES, and
// pagedllm/kernels/codes.py checks its names against them when the module loads.
namespace stack_codes {
// The attention kernel of a part of the step (PagedAttention.cpu_plan).
enum AttentionKernel : int64_t { kDecode = 0, kChunked = 1, kAmx = 2 };
// How a segment multiplies: our packed panels (plain, or gated with silu(gate) * up fused), int8
// tiles (int8_linear), packed quantized blocks (quant_linear), or float rows (torch's linear).
enum LinearKind : int64_t { kPanel = 0, kGatedPanel = 1, kInt8Tiled = 2, kQuantBlocks = 3, kFloatRows = 4 };
// The activation of the MLP: act(gate) * up after an ungated gate/up product, or act(x) in a plain
// MLP (relu: plain MLPs only); GPT-OSS's clamped SwiGLU (experts only).
enum Activation : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kClampedSwiglu = 4 };
// How a layer's blocks are wired (models/decoder_layer.py's DecoderLayer.forward): norms before
// each block (Llama), Gemma's sandwich, OLMo 2's norms after each block, GPT-NeoX's parallel
// attention and MLP with two input norms or (Phi, Cohere) one.
enum Block : int64_t { kPreNorm = 0, kSandwich = 1, kPostNorm = 2, kParallel = 3, kParallelShared = 4 };
// A norm: RMSNorm, Gemma's (1 + weight) RMSNorm, LayerNorm (its bias optional).
enum NormKind : int64_t { kRms = 0, kGemmaRms = 1, kLayerNorm = 2 };
// The q/k norms: none; one norm over each head; one over the whole projection (OLMo 2); a
// bias-free LayerNorm per head with a weight per head (StableLM, Cohere).
enum QkNorm : int64_t { kNoQkNorm = 0, kQkHead = 1, kQkProjection = 2, kQkHeads = 3 };
// The feed-forward block: a gated MLP, a plain one, or a sparse mixture of gated experts.
enum Mlp : int64_t { kGatedMlp = 0, kPlainMlp = 1, kMoe = 2 };
// How a mixture of experts weighs its chosen experts (models/moe.py SparseMoE): a softmax over the
// top k logits (GPT-OSS); the top k of a softmax over all, as they are or renormalized to sum to one.
enum Routing : int64_t { kTopkSoftmax = 0, kSoftmaxTopk = 1, kSoftmaxTopkNormalized = 2 };
}  // namespace stack_codes

// The attention kernels' `sinks`: float32 [Hq] sink logits (GPT-OSS), or an empty tensor for none.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens, double scale,
                                     int64_t sliding_window, double logits_soft_cap, at::Tensor sinks);
at::Tensor paged_chunked_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_tables, at::Tensor query_start_loc,
                                      at::Tensor context_lens, double scale, int64_t sliding_window,
                                      double logits_soft_cap, at::Tensor sinks);
bool prompt_attention_amx_supported(int64_t head_dim);
at::Tensor prompt_attention_amx(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                   at::Tensor block_tables, at::Tensor query_start_loc,
                                   at::Tensor context_lens, double scale, at::Tensor sinks);
std::tuple<at::Tensor, at::Tensor> greedy_pick(at::Tensor logits);
void apply_token_bitmask_cpu(at::Tensor logits, at::Tensor bitmask, std::vector<int64_t> rows);
at::Tensor dequantize_rows(at::Tensor qweight, int64_t format, int64_t k, c10::optional<at::Tensor> rows);
at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, int64_t format, int64_t k,
                           c10::optional<at::Tensor> bias, int64_t small_m);  // small_m < 0: one order for any rows
std::string int8_dot_isa();
bool int8_tiling_supported(int64_t format);
bool int8_tiling_exact(at::Tensor qweight, int64_t format, int64_t k);
int64_t int8_tiled_bytes(int64_t format, int64_t n, int64_t k);
at::Tensor int8_tile_weight(at::Tensor qweight, int64_t format, int64_t k, c10::optional<at::Tensor> out);
at::Tensor int8_tiled_rows(at::Tensor tiled, int64_t format, int64_t n_rows, int64_t k, at::Tensor rows);
at::Tensor int8_linear(at::Tensor x, at::Tensor tiled, int64_t format, int64_t n_rows, int64_t k,
                          c10::optional<at::Tensor> bias, int64_t amx_min_rows);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_mapping, c10::optional<at::Tensor> key_offset);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool gemma);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps, bool gemma);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gelu_tanh_and_mul(at::Tensor x);
at::Tensor gelu_and_mul(at::Tensor x);
void rotary_embedding_inplace(at::Tensor x, at::Tensor cos, at::Tensor sin);
bool dense_gemm_supported(at::Tensor weight);
at::Tensor dense_pack_weight(at::Tensor weight);
at::Tensor dense_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n_dim,
                           int64_t k_dim, bool silu_and_mul);
// Writes panel `panel` (outputs 32 panel .. 32 panel + 31, zero past N) of a weight as bfloat16 in
// dense_gemm_cpu.cpp's packed layout, [K / 2][32][2].
using PanelDecoder = std::function<void(int64_t panel, uint16_t* out)>;
// Whether decoded_linear runs here for K inputs (AMX, K a multiple of 32).
bool decoded_gemm_supported(int64_t k_dim);
// float32 y = x W^T (+ bias, float32 [N] or null) with W's bfloat16 panels decoded on demand, each
// once per call, multiplied with x rounded to bfloat16 on AMX tiles.
at::Tensor decoded_linear(at::Tensor x, const PanelDecoder& decode, int64_t n_dim, int64_t k_dim,
                             const float* bias);
std::tuple<at::Tensor, at::Tensor> run_layer_stack(
    at::Tensor hidden, std::vector<at::Tensor> layer_tensors, std::vector<int64_t> layer_codes,
    std::vector<double> layer_scalars, std::vector<int64_t> linear_specs, std::vector<at::Tensor> linear_tensors,
    std::vector<at::Tensor> ropes, at::Tensor slot_mapping, std::vector<int64_t> part_kernels,
    std::vector<int64_t> part_rows, std::vector<at::Tensor> part_tensors, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate_size, int64_t small_m, int64_t int8_amx_min_rows, double eps,
    double scale);
