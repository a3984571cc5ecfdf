"""MXFP4 checkpoints (GPT-OSS's released weights): their experts loaded packed, never as floats.

Such a checkpoint's config has ``quantization_config.quant_method == "mxfp4"`` and stores each
layer's fused experts as ``{prefix}_blocks`` (uint8 ``[E, rows, groups, 16]``: per row of the
nn.Linear-oriented weight, ``groups`` blocks of 32 inputs, two e2m1 codes a byte, the LOW nibble
the EVEN value) and ``{prefix}_scales`` (uint8 ``[E, rows, groups]``: e8m0 exponents, scale
2^(s - 127)), the layout transformers' ``integrations/mxfp4.py`` dequantizes. Everything else
(attention, router, embeddings, biases) is float.

``pack_mxfp4`` turns a pair into one PackedTensor in the MXFP4 format of formats.py (GGUF's block:
the exponent byte, then 16 bytes whose low nibbles are the block's first 16 values): the codes are
only moved between nibbles, so the weight is exactly the checkpoint's, and no float copy of it is
made. All experts' rows stay stacked (``[E * rows, in]``); moe.split_fused_experts cuts them per
expert. ``quantize_mxfp4`` is the inverse, for tests: float weights as a checkpoint's blocks/scales.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.quantization.formats import E2M1_VALUES, MXFP4
from pagedllm.quantization.packed import PackedTensor

METHOD = "mxfp4"
_PART = re.compile(r"(.*)_(blocks|scales)")


def _quant_method(hf_config: Any) -> str | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict()  # a transformers QuantizationConfigMixin
    return str(raw.get("quant_method", "")).lower() or None


def resolve_mxfp4(hf_config: Any, requested: str | None, path: str) -> str | None:
    """"mxfp4" for an MXFP4 checkpoint (ValueError if it cannot be loaded as one), None otherwise."""
    if _quant_method(hf_config) != METHOD:
        return None
    model_type = getattr(hf_config, "model_type", "")
    if model_type != "gpt_oss":
        # Only GPT-OSS's fused expert tensors are mapped onto our layers (as transformers does).
        raise ValueError(f"{path!r}: MXFP4 checkpoints of model_type {model_type!r} are not supported (gpt_oss only).")
    if requested is not None:
        raise ValueError(f"{path!r} is an MXFP4 checkpoint, already quantized: leave quantization unset, "
                         f"not {requested!r}.")
    return METHOD


def pack_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> PackedTensor:
    """A checkpoint's ``blocks`` [E, rows, groups, 16] and ``scales`` [E, rows, groups] as one packed
    weight of ``E * rows`` rows and ``groups * 32`` inputs."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not make "
                         "[E, rows, groups, 16] and [E, rows, groups]")
    experts, rows, groups, _ = blocks.shape
    # Codes in value order: byte k holds values 2k (low nibble) and 2k + 1 (high nibble).
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).view(experts, rows, groups, 32)
    repacked = codes[..., :16] | (codes[..., 16:] << 4)  # GGUF: low nibbles 0..15, high 16..31
    data = torch.cat((scales.unsqueeze(-1), repacked), dim=-1)  # [E, rows, groups, 17]
    return PackedTensor(data.reshape(experts * rows, groups * MXFP4.block_bytes), MXFP4, groups * 32)


def iter_mxfp4_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """The checkpoint's tensors with each ``_blocks`` / ``_scales`` pair replaced by one packed ``prefix``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _PART.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, part = match.groups()
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 2:  # the two parts of one tensor are adjacent in sorted checkpoints
            del pending[prefix]
            yield prefix, pack_mxfp4(prefix, parts["blocks"], parts["scales"])
    if pending:
        incomplete = ", ".join(f"{p} ({', '.join(parts)})" for p, parts in sorted(pending.items()))
        raise ValueError(f"MXFP4 checkpoint: tensors with only one of _blocks / _scales: {incomplete}")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[..., rows, in]`` (nn.Linear orientation) -> a checkpoint's (blocks [..., rows, in / 32, 16],
    scales [..., rows, in / 32]), as gguf-py's quantizer chooses them: per block of 32 the scale
    2^(floor(log2(max |w|)) - 2), each value the nearest e2m1 code times that scale."""
    *lead, rows, cols = weight.shape
    values = weight.float().reshape(*lead, rows, cols // 32, 32)
    peak = values.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(peak > 0, torch.floor(torch.log2(peak)) - 2, torch.full_like(peak, -127)).clamp(-127, 127)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = ((values / torch.exp2(exponent)).unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)
