"""A CPU model's packed weights moved, once loaded, into one block of physically contiguous memory.

A CPU step streams every weight from memory (a decode batch reads each weight once per step), so
the speed at which it streams is the speed of the step. Weights packed during loading land on
whatever pages the allocator hands out while loading churns through temporaries, and their
physical pages end up scattered: measured on a 2-core AMX Xeon (a VM), the default model's 30
bfloat16 gate/up weights at 64 rows took 12-15 ms in the pages they were packed into, 10-11 ms
in fresh copies or in huge pages, the physical pages of the copies being in long runs and those
of the originals in runs of a few pages. One mapping in huge pages (pagedllm/kernels/huge_pages.py) holds
every packed weight back to back, so the layout no longer depends on the load's history.

What moves: our panel-packed float weights (linear layers and the LM head) and the row segments of
quantized weights (packed blocks, float rows; int8 tiles only where they were not tiled straight
into one buffer of their own, quantization/int8_tiles.py's TileArena). Plain parameters (norms, biases, a float
embedding looked up by rows) and oneDNN's opaque weights stay. ``PAGEDLLM_HUGE_PAGES=0`` leaves
everything where it was loaded.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.kernels.huge_pages import huge_page_buffer, huge_pages_enabled
from pagedllm.layers.cpu_gemm import PanelWeight
from pagedllm.quantization.mapped_file import release_pages
from pagedllm.quantization.packed import QuantizedWeight

logger = logging.getLogger(__name__)

_ALIGN = 64  # a cache line: what the kernels' vector loads assume at most
_TRIM_EVERY = 64 << 20  # bytes of old copies freed between returns of free memory to the system
# A weight tensor and the function that puts its moved copy in its place.
Slot = tuple[torch.Tensor, Callable[[torch.Tensor], None]]


def move_weights_to_arena(model: nn.Module, placed: Callable[[torch.Tensor], bool] | None = None) -> int:
    """Copy the model's packed CPU weights into one huge-page mapping; returns the bytes moved.
    Weights for which ``placed`` is true (int8 tilings already back to back in their arena) stay."""
    if not huge_pages_enabled():
        return 0
    slots = [slot for slot in _weight_slots(model) if placed is None or not placed(slot[0])]
    if not slots:
        return 0
    sizes = [_aligned(tensor.numel() * tensor.element_size()) for tensor, _ in slots]
    total = sum(sizes)
    arena = huge_page_buffer(total)
    offset = freed = 0
    for i, size in enumerate(sizes):
        tensor, replace = slots[i]
        slots[i] = None  # the old copy goes as soon as it is replaced, not after the last one
        nbytes = tensor.numel() * tensor.element_size()
        moved = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        replace(moved)
        release_pages(tensor)  # a weight used where it lay in a mapped file
        del tensor, replace
        offset += size
        freed += nbytes
        if freed >= _TRIM_EVERY:
            # The arena fills as the old copies empty: the process holds the weights about once.
            _return_freed_memory()
            freed = 0
    del slots
    _return_freed_memory()
    logger.info("CPU weights: %.1f MiB in one huge-page arena", total / 2**20)
    return total


def _return_freed_memory() -> None:
    """Give the pages of the weights' old copies back to the system: glibc keeps freed heap memory
    in the process (the resident size would count both copies) until asked to trim it."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _weight_slots(model: nn.Module) -> list[Slot]:
    """Each packed CPU weight tensor with the function that puts its moved copy in its place."""
    slots: list[Slot] = []
    seen: set[int] = set()

    def add(tensor: torch.Tensor, replace: Callable[[torch.Tensor], None]) -> None:
        if tensor.device.type == "cpu" and tensor.is_contiguous() and id(tensor) not in seen:
            seen.add(id(tensor))
            slots.append((tensor, replace))

    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, PanelWeight):
            add(packed.data, lambda t, p=packed: setattr(p, "data", t))
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            for seg in weight.segments:
                if isinstance(seg.weight, torch.Tensor):
                    add(seg.weight, lambda t, s=seg: setattr(s, "weight", t))
                else:
                    add(seg.weight.data, lambda t, w=seg.weight: setattr(w, "data", t))
    return slots
