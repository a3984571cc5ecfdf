"""The CPU linear-layer paths side by side: a whole model's layer GEMMs at serving row counts.

For each row count, every path (F.linear, oneDNN over reordered weights, our panel kernel) runs
the default model's per-layer GEMMs (qkv, o, gate_up, down) over all its layers with distinct
weights, so the weights stream from memory as in a decode step; rounds alternate between the
paths, and the figures are medians over rounds. Printed: milliseconds per pass, the weight bytes
read per second, GFLOP/s, and each path's time over the panel kernel's.

    .venv/bin/python benchmarks/dense_gemm.py --dtype bfloat16
    .venv/bin/python benchmarks/dense_gemm.py --dtype float32 --rows 1 16 64 256 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pagedllm.layers.cpu_gemm import OneDNNWeight, PanelWeight, onednn_supported, panels_supported

# (name, in_features, out_features) of one decoder layer of the default model (SmolLM-135M shape).
LAYER_SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]


def build_paths(dtype: torch.dtype, layers: int) -> dict[str, list[Callable[[dict[int, torch.Tensor]], None]]]:
    weights = [[torch.randn(n, k).to(dtype) for _, k, n in LAYER_SHAPES] for _ in range(layers)]
    paths: dict[str, list] = {
        "F.linear": [(lambda xs, w=w, k=k: torch.nn.functional.linear(xs[k], w))
                     for layer in weights for w, (_, k, _) in zip(layer, LAYER_SHAPES, strict=True)]
    }
    if onednn_supported(dtype):
        packed = [OneDNNWeight(w) for layer in weights for w in layer]
        paths["oneDNN"] = [(lambda xs, p=p, k=k: p.linear(xs[k], None))
                           for p, (_, k, _) in zip(packed, LAYER_SHAPES * layers, strict=True)]
    if panels_supported(dtype):
        panels = [PanelWeight(w) for layer in weights for w in layer]
        paths["panels"] = [(lambda xs, p=p, k=k: p.linear(xs[k], None))
                           for p, (_, k, _) in zip(panels, LAYER_SHAPES * layers, strict=True)]
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64, 128, 256])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    paths = build_paths(dtype, args.layers)
    weight_bytes = sum(k * n for _, k, n in LAYER_SHAPES) * args.layers * dtype.itemsize
    print(f"{args.dtype}, {args.layers} layers, {weight_bytes / 1e6:.0f} MB of weights; paths: {', '.join(paths)}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(dtype) for _, k, _ in LAYER_SHAPES}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for calls in paths.values():  # warm-up
            for call in calls:
                call(xs)
        for _ in range(args.rounds):
            for name, calls in paths.items():
                start = time.perf_counter()
                for call in calls:
                    call(xs)
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians.get("panels")
        cells = []
        for name, seconds in medians.items():
            cell = f"{name} {seconds * 1e3:6.1f} ms {weight_bytes / seconds / 1e9:5.1f} GB/s " \
                   f"{2 * rows * weight_bytes / dtype.itemsize / seconds / 1e9:5.0f} GFLOP/s"
            if base is not None and name != "panels":
                cell += f" ({seconds / base:.2f}x)"
            cells.append(cell)
        print(f"rows {rows:4d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
