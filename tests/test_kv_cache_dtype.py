"""Quantized KV caches (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2, int4) and 16-bit ones under wider
queries (bfloat16, float16): the kernels write the bytes the torch reference writes, and every
attention path (the decode kernel, the chunked kernel, the AMX prompt kernel where it runs, the torch
path a GPU takes, sliding windows and soft caps) equals attention over the reference's dequantized
states, to float tolerance, at every kernel level."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_levels import at_path, kernel_paths
from requirements_here import require_kernels
from test_attention import _make_case, case_metadata, reference_attention, sink_logits

from pagedllm.attention import PagedAttention, write_to_cache
from pagedllm.attention.kv_quant import (
    cache_format,
    dequantize_rows,
    hadamard,
    hadamard_block,
    quantize_rows,
    rotation_shifts,
    roundtrip,
    storage_dtype,
)
from pagedllm.config import CacheConfig
from pagedllm.kernels import cpu_kernels, use_kernel_config
from pagedllm.kernels.attention import prompt_attention_amx
from pagedllm.kv_cache_format import FORMATS, parse_kv_cache_dtype

QUANTIZED = [name for name, fmt in FORMATS.items() if fmt.quantized]
SIXTEEN_BIT = [name for name, fmt in FORMATS.items() if fmt.storage is not None and not fmt.quantized]
STORED = QUANTIZED + SIXTEEN_BIT  # every format that is not the model dtype as it is


def _to_pool(x: torch.Tensor, fmt, offset: torch.Tensor | None = None) -> torch.Tensor:
    """States as a pool of ``fmt`` stores them: quantized rows, or values rounded to a 16-bit type."""
    if fmt.quantized:
        return quantize_rows(x, fmt, offset)
    assert offset is None
    return x.to(storage_dtype(fmt))


def _from_pool(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A pool's rows as float32 values."""
    return dequantize_rows(cache, head_dim, torch.float32) if cache_format(cache) is not None else cache.float()


def _states(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 2
    x[..., 3] *= 20  # an outlier channel, as keys have
    return x.to(dtype)


def test_names_follow_vllm() -> None:
    assert parse_kv_cache_dtype("fp8").name == "fp8_e4m3"
    assert not parse_kv_cache_dtype("auto").quantized
    assert SIXTEEN_BIT == ["bfloat16", "float16"]
    for name in SIXTEEN_BIT:  # plain 16-bit values: half of float32's bytes, no scales
        assert FORMATS[name].row_bytes(64, 4) == 128 and FORMATS[name].pool_row(64) == 64
    config = CacheConfig(kv_cache_dtype="fp8")
    assert config.kv_cache_dtype == "fp8_e4m3" and config.kv_cache_format is FORMATS["fp8_e4m3"]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp16")


def _value_bounds(name: str, y: torch.Tensor) -> torch.Tensor:
    """Per value of rows ``y`` as stored: half a quantization step of its row (or group of 32)."""
    fmt = FORMATS[name]
    if name == "int4":
        groups = y.unflatten(-1, (-1, 32))
        step = (groups.amax(-1) - groups.amin(-1)) / 15
        return step.repeat_interleave(32, -1) * 0.5 + 1e-2
    if name == "int8":
        return (y.abs().amax(-1, keepdim=True) / 127 * 0.5 + 1e-6).expand_as(y)
    # float8: relative to each value (3 or 2 mantissa bits), plus the subnormal floor of the row
    mantissa = 3 if name == "fp8_e4m3" else 2
    floor = y.abs().amax(-1, keepdim=True) / fmt.max_value * 2.0 ** (-6 if mantissa == 3 else -14)
    return y.abs() * 2.0 ** -(mantissa + 1) + floor


@pytest.mark.parametrize("name", QUANTIZED)
def test_reference_roundtrip_error_is_bounded(name: str) -> None:
    """Rows are stored rotated (y = H x 2^-w), each stored value within half a quantization step; the
    error comes back through the orthogonal rotation with its norm scaled by sqrt(block) 2^-r. Zero
    rows stay zero."""
    fmt = FORMATS[name]
    x = _states(7, 3, 64)
    rows = quantize_rows(x, fmt)
    assert rows.dtype == storage_dtype(fmt) and rows.shape == (7, 3, fmt.row_bytes(64))
    write, read = rotation_shifts(64)
    y = hadamard(x) * 2.0 ** -write
    bound = _value_bounds(name, y).norm(dim=-1) * math.sqrt(hadamard_block(64)) * 2.0 ** -read
    back = dequantize_rows(rows, 64, torch.float32)
    assert ((back - x).norm(dim=-1) <= bound * 1.0001).all()
    assert dequantize_rows(quantize_rows(torch.zeros(2, 64), fmt), 64, torch.float32).abs().sum() == 0


def test_hadamard_is_its_own_inverse_up_to_the_block() -> None:
    for head_dim in (32, 64, 80, 96, 128):
        x = _states(5, head_dim)
        write, read = rotation_shifts(head_dim)
        assert write + read == hadamard_block(head_dim).bit_length() - 1
        torch.testing.assert_close(hadamard(hadamard(x) * 2.0 ** -write) * 2.0 ** -read, x)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_rotation_spreads_an_outlier_channel(name: str) -> None:
    """A key with one channel 40x the others (as rotary keys have): rotated rows lose several times
    less than the same format applied to the raw row would (one scale stretched by the outlier)."""
    fmt = FORMATS[name]
    x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(3))
    x[..., 5] *= 40
    rotated_error = (roundtrip(x, fmt) - x).norm() / x.norm()
    bits = 127.0 if name == "int8" else 7.5
    raw_error = ((x / (x.abs().amax(-1, keepdim=True) / bits)).round() * (x.abs().amax(-1, keepdim=True) / bits) - x)
    assert rotated_error * 3 < raw_error.norm() / x.norm()


