"""Packed weights as the loaders and layers handle them.

- ``PackedTensor``: one checkpoint tensor kept in its blocks (a GGUF tensor, or a float tensor
  quantized at load time). It narrows and splits like a tensor, on block boundaries along the
  input dimension, so the tensor-parallel weight loaders cut shards of it as they cut float
  tensors, and a shard of a packed weight is a packed weight.
- ``QuantizedWeight``: what a linear layer (or an embedding / LM head) holds instead of a float
  parameter. The loaders write rows into it (``weight.data[offset:offset + size]`` as with a
  parameter); fused layers (q/k/v, gate/up) may receive parts of different formats (a Q4_K_M
  file stores attn_v as Q6_K next to Q4_K q and k), so it keeps segments of rows, each in one
  format, merged when adjacent ones agree. Float tensors (F32 / F16 / BF16 GGUF tensors) stay
  float segments. With int8 activations, packed segments are re-tiled once loaded
  (``int8_tiles.Int8TiledTensor``).
- ``input_order`` (GPTQ act-order checkpoints, awq_gptq.py): the packed columns hold the inputs in
  this order, sorted by quantization group so that every block lies in one group; the product
  takes the activation's columns in the same order, and ``dequantize`` puts them back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.quantization.formats import I8_ROW, Format, dequantize
from pagedllm.quantization.int8_tiles import Int8TiledTensor, tile_for_int8
from pagedllm.quantization.kernels import packed_embedding, packed_linear


@dataclass(slots=True)
class PackedTensor:
    """``[rows, in_features]`` weights stored as ``data`` (uint8 ``[rows, row_bytes]``) in ``fmt``."""

    data: torch.Tensor
    fmt: Format
    in_features: int
    input_order: torch.Tensor | None = None  # int64 [in_features]: packed column j is input input_order[j]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> PackedTensor:
        if dim == 0:
            return PackedTensor(self.data.narrow(0, start, length), self.fmt, self.in_features, self.input_order)
        if dim not in (1, -1):
            raise ValueError(f"a packed weight has 2 dimensions, not {dim + 1}")
        if start == 0 and length == self.in_features:
            return self  # a row-parallel layer's whole input (one rank)
        if self.input_order is not None:
            # The shard's inputs lie scattered over the permuted columns, and its blocks would mix groups.
            raise ValueError(
                "a GPTQ act-order (desc_act=True) weight holds its inputs permuted and cannot be split "
                "along them; load it with tensor_parallel_size=1"
            )
        if self.fmt.id == I8_ROW.id:
            # The row scale sits at the end of each row: keep it after the kept columns.
            data = torch.cat((self.data[:, start:start + length], self.data[:, self.in_features:]), dim=1)
            return PackedTensor(data, self.fmt, length)
        block = self.fmt.block_values
        if start % block or length % block:
            raise ValueError(
                f"a {self.fmt.name} weight can only be split on its {block}-value blocks "
                f"(asked for input columns [{start}, {start + length}))"
            )
        first, count = start // block * self.fmt.block_bytes, length // block * self.fmt.block_bytes
        return PackedTensor(self.data.narrow(1, first, count), self.fmt, length)

    def split(self, sizes: list[int], dim: int = 0) -> list[PackedTensor]:
        if dim != 0:
            raise ValueError("packed weights are split along their output rows only")
        return [PackedTensor(part, self.fmt, self.in_features, self.input_order)
                for part in self.data.split(sizes, dim=0)]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, in_features]``, columns in input order."""
        return _input_columns(dequantize(self.data, self.fmt, self.in_features), self.input_order)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(slots=True)
class _Segment:
    offset: int
    rows: int
    weight: PackedTensor | Int8TiledTensor | torch.Tensor  # packed rows, tiled rows, or float rows


