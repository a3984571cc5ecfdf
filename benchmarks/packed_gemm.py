"""The packed-weight kernels alone, side by side: float activations (quant_linear) against int8
activations over the re-tiled weight (int8_linear), on a Llama-3.2-1B's shapes.

For each shape and activation row count M: median milliseconds of each kernel, the weight bytes it
streams per millisecond (GB/s; above the machine's DRAM bandwidth means the weight sat in the last
level cache between calls), the int8 kernel's integer GOPS and the speed-up.

    .venv/bin/python benchmarks/packed_gemm.py [--threads 2] [--rows 1 4 16 64 256]
    .venv/bin/python benchmarks/packed_gemm.py --shapes qwen3-4b --copies 8 --rows 1 4 64

``--copies N`` cycles N distinct copies of each weight, one per call, so that the weights stream from
memory as in a decode step rather than from the last level cache.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_blocks import random_packed  # noqa: E402
from paper_fig18a_kernel import bench as median_seconds  # noqa: E402

from pagedllm.kernels import cpu_kernels  # noqa: E402
from pagedllm.kernels.invariance import int8_amx_min_rows  # noqa: E402

# name, output rows, inputs, GGUF type: a Llama-3.2-1B layer's projections and its Q6_K LM head.
SHAPES = {
    "llama-3.2-1b": [("qo", 2048, 2048, "Q4_0"), ("kv", 512, 2048, "Q4_0"), ("gate/up", 8192, 2048, "Q4_0"),
                     ("down", 2048, 8192, "Q4_0"), ("up Q4_K", 8192, 2048, "Q4_K"), ("head", 128256, 2048, "Q6_K")],
    # Qwen3-4B Q4_K_M: gate / up in Q4_K, down in Q6_K (every other layer), q in Q4_K.
    "qwen3-4b": [("up", 9728, 2560, "Q4_K"), ("down", 2560, 9728, "Q6_K"), ("q", 4096, 2560, "Q4_K")],
    # Qwen3-4B Q8_0: every projection in Q8_0.
    "qwen3-4b-q8_0": [("up", 9728, 2560, "Q8_0"), ("down", 2560, 9728, "Q8_0"), ("q", 4096, 2560, "Q8_0")],
    # gpt-oss-20b as make_gguf_models.py writes it: one expert's gate/up and down in MXFP4, attention in Q8_0.
    "gpt-oss-20b": [("exp g/u", 5760, 2880, "MXFP4"), ("exp down", 2880, 2880, "MXFP4"), ("qkv", 5120, 2880, "Q8_0"),
                    ("o", 2880, 4096, "Q8_0")],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--copies", type=int, default=1, help="distinct copies of each weight, cycled")
    args = parser.parse_args()
    from gguf.constants import GGMLQuantizationType

    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    print(f"int8 dot product: {kernels.int8_dot_isa()}, {args.threads} threads, {args.shapes} shapes, "
          f"{args.copies} cop{'y' if args.copies == 1 else 'ies'} of each weight")
    rng = np.random.default_rng(0)
    print(f"{'shape':>8} {'type':>5} {'M':>4} | {'float ms':>8} {'GB/s':>5} | "
          f"{'int8 ms':>8} {'GB/s':>5} {'GOPS':>6} | speed-up | {'engine ms':>9} {'GOPS':>6}")
    # "int8": integer dot products at every row count; "engine": int8_linear as the engine calls it
    # (from int8_amx_min_rows() rows on, on AMX, bfloat16 tiles over decoded panels).
    for name, n, k, type_name in SHAPES[args.shapes]:
        qtype = GGMLQuantizationType[type_name]
        packs = [torch.from_numpy(np.ascontiguousarray(random_packed(rng, qtype, n, k))) for _ in range(args.copies)]
        tiles = [kernels.int8_tile_weight(packed, qtype.value, k, None) for packed in packs]
        packed, tiled = packs[0], tiles[0]
        for m in args.rows:
            x = torch.randn(m, k)
            repeats = max(3, min(30, int(2e9 / (n * k * max(m, 8)))))
            weights = itertools.cycle(packs)
            t_float = median_seconds(
                lambda x=x, weights=weights, qtype=qtype, k=k: kernels.quant_linear(
                    x, next(weights), qtype.value, k, None, 48),
                repeats)
            t_int8, t_engine = (median_seconds(
                lambda x=x, weights=itertools.cycle(tiles), qtype=qtype, n=n, k=k, amx=amx: kernels.int8_linear(
                    x, next(weights), qtype.value, n, k, None, amx),
                repeats) for amx in (0, int8_amx_min_rows()))
            print(f"{name:>8} {type_name:>5} {m:4d} | {t_float * 1e3:8.2f} {packed.numel() / t_float / 1e9:5.1f} | "
                  f"{t_int8 * 1e3:8.2f} {tiled.numel() / t_int8 / 1e9:5.1f} {2 * m * n * k / t_int8 / 1e9:6.0f} | "
                  f"{t_float / t_int8:7.2f}x | {t_engine * 1e3:9.2f} {2 * m * n * k / t_engine / 1e9:6.0f}")

if __name__ == "__main__":
    main()
