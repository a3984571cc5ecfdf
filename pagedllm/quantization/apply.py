"""Turning a model's layers into packed-weight layers before its weights are loaded.

Runs on the meta-device model (before ``to_empty``), so the float weights these layers would
have had are never allocated: each chosen layer's ``weight`` parameter is replaced by a
``QuantizedWeight`` that the weight loaders fill with packed rows. After loading,
``settle_packed_weights`` turns holders that received only float rows back into plain parameters
(so the float fast paths apply to them) and moves packed rows to the model's device.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.layers.cpu_gemm import PackableLinear
from pagedllm.layers.parallel_layers import VocabParallelEmbedding
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight


def use_packed_weights(
    model: nn.Module,
    dtype: torch.dtype,
    quantizer: Callable[[torch.Tensor], PackedTensor] | None,
    include_embeddings: bool,
) -> int:
    """Give every linear layer (and, if asked, every vocabulary embedding / LM head) a packed weight holder."""
    count = 0
    for module in model.modules():
        is_linear = isinstance(module, PackableLinear)
        if not (is_linear or (include_embeddings and isinstance(module, VocabParallelEmbedding))):
            continue
        rows, cols = module.weight.shape
        del module._parameters["weight"]
        module.weight = QuantizedWeight(rows, cols, dtype, quantizer)
        count += 1
    return count


def settle_packed_weights(model: nn.Module, device: torch.device, int8_activations: bool = False) -> None:
    """Check every holder is complete; float-only holders become parameters again; move to device;
    with ``int8_activations``, re-tile packed rows for the int8 kernels (int8_tiles.py)."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, QuantizedWeight):
            continue
        weight.finish(f"weight of {name}")
        if weight.is_float:
            del module.weight
            module.weight = nn.Parameter(weight.float_weight().to(device=device, dtype=weight.dtype),
                                         requires_grad=False)
        else:
            weight.to(device)
            if int8_activations:
                weight.tile_int8()
                _release_free_memory()
    _release_free_memory()


def packed_weight_bytes(model: nn.Module) -> tuple[int, dict[str, int]]:
    """Bytes of packed weights in the model and how many layers hold each format."""
    total, formats = 0, {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            total += weight.nbytes
            for fmt in weight.formats:
                formats[fmt] = formats.get(fmt, 0) + 1
    return total, formats


def _release_free_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc's malloc_trim). Loading frees a
    packed copy of every tensor it merges or re-tiles; glibc keeps such freed chunks, and the
    process's resident memory would keep them, until told to return them."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


_libc = None
