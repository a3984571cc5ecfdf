"""KV cache storage formats: the model dtype as it is, a 16-bit float type (bfloat16, float16), or 8 / 4
bits with their scales inside each row.

A quantized pool keeps the layout of a float one, ``[num_blocks, block_size, num_kv_heads, row]``,
where one row (one token, one KV head) holds the head's quantized values followed by the scales
that decode them. Scales therefore live inside their block: copy-on-write, swapping, prefix caching
and beam forks move them with the block, and the pool's bytes per block account for them.

| format     | values                           | scales after the values               | row bytes (D = 64) |
|------------|----------------------------------|---------------------------------------|--------------------|
| int8       | D int8, round(x / s)             | float16 s = max|x| / 127              | 66                 |
| fp8_e4m3   | D float8 e4m3 (x / s)            | float16 s = max|x| / 448              | 66                 |
| fp8_e5m2   | D float8 e5m2 (x / s)            | float16 s = max|x| / 57344            | 66                 |
| int4       | D / 2 bytes, q in 0..15          | per group of 32: float16 d, float16 m | 40                 |

int4 is asymmetric per group of 32 values (x = d * q + m, llama.cpp's Q4_1 rule); a group's byte j
holds value j in its low nibble and value j + 16 in its high one, as ggml's 4-bit blocks do, so
that one 16-byte load gives 32 values by masking and shifting.

What is quantized is the head rotated by a Walsh-Hadamard transform (``hadamard``: entries +-1, in
blocks of the largest power of two dividing the head size): keys carry a few outlier channels
(rotary embeddings make some 10-50x the rest), and the rotation spreads each over the whole row, so
one scale per row (or group) fits every value. The transform is its own inverse up to the block
size, so attention can work in the rotated basis: the kernels rotate each query head before reading
and each output head after; ``dequantize_rows`` rotates back.

The integer formats quantize keys less a per-layer offset, the model's mean key
(attention/key_offset.py): softmax does not see it, and it takes the keys' shared bias out of every
row's range.

The pool's torch dtype names its format (int8, float8_e4m3fn, float8_e5m2, uint8 for int4), so a
kernel handed a cache knows how to read it. The functions here are the reference: the torch
attention path (and CUDA) quantizes and dequantizes with them, and the CPU kernels quantize
identically (the same float32 operations in the same order) and are tested against them.
"""

from __future__ import annotations

import torch

from pagedllm.kv_cache_format import FORMATS, INT4_GROUP, KVCacheFormat


def storage_dtype(fmt: KVCacheFormat) -> torch.dtype:
    """The torch dtype a format's pool is stored as (quantized or 16-bit float; not "auto")."""
    return getattr(torch, fmt.storage)


_BY_STORAGE = {storage_dtype(fmt): fmt for fmt in FORMATS.values() if fmt.quantized}


def cache_format(cache: torch.Tensor) -> KVCacheFormat | None:
    """The quantized format a pool (or a view of it) holds, from its dtype; None for a float cache."""
    return _BY_STORAGE.get(cache.dtype)


def pool_storage(fmt: KVCacheFormat, model_dtype: torch.dtype) -> torch.dtype:
    """What a pool of ``fmt`` is allocated as: the model dtype for "auto"."""
    return storage_dtype(fmt) if fmt.storage is not None else model_dtype


def hadamard_block(head_dim: int) -> int:
    """The size of the Hadamard blocks a head is rotated in: the largest power of two dividing it."""
    return head_dim & -head_dim


