"""Matrix products and row lookups over packed weights: the C++ CPU kernels, or the torch reference.

The C++ path (``kernels/csrc/quant_linear_cpu.cpp``) decodes blocks in vector registers and
multiplies in float32; the reference dequantizes with torch ops and calls ``F.linear``. Both give
the product with the dequantized weight (float32 activations; up to summation order), so greedy
output equals the dequantized float model's. The reference runs on every device (CUDA included)
and wherever the C++ kernels are missing, dequantizing a panel of rows at a time so that no
float copy of a whole large weight exists at once.

``quant_kernel="torch"`` (``PAGEDLLM_QUANT_KERNEL=torch``) forces the reference (for comparisons).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_kernels, kernel_config
from pagedllm.kernels.invariance import batch_invariant
from pagedllm.quantization.formats import CPU_KERNEL_FORMAT_IDS, Format, dequantize

# Up to this many activation rows the float C++ kernel decodes weight tiles per step in L1; beyond it,
# it decodes panels of rows once and hands them to at::mm (prefill).
SMALL_M = 48


def small_m() -> int:
    """quant_linear's row threshold: SMALL_M, or -1 under batch invariance (one summation order at
    every row count, see kernels/invariance.py)."""
    return -1 if batch_invariant() else SMALL_M

# Rows of a weight dequantized at once by the reference path (bounds its temporary memory).
_REFERENCE_PANEL_ELEMENTS = 1 << 22


def cpu_kernels_serve(device: torch.device, in_features: int, fmt: Format) -> bool:
    """Whether the C++ kernels multiply packed rows of ``fmt`` with ``in_features`` inputs here (else
    the torch reference). A format outside ``CPU_KERNEL_FORMAT_IDS`` is never handed to them: they
    would refuse its id."""
    if device.type != "cpu" or in_features % 16 or kernel_config().quant_kernel == "torch":
        return False
    return fmt.id in CPU_KERNEL_FORMAT_IDS and cpu_kernels() is not None


def _cpu_module(x: torch.Tensor, in_features: int, fmt: Format):
    return cpu_kernels() if cpu_kernels_serve(x.device, in_features, fmt) else None


def packed_linear(x: torch.Tensor, data: torch.Tensor, fmt: Format, in_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for a packed ``W`` (``data``: uint8 ``[out_features, row_bytes]``), in x's dtype."""
    module = _cpu_module(x, in_features, fmt)
    if module is not None:
        x32 = x if x.dtype == torch.float32 else x.float()
        y = module.quant_linear(x32, data, fmt.id, in_features, bias, small_m())
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    rows = data.shape[0]
    panel = max(1, _REFERENCE_PANEL_ELEMENTS // max(1, in_features))
    if rows <= panel:
        return F.linear(x, dequantize(data, fmt, in_features).to(x.dtype), bias)
    parts = []
    for start in range(0, rows, panel):
        w = dequantize(data[start:start + panel], fmt, in_features).to(x.dtype)
        parts.append(F.linear(x, w, None if bias is None else bias[start:start + panel]))
    return torch.cat(parts, dim=-1)


def packed_embedding(ids: torch.Tensor, data: torch.Tensor, fmt: Format, in_features: int) -> torch.Tensor:
    """float32 rows ``ids`` of a packed weight: only those rows are dequantized."""
    module = _cpu_module(ids, in_features, fmt)
    flat = ids.reshape(-1)
    if module is not None:
        out = module.dequantize_rows(data, fmt.id, in_features, flat)
    else:
        out = dequantize(data.index_select(0, flat), fmt, in_features)
    return out.view(*ids.shape, in_features)
