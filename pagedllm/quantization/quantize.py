"""Weight-only quantization at load time (``quantization="int8" | "int4"``) for float checkpoints.

- ``int8``: one float32 scale per output channel, symmetric (``round(w / s)`` in [-127, 127]).
- ``int4``: asymmetric groups of 32, 64 or 128 input values (``group_size``), each with an fp16
  scale and minimum (value = scale * q + min, q in 0..15), Q4_1's layout (group 32 is Q4_1).
  A layer whose input size the group does not divide takes the largest smaller group that does.

Each float tensor is quantized as it arrives from the checkpoint, so the float model never
exists in memory at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.quantization.formats import I4_G64, I4_G128, I8_ROW, Q4_1, Format
from pagedllm.quantization.packed import PackedTensor

QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZES = {32: Q4_1, 64: I4_G64, 128: I4_G128}


def quantize_int8_per_channel(weight: torch.Tensor) -> PackedTensor:
    w = weight.detach().float().cpu()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(w / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(-127, 127)
    data = torch.cat((q.to(torch.int8).view(torch.uint8), scale.contiguous().view(torch.uint8)), dim=1)
    return PackedTensor(data.contiguous(), I8_ROW, w.shape[1])


def quantize_int4_groups(weight: torch.Tensor, group_size: int = 32) -> PackedTensor:
    fmt: Format = INT4_GROUP_SIZES[group_size]
    w = weight.detach().float().cpu()
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"int4 quantization needs in_features divisible by the group size {group_size}, got {cols}.")
    groups = w.view(rows, cols // group_size, group_size)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    if max(float(high.max()), -float(low.min())) > 65504:
        raise ValueError("int4 quantization keeps fp16 scales; this weight has values beyond fp16's range.")
    # Round scale and minimum to fp16 first, then choose q against the stored values.
    scale = ((high - low) / 15.0).half().float()
    minimum = low.half().float()
    q = torch.where(scale > 0, torch.round((groups - minimum) / torch.where(scale > 0, scale, 1.0)), 0.0)
    q = q.clamp(0, 15).to(torch.uint8)
    half = group_size // 2
    nibbles = q[..., :half] | (q[..., half:] << 4)
    header = torch.cat((scale.half().view(torch.uint8), minimum.half().view(torch.uint8)), dim=-1)
    data = torch.cat((header, nibbles), dim=-1).reshape(rows, -1)
    return PackedTensor(data.contiguous(), fmt, cols)


def make_quantizer(method: str | None, group_size: int = 32) -> Callable[[torch.Tensor], PackedTensor] | None:
    """The load-time quantizer of ``method`` (None: keep float weights)."""
    if method is None:
        return None
    if method == "int8":
        return quantize_int8_per_channel
    if method == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {sorted(INT4_GROUP_SIZES)}, got {group_size}.")

        def quantize_int4(weight: torch.Tensor) -> PackedTensor:
            cols = weight.shape[1]
            fitting = [g for g in sorted(INT4_GROUP_SIZES, reverse=True) if g <= group_size and cols % g == 0]
            if not fitting:
                raise ValueError(f"int4 quantization needs in_features divisible by 32; a layer has {cols}.")
            return quantize_int4_groups(weight, fitting[0])

        return quantize_int4
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got {method!r}.")