def rotation_shifts(head_dim: int) -> tuple[int, int]:
    """(write, read): the powers of two the unnormalised transform is scaled by on each side. The
    transform H (entries +-1, blocks of b = 2^k) satisfies H H = b I, so writing H x 2^-w and reading
    through H q 2^-r with w + r = k gives back q . x exactly in exact arithmetic; both scalings are
    exact in float."""
    k = hadamard_block(head_dim).bit_length() - 1
    return k // 2, k - k // 2


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x over the last axis, unnormalised, in blocks of ``hadamard_block``: butterflies (a + b,
    a - b) in the order the kernels' fwht runs them, so both round alike."""
    head_dim = x.shape[-1]
    block = hadamard_block(head_dim)
    y = x.reshape(*x.shape[:-1], head_dim // block, block)
    half = 1
    while half < block:
        pairs = y.unflatten(-1, (block // (2 * half), 2, half))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], -2).flatten(-3)
        half *= 2
    return y.reshape(x.shape)


def _reciprocal(value: float) -> torch.Tensor:
    """1 / value rounded to float32: the kernels multiply by the same constant (a division by a
    constant compiles to that product under -ffast-math, so both sides use the product)."""
    return torch.tensor(1.0 / value, dtype=torch.float32)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row has scale 0: its values quantize to 0 rather than to nan.
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def quantize_rows(x: torch.Tensor, fmt: KVCacheFormat, offset: torch.Tensor | None = None) -> torch.Tensor:
    """[..., D] float states -> [..., row_bytes] rows of ``fmt`` (in its storage dtype). ``offset``
    (float32, broadcast over the leading axes: [Hkv, D] per KV head) is subtracted first: the rows
    hold ``x - offset`` (see attention/key_offset.py)."""
    head_dim = x.shape[-1]
    fmt.check_head_dim(head_dim)
    write_shift, _ = rotation_shifts(head_dim)
    x = x.float()
    if offset is not None:
        x = x - offset
    x = hadamard(x) * 2.0 ** -write_shift
    if fmt.bits == 4:
        groups = x.unflatten(-1, (head_dim // INT4_GROUP, INT4_GROUP))
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        # The float16 values stored are the ones quantized against, so decoding is exact to them.
        m = low.clamp(-65504, 65504).half()
        d = ((high - low) * _reciprocal(15.0)).clamp(max=65504).half()
        q = ((groups - m.float()) * _inverse(d.float())).round().clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        params = torch.cat([d, m], -1).view(torch.uint8)  # [..., G, 4]: d then m, little-endian halves
        return torch.cat([packed.flatten(-2), params.flatten(-2)], -1)
    scale = (x.abs().amax(-1, keepdim=True) * _reciprocal(fmt.max_value)).clamp(max=65504).half()
    scaled = (x * _inverse(scale.float())).clamp(-fmt.max_value, fmt.max_value)
    storage = storage_dtype(fmt)
    values = scaled.round().to(torch.int8) if storage == torch.int8 else scaled.to(storage)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], -1).view(storage)


def dequantize_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype, rotated: bool = False) -> torch.Tensor:
    """[..., row_bytes] rows of a quantized cache -> [..., head_dim] values in ``dtype``; with
    ``rotated``, the values as stored (H x 2^-w), in the basis the kernels attend in."""
    fmt = cache_format(rows)
    data = rows.view(torch.uint8)
    if fmt.bits == 4:
        groups = head_dim // INT4_GROUP
        packed = data[..., : head_dim // 2].unflatten(-1, (groups, 16))
        q = torch.cat([packed & 0xF, packed >> 4], -1).float()  # [..., G, 32]
        params = data[..., head_dim // 2 :].contiguous().view(torch.float16).unflatten(-1, (groups, 2)).float()
        stored = (q * params[..., 0:1] + params[..., 1:2]).flatten(-2)
    else:
        values = data[..., :head_dim].view(storage_dtype(fmt)).float()
        stored = values * data[..., head_dim:].contiguous().view(torch.float16).float()
    if rotated:
        return stored.to(dtype)
    return (hadamard(stored) * 2.0 ** -rotation_shifts(head_dim)[1]).to(dtype)


def roundtrip(x: torch.Tensor, fmt: KVCacheFormat | None, offset: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` as a cache of ``fmt`` gives it back (x itself for "auto", x rounded to a 16-bit format's
    type); with an ``offset``, ``x - offset`` is what comes back."""
    if fmt is None or fmt.storage is None:
        return x
    if not fmt.quantized:
        return x.to(storage_dtype(fmt)).to(x.dtype)
    return dequantize_rows(quantize_rows(x, fmt, offset), x.shape[-1], x.dtype)
