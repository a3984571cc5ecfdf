"""Decode attention per layer on a CPU: our paged kernel against reading its KV cache at full bandwidth.

Each decode query reads its sequence's whole context from the KV blocks, so at serving batch sizes
the kernel is bound by memory reads, not arithmetic: the figure that matters is how close it gets
to the machine's read bandwidth (benchmarks/bandwidth.py, measured in the same run). For each
(batch, context) shape and dtype, blocks are scattered at random through a pool of --pool-mib, as
a serving pool's are, and each call reads other blocks than the calls before it (otherwise the
context of a call stays in a large L3, 105 MB on a 2-core AMX Xeon, and the kernel seems to read
faster than memory can deliver); medians over rounds. Heads default to the default model's (9
query heads, 3 KV heads of 64, blocks of 16).

    .venv/bin/python benchmarks/decode_attention.py
    .venv/bin/python benchmarks/decode_attention.py --dtypes float32 --shapes 64x300 8x500

``--kv-cache-dtypes auto int8 fp8 fp8_e5m2 int4`` runs each shape also over quantized pools (laid out
as the engine's: the format's storage dtype, rows of values and scales; attention/kv_quant.py), next
to the model dtype's own pool (auto), and prints each one's time against auto's at the same shape:

    .venv/bin/python benchmarks/decode_attention.py --dtypes bfloat16 float32 \\
        --kv-cache-dtypes auto int8 fp8 fp8_e5m2 int4 --shapes 1x4096 8x4096 32x4096 64x500 8x2000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bandwidth import measure_read_bandwidth

from pagedllm.attention.kv_quant import quantize_rows, storage_dtype
from pagedllm.kernels.attention import paged_decode_attention
from pagedllm.kv_cache_format import KVCacheFormat, parse_kv_cache_dtype
from pagedllm.worker.cache_engine import zeroed_kv_pool

SHAPES = ["64x128", "64x300", "64x500", "8x500", "8x2000"]


def quantized_pool(shape: tuple[int, ...], fmt: KVCacheFormat, head_dim: int, sample_blocks: int = 256) -> torch.Tensor:
    """A pool of ``fmt`` rows holding valid quantized normals (random bytes could be fp8 NaNs): a
    sample of blocks is quantized once and tiled through the pool, which is all a timing needs."""
    pool = zeroed_kv_pool(shape, storage_dtype(fmt), torch.device("cpu"))
    sample = quantize_rows(torch.randn(min(sample_blocks, shape[0]), *shape[1:-1], head_dim), fmt)
    for start in range(0, shape[0], sample.shape[0]):
        count = min(sample.shape[0], shape[0] - start)
        pool[start:start + count] = sample[:count]
    return pool


def time_shape(
    batch: int, context: int, dtype: torch.dtype, args: argparse.Namespace, kv_cache_dtype: str = "auto"
) -> tuple[float, int]:
    """(median seconds per call, bytes of keys and values the call reads)."""
    fmt = parse_kv_cache_dtype(kv_cache_dtype)
    row_bytes = fmt.row_bytes(args.head_dim, dtype.itemsize)
    blocks_per_seq = -(-context // args.block_size)
    block_bytes = 2 * args.block_size * args.kv_heads * row_bytes
    pool = max(batch * blocks_per_seq, args.pool_mib * 2**20 // block_bytes)
    shape = (pool, args.block_size, args.kv_heads, fmt.pool_row(args.head_dim))
    # Allocated as the engine allocates its pool (in huge pages unless PAGEDLLM_HUGE_PAGES=0).
    cpu = torch.device("cpu")
    if not fmt.quantized:
        k_cache, v_cache = (zeroed_kv_pool(shape, dtype, cpu).normal_() for _ in range(2))
    else:
        k_cache, v_cache = (quantized_pool(shape, fmt, args.head_dim) for _ in range(2))
    order = torch.randperm(pool)
    calls = max(1, pool // (batch * blocks_per_seq))  # disjoint block sets, used in turn
    tables = [order[i * batch * blocks_per_seq:(i + 1) * batch * blocks_per_seq].view(batch, blocks_per_seq)
              for i in range(calls)]
    query = torch.randn(batch, args.heads, args.head_dim).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.long)
    scale = args.head_dim ** -0.5
    times = []
    for i in range(args.rounds + 2):
        start = time.perf_counter()
        out = paged_decode_attention(query, k_cache, v_cache, tables[i % len(tables)], lens, scale)
        times.append(time.perf_counter() - start)
    if out is None:
        raise SystemExit("the CPU kernels are not built here")
    if not torch.isfinite(out).all():
        raise SystemExit(f"non-finite attention output with kv_cache_dtype={kv_cache_dtype}")
    read = batch * context * 2 * args.kv_heads * row_bytes
    return statistics.median(times[2:]), read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="BATCHxCONTEXT")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-mib", type=int, default=2048, help="size of the KV pool the blocks are drawn from")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        help="KV pool formats per dtype: auto (the dtype itself), int8, fp8, fp8_e5m2, int4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = measure_read_bandwidth(args.threads)
    print(f"read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    compare = args.kv_cache_dtypes != ["auto"]
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for spec in args.shapes:
            batch, context = map(int, spec.split("x"))
            auto_seconds = None
            # The formats of one shape run back to back, so their ratio sees the same machine.
            for kv_dtype in args.kv_cache_dtypes:
                seconds, read = time_shape(batch, context, dtype, args, kv_dtype)
                if kv_dtype == "auto":
                    auto_seconds = seconds
                line = (f"{dtype_name:9s} {batch:3d} x {context:5d}: {seconds * 1e6:8.0f} us, "
                        f"KV {read / 1e6:6.1f} MB at {read / seconds / 1e9:5.1f} GB/s = "
                        f"{100 * read / seconds / bandwidth:5.1f}% of the bandwidth")
                if compare:
                    ratio = seconds / auto_seconds if auto_seconds else float("nan")
                    line = (f"{dtype_name:9s} kv={kv_dtype:9s}" + line[len(dtype_name):]
                            + f", {seconds / batch * 1e6:7.1f} us/token, {ratio:.2f}x auto")
                    rows.append((dtype_name, kv_dtype, spec, seconds, seconds / batch, read / seconds, ratio))
                print(line)
    if compare:
        print("\n| dtype | KV dtype | shape | us / call | us / token | GB/s | vs auto |")
        print("|---|---|---|---:|---:|---:|---:|")
        for dtype_name, kv_dtype, spec, seconds, per_token, rate, ratio in rows:
            print(f"| {dtype_name} | {kv_dtype} | {spec} | {seconds * 1e6:.0f} | {per_token * 1e6:.1f} | "
                  f"{rate / 1e9:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
