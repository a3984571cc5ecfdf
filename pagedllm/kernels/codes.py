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
# The kernel applying act(gate) * up after an ungated gate/up product, by its Python name.
ACTIVATION_CODES = {"silu_and_mul": 0, "gelu_and_mul": 1, "gelu_tanh_and_mul": 2}

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
}


def check_codes(module: ModuleType) -> None:
    exported = dict(module.CODES)
    if exported != _EXPECTED:
        raise RuntimeError(f"the CPU kernels' codes {exported} differ from pagedllm/kernels/codes.py's {_EXPECTED}")
