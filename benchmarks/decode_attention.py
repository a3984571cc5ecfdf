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
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bandwidth import measure_read_bandwidth

from pagedllm.kernels.attention import paged_decode_attention
from pagedllm.worker.cache_engine import zeroed_kv_pool

SHAPES = ["64x128", "64x300", "64x500", "8x500", "8x2000"]


def time_shape(batch: int, context: int, dtype: torch.dtype, args: argparse.Namespace) -> tuple[float, int]:
    """(median seconds per call, bytes of keys and values the call reads)."""
    blocks_per_seq = -(-context // args.block_size)
    block_bytes = 2 * args.block_size * args.kv_heads * args.head_dim * dtype.itemsize
    pool = max(batch * blocks_per_seq, args.pool_mib * 2**20 // block_bytes)
    shape = (pool, args.block_size, args.kv_heads, args.head_dim)
    # Allocated as the engine allocates its pool (in huge pages unless PAGEDLLM_HUGE_PAGES=0).
    cpu = torch.device("cpu")
    k_cache, v_cache = (zeroed_kv_pool(shape, dtype, cpu).normal_() for _ in range(2))
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
    read = batch * context * 2 * args.kv_heads * args.head_dim * dtype.itemsize
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = measure_read_bandwidth(args.threads)
    print(f"read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for spec in args.shapes:
            batch, context = map(int, spec.split("x"))
            seconds, read = time_shape(batch, context, dtype, args)
            print(f"{dtype_name:9s} {batch:3d} x {context:5d}: {seconds * 1e6:8.0f} us, KV {read / 1e6:6.1f} MB "
                  f"at {read / seconds / 1e9:5.1f} GB/s = {100 * read / seconds / bandwidth:5.1f}% of the bandwidth")


if __name__ == "__main__":
    main()
