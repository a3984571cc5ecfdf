"""Packed GGUF weight blocks for random benchmark models, made without a float32 copy of a whole tensor.

Legacy types (Q4_0, Q4_1, Q8_0) are quantized by gguf-py from normal floats, a few rows at a time.
gguf-py (0.19) cannot quantize K-quants, so Q4_K, Q5_K and Q6_K blocks are written directly: random
quants, and per-block scales chosen so the dequantized weights are zero-mean with standard
deviation ~``std`` (a trained layer's order of magnitude). MXFP4 (GPT-OSS's experts: 1 e8m0 exponent
byte + 16 bytes of e2m1 nibbles per 32 values) is written directly too (gguf-py's quantizer is slow):
random codes, exponents mixing two powers of two so the spread is ~``std``. Block layouts:
../shared/DESIGN.md §4 and ``gguf.quants.Q4_K/Q5_K/Q6_K/MXFP4.dequantize_blocks``; ``check_blocks``
verifies them through gguf-py.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

QK_K = 256
FLOAT_CHUNK = 8 << 20  # floats quantized per gguf-py call: 32 MB of float32 at a time
UNIFORM_NIBBLE_STD = float(np.sqrt((16**2 - 1) / 12))  # std of a uniform 4-bit quant
UNIFORM_5BIT_STD = float(np.sqrt((32**2 - 1) / 12))  # std of a uniform 5-bit quant
UNIFORM_6BIT_STD = float(np.sqrt((64**2 - 1) / 12))  # std of a uniform 6-bit quant
# e2m1 values doubled (gguf.quants.MXFP4.kvalues), indexed by the 4-bit code; e8m0 byte e scales them by 2^(e-128).
MXFP4_KVALUES = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=np.float64)


def row_bytes(qtype: GGMLQuantizationType, row: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if row % block:
        raise ValueError(f"a row of {row} is not a whole number of {qtype.name} blocks ({block})")
    return row // block * size


def random_packed(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int,
                  std: float = 0.02) -> np.ndarray:
    """``rows x row_bytes`` uint8: a ``rows x cols`` weight of ``qtype`` with values ~N(0, std)-sized."""
    if qtype == GGMLQuantizationType.Q4_K:
        return _random_q4_k(rng, rows * cols // QK_K, std).reshape(rows, -1)
    if qtype == GGMLQuantizationType.Q5_K:
        return _random_q5_k(rng, rows * cols // QK_K, std).reshape(rows, -1)
    if qtype == GGMLQuantizationType.Q6_K:
        return _random_q6_k(rng, rows * cols // QK_K, std).reshape(rows, -1)
    if qtype == GGMLQuantizationType.MXFP4:
        return _random_mxfp4(rng, rows * cols // 32, std).reshape(rows, -1)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(dtype).view(np.uint8)
    out = np.empty((rows, row_bytes(qtype, cols)), dtype=np.uint8)
    step = max(1, FLOAT_CHUNK // cols)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        floats = rng.standard_normal((stop - start, cols), dtype=np.float32) * np.float32(std)
        out[start:stop] = quantize(floats, qtype)
    return out


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes: the inverse of ``gguf.quants.Q4_K.get_scale_min``.

    Bytes 0-3: low 6 bits of scales 0-3, top 2 bits of scales 4-7; bytes 4-7: the same for the mins;
    bytes 8-11: low 4 bits of scales 4-7 | low 4 bits of mins 4-7 << 4.
    """
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    d_bytes = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m_bytes = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md_bytes = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d_bytes, m_bytes, md_bytes], axis=1)


