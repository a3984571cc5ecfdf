"""Turning a model's layers into packed-weight layers before its weights are loaded.

Runs on the meta-device model (before ``to_empty``), so the float weights these layers would
have had are never allocated: each chosen layer's ``weight`` parameter is replaced by a
``QuantizedWeight`` that the weight loaders fill with packed rows. After loading,
``settle_packed_weights`` turns holders that received only float rows back into plain parameters
(so the float fast paths apply to them) and moves packed rows to the model's device.

With int8 activations each loaded part (q, k and v; gate and up) is re-tiled on its own, straight
from the rows the loader gave (a GGUF file's mapped blocks), rather than first joined into one
packed copy and then tiled: 16-row panels never straddle parts whose rows are a multiple of 16, so
the parts' tilings one after another are the joined weight's tiling byte for byte.
``merge_tiled_segments`` then makes them one tiled weight again, as a view where they lie back to
back (tiled one after another into ``int8_tile_arena``, or placed so by the weight arena), else as
one copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.layers.cpu_gemm import PackableLinear
from pagedllm.layers.parallel_layers import VocabParallelEmbedding
from pagedllm.quantization.int8_tiles import PANEL_ROWS as _PANEL_ROWS
from pagedllm.quantization.int8_tiles import Int8TiledTensor, TileArena, tile_for_int8, tiled_bytes
from pagedllm.quantization.mapped_file import release_pages
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


def int8_tile_arena(model: nn.Module, device: torch.device, int8_activations: bool) -> TileArena | None:
    """An arena with room for the int8 tilings of every packed part of the model (its parts' sizes
    bound a joined weight's), or None where nothing is tiled."""
    if not (int8_activations and device.type == "cpu"):
        return None
    capacity = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            for seg in weight.segments:
                if isinstance(seg.weight, PackedTensor) and seg.weight.input_order is None:
                    capacity += tiled_bytes(seg.weight.fmt, seg.weight.data.shape[0], seg.weight.in_features) or 0
    return TileArena(capacity) if capacity else None


def settle_packed_weights(model: nn.Module, device: torch.device, int8_activations: bool = False,
                          merge_tiles: bool = True) -> None:
    """Check every holder is complete; float-only holders become parameters again; move to device;
    with ``int8_activations``, re-tile packed rows for the int8 kernels (int8_tiles.py). Without
    ``merge_tiles`` the tiled parts of a holder stay separate segments until ``merge_tiled_segments``
    (the caller moves them into the arena first)."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, QuantizedWeight):
            continue
        sources = [seg.weight.data for seg in weight.segments if isinstance(seg.weight, PackedTensor)]
        if int8_activations and device.type == "cpu":
            _tile_parts(weight)
        weight.finish(f"weight of {name}")
        if weight.is_float:
            del module.weight
            module.weight = nn.Parameter(weight.float_weight().to(device=device, dtype=weight.dtype),
                                         requires_grad=False)
        else:
            weight.to(device)
            if int8_activations:
                weight.tile_int8()
                if merge_tiles:
                    _merge_tiled(weight)
        # The rows as loaded are copied (tiled, joined, moved): a mapped file's pages go back now.
        kept = {id(seg.weight.data) for seg in weight.segments if isinstance(seg.weight, PackedTensor)}
        for data in sources:
            if id(data) not in kept:
                release_pages(data)
        del sources
        if int8_activations:
            _release_free_memory()
    _release_free_memory()


def merge_tiled_segments(model: nn.Module) -> None:
    """Join each holder's adjacent int8-tiled parts of one format into one tiled weight: a view
    where they lie back to back in one storage, one copy otherwise."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            _merge_tiled(weight)
    _release_free_memory()


def _tile_parts(weight: QuantizedWeight) -> None:
    """Tile each part of a run ``finish`` would join on its own (the run then joins nothing), where
    every part but the last is whole 16-row panels; other runs are left to ``finish`` and
    ``tile_int8`` as before, and so is a part alone (nothing to join)."""
    for run in _packed_runs(weight.segments):
        parts = [seg.weight for seg in run]
        if len(run) < 2 or parts[0].input_order is not None:
            continue
        if any(part.data.shape[0] % _PANEL_ROWS for part in parts[:-1]):
            continue
        tiled = [tile_for_int8(part.data, part.fmt, part.in_features) for part in parts]
        if any(t is None for t in tiled):
            continue  # this format / shape is not tiled here: none is
        for seg, t in zip(run, tiled, strict=True):
            seg.weight = t


def _packed_runs(segments: list) -> list[list]:
    """Maximal runs of adjacent packed segments ``finish`` would join (one format, one input order)."""
    runs: list[list] = []
    for i, seg in enumerate(segments):
        if i and _same_packed(segments[i - 1].weight, seg.weight):
            runs[-1].append(seg)
        elif isinstance(seg.weight, PackedTensor):
            runs.append([seg])
    return runs


def _same_packed(a: object, b: object) -> bool:
    if not (isinstance(a, PackedTensor) and isinstance(b, PackedTensor)):
        return False
    orders = (a.input_order, b.input_order)
    same_order = orders == (None, None) or (None not in orders and torch.equal(*orders))
    return a.fmt.id == b.fmt.id and same_order


def _merge_tiled(weight: QuantizedWeight) -> None:
    """Adjacent tiled segments of one format (parts ``_tile_parts`` tiled apart) made one again."""
    groups: list[list] = []
    for seg in weight.segments:
        last = groups[-1][-1] if groups else None
        if (last is not None and isinstance(last.weight, Int8TiledTensor) and isinstance(seg.weight, Int8TiledTensor)
                and last.weight.fmt.id == seg.weight.fmt.id and last.weight.in_features == seg.weight.in_features
                and last.rows % _PANEL_ROWS == 0):
            groups[-1].append(seg)
        else:
            groups.append([seg])
    for group in groups:
        if len(group) > 1:
            first = group[0].weight
            rows = sum(seg.rows for seg in group)
            group[0].weight = Int8TiledTensor(_joined([seg.weight.data for seg in group]), first.fmt, rows,
                                              first.in_features)
            group[0].rows = rows
    weight.segments = [group[0] for group in groups]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (rows of one width) one after another as one tensor: a view of their storage where
    each starts where the one before ends (the arena placed them so), else one copy."""
    first = parts[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    for part in parts:
        if (part.untyped_storage().data_ptr() != storage.data_ptr() or not part.is_contiguous()
                or part.shape[1:] != first.shape[1:] or part.data_ptr() != end):
            return torch.cat(parts)
        end += part.numel() * part.element_size()
    rows = sum(part.shape[0] for part in parts)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


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
