// The Python module of our CPU kernels, one build per instruction-set level (pagedllm/kernels/build.py
// compiles it with -DPAGEDLLM_ISA=<level> and that level's flags).
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "branches.h"
#include "kernels.h"

#ifndef PAGEDLLM_ISA
#error "PAGEDLLM_ISA names the instruction-set level of the build (see pagedllm/kernels/isa.py)"
#endif
#define PAGEDLLM_STRING(x) #x
#define PAGEDLLM_EXPAND_STRING(x) PAGEDLLM_STRING(x)

// The kernels that run for a while release the GIL: in the server the engine steps on a thread of
// its own, and the event loop (HTTP, streaming) must not wait for a GEMM to reach its next bytecode.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = PAGEDLLM_EXPAND_STRING(PAGEDLLM_ISA);
  {
    using namespace stack_codes;
    pybind11::dict codes;
    codes["DECODE_KERNEL"] = int64_t(kDecode);
    codes["CHUNKED_KERNEL"] = int64_t(kChunked);
    codes["AMX_KERNEL"] = int64_t(kAmx);
    codes["PANEL"] = int64_t(kPanel);
    codes["GATED_PANEL"] = int64_t(kGatedPanel);
    codes["INT8_TILED"] = int64_t(kInt8Tiled);
    codes["QUANT_BLOCKS"] = int64_t(kQuantBlocks);
    codes["FLOAT_ROWS"] = int64_t(kFloatRows);
    codes["SILU"] = int64_t(kSilu);
    codes["GELU"] = int64_t(kGelu);
    codes["GELU_TANH"] = int64_t(kGeluTanh);
    codes["RELU"] = int64_t(kRelu);
    codes["CLAMPED_SWIGLU"] = int64_t(kClampedSwiglu);
    codes["PRE_NORM"] = int64_t(kPreNorm);
    codes["SANDWICH"] = int64_t(kSandwich);
    codes["POST_NORM"] = int64_t(kPostNorm);
    codes["PARALLEL"] = int64_t(kParallel);
    codes["PARALLEL_SHARED"] = int64_t(kParallelShared);
    codes["RMS"] = int64_t(kRms);
    codes["GEMMA_RMS"] = int64_t(kGemmaRms);
    codes["LAYER_NORM"] = int64_t(kLayerNorm);
    codes["NO_QK_NORM"] = int64_t(kNoQkNorm);
    codes["QK_HEAD"] = int64_t(kQkHead);
    codes["QK_PROJECTION"] = int64_t(kQkProjection);
    codes["QK_HEADS"] = int64_t(kQkHeads);
    codes["GATED_MLP"] = int64_t(kGatedMlp);
    codes["PLAIN_MLP"] = int64_t(kPlainMlp);
    codes["MOE"] = int64_t(kMoe);
    codes["TOPK_SOFTMAX"] = int64_t(kTopkSoftmax);
    codes["SOFTMAX_TOPK"] = int64_t(kSoftmaxTopk);
    codes["SOFTMAX_TOPK_NORMALIZED"] = int64_t(kSoftmaxTopkNormalized);
    m.attr("CODES") = codes;
  }
  m.def("kernel_branches", &kernel_branches,
        "Per kernel: (the branch this build compiled, its calls since the module loaded)");
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", ReleaseGil());
  m.def("paged_chunked_attention", &paged_chunked_attention,
        "Paged attention over decodes and prompt chunks, causal, blocks read in place (CPU)", ReleaseGil());
  m.def("prompt_attention_amx_supported", &prompt_attention_amx_supported,
        "Whether prompt_attention_amx runs here for this head_dim (AMX, head_dim a multiple of 64)");
  m.def("prompt_attention_amx", &prompt_attention_amx,
        "Causal attention of prompt chunks over their cached context and themselves, bfloat16 on AMX tiles (CPU)",
        ReleaseGil());
  m.def("write_kv_cache", &write_kv_cache, "This step's keys and values into their cache slots (CPU)");
  m.def("greedy_pick", &greedy_pick, "Per-row argmax and its log-probability (CPU, float32 or bfloat16)",
        ReleaseGil());
  m.def("apply_token_bitmask", &apply_token_bitmask_cpu, "Forbid the tokens a grammar bitmask leaves out (CPU)");
  m.def("dequantize_rows", &dequantize_rows, "Packed weight rows (all, or the given ones) as float32 (CPU)");
  m.def("quant_linear", &quant_linear, "x @ W^T + bias over a packed weight, activations float32 (CPU)",
        ReleaseGil());
  m.def("int8_dot_isa", &int8_dot_isa, "The integer dot product the int8 kernels were built with");
  m.def("int8_tiling_supported", &int8_tiling_supported, "Whether a packed format can be int8-tiled here");
  m.def("int8_tiling_exact", &int8_tiling_exact, "Whether the int8 tiling holds a packed weight exactly");
  m.def("int8_tiled_bytes", &int8_tiled_bytes, "Bytes of the int8 tiling of an [n, k] weight");
  m.def("int8_tile_weight", &int8_tile_weight,
        "A packed weight re-tiled for int8 dot products, into out where given (else a new tensor) (CPU)");
  m.def("int8_tiled_rows", &int8_tiled_rows, "Rows of an int8-tiled weight as float32 (CPU)");
  m.def("int8_linear", &int8_linear,
        "int8(x) @ W^T + bias over an int8-tiled weight; from amx_min_rows rows on (0: never), on AMX, "
        "bfloat16(x) @ bfloat16(W)^T + bias (CPU)", ReleaseGil());
  m.def("decoded_gemm_supported", &decoded_gemm_supported,
        "Whether products over bfloat16-decoded weight panels run on AMX here for this many inputs");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row into a new tensor (gemma: scale by 1 + weight) (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "In place: residual += x, then x = RMSNorm(residual) (gemma: scale by 1 + weight) (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "[T, 2I] -> silu(gate) * up, [T, I] (CPU)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "[T, 2I] -> gelu_tanh(gate) * up, [T, I] (CPU)");
  m.def("gelu_and_mul", &gelu_and_mul, "[T, 2I] -> gelu(gate) * up, [T, I] (CPU)");
  m.def("rotary_embedding_inplace", &rotary_embedding_inplace,
        "Rotate-half rotary embedding of x [T, H, D] in place by cos, sin [T, rotary_dim / 2] (CPU)");
  m.def("dense_gemm_supported", &dense_gemm_supported, "Whether weights of this dtype can be panel-packed here");
  m.def("dense_pack_weight", &dense_pack_weight, "An [N, K] float32 / bfloat16 weight packed in column panels (CPU)");
  m.def("dense_linear", &dense_linear, "x @ W^T + bias over a panel-packed weight of N rows, K inputs; silu_and_mul: a gated weight (each "
        "panel 16 gate rows, then the 16 up rows of the same outputs), silu(gate) * up returned, N / 2 wide (CPU)", ReleaseGil());
  m.def("run_layer_stack", &run_layer_stack,
        "A step through decoder layers described by their programs (codes, scalars, norms, caches and linear "
        "segments per layer), attention by the step's plan, the Python layers' kernels in their order; returns "
        "(hidden, residual or None) before the final norm (CPU)",
        ReleaseGil());
}