def _random_q4_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Q4_K: value = d*sc*q - dmin*m; m = sc*15/16 with dmin = 8d puts each sub-block's centre at 0."""
    sc = rng.integers(16, 64, size=(n_blocks, 8), dtype=np.uint8)
    mn = np.rint(sc.astype(np.float32) * 15 / 16).astype(np.uint8)
    rms_sc = np.sqrt(np.mean(np.arange(16, 64, dtype=np.float64) ** 2))
    d = std / (UNIFORM_NIBBLE_STD * rms_sc) * rng.uniform(0.8, 1.2, size=n_blocks).astype(np.float32)
    out = np.empty((n_blocks, 144), dtype=np.uint8)
    out[:, 0:2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(d * 8)
    out[:, 4:16] = pack_q4_k_scales(sc, mn)
    out[:, 16:] = rng.integers(0, 256, size=(n_blocks, 128), dtype=np.uint8)
    return out


def _random_q5_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Q5_K: value = d*sc*q - dmin*m, q in [0, 32); m = sc*31/32 with dmin = 16d centres each sub-block at 0.

    Layout: d, dmin (fp16), 12 bytes of scales and mins (packed as Q4_K's), 32 bytes of high bits
    (bit j of byte l: value l of sub-block j), 128 bytes of low nibbles (as Q4_K's)."""
    sc = rng.integers(16, 64, size=(n_blocks, 8), dtype=np.uint8)
    mn = np.rint(sc.astype(np.float32) * 31 / 32).astype(np.uint8)
    rms_sc = np.sqrt(np.mean(np.arange(16, 64, dtype=np.float64) ** 2))
    d = std / (UNIFORM_5BIT_STD * rms_sc) * rng.uniform(0.8, 1.2, size=n_blocks).astype(np.float32)
    out = np.empty((n_blocks, 176), dtype=np.uint8)
    out[:, 0:2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(d * 16)
    out[:, 4:16] = pack_q4_k_scales(sc, mn)
    out[:, 16:] = rng.integers(0, 256, size=(n_blocks, 160), dtype=np.uint8)  # 32 B high bits + 128 B nibbles
    return out


def _random_mxfp4(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """MXFP4: value = 2^(e-128) * kvalue[code], codes uniform over the 16 e2m1 values. The exponent byte is
    E or E-1, E the smallest giving a spread >= std, mixed in the proportion whose mean square is std^2."""
    rms_k = float(np.sqrt(np.mean(MXFP4_KVALUES**2)))
    top = int(np.ceil(np.log2(std / rms_k))) + 128
    hi, lo = 4.0 ** (top - 128) * rms_k**2, 4.0 ** (top - 129) * rms_k**2
    p_top = (std**2 - lo) / (hi - lo)
    out = np.empty((n_blocks, 17), dtype=np.uint8)
    out[:, 0] = np.where(rng.random(n_blocks) < p_top, top, top - 1).astype(np.uint8)
    out[:, 1:] = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    return out


def _random_q6_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """Q6_K: value = d*scale*(q-32), q uniform in [0, 64): zero-centred (-0.5 quant) already."""
    scales = rng.integers(32, 128, size=(n_blocks, 16), dtype=np.int8)
    rms_scale = np.sqrt(np.mean(np.arange(32, 128, dtype=np.float64) ** 2))
    d = std / (UNIFORM_6BIT_STD * rms_scale) * rng.uniform(0.8, 1.2, size=n_blocks).astype(np.float32)
    out = np.empty((n_blocks, 210), dtype=np.uint8)
    out[:, :192] = rng.integers(0, 256, size=(n_blocks, 192), dtype=np.uint8)  # 128 B low + 64 B high bits
    out[:, 192:208] = scales.view(np.uint8)
    out[:, 208:210] = _fp16_bytes(d)
    return out


def check_blocks(seed: int = 0, std: float = 0.02, rows: int = 64, cols: int = 4096) -> dict[str, tuple[float, float]]:
    """Dequantize a random tensor of each type with gguf-py: {type: (mean, std)}; raises if off target."""
    rng = np.random.default_rng(seed)
    stats = {}
    for qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                  GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.MXFP4):
        values = dequantize(random_packed(rng, qtype, rows, cols, std), qtype)
        if values.shape != (rows, cols):
            raise AssertionError(f"{qtype.name}: dequantized to {values.shape}, expected {(rows, cols)}")
        mean, spread = float(values.mean()), float(values.std())
        if abs(mean) > 0.1 * std or not 0.8 * std < spread < 1.25 * std:
            raise AssertionError(f"{qtype.name}: mean {mean:.4g}, std {spread:.4g}; wanted ~0 and ~{std}")
        stats[qtype.name] = (mean, spread)
    # The scale packing must round-trip through gguf-py's unpacking.
    from gguf.quants import Q4_K

    sc = rng.integers(0, 64, size=(32, 8), dtype=np.uint8)
    mn = rng.integers(0, 64, size=(32, 8), dtype=np.uint8)
    got_sc, got_mn = Q4_K.get_scale_min(pack_q4_k_scales(sc, mn))
    if not (np.array_equal(got_sc, sc) and np.array_equal(got_mn, mn)):
        raise AssertionError("Q4_K scale packing does not round-trip through gguf.quants.Q4_K.get_scale_min")
    return stats


if __name__ == "__main__":
    for name, (mean, spread) in check_blocks().items():
        print(f"{name}: mean {mean:+.2e}, std {spread:.4f}")
