"""Packed weights re-tiled for int8 activations (integer dot products), and when to use them.

With ``int8_activations`` a linear layer quantizes its input to int8 per block of 32 (one float
scale per block, round to nearest), and multiplies it with the weight's own integer quants in
integer dot-product instructions, as llama.cpp does; the weight is re-tiled once at load time
into panels of 16 output rows (``kernels/csrc/quant_int8_cpu.cpp`` documents the layout) at the
same bits per weight as its format, replacing the packed rows (no second copy). This is several
times fewer instructions per weight than decoding to float, and the batch of a step shares every
unpacked weight. Quantizing activations changes results slightly: the greedy output is no longer
token-for-token the dequantized model's (``benchmarks/int8_activations.py`` measures perplexity
and greedy agreement); ``int8_activations=False`` keeps the exact float-activation kernels.

With batch invariance off (``kernels/invariance.py``), from ``int8_amx_min_rows`` rows of
activations on (``PAGEDLLM_INT8_AMX_MIN_ROWS``, default 32: a prompt, a large decode batch), on a
CPU with AMX, the kernel decodes each 16-row panel of the tiling to bfloat16 once per call and
multiplies it with the activations rounded to bfloat16 on AMX tiles instead: with that many rows per
weight the product is bound by arithmetic, and AMX's tiles do it several times faster than integer
dot products do (on a 2-core AMX machine they led from 16-32 rows on for the default model's
shapes, and by 2-3x from 64). bfloat16 keeps 8 bits of every activation where int8 blocks keep 7
of the block's largest, so this is no less exact; but which a row gets then depends on its step's
row count, so batch invariance keeps int8 at every row count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels.invariance import int8_amx_min_rows
from pagedllm.quantization.formats import Format

# Output rows per panel of the tiling (kPanel in the kernels): a weight's tiling is its panels in
# row order, so the tilings of parts of whole panels, one after another, are the whole's.
PANEL_ROWS = 16


@dataclass(slots=True)
class Int8TiledTensor:
    """A packed weight ``[rows, in_features]`` of ``fmt`` re-tiled for int8 dot products."""

    data: torch.Tensor  # uint8 [ceil(rows / 16), panel_bytes]
    fmt: Format
    rows: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        y = cpu_kernels().int8_linear(x32, self.data, self.fmt.id, self.rows, self.in_features, bias,
                                      int8_amx_min_rows())
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``ids`` (an embedding lookup)."""
        flat = ids.reshape(-1)
        out = cpu_kernels().int8_tiled_rows(self.data, self.fmt.id, self.rows, self.in_features, flat)
        return out.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.take_rows(torch.arange(self.rows))


def int8_tiling_reason(device: torch.device) -> str | None:
    """Why int8 activations cannot run here (None: they can)."""
    if device.type != "cpu":
        return f"int8 activations run on the CPU kernels only (the model is on {device})"
    module = cpu_kernels()
    if module is None:
        return "int8 activations need the C++ CPU kernels, which are not available here"
    if module.int8_dot_isa() == "portable":
        return f"the {module.ISA} kernels have no integer dot product (AVX2 or VNNI) for int8 activations"
    return None


def resolve_int8_activations(requested: bool | None, device: torch.device) -> bool:
    """``None`` (auto): on wherever the kernels can run; ``True``: on, or a clear error; ``False``: off."""
    if requested is False:
        return False
    reason = int8_tiling_reason(device)
    if reason is not None and requested:
        raise ValueError(f"int8_activations=True: {reason}.")
    return reason is None


_ALIGN = 64  # a cache line: what the kernels' vector loads assume at most


class TileArena:
    """One buffer that int8 tilings are written into, one after another, as they are made.

    The tilings are the weights' final place: the weight arena (models/weight_arena.py) does not copy
    them again, and parts tiled one after another lie back to back, so joining them is a view
    (apply._joined). Loading Qwen3-4B Q4_K_M on a 2-core AVX2 VM took 12-15 s with the tilings
    copied into the huge-page weight arena (6.6-7.2 s of it the copy), 12-13 s with them tiled into
    huge pages directly (the first writes to 2.7 GB of fresh huge pages cost ~5 s there), and
    7.6-7.7 s into this buffer of ordinary pages, with decode speed the same within the run's noise
    (6.4-7.1 tok/s each way). Pages past the last tiling are never touched, so never resident."""

    def __init__(self, capacity: int) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.buffer.numel():
            return None
        self.used = start + nbytes
        return self.buffer[start:start + nbytes]

    def holds(self, tensor: torch.Tensor) -> bool:
        begin = self.buffer.data_ptr()
        return begin <= tensor.data_ptr() < begin + self.buffer.numel()


_arena: TileArena | None = None


@contextlib.contextmanager
def tiling_into(arena: TileArena | None) -> Iterator[None]:
    """Within the block, ``tile_for_int8`` writes its tilings into ``arena`` (None: new tensors)."""
    global _arena
    previous, _arena = _arena, arena
    try:
        yield
    finally:
        _arena = previous


def _tileable(fmt: Format, in_features: int) -> bool:
    """Whether this CPU's kernels tile ``fmt`` at this width (MXFP4 also needs int8_tiling_exact)."""
    return in_features % 32 == 0 and cpu_kernels().int8_tiling_supported(fmt.id)


def tiled_bytes(fmt: Format, rows: int, in_features: int) -> int | None:
    """Room a TileArena needs for the int8 tiling of a ``[rows, in_features]`` weight (its bytes and
    the alignment before it), None where it is not tiled here."""
    if not _tileable(fmt, in_features):
        return None
    return cpu_kernels().int8_tiled_bytes(fmt.id, rows, in_features) + _ALIGN


def tile_for_int8(data: torch.Tensor, fmt: Format, in_features: int) -> Int8TiledTensor | None:
    """The int8 tiling of packed rows, or None where this format / shape cannot be tiled on this CPU."""
    module = cpu_kernels()
    if not _tileable(fmt, in_features):
        return None
    if not module.int8_tiling_exact(data, fmt.id, in_features):  # an MXFP4 scale no fp16 holds
        return None
    rows = data.shape[0]
    out = _arena.take(module.int8_tiled_bytes(fmt.id, rows, in_features)) if _arena is not None else None
    return Int8TiledTensor(module.int8_tile_weight(data, fmt.id, in_features, out), fmt, rows, in_features)
