"""int8_linear of several compiled kernel builds, side by side in one process, round by round.

A kernel change is measured against the build before it: torch caches every build under its source
hash (``~/.cache/torch_extensions/.../pagedllm_kernels_<level>_<hash>.so``;
``pagedllm.kernels.cpu_kernels().__file__`` names the current one). Each
build tiles the same random weights with its own ``int8_tile_weight`` (so builds whose layouts differ
compare fairly), then the builds take turns, one pass over ``--copies`` weights each, for ``--rounds``
rounds: the machine's drift falls on every build alike, and the medians are compared.

    python benchmarks/kernel_builds_ab.py OLD.so NEW.so --formats Q4_K Q6_K --rows 1 16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from types import ModuleType

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf_blocks import random_packed


def load_build(path: str) -> ModuleType:
    name = os.path.basename(path).removesuffix(".so")  # the module's init symbol is named after the file
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"not a loadable extension: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="+", help="paths of compiled kernel builds (.so)")
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K"], help="GGUF block types")
    parser.add_argument("--shape", nargs=2, type=int, default=[9728, 2560], metavar=("N", "K"))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16], help="activation rows per call")
    parser.add_argument("--copies", type=int, default=8, help="weights cycled, so they stream from memory")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = [(os.path.basename(path).removesuffix(".so"), load_build(path)) for path in args.builds]
    n, k = args.shape
    rng = np.random.default_rng(0)
    print(f"int8_linear [{n} x {k}], {args.copies} copies, {args.threads} threads, median of {args.rounds} rounds")
    for name in args.formats:
        fmt = GGMLQuantizationType[name]
        packed = [torch.from_numpy(np.ascontiguousarray(random_packed(rng, fmt, n, k))) for _ in range(args.copies)]
        tiles = {b: [m.int8_tile_weight(p, fmt.value, k, None) for p in packed] for b, m in builds}
        for rows in args.rows:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {b: [] for b, _ in builds}
            for _ in range(args.rounds):
                for b, m in builds:
                    start = time.perf_counter()
                    for w in tiles[b]:
                        m.int8_linear(x, w, fmt.value, n, k, None, 0)
                    times[b].append((time.perf_counter() - start) / args.copies * 1e3)
            cells = []
            for b, _ in builds:
                ms = statistics.median(times[b])
                cells.append(f"{b}: {ms:.3f} ms ({tiles[b][0].numel() / ms / 1e6:.1f} GB/s)")
            print(f"{name} rows={rows}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
