"""Packed weight formats: GGUF's block types and the formats load-time quantization writes.

A packed weight is a uint8 tensor ``[out_features, row_bytes]``: each output row is its blocks one
after another along the input dimension, exactly as GGUF stores them, so a GGUF tensor is used
as it lies in the file and a row (or a block-aligned column range) of it is again a packed
weight. The ids are ggml's type numbers for the GGUF types; the C++ kernels
(``kernels/csrc/quant_linear_cpu.cpp``) use the same ids.

``dequantize`` here is the torch reference (and the fallback on CUDA, without the C++ kernels,
and for a format outside ``CPU_KERNEL_FORMAT_IDS``, today none): the same float values gguf-py's
numpy dequantizer gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    id: int
    block_values: int  # weights per block along the input dimension
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        if self.id == I8_ROW.id:
            return in_features + 4
        return in_features // self.block_values * self.block_bytes


Q4_0 = Format("Q4_0", 2, 32, 18)
Q4_1 = Format("Q4_1", 3, 32, 20)
Q8_0 = Format("Q8_0", 8, 32, 34)
Q4_K = Format("Q4_K", 12, 256, 144)
Q5_K = Format("Q5_K", 13, 256, 176)
Q6_K = Format("Q6_K", 14, 256, 210)
# Written by load-time quantization (quantization="int4" / "int8"): int4 groups keep Q4_1's layout
# (fp16 scale, fp16 min, nibbles: low = the group's first half), so group 32 *is* Q4_1.
I4_G64 = Format("I4_G64", 1064, 64, 36)
I4_G128 = Format("I4_G128", 1128, 128, 68)
# int8 per output channel: the row's K int8 values, then its float32 scale (block_bytes unused).
I8_ROW = Format("I8_ROW", 1008, 16, 16)
# OCP microscaling FP4 (GPT-OSS's experts), as GGUF stores it: per 32 values one e8m0 exponent byte
# (scale 2^(e - 127)), then 16 bytes of e2m1 codes, the low nibbles the block's first 16 values.
MXFP4 = Format("MXFP4", 39, 32, 17)
# e2m1 code -> value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 (gguf-py's kvalues halved).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

GGUF_PACKED_TYPES = {f.name: f for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)}
# The formats kernels/csrc/quant_formats.h implements; any other is multiplied by the torch reference.
CPU_KERNEL_FORMAT_IDS = frozenset(f.id for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, I4_G64, I4_G128, I8_ROW, MXFP4))


def _half(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibble_groups(blocks: torch.Tensor, group: int) -> torch.Tensor:
    """Blocks [R, B, 4 + group/2] of (fp16 d, fp16 m, nibbles) -> float32 [R, B * group]."""
    d = _half(blocks[..., 0:2]).unsqueeze(-1)
    m = _half(blocks[..., 2:4]).unsqueeze(-1)
    qs = blocks[..., 4:]
    q = torch.cat((qs & 0xF, qs >> 4), dim=-1).float()
    return (q * d + m).flatten(1)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K blocks from their 12 packed bytes: [R, B, 8] each."""
    s = scales.int()
    low_sc = s[..., 0:4] & 63
    low_m = s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat((low_sc, high_sc), -1).float(), torch.cat((low_m, high_m), -1).float()


def _k_quant(blocks: torch.Tensor, five_bits: bool) -> torch.Tensor:
    d = _half(blocks[..., 0:2]).unsqueeze(-1)
    dmin = _half(blocks[..., 2:4]).unsqueeze(-1)
    sc, mn = _k_scales_mins(blocks[..., 4:16])
    qs = blocks[..., 48:176] if five_bits else blocks[..., 16:144]
    qs = qs.reshape(*qs.shape[:-1], 4, 32)  # four chunks of 32 bytes: low nibbles, then high
    q = torch.stack((qs & 0xF, qs >> 4), dim=-2).reshape(*qs.shape[:-2], 8, 32).int()
    if five_bits:
        qh = blocks[..., 16:48].int().unsqueeze(-2)  # [R, B, 1, 32]
        bits = torch.arange(8, device=blocks.device, dtype=torch.int32).view(8, 1)
        q = q | (((qh >> bits) & 1) << 4)
    values = (d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)
    return values.flatten(1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[..., 0:128].int().reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].int().reshape(*blocks.shape[:-1], 2, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float().reshape(*blocks.shape[:-1], 2, 8)
    d = _half(blocks[..., 208:210]).view(*blocks.shape[:-1], 1, 1)
    q1 = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
    q2 = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = torch.stack((q1, q2, q3, q4), dim=-2) - 32  # [R, B, 2, 4, 32]: 128 values per half
    scale = sc.reshape(*sc.shape[:-1], 4, 2).repeat_interleave(16, dim=-1)  # per 16 values
    return (d.unsqueeze(-1) * scale * q.float()).flatten(1)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [R, B, 17] -> float32 [R, B * 32]: code times 2^(e - 127), exact in float32."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    qs = blocks[..., 1:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).long()
    exponent = blocks[..., :1].int() - 127
    return torch.ldexp(lut[codes], exponent.float()).flatten(1)


def dequantize(packed: torch.Tensor, fmt: Format, in_features: int) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of a packed weight (torch ops only: any device)."""
    rows = packed.shape[0]
    if fmt.id == I8_ROW.id:
        scale = packed[:, in_features:].contiguous().view(torch.float32)
        return packed[:, :in_features].contiguous().view(torch.int8).float() * scale
    blocks = packed.reshape(rows, in_features // fmt.block_values, fmt.block_bytes)
    if fmt.id == Q4_0.id:
        d = _half(blocks[..., 0:2]).unsqueeze(-1)
        qs = blocks[..., 2:]
        q = torch.cat((qs & 0xF, qs >> 4), dim=-1).float() - 8
        return (q * d).flatten(1)
    if fmt.id in (Q4_1.id, I4_G64.id, I4_G128.id):
        return _nibble_groups(blocks, fmt.block_values)
    if fmt.id == Q8_0.id:
        d = _half(blocks[..., 0:2]).unsqueeze(-1)
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).flatten(1)
    if fmt.id in (Q4_K.id, Q5_K.id):
        return _k_quant(blocks, five_bits=fmt.id == Q5_K.id)
    if fmt.id == Q6_K.id:
        return _q6_k(blocks)
    if fmt.id == MXFP4.id:
        return _mxfp4(blocks)
    raise ValueError(f"Unknown packed weight format {fmt.name}.")
