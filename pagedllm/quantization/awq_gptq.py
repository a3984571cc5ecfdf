"""AWQ and GPTQ 4-bit checkpoints, converted at load time into the packed formats our kernels run.

Both store, per linear layer, 4-bit quants q and, per group of inputs and per output feature, an
fp16 scale s and a 4-bit zero point z: ``w = (q - z) * s``. Each layer becomes one PackedTensor in
Q4_1's layout (formats.py: fp16 d, fp16 m, nibbles; value = q * d + m) with ``d = s`` and
``m = -z * s``, in blocks of 128 (I4_G128), 64 (I4_G64) or 32 (Q4_1) inputs that never straddle a
group (group_size -1, one group per row, repeats the row's d and m in every block). The quants are
copied nibble for nibble; no float copy of a weight is made.

Exactness: ``q * d`` and ``q * d + m`` are exact in float32, but ``m`` is stored in fp16: exact when
``z * s`` fits fp16's 11-bit significand (z of 0, 1, 2, 4, 8 or 16, so every symmetric checkpoint,
GPTQ's sym=True with z = 8), otherwise rounded by at most half an fp16 ulp of ``z * s``, under
0.8% of the quantization step s, about the rounding of AWQ's own fp16 dequantization. The
converted model therefore equals the checkpoint's weights dequantized up to that rounding of m;
``ConversionStats`` measures it and the loader logs it.

Layouts (int32 words, little-endian; nibble k of a word is bits 4k..4k+3):

- AWQ (AutoAWQ's "gemm" version, what transformers and vLLM load): ``qweight [in, out / 8]`` and
  ``qzeros [groups, out / 8]`` hold 8 output columns per word, nibble k holding column
  ``AWQ_ORDER[k]`` of its eight; ``scales [groups, out]``; the group of input i is i // group_size.
- GPTQ (AutoGPTQ, optimum, GPTQModel): ``qweight [in / 8, out]`` holds 8 inputs per word in order;
  ``qzeros [groups, out / 8]`` 8 output columns per word in order, each zero stored minus one in
  the original format (``checkpoint_format`` "gptq": its kernels add the one back unmasked, so a
  stored 15 means 16) and as it is in "gptq_v2"; ``scales [groups, out]``; ``g_idx [in]``, the group
  of each input. With ``desc_act`` (act-order) g_idx is not i // group_size: the inputs are then
  sorted by group (PackedTensor.input_order) and the activation is permuted the same way, exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.quantization.formats import I4_G64, I4_G128, Q4_1, Format
from pagedllm.quantization.packed import PackedTensor

logger = logging.getLogger(__name__)

CHECKPOINT_METHODS = ("awq", "gptq")
# Nibble k of an AWQ "gemm" word holds output column AWQ_ORDER[k] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL_ORDER = tuple(range(8))
# Block sizes, largest first: fewer fp16 headers per weight.
_BLOCK_FORMATS: dict[int, Format] = {128: I4_G128, 64: I4_G64, 32: Q4_1}
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """What a checkpoint's ``quantization_config`` says about its 4-bit linear layers."""

    method: str  # "awq" or "gptq"
    group_size: int  # inputs per group; -1: one group per row
    zero_offset: int = 0  # added to each stored zero point (GPTQ's original format stores z - 1)
    desc_act: bool = False  # GPTQ act-order: g_idx is required, not i // group_size


@dataclass(slots=True)
class ConversionStats:
    """How far the converted weights are from ``(q - z) * s``: only m = -z * s (and a scale that was
    not fp16) can round."""

    linears: int = 0
    groups: int = 0
    rounded_groups: int = 0
    max_error: float = 0.0  # max |converted - (q - z) * s| over every weight
    max_step_fraction: float = 0.0  # the same error as a fraction of its group's scale
    formats: set[str] = field(default_factory=set)