class QuantizedWeight:
    """The weight of one layer, ``[out_features, in_features]``, as packed (or float) row segments.

    ``quantizer`` turns a float tensor loaded into it into a PackedTensor (load-time quantization);
    None keeps float tensors as float rows.
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype,
                 quantizer: Callable[[torch.Tensor], PackedTensor] | None = None) -> None:
        self.shape = torch.Size((out_features, in_features))
        self.dtype = dtype
        self.quantizer = quantizer
        self.segments: list[_Segment] = []

    # The parameter protocol the weight loaders use: ``param.data[a:b]``, ``param.shape``, ``param.dim()``.
    @property
    def data(self) -> QuantizedWeight:
        return self

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice) -> _RowView:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("packed weights take contiguous row ranges only")
        return _RowView(self, start, stop - start)

    def assign(self, what: str, offset: int, rows: int, tensor: PackedTensor | torch.Tensor) -> None:
        """Store ``tensor`` as rows [offset, offset + rows)."""
        if tuple(tensor.shape) != (rows, self.shape[1]):
            raise ValueError(f"{what} has shape {tuple(tensor.shape)}, the model expects {(rows, self.shape[1])}.")
        if isinstance(tensor, torch.Tensor):
            tensor = self.quantizer(tensor) if self.quantizer is not None else tensor.detach().to(self.dtype).clone()
        elif not tensor.data.is_contiguous() or tensor.data.untyped_storage().nbytes() > tensor.data.numel():
            # A shard cut out of a whole tensor: keep a compact copy, not a view that pins the whole.
            tensor = PackedTensor(tensor.data.contiguous().clone(), tensor.fmt, tensor.in_features, tensor.input_order)
        self.segments = [s for s in self.segments if s.offset + s.rows <= offset or s.offset >= offset + rows]
        self.segments.append(_Segment(offset, rows, tensor))
        self.segments.sort(key=lambda s: s.offset)

    def zero_rows(self, offset: int, rows: int) -> None:
        self.assign("padding rows", offset, rows, torch.zeros(rows, self.shape[1], dtype=self.dtype))

    def finish(self, what: str) -> None:
        """Check every row was loaded; merge adjacent segments of one format (one kernel call each)."""
        covered = 0
        for seg in self.segments:
            if seg.offset != covered:
                break
            covered += seg.rows
        if covered != self.shape[0]:
            raise ValueError(f"{what}: rows [{covered}, {self.shape[0]}) were never loaded.")
        merged: list[_Segment] = []
        for seg in self.segments:
            last = merged[-1] if merged else None
            if last is not None and _same_kind(last.weight, seg.weight):
                if isinstance(seg.weight, PackedTensor):
                    data = torch.cat((last.weight.data, seg.weight.data))
                    last.weight = PackedTensor(data, seg.weight.fmt, seg.weight.in_features, seg.weight.input_order)
                else:
                    last.weight = torch.cat((last.weight, seg.weight))
                last.rows += seg.rows
            else:
                merged.append(_Segment(seg.offset, seg.rows, seg.weight))
        self.segments = merged

    def tile_int8(self) -> None:
        """Re-tile packed segments for int8 activations (those this CPU can tile); the packed rows go."""
        for seg in self.segments:
            # Int8 tiles keep no input order: act-order rows stay packed (float activations).
            if isinstance(seg.weight, PackedTensor) and seg.weight.input_order is None:
                tiled = tile_for_int8(seg.weight.data, seg.weight.fmt, seg.weight.in_features)
                if tiled is not None:
                    seg.weight = tiled

    @property
    def is_float(self) -> bool:
        return all(isinstance(s.weight, torch.Tensor) for s in self.segments)

    def float_weight(self) -> torch.Tensor:
        """The whole weight as float32 (tests, and layers that cannot use packed rows)."""
        parts = [s.weight.float() if isinstance(s.weight, torch.Tensor) else s.weight.dequantize()
                 for s in self.segments]
        return torch.cat(parts)

    @property
    def nbytes(self) -> int:
        return sum(s.weight.numel() * s.weight.element_size() if isinstance(s.weight, torch.Tensor) else s.weight.nbytes
                   for s in self.segments)

    @property
    def formats(self) -> list[str]:
        return [_kind_name(s.weight) for s in self.segments]

    def to(self, device: torch.device) -> QuantizedWeight:
        for seg in self.segments:
            if isinstance(seg.weight, PackedTensor):
                order = seg.weight.input_order
                seg.weight = PackedTensor(seg.weight.data.to(device), seg.weight.fmt, seg.weight.in_features,
                                          None if order is None else order.to(device))
            elif isinstance(seg.weight, Int8TiledTensor):
                if device.type != "cpu":
                    raise ValueError("int8-tiled weights run on the CPU kernels only")
            else:
                seg.weight = seg.weight.to(device)
        return self

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T + bias`` in x's dtype."""
        if len(self.segments) == 1:
            return _segment_linear(x, self.segments[0].weight, bias)
        parts = [_segment_linear(x, s.weight, None if bias is None else bias[s.offset:s.offset + s.rows])
                 for s in self.segments]
        return torch.cat(parts, dim=-1)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (an embedding lookup), in the model dtype."""
        if len(self.segments) == 1:
            return _segment_rows(self.segments[0].weight, ids).to(self.dtype)
        out = torch.empty(*ids.shape, self.shape[1], dtype=self.dtype, device=ids.device)
        for seg in self.segments:
            inside = (ids >= seg.offset) & (ids < seg.offset + seg.rows)
            if bool(inside.any()):
                out[inside] = _segment_rows(seg.weight, ids[inside] - seg.offset).to(self.dtype)
        return out


class _RowView:
    """``weight.data[a:b]`` of a QuantizedWeight: the target of one shard's copy."""

    def __init__(self, weight: QuantizedWeight, offset: int, rows: int) -> None:
        self.weight, self.offset, self.rows = weight, offset, rows
        self.shape = torch.Size((rows, weight.shape[1]))

    def assign(self, what: str, tensor: PackedTensor | torch.Tensor) -> None:
        self.weight.assign(what, self.offset, self.rows, tensor)

    def zero_(self) -> _RowView:
        self.weight.zero_rows(self.offset, self.rows)
        return self


