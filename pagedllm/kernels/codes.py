"""The integer codes the C++ layer loop takes (``stack_codes`` in csrc/kernels.h).

The module exports its own values as ``CODES``; ``check_codes`` compares them with these when a
build loads, so the two sides cannot drift apart unnoticed.
"""

from __future__ import annotations

from types import ModuleType

# The attention kernel of each part of a step's CPU plan.
DECODE_KERNEL, CHUNKED_KERNEL, AMX_KERNEL = 0, 1, 2
# How run_layer_stack multiplies one row segment of a weight.
PANEL, GATED_PANEL, INT8_TILED, QUANT_BLOCKS, FLOAT_ROWS = range(5)
# The kernel applying act(gate) * up after an ungated gate/up product, by its Python name; GPT-OSS's
# experts' clamped SwiGLU by its module's ``activation``.
ACTIVATION_CODES = {"silu_and_mul": 0, "gelu_and_mul": 1, "gelu_tanh_and_mul": 2, "clamped_swiglu": 4}
# A plain MLP's activation (torch's function) by its HF name.
PLAIN_ACTIVATION_CODES = {"silu": 0, "swish": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "gelu_fast": 2,
                          "relu": 3}
# A layer's wiring, its norms' kind, its q/k norms and its MLP (stack_codes in csrc/kernels.h).
PRE_NORM, SANDWICH, POST_NORM, PARALLEL, PARALLEL_SHARED = range(5)
RMS, GEMMA_RMS, LAYER_NORM = range(3)
NO_QK_NORM, QK_HEAD, QK_PROJECTION, QK_HEADS = range(4)
GATED_MLP, PLAIN_MLP, MOE = range(3)
# How a mixture of experts weighs its chosen experts (SparseMoE's routing, and its normalization).
TOPK_SOFTMAX, SOFTMAX_TOPK, SOFTMAX_TOPK_NORMALIZED = range(3)

_EXPECTED = {
    "DECODE_KERNEL": DECODE_KERNEL,
    "CHUNKED_KERNEL": CHUNKED_KERNEL,
    "AMX_KERNEL": AMX_KERNEL,
    "PANEL": PANEL,
    "GATED_PANEL": GATED_PANEL,
    "INT8_TILED": INT8_TILED,
    "QUANT_BLOCKS": QUANT_BLOCKS,
    "FLOAT_ROWS": FLOAT_ROWS,
    "SILU": ACTIVATION_CODES["silu_and_mul"],
    "GELU": ACTIVATION_CODES["gelu_and_mul"],
    "GELU_TANH": ACTIVATION_CODES["gelu_tanh_and_mul"],
    "RELU": PLAIN_ACTIVATION_CODES["relu"],
    "CLAMPED_SWIGLU": ACTIVATION_CODES["clamped_swiglu"],
    "PRE_NORM": PRE_NORM,
    "SANDWICH": SANDWICH,
    "POST_NORM": POST_NORM,
    "PARALLEL": PARALLEL,
    "PARALLEL_SHARED": PARALLEL_SHARED,
    "RMS": RMS,
    "GEMMA_RMS": GEMMA_RMS,
    "LAYER_NORM": LAYER_NORM,
    "NO_QK_NORM": NO_QK_NORM,
    "QK_HEAD": QK_HEAD,
    "QK_PROJECTION": QK_PROJECTION,
    "QK_HEADS": QK_HEADS,
    "GATED_MLP": GATED_MLP,
    "PLAIN_MLP": PLAIN_MLP,
    "MOE": MOE,
    "TOPK_SOFTMAX": TOPK_SOFTMAX,
    "SOFTMAX_TOPK": SOFTMAX_TOPK,
    "SOFTMAX_TOPK_NORMALIZED": SOFTMAX_TOPK_NORMALIZED,
}


def check_codes(module: ModuleType) -> None:
    exported = dict(module.CODES)
    if exported != _EXPECTED:
        raise RuntimeError(f"the CPU kernels' codes {exported} differ from pagedllm/kernels/codes.py's {_EXPECTED}")