def checkpoint_quantization(hf_config: Any) -> CheckpointQuant | None:
    """The AWQ / GPTQ settings of a config's ``quantization_config`` (None without one); ValueError
    for a method, bit width or layout the converter does not load."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict()  # a transformers QuantizationConfigMixin
    method = str(raw.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"The checkpoint's quantization_config has quant_method {raw.get('quant_method')!r}; pagedllm loads "
            "'awq' and 'gptq' 4-bit checkpoints, float checkpoints and GGUF files."
        )
    name = method.upper()
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{name} checkpoint with bits={bits!r}: only 4-bit {name} weights are supported.")
    group = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
        raise ValueError(
            f"{name} checkpoint with group_size={group!r}: supported are -1 and multiples of 32 "
            "(the packed formats' blocks of 32 inputs must each lie in one group)."
        )
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint of version {raw.get('version')!r}: only the 'gemm' layout is supported.")
        if not raw.get("zero_point", True):
            raise ValueError("AWQ checkpoint with zero_point=False: only AWQ with zero points is supported.")
        return CheckpointQuant("awq", group)
    layout = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if layout not in _GPTQ_ZERO_OFFSETS:
        raise ValueError(
            f"GPTQ checkpoint of format {layout!r}: supported are {', '.join(map(repr, _GPTQ_ZERO_OFFSETS))} "
            "(repacked formats such as marlin or bitblas are not)."
        )
    return CheckpointQuant("gptq", group, _GPTQ_ZERO_OFFSETS[layout], bool(raw.get("desc_act", False)))


def resolve_checkpoint_quantization(hf_config: Any, requested: str | None, path: str) -> str | None:
    """The quantization to load with: the checkpoint's own method when it is AWQ / GPTQ (``requested``
    None, or that method as vLLM's ``--quantization awq`` names it), else ``requested`` unchanged."""
    quant = checkpoint_quantization(hf_config)
    if quant is None:
        if requested in CHECKPOINT_METHODS:
            raise ValueError(
                f"quantization={requested!r} is for {requested.upper()} checkpoints (a config.json whose "
                f"quantization_config has quant_method {requested!r}); {path!r} has no quantization_config."
            )
        return requested
    if requested not in (None, quant.method):
        raise ValueError(
            f"{path!r} is a {quant.method.upper()} checkpoint, already quantized: leave quantization unset "
            f"(or pass {quant.method!r}), not {requested!r}."
        )
    return quant.method