def test_int4_needs_a_head_size_in_groups_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows(torch.zeros(1, 80), FORMATS["int4"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Key offsets belong to the quantized formats; the 16-bit ones are written as they are.
@pytest.mark.parametrize("name, with_offset",
                         [(name, False) for name in STORED] + [(name, True) for name in QUANTIZED])
@pytest.mark.parametrize("path", [p for p in kernel_paths() if p != "torch"])
def test_cache_write_kernel_writes_the_reference_bytes(path: str, name: str, dtype: torch.dtype,
                                                       with_offset: bool) -> None:
    """The C++ scatter quantizes exactly as kv_quant.quantize_rows (the same float32 operations), or
    rounds to a 16-bit type as torch does, from strided rows of a fused qkv output, less the key offset
    when there is one (integer formats), and leaves every other slot alone; the torch path writes the
    same bytes."""
    with at_path(path):
        _check_cache_write(name, dtype, with_offset)


def _check_cache_write(name: str, dtype: torch.dtype, with_offset: bool) -> None:
    fmt = FORMATS[name]
    blocks, block_size, heads, dim, tokens = 6, 4, 3, 64, 5
    row = fmt.row_bytes(dim)
    k_cache = torch.zeros(blocks, block_size, heads, row, dtype=torch.uint8).view(storage_dtype(fmt))
    v_cache = k_cache.clone()
    qkv = _states(tokens, 4 * heads * dim, dtype=dtype)
    key = qkv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    value = _states(tokens, heads, dim, seed=1, dtype=dtype)
    value[1] = 0  # an all-zero token
    slots = torch.tensor([3, 17, 0, 23, 9])
    offset = _states(heads, dim, seed=2) if with_offset else None
    expected_k, expected_v = k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone()
    expected_k.view(-1, heads, row).index_copy_(0, slots, _to_pool(key, fmt, offset).view(torch.uint8))
    expected_v.view(-1, heads, row).index_copy_(0, slots, _to_pool(value, fmt).view(torch.uint8))
    write_to_cache(key, value, k_cache, v_cache, slots, offset)
    assert torch.equal(k_cache.view(torch.uint8), expected_k)
    assert torch.equal(v_cache.view(torch.uint8), expected_v)
    with use_kernel_config(cpu_kernels=False):  # the torch path writes the same bytes
        k_torch, v_torch = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        write_to_cache(key, value, k_torch, v_torch, slots, offset)
    assert torch.equal(k_torch.view(torch.uint8), expected_k)
    assert torch.equal(v_torch.view(torch.uint8), expected_v)


def _quantized_case(seed: int, kind: str, fmt, head_dim: int, window: int | None, num_heads=4, num_kv_heads=2,
                    query_dtype=torch.float32):
    """A batch over a quantized pool (scattered blocks, a released block 0 with a window), the
    step's queries, keys and values, and the dequantized pool the reference attends over."""
    block_size = 4
    k_float, v_float, seqs = _make_case(seed, kind, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        block_size=block_size, released=window is not None)
    k_cache, v_cache = _to_pool(k_float, fmt), _to_pool(v_float, fmt)
    total_new = sum(new for _, new, _ in seqs)
    gen = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(total_new, num_heads * head_dim, generator=gen).to(query_dtype)
    key = torch.randn(total_new, num_kv_heads * head_dim, generator=gen).to(query_dtype)
    value = torch.randn(total_new, num_kv_heads * head_dim, generator=gen).to(query_dtype)
    meta, starts, positions, _ = case_metadata(seqs, block_size, window)
    return k_cache, v_cache, seqs, (query, key, value), meta, starts, positions


def _check_against_reference(path: str, kind: str, name: str, head_dim: int, window=None, soft_cap=None,
                             query_dtype=torch.float32, seeds=range(6), key_offset: bool = False,
                             sinks: bool = False) -> None:
    """With ``key_offset`` the layer subtracts one from the step's keys (the context rows stand for
    keys stored less it) and the reference also attends over the keys with it added back: softmax
    does not see it. With ``sinks`` the layer has a sink logit per head (GPT-OSS)."""
    fmt = FORMATS[name]
    num_heads, num_kv_heads = 4, 2
    for seed in seeds:
        k_cache, v_cache, seqs, (query, key, value), meta, starts, positions = _quantized_case(
            seed, kind, fmt, head_dim, window, query_dtype=query_dtype)
        attn = PagedAttention(num_heads, head_dim, num_kv_heads, 1 / math.sqrt(head_dim), window, soft_cap, sinks)
        sink_values = sink_logits(num_heads, seed) if sinks else None
        if sinks:
            attn.sinks.copy_(sink_values)
        attn.use_cpu_kernel = path != "torch"
        offset = _states(num_kv_heads, head_dim, seed=seed + 7) if key_offset else None
        attn.key_offset = offset
        out = attn(query, key, value, (k_cache, v_cache), meta).view(-1, num_heads, head_dim)
        # The step's rows were quantized into the pool; the reference attends over the dequantized pool.
        k_ref = _from_pool(k_cache, head_dim)
        v_ref = _from_pool(v_cache, head_dim)
        expected_new = roundtrip(key.float().view(-1, num_kv_heads, head_dim), fmt, offset)
        assert torch.equal(k_ref.view(-1, num_kv_heads, head_dim)[meta.slot_mapping], expected_new)
        if offset is not None and seed % 2:
            k_ref = k_ref + offset
        q = query.view(-1, num_heads, head_dim)
        for i, (_, _, table) in enumerate(seqs):
            expected = reference_attention(q[starts[i] : starts[i + 1]].float(), k_ref, v_ref, table, positions[i],
                                           num_heads, num_kv_heads, window, soft_cap, sink_values)
            tol = 1e-5 if query_dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize("path", kernel_paths())
def test_decode_reads_quantized_rows(path: str, name: str, head_dim: int) -> None:
    """The decode kernel decodes rows on its register loops (AVX-512: in registers; AVX2: four rows at
    a time into a float32 buffer; scalar: the portable loops) and the torch path dequantizes its
    gathered copy: both equal the reference. 256 takes the AVX-512 loops one row at a time."""
    with at_path(path) as level:
        _check_against_reference(path, "decode", name, head_dim)
        if level is not None:
            level.assert_ran("paged_decode_attention")


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("path", kernel_paths())
def test_key_offset_is_stored_and_invisible(path: str, name: str, kind: str) -> None:
    """Keys stored less a key offset (attention/key_offset.py): every path writes k - offset and
    attends as over the keys themselves."""
    with at_path(path):
        _check_against_reference(path, kind, name, 64, key_offset=True, seeds=range(4))


@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("path", kernel_paths())
def test_mixed_batches_read_quantized_rows(path: str, invariant: bool, name: str) -> None:
    """Decodes and prompt chunks: every row through the decode kernel (batch invariance), or the
    chunked kernel and torch's SDPA over the dequantized context (without it)."""
    with at_path(path) as level, use_kernel_config(batch_invariant=invariant):
        _check_against_reference(path, "mixed", name, 64)
        if level is not None:
            level.assert_ran("paged_decode_attention" if invariant else "paged_chunked_attention")


@pytest.mark.parametrize("window, soft_cap", [(5, None), (None, 2.0), (8, 2.0)])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4", "float16"])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("path", kernel_paths())
def test_windows_and_soft_caps_over_quantized_rows(path: str, invariant: bool, name: str, window, soft_cap) -> None:
    with at_path(path), use_kernel_config(batch_invariant=invariant):
        _check_against_reference(path, "mixed", name, 64, window=window, soft_cap=soft_cap, seeds=range(4))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4", "bfloat16"])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("path", kernel_paths())
def test_sinks_over_quantized_rows(path: str, invariant: bool, name: str, window) -> None:
    """A layer with sinks (which keeps no key offset: the sink does not move with the keys) over a
    quantized cache: the decode and chunked kernels' softmax takes the sink as the torch path's does."""
    with at_path(path) as level, use_kernel_config(batch_invariant=invariant):
        _check_against_reference(path, "mixed", name, 64, window=window, seeds=range(4), sinks=True)
        if level is not None:
            level.assert_ran("paged_decode_attention" if invariant else "paged_chunked_attention")


@pytest.mark.parametrize("name", [*QUANTIZED, "float16"])
def test_bfloat16_queries_over_quantized_rows(name: str) -> None:
    with use_kernel_config(batch_invariant=False):
        _check_against_reference("cpu", "mixed", name, 64, query_dtype=torch.bfloat16, seeds=range(3))


@pytest.mark.kernels(level="amx")
@pytest.mark.parametrize("dim", [64, 128])  # 128: a read shift (4) other than the write shift (3)
@pytest.mark.parametrize("name", QUANTIZED)
def test_amx_prompt_attention_reads_quantized_rows(name: str, dim: int) -> None:
    """The tile kernel decodes rows to bfloat16 as they are stored, rotated, and multiplies them by
    queries rotated to bfloat16: its own result over a bfloat16 cache holding those rotated values,
    for the rotated queries, rotated back. Not its result over the dequantized values: there the
    bfloat16 roundings fall in the other basis, and with outlier channels in queries and keys
    (scores in the hundreds) they move near-ties of the softmax by whole values. The two results
    differ by a bfloat16 rounding of each output row in each basis, 2^-8 of the row's norm each."""
    fmt = FORMATS[name]
    heads, kv_heads, block_size, length = 4, 2, 16, 150
    k_float, v_float = _states(12, block_size, kv_heads, dim), _states(12, block_size, kv_heads, dim, seed=1)
    k_cache, v_cache = quantize_rows(k_float, fmt), quantize_rows(v_float, fmt)
    query = _states(length, heads, dim, seed=2, dtype=torch.bfloat16)
    tables = torch.randperm(12)[: -(-length // block_size)].unsqueeze(0)
    starts, lens = torch.tensor([0, length]), torch.tensor([length])
    out = prompt_attention_amx(query, k_cache, v_cache, tables, starts, lens, dim ** -0.5)
    k_stored = dequantize_rows(k_cache, dim, torch.bfloat16, rotated=True)
    v_stored = dequantize_rows(v_cache, dim, torch.bfloat16, rotated=True)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return hadamard(x.float()) * 2.0 ** -rotation_shifts(dim)[1]

    rotated_out = prompt_attention_amx(rotate(query).to(torch.bfloat16), k_stored, v_stored, tables, starts, lens,
                                       dim ** -0.5)
    expected = rotate(rotated_out)
    assert ((out.float() - expected).norm(dim=-1) <= 2.0 ** -7 * expected.norm(dim=-1)).all()


def test_a_cache_of_another_dtype_is_refused_clearly() -> None:
    require_kernels()
    query = torch.zeros(1, 4, 64)
    cache = torch.zeros(4, 4, 2, 64, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="cannot serve"):
        cpu_kernels().paged_decode_attention(query, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                             torch.ones(1, dtype=torch.long), 0.1, 0, 0.0, torch.empty(0))
    short_rows = torch.zeros(4, 4, 2, 64, dtype=torch.int8)  # no room for the scale
    with pytest.raises(RuntimeError, match="holds 66 elements"):
        cpu_kernels().paged_decode_attention(query, short_rows, short_rows, torch.zeros(1, 1, dtype=torch.long),
                                             torch.ones(1, dtype=torch.long), 0.1, 0, 0.0, torch.empty(0))