def _same_kind(a: PackedTensor | torch.Tensor, b: PackedTensor | torch.Tensor) -> bool:
    if isinstance(a, PackedTensor) and isinstance(b, PackedTensor):
        orders = (a.input_order, b.input_order)
        same_order = orders == (None, None) or (None not in orders and torch.equal(*orders))
        return a.fmt.id == b.fmt.id and same_order
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def _kind_name(weight: PackedTensor | Int8TiledTensor | torch.Tensor) -> str:
    if isinstance(weight, torch.Tensor):
        return str(weight.dtype).removeprefix("torch.")
    return weight.fmt.name + ("/int8-tiled" if isinstance(weight, Int8TiledTensor) else "")


def _segment_linear(x: torch.Tensor, weight: PackedTensor | Int8TiledTensor | torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight.to(x.dtype), bias)
    if isinstance(weight, Int8TiledTensor):
        return weight.linear(x, bias)
    if weight.input_order is not None:
        x = x.index_select(-1, weight.input_order)
    return packed_linear(x, weight.data, weight.fmt, weight.in_features, bias)


def _segment_rows(weight: PackedTensor | Int8TiledTensor | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    if isinstance(weight, Int8TiledTensor):
        return weight.take_rows(ids)
    return _input_columns(packed_embedding(ids, weight.data, weight.fmt, weight.in_features), weight.input_order)


def _input_columns(values: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
    """Values whose last dimension is in packed column order, put back in input order."""
    if input_order is None:
        return values
    return torch.empty_like(values).index_copy_(-1, input_order, values)


def assign_to(what: str, target: object, tensor: PackedTensor | torch.Tensor) -> bool:
    """Load ``tensor`` into a packed target (True), or say the target is a plain tensor (False)."""
    if isinstance(target, _RowView):
        target.assign(what, tensor)
        return True
    if isinstance(target, QuantizedWeight):
        target.assign(what, 0, target.shape[0], tensor)
        return True
    return False