# ------------------------------------------------------------------------------------ unpacking


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> uint8 ``[R, C, 8]``, nibble k of each word at index k."""
    rows, cols = packed.shape
    # Little-endian words: byte b holds nibbles 2b (low half) and 2b + 1 (high half).
    raw = packed.contiguous().view(torch.uint8).view(rows, cols, 4)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).view(rows, cols, 8)


def unpack_int4_columns(packed: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """int32 ``[R, C]`` -> uint8 ``[R, 8 C]``: nibble k of word (r, c) is column ``8 c + order[k]``."""
    nibbles = _nibbles(packed)
    placed = torch.empty_like(nibbles)
    placed[..., list(order)] = nibbles
    return placed.view(packed.shape[0], -1)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> uint8 ``[8 R, C]``: nibble k of word (r, c) is row ``8 r + k``."""
    return _nibbles(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_linear(parts: dict[str, torch.Tensor], quant: CheckpointQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(quants uint8 ``[out, in]``, zero points int32 ``[groups, out]``) of one checkpoint linear."""
    for part in ("qweight", "qzeros"):
        if parts[part].dtype != torch.int32:
            raise ValueError(f"{part} is {parts[part].dtype}, {quant.method.upper()} stores int32 words")
    if quant.method == "awq":
        q = unpack_int4_columns(parts["qweight"], AWQ_ORDER).t()
        zeros = unpack_int4_columns(parts["qzeros"], AWQ_ORDER).int()
    else:
        q = unpack_int4_rows(parts["qweight"]).t()
        zeros = unpack_int4_columns(parts["qzeros"]).int() + quant.zero_offset
    return q, zeros


# ----------------------------------------------------------------------------------- converting


def _block_layout(name: str, g_idx: torch.Tensor, shards: int) -> tuple[torch.Tensor | None, int]:
    """(input order or None, block size): the largest block of 128 / 64 / 32 inputs of one group
    each, in the checkpoint's input order if it has one, else with the inputs sorted by group.
    Under tensor parallelism a block that fits a rank's share of the inputs is preferred."""
    in_features = g_idx.numel()
    if in_features % 32:
        raise ValueError(f"{name}: {in_features} inputs, the packed formats need a multiple of 32")
    sizes = [b for b in _BLOCK_FORMATS if in_features % b == 0]
    sizes = [b for b in sizes if in_features % (b * shards) == 0] + [b for b in sizes if in_features % (b * shards)]
    sorted_order = torch.argsort(g_idx, stable=True)
    for order in (None, sorted_order):
        groups = g_idx if order is None else g_idx[order]
        for block in sizes:
            per_block = groups.view(-1, block)
            if bool((per_block == per_block[:, :1]).all()):
                return order, block
    raise ValueError(f"{name}: its groups (g_idx) cannot be cut into blocks of 32 inputs that each lie in one group")


def convert_linear(name: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant, shards: int = 1,
                   stats: ConversionStats | None = None) -> PackedTensor:
    """One checkpoint linear (``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``) as a packed weight
    ``[out, in]``; ``shards``: the tensor-parallel ranks its inputs may be split over."""
    q, zeros = unpack_linear(parts, quant)
    out_features, in_features = q.shape
    scales = parts["scales"]
    groups = scales.shape[0] if scales.dim() == 2 else -1
    if tuple(scales.shape) != (groups, out_features) or tuple(zeros.shape) != (groups, out_features):
        raise ValueError(
            f"{name}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not match a "
            f"[{in_features} in, {out_features} out] weight's [groups, {out_features}]"
        )
    group_size = in_features if quant.group_size == -1 else quant.group_size
    if -(-in_features // group_size) != groups:
        raise ValueError(f"{name}: {groups} groups of scales, the config's group_size {quant.group_size} makes "
                         f"{-(-in_features // group_size)} of {in_features} inputs")
    g_idx = parts.get("g_idx")
    if g_idx is None:
        if quant.desc_act:
            raise ValueError(f"{name}: a GPTQ desc_act checkpoint needs g_idx (the group of each input), it has none")
        g_idx = torch.arange(in_features) // group_size
    g_idx = g_idx.long()
    if tuple(g_idx.shape) != (in_features,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{name}: g_idx must give each of the {in_features} inputs a group in [0, {groups})")
    order, block = _block_layout(name, g_idx, shards)
    if order is not None:
        q, g_idx = q[:, order], g_idx[order]
    block_groups = g_idx[::block]  # the group of each block, along the packed input columns
    s = scales.float()
    d = scales.half()
    m = (-zeros.float() * s).half()  # -z * s is exact in float32 (16 significant bits at most)
    if not bool(torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError(f"{name}: a scale or scale * zero point is beyond fp16's range")
    if stats is not None:
        _measure(stats, s, zeros, d, m)
    rows_blocks = (out_features, in_features // block)
    header = torch.stack((d[block_groups].t(), m[block_groups].t()), dim=-1)  # [out, blocks, 2] fp16
    qb = q.reshape(*rows_blocks, block)
    nibbles = qb[..., :block // 2] | (qb[..., block // 2:] << 4)  # low nibble: the block's first half
    data = torch.cat((header.contiguous().view(torch.uint8).view(*rows_blocks, 4), nibbles), dim=-1)
    fmt = _BLOCK_FORMATS[block]
    if stats is not None:
        stats.formats.add(fmt.name)
    return PackedTensor(data.reshape(out_features, -1).contiguous(), fmt, in_features, order)


def _measure(stats: ConversionStats, s: torch.Tensor, zeros: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """Add one layer's groups: the converted q * d + m against (q - z) * s is linear in q, so its
    largest error is at q = 0 or q = 15 (float64: every term exact)."""
    s64, d64, m64 = s.double(), d.double(), m.double()
    at_zero = (m64 + zeros.double() * s64).abs()
    error = torch.maximum(at_zero, (at_zero + 15 * (d64 - s64)).abs())
    stats.linears += 1
    stats.groups += error.numel()
    stats.rounded_groups += int((error > 0).sum())
    stats.max_error = max(stats.max_error, float(error.max()))
    fraction = torch.where(s64 != 0, error / s64.abs(), error)
    stats.max_step_fraction = max(stats.max_step_fraction, float(fraction.max()))


def iter_converted_weights(weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuant, shards: int = 1,
                           stats: ConversionStats | None = None) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """The checkpoint's tensors with each quantized linear's parts replaced by one packed
    ``PREFIX.weight``; every other tensor (embeddings, norms, biases, float layers) passes as it is."""
    stats = ConversionStats() if stats is None else stats
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if quant.method == "gptq" else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if needed <= parts.keys():  # the parts of one layer are adjacent in sorted checkpoints
            yield f"{prefix}.weight", convert_linear(prefix, pending.pop(prefix), quant, shards, stats)
    for prefix, parts in pending.items():
        missing = sorted({"qweight", "qzeros", "scales"} - parts.keys())
        if missing:
            raise ValueError(f"{quant.method.upper()} checkpoint: {prefix} has {', '.join(sorted(parts))} "
                             f"but no {', '.join(missing)}.")
        yield f"{prefix}.weight", convert_linear(prefix, parts, quant, shards, stats)  # GPTQ without g_idx
    logger.info(
        "%s: %d linear weights loaded packed as %s; fp16 minimum -z*s rounded in %d of %d groups "
        "(max weight change %.3g, %.2g%% of a quantization step)",
        quant.method.upper(), stats.linears, "/".join(sorted(stats.formats)) or "nothing", stats.rounded_groups,
        stats.groups, stats.max_error, 100 * stats.max_step_fraction,
    )
